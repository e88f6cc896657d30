"""Cost of one DeAR training step on ViT-B/16, against frozen CLIP inference.

For ViT-B/16 (random weights: speed does not depend on them) at batch 4 and 100 classes:
  * the time of one DeAR training step (forward with the frozen pass, the three losses,
    backward, AdamW) divided by the time of an image-only frozen forward of the same batch
    (encode_image on the 4 images under no_grad): the ratio a reader expects, the step's
    cost in units of "looking at the images once". Its floor is about 2.5 (the layers from J
    run three times, twice with autograd, and the text side from J runs for every class);
  * the same step divided by one frozen CLIP inference that also encodes the class prompts
    at 77 tokens (encode_image + encode_text), which makes the step look cheaper than
    inference: DeAR cuts the prompts after the longest one and prepares their first layers
    once per class list;
  * the step's peak memory: the peak resident memory of a process that does nothing else
    (weights included), and the bytes autograd keeps for the backward pass;
DeAR's own path, the only one the library has: the layers before J without autograd, the
frozen pass sharing them, the class list's text side prepared once (`prepare_classes`, outside
the timed step, as train.py does) and cut after the longest prompt. (The plain computation
these savings are checked against lives in tests/test_dear_reference.py, a float64 per-head
reference that is for correctness, not for timing.) The inference and the step each run in
their own process so that the peak memory figures do not mix.

    python benchmarks/bench_train_step.py                 # CPU (~1.5 min on 2 quiet cores)
    python benchmarks/bench_train_step.py --device cuda --amp fp16 --batch 32
    python benchmarks/bench_train_step.py --tokens shared # MMRL++'s shared token space instead
    python benchmarks/bench_train_step.py --tiny          # a tiny CLIP: seconds

Targets: step / image-only forward at most 2.9 (2.65 on 2 quiet CPU cores); step / inference
with prompts at most 1.8; peak memory at most 2 GB. It also prints the step's model FLOP
utilisation: step_flops over the GPU's dense bf16 peak (PEAK_BF16_TFLOPS, or --peak-tflops).
"""

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import clip_model  # noqa: E402
import dear  # noqa: E402

B16 = dict(embed_dim=512, image_resolution=224, vision_layers=12, vision_width=768, vision_patch_size=16,
           vision_heads=12, context_length=77, vocab_size=49408, transformer_width=512,
           transformer_heads=8, transformer_layers=12)
# --tiny: a CLIP small enough for seconds on a CPU, with the shapes that matter kept (several
# heads, J inside the last four layers).
TINY = dict(embed_dim=64, image_resolution=32, vision_layers=4, vision_width=80, vision_patch_size=8,
            vision_heads=5, context_length=24, vocab_size=1000, transformer_width=32,
            transformer_heads=4, transformer_layers=4)
# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' datasheets. The
# first entry whose name is part of torch.cuda.get_device_name() wins (H200 before H100, the
# PCIe H100 before the SXM one).
PEAK_BF16_TFLOPS = [
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("GH200", 989.0), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0),
    ("A10", 125.0), ("RTX 6000 Ada", 364.0), ("A6000", 155.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0),
    ("V100", 125.0), ("T4", 65.0),  # no bf16 on these two: their fp16 peak (train.py uses fp16 there)
]
PRECISIONS = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}  # train.py's --amp


def peak_tflops(name: str, given=None):
    """-> (the dense bf16 peak of the GPU called `name`, or None; where it comes from)."""
    if given is not None:
        return given, "--peak-tflops"
    return next(((tflops, f"{name} ({key} in the table)") for key, tflops in PEAK_BF16_TFLOPS
                 if key in name), (None, name))


def step_flops(config: dict, batch: int, classes: int, prompt_tokens: int, attributes: int = 5,
               text_tokens: int = 4) -> float:
    """Matrix-product FLOPs (2 per multiply-add) of one DeAR training step as dear.py runs it.
    A layer over S sequences of T tokens of width d: 24 S T d^2 in its linear maps, 4 S T^2 d in
    attention. Backward: CLIP is frozen, so only the gradients of the activations are formed,
    about as much as the forward again (twice that in attention, where Q, K and V all get one)."""
    def forward(S, T, d):
        return 24 * S * T * d * d + 4 * S * T * T * d

    def backward(S, T, d):
        return 24 * S * T * d * d + 8 * S * T * T * d

    layers, d = config["vision_layers"], config["vision_width"]
    J = max(layers - 4, 0)  # 0-based index of DeAR's first layer (dear.default_first_layer, 1-based)
    patches = (config["image_resolution"] // config["vision_patch_size"]) ** 2
    N = 1 + patches
    flops = 2 * batch * patches * 3 * config["vision_patch_size"] ** 2 * d  # patch embedding
    flops += J * forward(batch, N, d)  # layers before J, no autograd
    flops += (layers - J) * forward(batch, N, d)  # the frozen pass for L_reg
    flops += (layers - J) * (forward(batch, N + attributes, d) + backward(batch, N + attributes, d))
    width_t, T = config["transformer_width"], prompt_tokens + text_tokens
    flops += (config["transformer_layers"] - J) * (forward(classes, T, width_t) + backward(classes, T, width_t))
    flops += 3 * 2 * batch * (1 + attributes) * classes * config["embed_dim"]  # logits, forward + backward
    return float(flops)


def class_prompts(num_classes: int, generator: torch.Generator, context: int = 77,
                  vocab: int = 49408) -> torch.Tensor:
    """Token ids shaped like real class prompts: start, 6-16 tokens (fewer if the context is
    short), end (the largest id, as in CLIP's vocabulary)."""
    ids = torch.zeros(num_classes, context, dtype=torch.long)
    longest = min(16, context - 2)
    for c in range(num_classes):
        length = int(torch.randint(min(6, longest), longest + 1, (1,), generator=generator))
        ids[c, 0] = vocab - 2
        ids[c, 1:length + 1] = torch.randint(1, vocab - 3, (length,), generator=generator)
        ids[c, length + 1] = vocab - 1
    return ids


def mixed_roles(layers: int = 12, heads: int = 12) -> dear.RoleMap:
    """A role map like an analysis gives, over the last four layers: a third each of
    attribute, generalization and mixed heads."""
    entries = []
    for layer in range(max(layers - 4, 0), layers):
        for head in range(heads):
            kind = (layer + head) % 3
            if kind == 0:
                entries.append(dear.HeadRole(layer, head, "attribute", dear.CORE_ATTRIBUTES[head % 5]))
            else:
                entries.append(dear.HeadRole(layer, head, "generalization" if kind == 1 else "mixed"))
    return dear.RoleMap(layers, heads, list(dear.CORE_ATTRIBUTES), entries)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(part: str, device: str, batch: int, classes: int, repeats: int, tokens: str,
            config: dict = B16, amp: str = "off") -> dict:
    """Run in a child process that does only `part` ("inference" or "step"), so that its peak
    memory is that part's alone. Returns the best time and the memory figures; the step's
    process also times the image-only frozen forward of the same batch, alternating with the
    step, so that their ratio is measured in the same moments of a busy machine."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    clip = clip_model.CLIP(**config).eval().to(device)
    size, dtype = config["image_resolution"], PRECISIONS[amp]
    images = torch.randn(batch, 3, size, size, generator=generator).to(device)
    prompts = class_prompts(classes, generator, config["context_length"], config["vocab_size"]).to(device)
    autocast = torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None)
    labels = torch.randint(0, classes, (batch,), generator=generator).to(device)
    saved_bytes = [0]

    def image_only():  # the frozen forward of the same batch, images only
        with torch.no_grad(), autocast:
            clip.encode_image(images)

    if part == "inference":
        def run():
            with torch.no_grad(), autocast:
                clip.encode_image(images), clip.encode_text(prompts)
    else:
        roles = mixed_roles(config["vision_layers"], config["vision_heads"])
        model = dear.DeAR(clip, roles, tokens=tokens).to(device)
        with autocast:
            prepared = model.prepare_classes(prompts)  # once per class list, as in train.py
        optimizer = torch.optim.AdamW(model.learnable_parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler(torch.device(device).type, enabled=dtype == torch.float16)
        # Autograd's own memory: tensors saved for backward, each storage counted once, the
        # frozen weights (which exist anyway) not counted.
        weights = {p.untyped_storage().data_ptr() for p in clip.parameters()}

        def count_saved(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                saved_bytes[-1] += storage.nbytes()
            return tensor

        def run(count: bool = False):
            # The saved-tensor hooks count, in the warm-up only: the timed steps run plain.
            hooks = (torch.autograd.graph.saved_tensors_hooks(count_saved, lambda t: t) if count
                     else contextlib.nullcontext())
            with hooks, autocast:  # train.py's step: autocast, fp16's loss scaler, AdamW
                output = model(images, prepared, with_frozen=True)
                loss = dear.dear_loss(output, labels)["total"]
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        seen = set()

    def timed(function) -> float:
        synchronize(device)
        start = time.perf_counter()
        function()
        synchronize(device)
        return time.perf_counter() - start

    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # runtime + weights, built
    if part == "step":
        run(count=True)  # warm-up, counting what autograd keeps
    else:
        run()  # warm-up
    times, image_times = [], []
    for _ in range(repeats):
        times.append(timed(run))
        if part == "step":
            image_times.append(timed(image_only))
    peak = (torch.cuda.max_memory_allocated() if device.startswith("cuda")
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"seconds": min(times), "image_seconds": min(image_times, default=None), "peak_bytes": peak,
            "prompt_tokens": int(prompts.argmax(dim=-1).max()) + 1,  # DeAR cuts after the longest
            "saved_bytes": max(saved_bytes), "above_bytes": peak - (0 if device.startswith("cuda") else baseline)}


def run_child(part: str, args) -> dict:
    child = subprocess.run([sys.executable, __file__, "--only", part, "--device", args.device,
                            "--batch", str(args.batch), "--classes", str(args.classes),
                            "--repeats", str(args.repeats), "--tokens", args.tokens, "--amp", args.amp]
                           + ["--tiny"] * args.tiny,
                           capture_output=True, text=True)
    if child.returncode != 0:
        sys.exit(f"error: the {part} run failed: {child.stderr.strip().splitlines()[-1]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description="DeAR training-step cost vs frozen CLIP inference")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batch", type=int, default=4, help="images per step")
    parser.add_argument("--classes", type=int, default=100, help="classes (text prompts) per step")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats; the best counts")
    parser.add_argument("--tokens", choices=dear.TOKEN_CONSTRUCTIONS, default="separate",
                        help="DeAR's token construction (train.py --tokens)")
    parser.add_argument("--amp", choices=PRECISIONS, default="off",
                        help="autocast as train.py's --amp: off (fp32), fp16 (+ loss scaler), bf16")
    parser.add_argument("--tiny", action="store_true", help="a tiny CLIP instead of ViT-B/16: seconds")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for the MFU")
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # child-process mode
    args = parser.parse_args()
    config = TINY if args.tiny else B16

    if args.only is not None:
        print(json.dumps(measure(args.only, args.device, args.batch, args.classes, args.repeats,
                                 args.tokens, config, args.amp)))
        return

    print(f"DeAR step vs frozen CLIP inference: {'tiny CLIP' if args.tiny else 'ViT-B/16'}, batch "
          f"{args.batch}, {args.classes} classes, tokens {args.tokens}, --amp {args.amp}, {args.device}, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}")
    inference = run_child("inference", args)
    print(f"frozen CLIP inference ({args.batch} images + {args.classes} prompts at "
          f"{config['context_length']} tokens): "
          f"{inference['seconds']:.3f} s, peak {inference['peak_bytes'] / 2**20:.0f} MB")
    r = run_child("step", args)
    print(f"frozen image-only forward ({args.batch} images, timed between the steps): {r['image_seconds']:.3f} s")
    print(f"{'step s':>9}{'step/image':>12}{'step/inf':>10}{'peak MB':>10}{'of it, step MB':>16}{'autograd MB':>13}")
    print(f"{r['seconds']:>9.3f}{r['seconds'] / r['image_seconds']:>12.2f}{r['seconds'] / inference['seconds']:>10.2f}"
          f"{r['peak_bytes'] / 2**20:>10.0f}{r['above_bytes'] / 2**20:>16.0f}{r['saved_bytes'] / 2**20:>13.0f}")
    print("targets: step/image <= 2.9 (the step over an image-only frozen forward of the same batch; "
          "floor about 2.5), step/inf <= 1.8 (inference encoding the prompts at 77 tokens too), "
          "peak <= 2048 MB. 'peak MB' is the "
          "process's peak resident memory on CPU (the ~0.5 GB runtime and 0.6 GB of weights included; "
          "'of it, step MB' is what the step adds on top), the allocator's peak on CUDA; 'autograd MB' is what the step keeps for backward, weights excluded")
    flops = step_flops(config, args.batch, args.classes, r["prompt_tokens"])
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "the CPU"
    peak, source = peak_tflops(name, args.peak_tflops)
    achieved = flops / r["seconds"] / 1e12
    print(f"MFU: {flops / 1e9:,.1f} GFLOP per step, {achieved:,.3g} TFLOP/s" + (
        f" of {peak:,.3g} ({source}): {100 * achieved / peak:.1f}%" if peak else
        f"; no peak known for {source} (give --peak-tflops)"))


if __name__ == "__main__":
    main()
