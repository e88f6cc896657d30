"""How fast the training loader feeds a GPU at 224 px: images/s per loading process, against the
rate a GPU trains DeAR at, estimated from the step's FLOPs.

    python benchmarks/bench_loader.py              # ~1 minute on 2 cores
    python benchmarks/bench_loader.py --images 400 --workers 0 1 2

It writes JPEGs at a typical photo size (500 x 375, ImageNet's most common; textured, quality
90, about 100 KB each, so that decoding costs what a real photo costs), then times train.py's
training loader over them with each number of worker processes, after one untimed pass (the
page cache warm, as from the second epoch on; batches of 32): each photo decoded every epoch
(data.ImageDataset with train_transform(224): decode, random resized crop with bicubic
resampling, flip, normalise), and decoded once (imagecache.DecodedImages, train.py's default: the
crop, flip and normalisation of a kept uint8 tensor; the decoding itself is not timed). The GPU
side: bench_train_step.step_flops, the FLOPs of one DeAR training step on ViT-B/16 at batch
32, over an H200's dense bf16 peak at a model FLOP utilisation of 40% (a good one for this step).
Last, the memory and time of decoding them once in one process of 1 and of 8 (torchrun's shards).
"""

import argparse
import os
import sys
import tempfile
import time

import torch
from PIL import Image
from torch.utils.data import DataLoader

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import data  # noqa: E402
from bench_train_step import B16, peak_tflops, step_flops  # noqa: E402
from harness import imagecache  # noqa: E402

PHOTO = (500, 375)  # pixels: ImageNet's most common size
UTILISATION = 0.4


def write_photos(folder: str, count: int) -> list:
    """`count` textured JPEGs of PHOTO's size -> their data.Items."""
    generator = torch.Generator().manual_seed(0)
    items = []
    for index in range(count):
        low = torch.randint(0, 256, (3, PHOTO[1] // 8, PHOTO[0] // 8), generator=generator)
        pixels = torch.nn.functional.interpolate(low[None].float(), size=PHOTO[::-1],
                                                 mode="bilinear", align_corners=False)[0]
        pixels += 24 * torch.randn(pixels.shape, generator=generator)  # fine texture: real cost
        image = pixels.clamp(0, 255).byte().permute(1, 2, 0).numpy()
        path = os.path.join(folder, f"photo{index}.jpg")
        Image.fromarray(image).save(path, quality=90)
        items.append(data.Item(path, index % 10, f"class {index % 10}"))
    return items


def images_per_second(items: list, workers: int, batch: int = 32, size: int = 224,
                      cached: bool = False) -> float:
    """train.py's training loader (augmented) over `items`: each photo decoded every epoch, or
    (cached) decoded once up front (imagecache.DecodedImages, not timed) -> images/s of an epoch."""
    if cached:
        dataset = imagecache.DecodedImages(items, size, augment=True, seed=0, workers=workers)
    else:
        dataset = data.ImageDataset(items, data.train_transform(size), seed=0)
    loader = DataLoader(dataset, batch_size=batch, num_workers=workers, shuffle=False)
    for _ in loader:  # untimed: the page cache and the workers' start
        pass
    started = time.perf_counter()
    for _ in loader:
        pass
    return len(items) / (time.perf_counter() - started)


def gpu_images_per_second(classes: int) -> float:
    flops = step_flops(B16, batch=32, classes=classes, prompt_tokens=20)
    return 32 / (flops / (peak_tflops("H200")[0] * 1e12 * UTILISATION))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256, help="JPEGs to write and load")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a loading process decodes on one thread
    with tempfile.TemporaryDirectory(prefix="bench_loader-") as folder:
        items = write_photos(folder, args.images)
        size = sum(os.path.getsize(item.path) for item in items) / len(items) / 1024
        print(f"{len(items)} JPEGs of {PHOTO[0]} x {PHOTO[1]}, {size:.0f} KB each; "
              f"train_transform(224), batches of 32")
        for cached in (False, True):
            print("decoded once, kept in memory (imagecache.DecodedImages):" if cached else
                  "each photo decoded every epoch (data.ImageDataset):")
            for workers in args.workers:
                rate = images_per_second(items, workers, cached=cached)
                per = f" ({rate / workers:.0f} per worker)" if workers else ""
                print(f"  workers {workers}: {rate:.0f} images/s{per}", flush=True)
        for world in (1, 8):  # under torchrun a process decodes its shard alone (EpochSampler)
            started, shard = time.perf_counter(), imagecache.EpochSampler(len(items), world).shard
            kept = imagecache.DecodedImages(items, 224, augment=True, only=shard).buffer.numel()
            print(f"decoded once by 1 of {world} processes: {kept / 2**20:.0f} MB kept "
                  f"({kept / len(set(shard)) / 2**20:.2f} MB an image), decoded in "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
    for classes in (100, 1000):
        print(f"GPU, estimated: H200 at {UTILISATION:.0%} of its bf16 peak trains DeAR (ViT-B/16, "
              f"batch 32, {classes} classes) at {gpu_images_per_second(classes):,.0f} images/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
