"""harness/imagecache.py -- the few-shot training images decoded once into one uint8 buffer
(DecodedImages, train.py's --image-cache on), and the training order (EpochSampler), which tells
the loading processes the epoch, so that they live across epochs, and under torchrun gives each
process a shard of its own, so that it decodes only those images.

A few-shot training set is small (16 shots of 1,000 classes: 16,000 images) and read every epoch.
Decoding a photo and resampling it again each time costs a loading process about 3 ms an image,
about 350 images/s: tens of processes to feed one fast GPU (benchmarks/bench_loader.py). Decoded
once into memory as uint8, an epoch only crops, flips and normalises tensors: about five times
faster per process (docs/MEASURED.md, "The loader").
"""

from __future__ import annotations

import math

import torch
from PIL import Image
from torch.utils.data import DataLoader, Sampler, Subset
from torchvision import transforms as T

import data
from . import devices

CACHED_SIDE = 8 / 7  # with augmentation, each image is kept with its shorter side at 8/7 x size


def kept_transform(size: int, augment: bool) -> T.Compose:
    """A photo as it is kept, PIL -> (3, h, w) uint8. Augmented: resized (bicubic) so that its
    shorter side is CACHED_SIDE x size (256 for 224), the picture the random crop is then taken
    from (our choice, as FFCV's loaders keep them: the crop's pixels come from that, not from
    the full photo). Not augmented: the test transform's own resize and centre crop, so that the
    tensors it gives are test_transform's, bit for bit."""
    if augment:
        resize = [T.Resize(round(size * CACHED_SIDE), interpolation=T.InterpolationMode.BICUBIC)]
    else:
        resize = data.test_transform(size).transforms[:2]  # its resize and centre crop
    return T.Compose([*resize, T.PILToTensor()])


def kept_size(path: str, size: int, augment: bool) -> int:
    """The bytes kept_transform gives for the photo at `path`, from its header: torchvision's
    Resize(S) keeps int(S * long side / short side) on the long side (0 for a file that does not
    open: its decoding names it)."""
    if not augment:
        return 3 * size * size
    side = round(size * CACHED_SIDE)
    try:
        with Image.open(path) as image:
            short, long = sorted(image.size)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return 0
    return 3 * side * int(side * long / short)


def normalised(image: torch.Tensor) -> torch.Tensor:
    """uint8 (3, h, w) -> CLIP's normalised float, as ToTensor and Normalize compute it."""
    return T.functional.normalize(image.float().div(255), data.CLIP_MEAN, data.CLIP_STD)


class DecodedImages(data.ImageDataset):
    """ImageDataset with every image (or those numbered in `only`) decoded once, up front
    (`workers` processes), kept in memory as uint8 (kept_transform: 256 px on the shorter side
    for 224: 16,000 take about 3.9 GiB).
    Augmented: train_transform's random resized crop (bicubic, antialiased) and flip, on the
    kept tensor; not: the test transform's result exactly. The augmentation is seeded per image,
    epoch and seed as ImageDataset's.

    The images lie end to end in one buffer (image i is buffer[offsets[i]:...] seen as
    shapes[i]): three tensors to hand a loading process, one shared-memory file each
    where the dataset is pickled to it (forkserver, spawn), not one per image (16,000 open files
    against a common limit of 1,024)."""

    def __init__(self, items: list[data.Item], size: int, augment: bool, seed: int | None = None,
                 workers: int = 0, only: list[int] | None = None):
        crop = T.RandomResizedCrop(size, scale=(0.5, 1.0), antialias=True,
                                   interpolation=T.InterpolationMode.BICUBIC)
        transform = (T.Compose([crop, T.RandomHorizontalFlip(), normalised]) if augment
                     else normalised)
        super().__init__(items, transform, seed)
        # the images this process reads: all, or under torchrun its shard (EpochSampler.shard)
        held = sorted(set(range(len(self.items)) if only is None else only))
        reader = Subset(data.ImageDataset(self.items, kept_transform(size, augment)), held)
        # The buffer, sized from the files' headers, filled as the images arrive (decoded in
        # `workers`): each comes in a shared-memory file of its own, copied in at once (thousands
        # held would fill /dev/shm and the open-file limit).
        self.buffer = torch.empty(sum(kept_size(self.items[i].path, size, augment) for i in held),
                                  dtype=torch.uint8)
        self.shapes = torch.zeros(len(self.items), 3, dtype=torch.long)  # (n, 3), 0s: not held
        self.offsets = torch.zeros(len(self.items), dtype=torch.long)  # (n,): where image i starts
        start, end = devices.LOADER_START if workers else None, 0
        for i, (image, _) in zip(held, DataLoader(reader, batch_size=None, num_workers=workers,
                                                  multiprocessing_context=start)):
            self.buffer[end:end + image.numel()] = image.flatten()
            self.shapes[i], self.offsets[i] = torch.tensor(image.shape), end
            end += image.numel()

    def image(self, index: int) -> torch.Tensor:  # the kept tensor, in place of the file
        shape, start = self.shapes[index].tolist(), int(self.offsets[index])
        if not shape[0]:  # a sampler that is not the one DecodedImages was made for
            raise IndexError(f"image {index} was not decoded by this process (not in `only`)")
        return self.buffer[start:start + math.prod(shape)].view(shape)


class EpochSampler(Sampler):
    """The training order, each image's number handed on with the epoch, (epoch, number): the
    loading processes, kept across epochs (persistent_workers), read the epoch of each image's
    augmentation from what they are asked for, not from their copy of the dataset, made when they
    started. Each epoch's order is a permutation drawn from (seed + epoch) alone (set_epoch), so
    that an epoch replays after --resume; in one process it is DistributedSampler's, exactly.

    Under torchrun (`world` processes) each process reads a shard of its own, the same in every
    epoch: positions rank, rank + world, ... of one permutation drawn from the seed, topped up from
    its start to equal lengths (as DistributedSampler tops up: every process takes as many steps).
    So a process decodes and holds its shard alone (DecodedImages(only=shard)): 1/world of the
    images (DistributedSampler deals every image to every process over the epochs, so each would
    hold them all: 8 x 3.9 GiB on a node of 8 GPUs for ImageNet's 16 shots). Each step's batch
    then takes batch/world images from each shard: an unbiased draw all the same (our choice;
    webdataset deals its shards so, webdataset/shardlists.py split_by_node)."""

    def __init__(self, count: int, world: int = 1, rank: int = 0, seed: int = 0):
        self.seed, self.epoch, length = seed, 0, math.ceil(count / world)  # each shard's length
        order = (torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
                 if world > 1 else list(range(count)))
        topped_up = (order * math.ceil(length * world / count))[:length * world]
        self.shard = topped_up[rank::world]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.shard)

    def __iter__(self):
        shuffled = torch.randperm(len(self.shard),
                                  generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return ((self.epoch, self.shard[position]) for position in shuffled.tolist())
