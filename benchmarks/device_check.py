"""One command that proves the GPU path and measures it: `python benchmarks/device_check.py`.

On a machine with a CUDA GPU it runs in about 2-5 minutes, prints one table (a pass/fail
line per check, with its figures) and writes the same as JSON and Markdown in --output
(default runs/device_check/; the train.py runs' output goes to its logs/). The exit status is
1 if any check fails. train.py's precision on CUDA is fp16 autocast with a loss scaler
(devices.choose_precision; --amp bf16 from compute capability 8.0); the checks run both half
precisions, and on the CPU the checks that need autocast simulate them. Checks:

  1. parity      random ViT-B/16 (fp32, TF32 off): image and text features on the device
                 against the CPU (max abs difference <= 1e-3), and the per-head
                 decomposition's sum against encode_image on the device;
  2. scores      DeAR.fused_logits on fixed fp32 features (64 images x 200 close classes at
                 CLIP's scale of 100) under autocast bf16 and fp16: float32, and fp32's
                 predictions exactly; the full toy's predictions (zero-shot and DeAR, 720 test
                 images) with the encoders in train.py's precision change against fp32 in at most
                 TOY_CHANGES_BOUND images per set (a bound measured in the CPU simulation);
  3. attention   each fused attention backend (math, flash, memory-efficient, cuDNN; torch's
                 sdpa_kernel) under DeAR's per-head masks at the vision length (197 + A) and the
                 causal mask at text lengths 63, 64, 65 and 77 + K, forward and backward in
                 train.py's precision, against the explicit per-head path in fp32: at most twice
                 that path's own error in the same precision, + 1e-3; a backend that cannot run
                 a case says "unavailable" (a row of none: skip);
  4. amp steps   DeAR training steps under autocast bf16 (where train.py chooses it), and fp16
                 with the gradient scaler on every device: the loss and every learnable
                 gradient finite, every learnable tensor moved, CLIP unchanged;
     speed       images/s and peak memory of the training step and of the frozen image-only
                 forward of the same batch, at batch 4 and 32 with 100 and 1,000 classes,
                 and their time ratio (the same process, one after the other);
  5. open_clip   image encoding, ours against open_clip's on the same weights and the same
                 autocast precision, as a throughput ratio (skipped, saying so, when
                 open-clip-torch is not installed);
  6. train.py    end to end on the toy world on the device (its own precision), and through
                 `torchrun --nproc_per_node=1` in fp32 on a CoOp-layout dataset written from
                 the toy world's task: each must exit 0, write its table, and land within a
                 stated tolerance of the same run on the CPU (6.3 and 4.2 accuracy points:
                 TOLERANCE_POINTS_* below say why); a stop after one epoch and a --resume must
                 end with the same tensors as the unbroken run (bitwise on the CPU; on a GPU
                 within 1e-3); a DistributedDataParallel step of DeAR over NCCL (gloo on the
                 CPU) in a process group of one; a run stopped in a precision without a loss
                 scaler (bf16 where the GPU has it, else fp32) and resumed in fp16, train.py's
                 default, with a fresh loss scaler; train.py in 2 processes for 2 steps, rank 0 analysing the heads alone,
                 over NCCL with 2 GPUs (with one, the row says NCCL across processes was not
                 checked) and over gloo on the CPU;
  7. MFU         the model FLOP utilisation of the training step at batch 32: FLOPs counted
                 from the model's sizes, over the GPU's dense bf16 peak (a table of known GPUs
                 below, or --peak-tflops).

    python benchmarks/device_check.py                         # CUDA: the only command needed
    python benchmarks/device_check.py --device cpu --quick    # every check on a tiny model, seconds
    python benchmarks/device_check.py --peak-tflops 312       # a GPU the table does not know

The train.py runs use the miniature toy world in both modes (its tiny CLIP is pretrained on
the CPU in seconds, then cached in $CLIP_CACHE_DIR or ~/.cache/clip-from-scratch); check 2
reads the shipped full toy model (its task is drawn into the cache in seconds). `--toy-scale
full` trains on the full toy world too, slower. The toy run trains the toy recipe for 5
epochs (--quick: 2, and only the zero-shot and DeAR rows), the CoOp-layout runs 5 epochs on 16
shots (--quick: 3 on 4).

A GPU machine without network: what to bring. The script needs torch (any version from 2.4
on, requirements.txt's floor), torchvision, regex, numpy and pillow (the last two
come with torchvision). ftfy may be missing: the script then puts a stand-in on the path
(it says so; these checks tokenize plain ASCII, which ftfy leaves as it is). open-clip-torch
is only for check 5, which is skipped, with a line saying so, without it. Here, with network,
download the wheels for the GPU machine's Python and platform (e.g. Python 3.12, x86-64 Linux;
torch's CUDA build from its own index, e.g. cu124 for a recent driver):

    pip download torch torchvision regex numpy pillow ftfy open-clip-torch -d wheels \\
        --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: \\
        --index-url https://download.pytorch.org/whl/cu124 --extra-index-url https://pypi.org/simple

then copy `wheels/` and this repository to the GPU machine, and there:

    pip install --no-index --find-links wheels torch torchvision regex numpy pillow ftfy open-clip-torch
    python benchmarks/device_check.py

Where torch and torchvision are installed already, bring only what is missing, without
dependencies (open-clip-torch would pull in a second torch): `pip download regex ftfy wcwidth
-d wheels --no-deps` with the same --python-version/--platform/--only-binary flags, then
`pip install --no-index --find-links wheels regex ftfy wcwidth` there (check 5 is then skipped).
"""

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# clip_model.py cleans text with ftfy. Without it (a GPU machine may lack it) a stand-in that
# returns the text unchanged is put on the path, here and for the train.py processes: every
# prompt in these checks is plain ASCII, which ftfy leaves unchanged anyway.
try:
    import ftfy  # noqa: F401
    FTFY_STAND_IN = None
except ImportError:
    FTFY_STAND_IN = tempfile.mkdtemp(prefix="device_check-ftfy-")
    with open(os.path.join(FTFY_STAND_IN, "ftfy.py"), "w", encoding="utf-8") as stand_in:
        stand_in.write('"""Written by benchmarks/device_check.py: ftfy is not installed."""\n\n\n'
                       "def fix_text(text):\n    return text\n")
    sys.path.insert(0, FTFY_STAND_IN)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [FTFY_STAND_IN, os.environ.get("PYTHONPATH")]))
import clip_model  # noqa: E402
import data  # noqa: E402
import dear  # noqa: E402
from harness import devices, runfolder  # noqa: E402
import train  # noqa: E402
from bench_train_step import B16, class_prompts, mixed_roles  # noqa: E402
# train.py's precision forced (an H200 never takes the fp16 path on its own; the CPU no autocast)
from precision_table import forced_precision, measure  # noqa: E402

# --quick: a CLIP small enough that every check runs in seconds on a CPU, with the shapes
# that matter kept (several heads, J inside the last four layers, a 1,000-class text side).
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
TOLERANCE_FP32 = 1e-3  # max abs difference of features, device vs CPU, both fp32 (TF32 off)
# Accuracy points a train.py run on the device may differ from the same run on the CPU, in any
# cell of its table. The miniature toy CLIP is near chance, so its logits are close to ties, and
# a test column holds 48 images (2.08 points each): an fp32 run may move 2 of them (CUDA's
# convolutions use TF32 by default). A run in the device's autocast (the toy run, 6a) gets one
# image more: in the CPU simulation (that run, 5 epochs, bf16 autocast on the CPU against fp32)
# its bf16 encoders and training moved 1 image (2.08 points; 2 images, 4.17, while the scores
# were still rounded to bf16, when this allowance was twice fp32's, 8.4).
TOLERANCE_POINTS_FP32 = 4.2
TOLERANCE_POINTS_AMP = 6.3


class Report:
    """The table: one row per check -> (name, status, figures); status pass / fail / skip / info."""

    def __init__(self):
        self.rows, self.started = [], time.time()

    def add(self, name: str, ok, figures: str, **values) -> None:
        status = ok if isinstance(ok, str) else ("pass" if ok else "fail")
        self.rows.append(dict(check=name, status=status, figures=figures, values=values))
        print(f"  [{time.time() - self.started:4.0f} s] {status:<5} {name}: {figures}", flush=True)

    @property
    def failed(self) -> bool:
        return any(row["status"] == "fail" for row in self.rows)

    def verdict(self) -> str:
        """"passed", "passed with N skipped (why)" or "FAILED (N of M)": never "all passed" over a
        skipped row. A row of figures alone ("info") neither passes nor fails."""
        failed = [row for row in self.rows if row["status"] == "fail"]
        skipped = [row for row in self.rows if row["status"] == "skip"]
        if failed:
            return f"FAILED ({len(failed)} of {len(self.rows)} checks: " + \
                "; ".join(row["check"] for row in failed) + ")"
        if skipped:
            return f"passed with {len(skipped)} skipped (" + \
                "; ".join(f"{row['check']}: {row['figures'][:80]}" for row in skipped) + ")"
        return "passed"

    def markdown(self) -> str:
        lines = ["| check | result | figures |", "|---|---|---|"]
        lines += [f"| {row['check']} | {row['status']} | {row['figures']} |" for row in self.rows]
        return "\n".join(lines)


def write_file(path: str, text: str) -> None:
    def write(temporary: str) -> None:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)

    clip_model.atomic_write(path, write)  # no half-written table if the run is killed


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_mb(device: torch.device):
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def timed(run, device: torch.device, warmup: int, repeats: int) -> float:
    """Seconds per call of run(), the mean over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        run()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    synchronize(device)
    return (time.perf_counter() - start) / repeats


def random_clip(config: dict, seed: int = 0) -> clip_model.CLIP:
    """A CLIP with random weights, biases and LayerNorm gains included (a fresh model has zero
    biases and unit gains, which would hide a bias that goes missing on one device)."""
    torch.manual_seed(seed)
    clip = clip_model.CLIP(**config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clip.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    return clip.eval().requires_grad_(False)


def autocast(device: torch.device, dtype):
    """train.py's autocast, for any device (the CPU's runs bf16 and fp16 alike)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def device_precision(device: torch.device):
    """-> (train.py's autocast dtype on this device, why): devices.choose_precision's default, fp16
    with a loss scaler. On the CPU the checks simulate it (CPU autocast, clip_model's fp32
    LayerNorm and softmax: CUDA's dtype flow)."""
    if device.type != "cuda":
        return torch.float16, "fp16 autocast (on the CPU: a simulation of a GPU's)"
    return devices.choose_precision("cuda", "on", torch.cuda.get_device_capability(device))


def has_bf16(device: torch.device) -> bool:
    """bf16 in hardware (--amp bf16 is allowed): compute capability 8.0 on; the CPU simulates."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= devices.BF16_CAPABILITY


def precision_name(dtype) -> str:
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


@contextlib.contextmanager
def no_tf32():
    """fp32 that is fp32 on a GPU too: TF32 (10-bit products) off for matmuls and convolutions."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def guarded(report: Report, name: str, check, *args):
    """Run one check; an exception fails it (with its line in the table, the traceback on
    stderr) and the next check still runs."""
    try:
        return check(*args)
    except Exception as error:  # noqa: BLE001 -- whatever breaks on the device is the finding
        traceback.print_exc()
        message = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        report.add(name, False, f"{type(error).__name__}: {message}")
        return None


# ------------------------------------------------------------------------------------------
# 1. Parity
# ------------------------------------------------------------------------------------------


def check_parity(report: Report, config: dict, device: torch.device) -> clip_model.CLIP:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here (TF32 rounds to 10 bits)
    torch.backends.cudnn.allow_tf32 = False
    clip = random_clip(config)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(4, 3, config["image_resolution"], config["image_resolution"], generator=generator)
    texts = class_prompts(8, generator, config["context_length"], config["vocab_size"])
    with torch.no_grad():
        cpu_image, cpu_text = clip.encode_image(images), clip.encode_text(texts)
        clip = clip.to(device)
        dev_image = clip.encode_image(images.to(device)).cpu()
        dev_text = clip.encode_text(texts.to(device)).cpu()
        parts = clip_model.head_contributions(clip, images.to(device), num_layers=4)
        decomposition = (parts.total() - clip.encode_image(images.to(device))).abs().max().item()
    image_diff = (dev_image - cpu_image).abs().max().item()
    text_diff = (dev_text - cpu_text).abs().max().item()
    scale = cpu_image.abs().max().item()
    report.add(f"1. parity {device.type} vs cpu, fp32, TF32 off", max(image_diff, text_diff) <= TOLERANCE_FP32,
               f"image {image_diff:.1e}, text {text_diff:.1e} max abs (features up to {scale:.2f}; <= {TOLERANCE_FP32:g})",
               image=image_diff, text=text_diff)
    report.add("1. per-head decomposition sum vs encode_image", decomposition <= TOLERANCE_FP32,
               f"{decomposition:.1e} max abs on {device.type} (<= {TOLERANCE_FP32:g})", difference=decomposition)
    torch.backends.cudnn.allow_tf32 = True  # back to torch's defaults for the rest
    return clip


# ------------------------------------------------------------------------------------------
# 2. Scores in fp32 under autocast
# ------------------------------------------------------------------------------------------
# train.py runs the encoders under autocast and every score in fp32 (dear.cosine_logits): a bf16
# logit near CLIP's scale of 100 moves in steps of 0.5 (near the toy's 25, of 0.125).
MARGIN_BATCH = dict(images=64, classes=200, width=512, scale=100.0)  # ViT-B/16's E; CLIP's scale
# The full toy's predictions (its base and novel test sets, 360 images each; zero-shot CLIP and
# DeAR at its seed-1 initialisation, all heads mixed: fused and class-branch logits) with the
# encoders under bf16 autocast may differ from fp32's in at most this many images per set and
# kind of logits. Measured in the CPU simulation (bf16 autocast on the CPU against fp32, this
# check with --device cpu): at most 1 of 360 (docs/MEASURED.md); 3 allows for another
# accumulation order on a GPU. Scores rounded to bf16, as before they were kept in fp32, changed
# 2 of 360 and left tied top-2 pairs.
TOY_CHANGES_BOUND = 3


def margin_batch(seed: int = 0):
    """64 images x (class + 5 attribute) features and 200 text features, all near one direction,
    fp32: every logit within about 0.1 of the others at a scale of 100, where bf16 has steps of
    0.5 -> ((64, 6, 512), (200, 512))."""
    generator = torch.Generator().manual_seed(seed)
    images, classes, width = MARGIN_BATCH["images"], MARGIN_BATCH["classes"], MARGIN_BATCH["width"]
    centre = torch.randn(width, generator=generator)
    text = centre + 0.02 * torch.randn(classes, width, generator=generator)
    return centre + 0.05 * torch.randn(images, 6, width, generator=generator), text


def check_scores(report: Report, device: torch.device) -> None:
    """DeAR.fused_logits on fixed fp32 features, under autocast bf16 and fp16 on the device:
    float32, and fp32's predictions exactly (fused and every branch)."""
    layers, heads = TINY["vision_layers"], TINY["vision_heads"]
    with warnings.catch_warnings():  # blind attribute tokens of the tiny model: expected
        warnings.simplefilter("ignore")
        model = dear.DeAR(random_clip(TINY), mixed_roles(layers, heads)).to(device)
    with torch.no_grad():
        model.clip.logit_scale.fill_(math.log(MARGIN_BATCH["scale"]))
    features, text = (t.to(device) for t in margin_batch())
    images, classes = MARGIN_BATCH["images"], MARGIN_BATCH["classes"]
    with torch.no_grad(), no_tf32():
        fused, branches = model.fused_logits(features, text)  # fp32: no autocast
        for dtype in (torch.bfloat16, torch.float16):
            name = precision_name(dtype)
            with autocast(device, dtype):
                fused_amp, branches_amp = model.fused_logits(features, text)
                unit = [F.normalize(t, dim=-1).to(dtype) for t in (features[:, 0], text)]
                rounded = (MARGIN_BATCH["scale"] * unit[0] @ unit[1].T).argmax(-1)  # in `dtype`
            pairs = ((fused_amp, fused), *zip(branches_amp.unbind(1), branches.unbind(1)))
            changed = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in pairs)
            would = int((rounded != branches[:, 0].argmax(-1)).sum())
            dtypes = {str(t.dtype).replace("torch.", "") for t in (fused_amp, branches_amp)}
            report.add(f"2. scores under autocast {name}, {images} images x {classes} close "
                       "classes",
                       dtypes == {"float32"} and changed == 0,
                       f"fused and branch logits {'/'.join(sorted(dtypes))}; {changed} predictions "
                       f"changed against fp32 (must be 0); scores rounded to {name} would change "
                       f"{would} of {images}", changed=changed, rounded_changed=would)


def toy_predictions(clip, tokenizer, split, model, device: torch.device, dtype) -> dict:
    """{kind: (n,) predicted labels} of a toy test set as train.evaluate scores it: zero-shot CLIP,
    DeAR's fused and class-branch logits; the encoders under autocast `dtype` (None: fp32, TF32
    off)."""
    loader = torch.utils.data.DataLoader(data.ImageDataset(split.test, data.test_transform(
        clip.visual.input_resolution)), batch_size=len(split.test))
    images = next(iter(loader))[0].to(device)
    ids = tokenizer.tokenize(split.prompts, clip.context_length, truncate=True).to(device)
    with torch.no_grad(), no_tf32(), autocast(device, dtype):
        zero_shot = train.zero_shot_logits(clip, clip.encode_image(images), clip.encode_text(ids))
        text = model.encode_text(model.prepare_classes(ids))
        f_cls, f_attr, _ = model.encode_image(images)
        fused, branches = model.fused_logits(torch.cat([f_cls[:, None], f_attr], dim=1), text)
    return {"zero-shot": zero_shot.argmax(-1), "DeAR fused": fused.argmax(-1),
            "DeAR class": branches[:, 0].argmax(-1)}


def check_toy_predictions(report: Report, device: torch.device, dtype) -> None:
    import toyworld

    assets = toyworld.prepare("full", log=lambda line: None)  # the shipped model; its task, once
    clip, _ = clip_model.load(assets.weights, device=device, head_width=assets.head_width)
    clip = clip.eval().requires_grad_(False)
    tokenizer = clip_model.SimpleTokenizer(assets.bpe)
    depth, heads = len(clip.visual.transformer.resblocks), clip.visual.transformer.heads
    torch.manual_seed(1)  # DeAR's tokens as train.py's seed 1 starts them
    roles = dear.RoleMap.uniform("mixed", depth, heads, range(depth), assets.attributes)
    model = dear.DeAR(clip, roles, beta=0.5).to(device).eval()
    changes = {}
    for column, subsample in (("base", "base"), ("novel", "new")):
        split = data.load_dataset("toyworld", assets.data_root, subsample=subsample)
        fp32 = toy_predictions(clip, tokenizer, split, model, device, None)
        amp = toy_predictions(clip, tokenizer, split, model, device, dtype)
        for kind in fp32:
            changes[f"{kind} {column}"] = int((fp32[kind] != amp[kind]).sum())
    report.add(f"2. the full toy's predictions, {precision_name(dtype)} encoders vs fp32",
               max(changes.values()) <= TOY_CHANGES_BOUND,
               ", ".join(f"{key} {n}" for key, n in changes.items())
               + f" of 360 changed (<= {TOY_CHANGES_BOUND} each)", changes=changes)


# ------------------------------------------------------------------------------------------
# 3. The fused attention kernels under DeAR's masks
# ------------------------------------------------------------------------------------------
# DeAR gives each head an additive mask of its own, (H, N, N); torch picks a fused kernel per
# call. Which kernels take such a mask, at which lengths, in bf16, forward and backward, only a
# GPU can say. Each backend, forced alone, is held against the explicit per-head path
# (return_details=True) in fp32: its error (max abs difference over the largest |value|, of the
# output and of the input's gradient) may be at most twice the explicit path's own in bf16,
# plus 1e-3. A mask mishandled moves the output by its own size; a -inf row gives NaN.
ATTENTION_BACKENDS = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
ATTENTION_TOLERANCE = (2.0, 1e-3)  # (times the explicit bf16 path's error, plus)
TEXT_LENGTHS = (63, 64, 65)  # around 64, a kernel's block size; and the context + K
ATTRIBUTES, TEXT_TOKENS = 5, 4  # A and K of the cases


def attention_cases(config: dict) -> list:
    """(name, width, heads, mask) of DeAR's attention: the vision tower at 1 + G*G + A tokens
    under the role masks of a map with every role (H, N, N); the text tower at 63, 64, 65 and
    context + K tokens under the causal mask (N, N)."""
    layers, heads = config["vision_layers"], config["vision_heads"]
    image_tokens = 1 + (config["image_resolution"] // config["vision_patch_size"]) ** 2
    J = dear.default_first_layer(layers)
    masks = dear.build_role_masks(mixed_roles(layers, heads), J, layers, image_tokens)[0]
    cases = [(f"vision {masks.shape[-1]}", config["vision_width"], heads, masks)]
    for length in (*TEXT_LENGTHS, config["context_length"] + TEXT_TOKENS):
        cases.append((f"text {length}", config["transformer_width"], config["transformer_heads"],
                      clip_model.causal_mask(length)))
    return cases


def attention_pass(attention, x, gradient, mask, device, dtype, details: bool):
    """(output, the input's gradient) of one forward and backward, both float32."""
    x = x.detach().clone().requires_grad_(True)
    with autocast(device, dtype):
        output = attention(x, mask, return_details=True)[0] if details else attention(x, mask)
    (output.float() * gradient).sum().backward()
    return output.detach().float(), x.grad.float()


def relative_error(value, reference) -> float:
    return float((value - reference).abs().max() / reference.abs().max())


def check_attention(report: Report, config: dict, device: torch.device) -> None:
    """Each backend against the explicit fp32 path in fp16 and bf16, the backend torch picks by
    default in each; then, on a GPU, the verdicts (ok / wrong / unavailable per backend) kept
    where train.py's --attention auto reads them (devices.attention_record)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    verdicts = {}
    dtypes = [torch.float16] + ([torch.bfloat16] if has_bf16(device) else [])
    for dtype in dtypes:
        picked = devices.sdpa_kernel_used(device, dtype, None)
        report.add(f"3. the kernel torch picks by default, {precision_name(dtype)}", "info",
                   f"{picked} (found by running ViT-B/16's vision attention with DeAR's masks)",
                   picked=picked)
        for backend, (status, available) in attention_verdicts(report, config, device, dtype,
                                                               SDPBackend, sdpa_kernel).items():
            previous = verdicts.get(backend)
            verdicts[backend] = ("wrong" if "wrong" in (status, previous) else
                                 "ok" if "ok" in (status, previous) else "unavailable")
    if device.type == "cuda":  # for --attention auto on this GPU and build
        keep_verdicts(devices.gpu_build(device), verdicts)


def keep_verdicts(build: str, verdicts: dict) -> None:
    """{backend: ok | wrong | unavailable} for this GPU and build, added to devices.attention_record
    (each GPU and build its own entry), where train.py's --attention auto reads them."""
    path = devices.attention_record()
    try:
        with open(path, encoding="utf-8") as f:
            record = dict(json.load(f))
    except (OSError, ValueError, TypeError):  # none yet, or damaged: started again
        record = {}
    record[build] = verdicts
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_file(path, json.dumps(record, indent=1))


def attention_verdicts(report: Report, config: dict, device: torch.device, dtype, SDPBackend,
                       sdpa_kernel) -> dict:
    """One row per backend in `dtype` -> {backend: ("ok" | "wrong" | "unavailable", cases run)}."""
    name = f"3. fused attention with DeAR's masks, {precision_name(dtype)}"
    cases = []
    for case, width, heads, mask in attention_cases(config):
        torch.manual_seed(0)
        attention = clip_model.MultiHeadAttention(width, heads).to(device).requires_grad_(False)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(2, mask.shape[-1], width, generator=generator).to(device)
        gradient = torch.randn(2, mask.shape[-1], width, generator=generator).to(device)
        mask = mask.to(device)
        with no_tf32():
            reference = attention_pass(attention, x, gradient, mask, device, None, details=True)
            explicit = attention_pass(attention, x, gradient, mask, device, dtype, details=True)
        own = [relative_error(e, r) for e, r in zip(explicit, reference)]  # the explicit one's
        cases.append((case, attention, x, gradient, mask, reference, own))
    times, plus = ATTENTION_TOLERANCE
    worst = max(o for *_, own in cases for o in own)
    allowed = (f" (explicit path in {precision_name(dtype)}: up to {worst:.1e}; allowed {times:g}x "
               f"its error + {plus:g})")
    refusals = ("No available kernel", "No viable backend")  # torch's words: CUDA's, the CPU's
    verdicts = {}
    for backend in ATTENTION_BACKENDS:
        if not hasattr(SDPBackend, backend):  # e.g. cuDNN's before torch 2.5
            report.add(f"{name}, {backend}", "skip", f"unavailable: no SDPBackend.{backend} here")
            verdicts[backend] = ("unavailable", 0)
            continue
        figures, ok, ran = [], True, 0
        for case, attention, x, gradient, mask, reference, own in cases:
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch's reasons for refusing a kernel
                    fused = attention_pass(attention, x, gradient, mask, device, dtype, False)
            except RuntimeError as error:
                if not any(words in str(error) for words in refusals):
                    raise  # the kernel was chosen, then broke: the finding
                figures.append(f"{case} unavailable")
                continue
            ran += 1
            errors = [relative_error(f, r) for f, r in zip(fused, reference)]
            within = all(e <= times * o + plus for e, o in zip(errors, own))  # NaN: False
            ok &= within
            verdict = "" if within else " FAIL"
            figures.append(f"{case} out {errors[0]:.1e} grad {errors[1]:.1e}{verdict}")
        status = ("pass" if ok else "fail") if ran else "skip"
        report.add(f"{name}, {backend}", status, "; ".join(figures) + allowed, available=ran,
                   cases=len(cases))
        verdicts[backend] = ({"pass": "ok", "fail": "wrong", "skip": "unavailable"}[status], ran)
    return verdicts


# ------------------------------------------------------------------------------------------
# 4. DeAR steps under autocast, and their speed
# ------------------------------------------------------------------------------------------


def build_step(clip, config: dict, device: torch.device, batch: int, classes: int, dtype, seed: int = 0,
               record: bool = True):
    """A DeAR on `clip` with a mixed role map, one batch and class list, and a train.py-style
    step: autocast forward and losses, (scaled) backward, AdamW. -> (model, step, images,
    last: the last step's loss and, if `record`, a copy of its unscaled gradients)"""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # a blind attribute token in the tiny model is expected
        warnings.simplefilter("ignore")
        model = dear.DeAR(clip, mixed_roles(config["vision_layers"], config["vision_heads"])).to(device)
    resolution = config["image_resolution"]
    images = torch.randn(batch, 3, resolution, resolution, generator=generator).to(device)
    labels = torch.randint(0, classes, (batch,), generator=generator).to(device)
    prompts = class_prompts(classes, generator, config["context_length"], config["vocab_size"]).to(device)
    with autocast(device, dtype):
        prepared = model.prepare_classes(prompts)  # once per class list, as in train.py
    optimizer = torch.optim.AdamW(model.learnable_parameters(), lr=1e-3)
    scaler = devices.grad_scaler(device, enabled=dtype == torch.float16)  # train.py's
    last = {"prompt_tokens": int(prompts.argmax(dim=-1).max()) + 1}  # DeAR cuts the prompts after the longest

    def step():
        with autocast(device, dtype):
            output = model(images, prepared, with_frozen=True)
            loss = dear.dear_loss(output, labels)["total"]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # so that the gradients read below are the true ones
        last["loss"] = loss.detach()
        if record:
            last["grads"] = [None if p.grad is None else p.grad.detach().clone() for p in model.learnable_parameters()]
        scaler.step(optimizer)
        scaler.update()

    return model, step, images, last


STEPS = 6  # per precision; GradScaler starts at 2^16 and halves its scale after each overflow


def check_amp_steps(report: Report, clip, config: dict, device: torch.device, quick: bool) -> None:
    """fp16 with the loss scaler (train.py's default), and bf16 (--amp bf16) where the GPU has it
    in hardware."""
    for dtype in (torch.float16, torch.bfloat16):
        name = f"4. DeAR steps, autocast {precision_name(dtype)}" + (
            " + grad scaler" if dtype == torch.float16 else "")
        if not has_bf16(device) and dtype == torch.bfloat16:
            report.add(name, "skip", "no bf16 in hardware on this GPU (--amp bf16 is refused)")
            continue
        frozen = {key: value.clone() for key, value in clip.state_dict().items()}
        model, step, _, last = build_step(clip, config, device, batch=4, classes=10 if quick else 100, dtype=dtype)
        before = {n: p.detach().clone() for n, p in model.learnable_tensors().items()}
        skipped = 0
        for _ in range(STEPS):  # fp16: the scaler may skip the first steps while it backs off
            step()
            skipped += not all(g is not None and torch.isfinite(g).all() for g in last["grads"])
        grads_ok = all(g is not None and bool(torch.isfinite(g).all()) for g in last["grads"])
        loss_ok = bool(torch.isfinite(last["loss"]))
        still = [n for n, p in model.learnable_tensors().items() if torch.equal(p.detach(), before[n])]
        changed = [key for key, value in clip.state_dict().items() if not torch.equal(value, frozen[key])]
        ok = loss_ok and grads_ok and not still and not changed
        figures = (f"loss {last['loss'].item():.3f} {'finite' if loss_ok else 'NOT finite'}; grads "
                   f"{'finite' if grads_ok else 'NOT finite'} (last of {STEPS} steps; {skipped} skipped by the scaler); "
                   f"learnables {'all moved' if not still else 'unmoved: ' + ', '.join(still)}; "
                   f"CLIP {'unchanged' if not changed else 'CHANGED: ' + ', '.join(changed[:3])}")
        report.add(name, ok, figures, loss=last["loss"].item(), skipped=skipped, unmoved=still, clip_changed=changed)
        del model


def check_speed(report: Report, clip, config: dict, device: torch.device, dtype, quick: bool) -> dict:
    """img/s and peak memory of the step and of the frozen image-only forward of the same
    batch -> {(batch, classes): (step seconds, prompt tokens)} (for the MFU)."""
    warmup, repeats = (1, 1) if quick else (3, 10)
    precision = str(dtype).replace("torch.", "") if dtype is not None else "fp32"
    seconds = {}
    for batch in (4, 32):
        for classes in ((10, 100) if quick else (100, 1000)):
            reset_peak(device)
            model, step, images, last = build_step(clip, config, device, batch, classes, dtype, record=False)
            step_s = timed(step, device, warmup, repeats)
            step_mb = peak_mb(device)
            finite, prompt_tokens = bool(torch.isfinite(last["loss"])), last["prompt_tokens"]
            del model, step, last
            reset_peak(device)

            def forward():
                with torch.no_grad(), autocast(device, dtype):
                    clip.encode_image(images)

            image_s = timed(forward, device, warmup, repeats)
            image_mb = peak_mb(device)
            seconds[(batch, classes)] = (step_s, prompt_tokens)
            memory = (f", peak {step_mb:,.0f} MB vs {image_mb:,.0f} MB" if step_mb is not None else "")
            report.add(f"4. speed, batch {batch}, {classes} classes, {precision}", finite,
                       f"step {batch / step_s:,.1f} img/s, frozen image forward {batch / image_s:,.1f} img/s: "
                       f"ratio {step_s / image_s:.2f}{memory}",
                       step_images_per_s=batch / step_s, image_forward_images_per_s=batch / image_s,
                       ratio=step_s / image_s, step_peak_mb=step_mb, image_forward_peak_mb=image_mb)
    return seconds


# ------------------------------------------------------------------------------------------
# 5. Ours against open_clip
# ------------------------------------------------------------------------------------------


def check_open_clip(report: Report, config: dict, device: torch.device, dtype, quick: bool) -> None:
    name = "5. image encoding, ours vs open_clip"
    try:
        import open_clip
    except ImportError:
        report.add(name, "skip", "open-clip-torch is not installed (pip install open-clip-torch to compare)")
        return
    torch.manual_seed(0)
    if quick:
        reference = open_clip.model.CLIP(
            embed_dim=config["embed_dim"], quick_gelu=True,
            vision_cfg=dict(layers=config["vision_layers"], width=config["vision_width"], image_size=config["image_resolution"],
                            head_width=config["vision_width"] // config["vision_heads"], patch_size=config["vision_patch_size"]),
            text_cfg=dict(context_length=config["context_length"], vocab_size=config["vocab_size"],
                          width=config["transformer_width"], heads=config["transformer_heads"],
                          layers=config["transformer_layers"]))
    else:
        reference = open_clip.create_model("ViT-B-16-quickgelu", pretrained=None)
    reference = reference.eval().to(device)
    ours = clip_model.build_model(reference.state_dict(), head_width=config["vision_width"] // config["vision_heads"])
    ours = ours.eval().to(device)
    batch = 8 if quick else 32
    images = torch.randn(batch, 3, config["image_resolution"], config["image_resolution"], device=device)
    with torch.no_grad(), autocast(device, dtype):
        difference = (ours.encode_image(images).float() - reference.encode_image(images).float()).abs().max().item()
        rates = {}
        for _ in range(3):  # alternate, so that a slow moment of the machine hits both alike
            for label, model in (("ours", ours), ("open_clip", reference)):
                seconds = timed(lambda: model.encode_image(images), device, 1, 2 if quick else 10)
                rates[label] = max(rates.get(label, 0.0), batch / seconds)
    ratio = rates["ours"] / rates["open_clip"]
    tolerance = TOLERANCE_FP32 if dtype is None else 0.05  # bf16/fp16 keep 8/11 bits
    precision = str(dtype).replace("torch.", "") if dtype is not None else "fp32"
    # The ratio counts on the GPU at ViT-B/16's size; a tiny model on a CPU measures overheads.
    fast_enough = ratio >= 0.8 or quick
    report.add(name, difference <= tolerance and fast_enough,
               f"{precision}, batch {batch}: ours {rates['ours']:,.1f} img/s, open_clip {rates['open_clip']:,.1f}: "
               f"ratio {ratio:.2f} (>= 0.8{'; not counted with --quick' if quick else ''}); "
               f"features max abs {difference:.1e} (<= {tolerance:g})",
               ratio=ratio, difference=difference, **{f"{k}_images_per_s": v for k, v in rates.items()})


# ------------------------------------------------------------------------------------------
# 6. train.py end to end
# ------------------------------------------------------------------------------------------


def run_command(argv: list, env: dict, log_path: str) -> int:
    with open(log_path, "w") as log:
        return subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


def torchrun(processes: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]


def summary_cells(folder: str) -> dict:
    """summary.json -> {"dataset/row/column": accuracy} (every number of the tables)."""
    with open(os.path.join(folder, "summary.json"), encoding="utf-8") as f:
        tables = json.load(f)["tables"]
    cells = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}/{key}", inner)
        elif isinstance(value, list):
            for index, inner in enumerate(value):
                walk(f"{prefix}/{index}", inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            cells[prefix] = float(value)

    walk("", tables)
    return cells


def largest_gap(a: dict, b: dict) -> float:
    if set(a) != set(b) or not a:
        return math.inf
    return max(abs(a[key] - b[key]) for key in a)


def learnable_tensors(folder: str) -> dict:
    paths = [os.path.join(root, "checkpoint.pt") for root, _, files in os.walk(folder) if "checkpoint.pt" in files]
    return {os.path.relpath(path, folder): torch.load(path, map_location="cpu", weights_only=True)["learnable"]
            for path in sorted(paths)}


def write_coop_copy(data_root: str, target: str) -> str:
    """The toy world's task (a CoOp-layout folder, toyworld/task.py) rewritten as a 'dtd' dataset:
    its images and its split under DTD's split-file name, so that train.py reads it as a
    CoOp dataset (the toy world itself runs only in one process)."""
    source = os.path.join(data_root, "toyworld")
    shutil.copytree(os.path.join(source, "images"), os.path.join(target, "dtd", "images"))
    with open(os.path.join(source, "split_toyworld.json"), encoding="utf-8") as f:
        split = json.load(f)
    with open(os.path.join(target, "dtd", "split_zhou_DescribableTextures.json"), "w", encoding="utf-8") as f:
        json.dump(split, f)
    return target


def check_train_py(report: Report, device: torch.device, quick: bool, toy_scale: str, scratch: str,
                   logs: str) -> None:
    import toyworld

    assets = toyworld.prepare(toy_scale, log=lambda line: None)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1" if device.type == "cpu" else "4"))
    epochs = ["--epochs", "2" if quick else "5"]
    os.makedirs(logs, exist_ok=True)

    def train_py(tag: str, *flags, launcher=None):
        """train.py with these flags: under `launcher` (torchrun) in a subprocess, else in this
        process through train.main, the same code as the command line without a fresh Python."""
        folder, log_path = os.path.join(scratch, tag), os.path.join(logs, f"{tag}.txt")
        argv = ["--output", folder, *flags]
        if launcher is not None:
            code = run_command([*launcher, "train.py", *argv], env, log_path)
        else:
            with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                try:
                    code = train.main(argv)
                except SystemExit as stop:  # argparse's exit on a flag this torch's train.py refuses
                    code = stop.code if isinstance(stop.code, int) else 2
                except Exception:  # noqa: BLE001 -- a crash is this run's result: its last line goes in the table
                    traceback.print_exc()
                    code = 1
        return folder, code, os.path.isfile(os.path.join(folder, "summary.md"))

    def tail(tag: str) -> str:
        with open(os.path.join(logs, f"{tag}.txt"), encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[-1][:200] if lines else "(no output)"

    # (a) The toy world end to end (analysis, causal check, every row) on the device and on the CPU.
    # --quick: zero-shot and DeAR with the head analysis (and the toy world's causal check); the
    # full mode every row of the toy table.
    toy = ["--dataset", "toyworld", "--toy-scale", toy_scale, "--seeds", "1", *epochs]
    if quick:
        toy += ["--method", "zeroshot", "dear", "--roles", "analyse"]
    folder, code, written = train_py(f"toy-{device.type}", *toy, "--device", str(device))
    if code != 0:
        report.add(f"6. train.py toy world on {device.type}", False,
                   f"exit {code}: {tail(f'toy-{device.type}')}")
    else:
        cpu_folder = folder
        if device.type != "cpu":
            cpu_folder, cpu_code, _ = train_py("toy-cpu", *toy, "--device", "cpu")
        gap = largest_gap(summary_cells(folder), summary_cells(cpu_folder)) if written else math.inf
        report.add(f"6. train.py toy world ({toy_scale}) on {device.type}, default precision",
                   written and gap <= TOLERANCE_POINTS_AMP,
                   f"exit 0, table written; largest cell gap to the CPU run {gap:.2f} points (<= {TOLERANCE_POINTS_AMP:g})"
                   + (" (the CPU run is this run)" if device.type == "cpu" else ""), gap=gap)

    # (b) torchrun on a CoOp-layout copy of the toy task, in fp32 (--amp off), against one plain
    # process on the CPU; then a stop after one epoch and --resume against the unbroken run. With
    # one process train.py starts no process group (there is nothing to average); (c) below runs
    # DDP over NCCL itself, (e) train.py in 2 processes.
    root = write_coop_copy(assets.data_root, os.path.join(scratch, "data"))
    model_files = ["--dataset", "dtd", "--root", root, "--weights", assets.weights,
                   "--bpe", assets.bpe, "--head-width", str(assets.head_width), "--seeds", "1"]
    coop = [*model_files, "--method", "zeroshot", "dear", "--roles", "all-generalization",
            "--shots", "4" if quick else "16", "--epochs", "3" if quick else "5",
            "--batch-size", "4", "--amp", "off"]
    ddp, code, written = train_py("coop-torchrun", *coop, "--device", device.type, launcher=torchrun(1))
    if code != 0:
        report.add(f"6. torchrun x 1 train.py on {device.type}", False,
                   f"exit {code}: {tail('coop-torchrun')}")
        return
    # On the CPU the plain-process reference is the resumed run below (bit-identical or not).
    reference, ref_code = ddp, 0
    if device.type != "cpu":
        reference, ref_code, _ = train_py("coop-cpu", *coop, "--device", "cpu")
    gap = largest_gap(summary_cells(ddp), summary_cells(reference)) if written and ref_code == 0 else math.inf
    report.add(f"6. torchrun x 1 train.py on {device.type}, fp32",
               written and gap <= TOLERANCE_POINTS_FP32,
               f"exit 0, table written; largest cell gap to one CPU process {gap:.2f} points (<= {TOLERANCE_POINTS_FP32:g})"
               + (" (compared below)" if device.type == "cpu" else ""), gap=gap)

    broken, code, _ = train_py("coop-broken", *coop, "--device", device.type, "--max-epochs-per-call", "1")
    stopped = code == 0 and not os.path.isfile(os.path.join(broken, "summary.md"))
    if stopped:
        _, code, _ = train_py("coop-broken", "--resume")
    if not stopped or code != 0:
        report.add(f"6. resume after a stop, {device.type}", False,
                   f"stop or resume failed: {tail('coop-broken')}")
    else:
        unbroken, resumed = learnable_tensors(ddp), learnable_tensors(broken)
        same_runs = set(unbroken) == set(resumed) and bool(unbroken)
        difference = max((float((resumed[run][key].float() - tensor.float()).abs().max())
                          for run, tensors in unbroken.items() for key, tensor in tensors.items()),
                         default=math.inf) if same_runs else math.inf
        cells = largest_gap(summary_cells(ddp), summary_cells(broken))
        # Bit-identical on the CPU (tested); on a GPU the same up to kernels whose sums are not
        # run-to-run deterministic, which README's resume guarantee says.
        exact = difference == 0.0
        ok = exact if device.type == "cpu" else (difference <= 1e-3 and cells <= TOLERANCE_POINTS_FP32)
        report.add(f"6. resume after a stop = unbroken run, {device.type}", ok,
                   f"learnable tensors {'bit-identical' if exact else f'differ by {difference:.1e} max abs'}; "
                   f"largest cell gap {cells:.2f} points", difference=difference, cells=cells, bit_identical=exact)

    # (c) DistributedDataParallel over DeAR through the backend train.py picks, in a one-process group.
    backend = "nccl" if device.type == "cuda" else "gloo"
    figures = guarded(report, f"6. DDP step of DeAR, process group {backend}", ddp_smoke, device,
                      backend)
    if figures is not None:
        report.add(f"6. DDP step of DeAR, process group {backend}", True, figures)

    # (d) A run stopped after one epoch in a precision without a loss scaler (bf16 where the GPU
    # has it, else fp32; the CPU: fp32), resumed in fp16 with its scaler (train.py's default;
    # forced on the CPU, which takes no autocast): train.py starts a fresh scaler, saying so.
    first = "bf16" if device.type == "cuda" and has_bf16(device) else "off"
    name = f"6. resume from --amp {first} into fp16 + loss scaler, {device.type}"
    fp16 = [*model_files, "--method", "dear", "--roles", "all-mixed", "--shots", "4",
            "--epochs", "2", "--batch-size", "4", "--device", str(device)]
    folder, code, _ = train_py("fp16-resume", *fp16, "--amp", first, "--max-epochs-per-call", "1")
    if code == 0:
        forced = (forced_precision(torch.float16, "fp16 autocast with a loss scaler (forced)")
                  if device.type != "cuda" else contextlib.nullcontext())
        with forced:
            _, code, written = train_py("fp16-resume", "--resume", "--amp", "on")
    if code != 0:
        report.add(name, False, f"exit {code}: {tail('fp16-resume')}")
    else:
        leaf = os.path.join(folder, "dtd", "dear-all-mixed", "seed1", "checkpoint.pt")
        checkpoint = torch.load(leaf, map_location="cpu", weights_only=True)
        scale = float(checkpoint["scaler"].get("scale", 0.0))
        finite = all(bool(torch.isfinite(t).all()) for t in checkpoint["learnable"].values())
        with open(os.path.join(logs, "fp16-resume.txt"), encoding="utf-8") as f:
            fresh = "a fresh scaler" in f.read()
        report.add(name, written and checkpoint["epoch"] == 2 and scale > 0 and finite and fresh,
                   f"epoch 1 with --amp {first}, epoch 2 in fp16: exit 0, table written; "
                   f"{'a fresh scaler, said' if fresh else 'NO fresh scaler'}, its scale saved "
                   f"{scale:g}; learnable tensors {'finite' if finite else 'NOT finite'}",
                   scale=scale, finite=finite)

    # (e) train.py in 2 processes, 2 steps each (12 images, batch 3), rank 0 analysing the heads
    # alone while the other waits on the CPU-side gloo group: NCCL with 2 GPUs; on the CPU, gloo
    # (as tests/test_devices.py runs it).
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        report.add("6. torchrun x 2 train.py", "info", "one GPU: NCCL across processes was not "
                   "checked (a machine with 2 GPUs runs train.py in 2 processes here)")
        return
    pair = [*model_files, "--method", "dear", "--roles", "analyse", "--descriptions", "4",
            "--shots", "1", "--epochs", "1", "--batch-size", "3", "--device", device.type]
    folder, code, written = train_py("torchrun-2", *pair, launcher=torchrun(2))
    run_log = os.path.join(folder, "dtd", "dear", "seed1", "log.txt")  # every progress line
    with open(run_log if os.path.isfile(run_log) else os.devnull, encoding="utf-8") as f:
        steps = "step 2/2 " in f.read()
    backend = "nccl" if device.type == "cuda" else "gloo"
    report.add(f"6. torchrun x 2 train.py on {device.type} ({backend}), the analysis on rank 0",
               code == 0 and written and steps,
               f"exit {code}, table written, 2 steps per process" if code == 0 and written and steps
               else f"exit {code}: {tail('torchrun-2')}")


def check_nan_stop(report: Report, device: torch.device, scratch: str, logs: str) -> None:
    """A NaN injected mid-run (the loss of the 5th step, in train.py's precision on the device):
    the run stops at that step with one line, keeps its last finite checkpoint, writes no
    results.json; the call exits 1; --resume (without the NaN) finishes it."""
    import toyworld

    assets = toyworld.prepare("miniature", log=lambda line: None)
    folder = os.path.join(scratch, "nan")
    argv = ["--dataset", "toyworld", "--toy-scale", "miniature", "--method", "dear", "--roles",
            "all-mixed", "--seeds", "1", "--shots", "4", "--epochs", "3", "--batch-size", "4",
            "--device", str(device), "--output", folder]
    real, calls = dear.dear_loss, []

    def poisoned(output, labels, *args, **kwargs):
        losses = real(output, labels, *args, **kwargs)
        calls.append(1)
        if len(calls) == 5:
            losses["total"] = losses["total"] * float("nan")
        return losses

    log_path = os.path.join(logs, "nan.txt")
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        train.dear.dear_loss = poisoned
        try:
            stopped = train.main(argv)
        finally:
            train.dear.dear_loss = real
        resumed = train.main(["--output", folder, "--resume"])
    with open(log_path, encoding="utf-8") as f:
        line = next((l.strip() for l in f if "diverged at epoch" in l), "")
    run = os.path.join(folder, "toyworld", "dear-all-mixed", "seed1")
    steps = len(data.load_dataset("toyworld", assets.data_root, num_shots=4, subsample="base")
                .train) // 4
    epoch = 4 // steps + 1  # the epoch of the 5th step
    ok = stopped == 1 and f"diverged at epoch {epoch}" in line and resumed == 0 \
        and os.path.isfile(os.path.join(run, "results.json"))
    report.add(f"6. a NaN at step 5 stops the run, {device.type}", ok,
               f"exit {stopped}, then --resume exit {resumed}; {line[:150] or 'no diverged line'}")


def check_loader(report: Report, device: torch.device, quick: bool, scratch: str) -> None:
    """The real loader at 224 px (--quick: the tiny model's 32) with train.py's default processes
    here (devices.loader_plan), over JPEGs of a photo's size: images/s of the loader alone, then a
    short train.py run (a random ViT-B/16, or the tiny CLIP, on those photos as a CoOp dataset):
    images/s of training including loading, and the share of each step spent waiting for data."""
    from bench_loader import images_per_second, write_photos

    config = TINY if quick else B16
    size = config["image_resolution"]
    photos = os.path.join(scratch, "photos")
    os.makedirs(photos)
    items = write_photos(photos, (64 if quick else 512) + 40)  # 10 classes; val, test: 20 each
    settings = dict(workers=None, batch_size=32, eval_batch_size=64)
    runtime = devices.Runtime(device)
    workers, _ = devices.loader_plan(settings, runtime, size)["train"]
    alone = {cached: images_per_second(items[:-40], workers, size=size, cached=cached)
             for cached in (False, True)}
    # The photos as a CoOp dataset ('dtd'); the model saved with a BPE file of its own.
    root = os.path.join(scratch, "loader-data")
    listed = [[os.path.relpath(i.path, photos), i.label, i.classname] for i in items]
    split = {"train": listed[:-40], "val": listed[-40:-20], "test": listed[-20:]}
    os.makedirs(os.path.join(root, "dtd"))
    os.symlink(photos, os.path.join(root, "dtd", "images"))
    with open(os.path.join(root, "dtd", "split_zhou_DescribableTextures.json"), "w") as f:
        json.dump(split, f)
    bpe = os.path.join(scratch, "bpe.txt")
    with open(bpe, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\nc l\ncl a\n")
    vocab = clip_model.SimpleTokenizer(bpe).vocab_size
    weights = os.path.join(scratch, "loader-clip.pt")
    clip_model.save(random_clip(dict(config, vocab_size=vocab)), weights)
    folder = os.path.join(scratch, "loader-run")
    argv = ["--dataset", "dtd", "--root", root, "--weights", weights, "--bpe", bpe, "--method",
            "dear", "--roles", "all-mixed", "--seeds", "1", "--shots", "16" if quick else "48",
            "--epochs", "2", "--batch-size", "32", "--device", str(device), "--output", folder,
            "--protocol", "fewshot", "--template", "a photo of a {}."]
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = train.main(argv)
    metrics = runfolder.read_metrics(os.path.join(folder, "dtd", "dear-all-mixed",
                                             f"shots{argv[argv.index('--shots') + 1]}-seed1",
                                             runfolder.METRICS_FILE))
    if code != 0 or not metrics:
        report.add(f"9. the loader at {size} px", False, f"train.py exit {code}, no metrics")
        return
    last = metrics[-1]
    report.add(f"9. the loader at {size} px, {workers} processes (train.py's default here)", "info",
               f"loader alone: {alone[False]:,.0f} images/s decoding each epoch, "
               f"{alone[True]:,.0f} decoded once (train.py's); training with it "
               f"{last['images_per_second']:,.0f} images/s, waiting for data "
               f"{100 * last['data_wait']:.0f}% of each step",
               loader_images_per_s=alone[False], cached_loader_images_per_s=alone[True],
               training_images_per_s=last["images_per_second"],
               data_wait=last["data_wait"], workers=workers)


def check_precision(report: Report, device: torch.device, quick: bool) -> None:
    """benchmarks/precision_table.py on the device: the toy trained and scored in fp32, fp16 and
    bf16 (2 epochs under --quick), the predictions and logits of fp32's run moved by each."""
    for row in measure(device, epochs=2 if quick else 20, log=lambda line: None):
        changed = sum(row["changed"].values())
        report.add(f"8. precision {row['precision']}, the toy world", "info",
                   f"HM {row['hm_fused']:.2f} fused / {row['hm_class']:.2f} class-on-unseen; "
                   f"{changed} predictions of 4 x 360 changed vs fp32; largest logit change "
                   f"{row['max_logit_change']:.3f} (scale {row['toy_scale']:.1f}), "
                   f"{row['max_logit_change_100']:.3f} (scale 100)", **row)


def ddp_smoke(device: torch.device, backend: str) -> str:
    """train.py's DDP pieces on a tiny DeAR in a process group of one: the wrapper, a forward
    and backward under autocast, the float64 all_reduce of the test counts, a barrier."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        dtype = None if device.type != "cuda" else device_precision(device)[0]  # train.py's
        clip = random_clip(TINY).to(device)
        model, _, images, _ = build_step(clip, TINY, device, batch=4, classes=10, dtype=dtype)
        with warnings.catch_warnings():  # newer torch deprecates broadcast_buffers, which train.py passes
            warnings.simplefilter("ignore")
            network = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index or 0] if device.type == "cuda" else None, broadcast_buffers=False)
        prompts = class_prompts(10, torch.Generator().manual_seed(0), TINY["context_length"], TINY["vocab_size"])
        with autocast(device, dtype):
            output = network(images, model.prepare_classes(prompts.to(device)), with_frozen=True)
            loss = dear.dear_loss(output, torch.zeros(4, dtype=torch.long, device=device))["total"]
        loss.backward()
        counts = torch.tensor([3.0, 4.0], dtype=torch.float64, device=device)
        dist.all_reduce(counts)  # what train.py's _sum_over_processes does with the test counts
        dist.barrier()
        if not all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.learnable_parameters()):
            raise RuntimeError("a learnable gradient is missing or not finite after DDP's backward")
        precision = "fp32" if dtype is None else f"autocast {str(dtype).replace('torch.', '')}"
        return f"DDP forward/backward ({precision}), loss {loss.item():.3f}, all_reduce {counts.tolist()}, barrier: done"
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# 7. Model FLOP utilisation
# ------------------------------------------------------------------------------------------


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


def device_peak_tflops(device: torch.device, given):
    if given is not None:
        return given, "--peak-tflops"
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops, f"{name} ({key} in the table)"
    return None, name


def check_mfu(report: Report, config: dict, device: torch.device, seconds: dict, peak_given) -> None:
    classes = min(c for b, c in seconds if b == 32)
    step_s, longest = seconds[(32, classes)]
    flops = step_flops(config, 32, classes, longest)
    achieved = flops / step_s / 1e12
    peak, source = device_peak_tflops(device, peak_given)
    if peak is None:
        report.add(f"7. MFU, step at batch 32, {classes} classes", "info",
                   f"{flops / 1e9:,.1f} GFLOP per step, {achieved:,.3g} TFLOP/s achieved; no peak known for "
                   f"{source or device.type} (give --peak-tflops)", flops=flops, achieved_tflops=achieved)
        return
    mfu = achieved / peak
    report.add(f"7. MFU, step at batch 32, {classes} classes", 0 < mfu < 1,
               f"{flops / 1e9:,.1f} GFLOP per step, {achieved:,.3g} TFLOP/s of {peak:,.3g} ({source}): MFU {100 * mfu:.1f}%",
               flops=flops, achieved_tflops=achieved, peak_tflops=peak, mfu=mfu)


# ------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Prove the GPU path of this project and measure it (one table).")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny CLIP instead of ViT-B/16, 2 epochs: seconds")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for the MFU")
    parser.add_argument("--toy-scale", default="miniature", choices=("miniature", "full"),
                        help="the toy world of the train.py runs (full: the shipped model; slower)")
    parser.add_argument("--output", default=os.path.join("runs", "device_check"), help="folder for the table files")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("device_check.py: error: --device cuda: no CUDA device here; use --device cpu --quick", file=sys.stderr)
        return 2
    started = time.time()
    config = TINY if args.quick else B16
    # train.py's precision on this device (devices.choose_precision: fp16 with the loss scaler
    # unless --amp bf16); the CPU checks simulate it.
    dtype, why = device_precision(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"device check: {'tiny CLIP' if args.quick else 'ViT-B/16'}, {where}, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}; train.py's precision here: {why}"
          + ("; ftfy is not installed: a stand-in that changes no text" if FTFY_STAND_IN else ""),
          flush=True)

    report = Report()
    clip = guarded(report, "1. parity", check_parity, report, config, device)
    if clip is None:  # the model could not even run on the device: the checks below would only repeat that
        clip = random_clip(config).to(device)
    guarded(report, "2. scores", check_scores, report, device)
    guarded(report, "2. the full toy's predictions", check_toy_predictions, report, device, dtype)
    guarded(report, "3. fused attention", check_attention, report, config, device)
    guarded(report, "4. DeAR steps", check_amp_steps, report, clip, config, device, args.quick)
    # The speed in train.py's precision: autocast on CUDA, fp32 on the CPU (as train.py runs there).
    seconds = guarded(report, "4. speed", check_speed, report, clip, config, device,
                      dtype if device.type == "cuda" else None, args.quick)
    del clip
    guarded(report, "5. ours vs open_clip", check_open_clip, report, config, device, dtype,
            args.quick)
    logs = os.path.join(args.output, "logs")
    with tempfile.TemporaryDirectory(prefix="device_check-") as scratch:
        guarded(report, "6. train.py", check_train_py, report, device, args.quick, args.toy_scale,
                scratch, logs)
        guarded(report, "6. a NaN mid-run", check_nan_stop, report, device, scratch, logs)
        if seconds:
            guarded(report, "7. MFU", check_mfu, report, config, device, seconds, args.peak_tflops)
        else:
            report.add("7. MFU", False, "no step time (check 4 failed)")
        guarded(report, "8. precision", check_precision, report, device, args.quick)
        guarded(report, "9. the loader", check_loader, report, device, args.quick, scratch)

    elapsed = time.time() - started
    title = (f"Device check: {'tiny CLIP (--quick)' if args.quick else 'ViT-B/16'}, {where}, "
             f"torch {torch.__version__}, {elapsed:.0f} s; {report.verdict()}")
    table = report.markdown()
    print("\n" + title + "\n\n" + table)
    os.makedirs(args.output, exist_ok=True)
    stem = os.path.join(args.output, f"device_check_{device.type}{'_quick' if args.quick else ''}")
    record = dict(title=title, device=where, torch=torch.__version__, quick=args.quick, seconds=elapsed,
                  passed=not report.failed, checks=report.rows)
    for suffix, text in ((".md", f"{title}\n\n{table}\n"), (".json", json.dumps(record, indent=1, default=str))):
        write_file(stem + suffix, text)
    print(f"\nwritten: {stem}.md, {stem}.json")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
