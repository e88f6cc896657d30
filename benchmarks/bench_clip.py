"""Image-encoding throughput of our hand-written ViT-B/16 against open_clip's, same weights.

Both models get the same random weights (open_clip's ViT-B-16-quickgelu, saved in OpenAI's
state-dict format and loaded through `clip_model.load`), the same batch of random images,
float32, no autograd, and the machine's threads. Rounds alternate between the two models so
that a slow moment of the machine hits both alike; the best round of each counts.

    pip install -r requirements-dev.txt      # open-clip-torch is the reference
    python benchmarks/bench_clip.py                      # batch 8, CPU
    python benchmarks/bench_clip.py --device cuda --rounds 20
    python benchmarks/bench_clip.py --batch 1 --rounds 1     # its code runs, in seconds

Prints images/s for each and the ratio ours / open_clip (target on CPU: at least 1.0).
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import clip_model  # noqa: E402


def images_per_second(encode, images: torch.Tensor) -> float:
    if images.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    encode(images)
    if images.is_cuda:
        torch.cuda.synchronize()
    return images.shape[0] / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--batch", type=int, default=8, help="images per forward pass")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per model")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()

    try:
        import open_clip
    except ImportError:
        sys.exit("error: this benchmark compares against open_clip: pip install -r requirements-dev.txt")

    torch.manual_seed(0)
    reference = open_clip.create_model("ViT-B-16-quickgelu", pretrained=None).eval()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ViT-B-16-random.pt")
        torch.save(reference.state_dict(), path)
        ours, _ = clip_model.load(path, device=args.device)
    reference = reference.to(args.device)
    images = torch.randn(args.batch, 3, 224, 224, device=args.device)

    with torch.inference_mode():
        difference = (ours.encode_image(images) - reference.encode_image(images)).abs().max().item()
        for _ in range(2):  # warm-up: allocator, kernels, thread pools
            ours.encode_image(images), reference.encode_image(images)
        rates = {"ours": [], "open_clip": []}
        for _ in range(args.rounds):
            rates["ours"].append(images_per_second(ours.encode_image, images))
            rates["open_clip"].append(images_per_second(reference.encode_image, images))

    best = {name: max(values) for name, values in rates.items()}
    print(f"ViT-B/16 image encoding, batch {args.batch}, float32, {args.device}, "
          f"{torch.get_num_threads()} threads, best of {args.rounds} rounds")
    print(f"  max |ours - open_clip| on the embeddings: {difference:.2e}")
    for name, value in best.items():
        print(f"  {name:<10} {value:8.2f} images/s   (rounds: {', '.join(f'{v:.2f}' for v in rates[name])})")
    print(f"  ratio ours / open_clip: {best['ours'] / best['open_clip']:.3f}   (target >= 1.0)")


if __name__ == "__main__":
    main()
