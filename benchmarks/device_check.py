"""One command that proves the GPU path and measures it: `python benchmarks/device_check.py`.

On a CUDA machine (a few minutes) it prints one table, a row per check (pass, fail, skip, or
info: figures alone), and writes it as Markdown and JSON in --output; exit status 1 if a check
fails. train.py's precision on CUDA is fp16 autocast with a loss scaler (bf16 by --amp bf16
from compute capability 8.0): the checks run both; on the CPU, CPU autocast simulates them.

  1. parity     a random CLIP in fp32 (TF32 off), features on the device against the CPU, and
                the per-head decomposition's sum against encode_image (<= 1e-3);
  2. scores     DeAR.fused_logits under autocast, 64 images x 200 close classes: fp32 scores
                and fp32's predictions exactly;
  3. attention  the kernel torch picks on DeAR's real calls (vision and text, q/k/v views that
                require grad); each fused backend forced alone, forward and backward, against
                the explicit path in fp32: DeAR's role masks, the causal mask at 63, 64, 65 and
                77 + K tokens, and pytorch issue 196678's inputs (every row's logsumexp below
                -88.7; 64 and 192 tokens, masked); the verdicts kept where --attention auto
                reads them (devices.attention_record);
  4. steps      DeAR steps in fp16 + loss scaler and in bf16: finite, every learnable moved,
                CLIP unchanged; the step's speed at batch 32 against the frozen image forward,
                and its MFU (bench_train_step.step_flops over the GPU's peak or --peak-tflops);
  5. train.py   the toy world against the same run on the CPU; a stop and --resume against the
                unbroken run; a run without a loss scaler resumed in fp16; 2 processes under
                torchrun (2 GPUs; gloo on the CPU); every 5th loss NaN in fp16: diverged;
  6. precision  benchmarks/precision_table.py on the device (--quick: the miniature toy): each
                precision's predictions against fp32's, at most TOY_CHANGES_BOUND per test set.

    python benchmarks/device_check.py                         # CUDA: the only command needed
    python benchmarks/device_check.py --device cpu --quick    # every check on a tiny CLIP
    python benchmarks/device_check.py --peak-tflops 312       # a GPU the peak table lacks

Speed against open_clip: bench_clip.py; the loader: bench_loader.py (each with --device cuda).
"""

import argparse
import contextlib
import json
import math
import os
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
import clip_model  # noqa: E402
import dear  # noqa: E402
from harness import devices, runfolder  # noqa: E402
import train  # noqa: E402
import bench_train_step  # noqa: E402
from bench_train_step import B16, TINY, class_prompts, mixed_roles, peak_tflops, step_flops  # noqa: E402
from precision_table import forced_precision, measure  # noqa: E402

TOLERANCE_FP32 = 1e-3  # max abs difference of features, device vs CPU, both fp32 (TF32 off)
# Accuracy points the toy run on the device may differ from the same run on the CPU in any cell:
# a test column of the miniature toy holds 48 images (2.08 points each), its logits near ties;
# fp32 may move 2 images, autocast one more (bf16 on the CPU moved 1: docs/MEASURED.md).
TOLERANCE_POINTS_AMP = 6.3
# The toy's predictions with half-precision encoders changed at most 1 of 360 per set in the CPU
# simulation (docs/MEASURED.md); 3 allows another summation order on a GPU.
TOY_CHANGES_BOUND = 3


def row(name: str, ok, figures: str, **values) -> tuple:
    """A table row: ok is True / False (pass / fail) or "skip" / "info" (figures alone)."""
    return name, ok if isinstance(ok, str) else ("pass" if ok else "fail"), figures, values


def guarded(name: str, check, *args) -> list:
    """check(*args)'s rows; an exception is a failed row (its traceback on stderr)."""
    try:
        return check(*args)
    except Exception as error:  # noqa: BLE001 -- whatever breaks on the device is the finding
        traceback.print_exc()
        return [row(name, False, f"{type(error).__name__}: {str(error).strip()[:200]}")]


def amp(device: torch.device, dtype):
    return devices.autocast(devices.Runtime(device, amp_dtype=dtype))  # train.py's, dtype None: fp32


def has_bf16(device: torch.device) -> bool:  # --amp bf16 is allowed; the CPU simulates
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= devices.BF16_CAPABILITY


def random_clip(config: dict, seed: int = 0) -> clip_model.CLIP:
    """Random weights, biases and LayerNorm gains included (zero biases and unit gains would
    hide a bias that goes missing on one device)."""
    torch.manual_seed(seed)
    clip = clip_model.CLIP(**config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in clip.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    return clip.eval().requires_grad_(False)


def quiet_dear(clip, roles, **kwargs) -> dear.DeAR:
    with warnings.catch_warnings():  # the tiny model's blind attribute tokens: expected
        warnings.simplefilter("ignore", dear.LeftOutWarning)
        return dear.DeAR(clip, roles, **kwargs)


# 1. Parity ----------------------------------------------------------------------------------

def check_parity(config: dict, device: torch.device) -> list:
    clip, generator = random_clip(config), torch.Generator().manual_seed(1)
    size = config["image_resolution"]
    images = torch.randn(4, 3, size, size, generator=generator)
    texts = class_prompts(8, generator, config["context_length"], config["vocab_size"])
    with torch.no_grad():
        cpu = clip.encode_image(images), clip.encode_text(texts)
        clip = clip.to(device)
        image = clip.encode_image(images.to(device))
        found = image.cpu(), clip.encode_text(texts.to(device)).cpu()
        parts = clip_model.head_contributions(clip, images.to(device), num_layers=4)
        decomposition = (parts.total() - image).abs().max().item()
    image_diff, text_diff = ((a - b).abs().max().item() for a, b in zip(found, cpu))
    return [row(f"1. parity {device.type} vs cpu, fp32, TF32 off", max(image_diff, text_diff) <= TOLERANCE_FP32,
                f"image {image_diff:.1e}, text {text_diff:.1e} max abs (<= {TOLERANCE_FP32:g})",
                image=image_diff, text=text_diff),
            row("1. per-head decomposition sum vs encode_image", decomposition <= TOLERANCE_FP32,
                f"{decomposition:.1e} max abs (<= {TOLERANCE_FP32:g})", difference=decomposition)]


# 2. Scores in fp32 under autocast: a bf16 logit near CLIP's scale of 100 moves in steps of 0.5 --


def check_scores(device: torch.device) -> list:
    """fused_logits on fixed fp32 features near one direction (every logit within about 0.1 at a
    scale of 100), under autocast: float32, and fp32's predictions, fused and every branch."""
    model = quiet_dear(random_clip(TINY), mixed_roles(TINY["vision_layers"], TINY["vision_heads"]))
    model = model.to(device)
    with torch.no_grad():
        model.clip.logit_scale.fill_(math.log(100.0))
    generator = torch.Generator().manual_seed(0)
    centre = torch.randn(512, generator=generator)
    text = (centre + 0.02 * torch.randn(200, 512, generator=generator)).to(device)
    features = (centre + 0.05 * torch.randn(64, 6, 512, generator=generator)).to(device)
    rows = []
    with torch.no_grad():
        fused, branches = model.fused_logits(features, text)
        for dtype in (torch.bfloat16, torch.float16):
            name = devices.precision_name(dtype)
            with amp(device, dtype):
                fused_amp, branches_amp = model.fused_logits(features, text)
                unit = [F.normalize(t, dim=-1).to(dtype) for t in (features[:, 0], text)]
                rounded = (100.0 * unit[0] @ unit[1].T).argmax(-1)  # scores in `dtype`
            pairs = ((fused_amp, fused), *zip(branches_amp.unbind(1), branches.unbind(1)))
            changed = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in pairs)
            would = int((rounded != branches[:, 0].argmax(-1)).sum())
            dtypes = {str(t.dtype)[6:] for t in (fused_amp, branches_amp)}
            rows.append(row(f"2. scores under autocast {name}, 64 images x 200 close classes",
                            dtypes == {"float32"} and changed == 0,
                            f"logits {'/'.join(sorted(dtypes))}; {changed} predictions changed vs fp32 "
                            f"(must be 0); scores in {name} would change {would} of 64",
                            changed=changed, rounded_changed=would))
    return rows


# 3. The fused attention kernels under DeAR's masks -------------------------------------------
# Each backend, forced alone, against the explicit per-head path in fp32: its error (max abs
# difference over the largest |value|, of the output and of the input's gradient) may be at most
# twice the explicit path's own in the same precision, plus 1e-3. A mishandled mask moves the
# output by its own size; a -inf row gives NaN. Pytorch issue 196678: cuDNN's kernel goes wrong
# where a row's logsumexp falls below about -88.7 (where exp underflows in fp32), with a mask, at
# lengths such as 64 and 192; its inputs here: q and k pointing opposite ways, every raw score
# near -120 sqrt(D), so every row's logsumexp near -120 + log N.
ATTENTION_BACKENDS = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
ATTENTION_TOLERANCE = (2.0, 1e-3)  # (times the explicit path's error in that precision, plus)
TEXT_LENGTHS, TEXT_TOKENS = (63, 64, 65), 4  # around 64, a kernel's block size; and K
ADVERSARIAL_LENGTHS, ADVERSARIAL_SCORE = (64, 192), -120.0


def attention_cases(config: dict) -> list:
    """(name, attention, x (2, N, W), mask) of DeAR's calls: vision at 1 + G*G + A tokens under a
    role map's masks (H, N, N), text under the causal mask (N, N), issue 196678's inputs."""
    layers, heads, width = config["vision_layers"], config["vision_heads"], config["vision_width"]
    image_tokens = 1 + (config["image_resolution"] // config["vision_patch_size"]) ** 2
    roles = mixed_roles(layers, heads)
    masks = dear.build_role_masks(roles, dear.default_first_layer(layers), layers, image_tokens)[0]
    text = (config["transformer_width"], config["transformer_heads"])
    shapes = [(f"vision {masks.shape[-1]}", width, heads, masks)]
    shapes += [(f"text {n}", *text, clip_model.causal_mask(n))
               for n in (*TEXT_LENGTHS, config["context_length"] + TEXT_TOKENS)]
    shapes += [(f"196678 {n}", width, heads, clip_model.causal_mask(n)) for n in ADVERSARIAL_LENGTHS]
    cases = []
    for name, width, heads, mask in shapes:
        torch.manual_seed(0)
        attention = clip_model.MultiHeadAttention(width, heads).requires_grad_(False)
        x = torch.randn(2, mask.shape[-1], width, generator=torch.Generator().manual_seed(1))
        if name.startswith("196678"):  # q = s x, k = -s x, x near all ones: q.k near -s^2 D
            x = 1 + 0.1 * x
            scale = (-ADVERSARIAL_SCORE / attention.head_dim**0.5) ** 0.5
            with torch.no_grad():
                attention.in_proj_weight[:2 * width] = torch.cat([torch.eye(width), -torch.eye(width)]) * scale
                attention.in_proj_bias.zero_()
        cases.append((name, attention, x, mask))
    return cases


def relative_error(value, reference) -> float:
    return float((value - reference).abs().max() / reference.abs().max())


def attention_pass(attention, x, gradient, mask, device, dtype, explicit: bool):
    """(output, the input's gradient) of one forward and backward, both float32."""
    x = x.detach().clone().requires_grad_(True)
    with amp(device, dtype):
        output = attention(x, mask, return_details=True)[0] if explicit else attention(x, mask)
    (output.float() * gradient).sum().backward()
    return output.detach().float(), x.grad.float()


def kernel_picked(attention, x, mask, device, dtype) -> str:
    """The backend torch runs for this call as MultiHeadAttention makes it: q, k, v views of one
    projection (not contiguous) that require grad, under autocast."""
    x = x.clone().requires_grad_(True)
    with amp(device, dtype):
        qkv = F.linear(x, attention.in_proj_weight, attention.in_proj_bias)
        q, k, v = (t.unflatten(-1, (attention.heads, -1)).transpose(1, 2) for t in qkv.chunk(3, -1))
        return devices.sdpa_kernel_used(device, dtype, None, (q, k, v, mask.to(device, q.dtype)))


def check_attention(config: dict, device: torch.device) -> list:
    """The kernels torch picks, then one row per backend over every case in fp16 and bf16; on a
    GPU the verdicts (ok / wrong / unavailable per backend) kept for --attention auto."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cases = [(n, a.to(device), x.to(device), m.to(device)) for n, a, x, m in attention_cases(config)]
    dtypes = {devices.precision_name(d): d for d in [torch.float16] + [torch.bfloat16] * has_bf16(device)}
    picked = {f"{p} {n}": kernel_picked(a, x, m, device, d) for p, d in dtypes.items()
              for n, a, x, m in (cases[0], cases[4])}  # vision, and text at context + K
    rows, runs, verdicts = [row("3. the kernel torch picks", "info", ", ".join(
        f"{n} {k}" for n, k in picked.items()) + " (DeAR's calls: q, k, v views with grad)", picked=picked)], [], {}
    for case, attention, x, mask in cases:
        gradient = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device)
        reference = attention_pass(attention, x, gradient, mask, device, None, True)
        for precision, dtype in dtypes.items():
            explicit = attention_pass(attention, x, gradient, mask, device, dtype, True)
            runs.append((f"{precision} {case}", dtype, attention, x, gradient, mask, reference,
                         [relative_error(e, r) for e, r in zip(explicit, reference)]))
    times, plus = ATTENTION_TOLERANCE
    for backend in ATTENTION_BACKENDS:
        if not hasattr(SDPBackend, backend):  # e.g. cuDNN's before torch 2.5
            rows.append(row(f"3. fused attention, {backend}", "skip", f"unavailable: no SDPBackend.{backend}"))
            continue
        figures, ok, ran = [], True, 0
        for case, dtype, attention, x, gradient, mask, reference, own in runs:
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch's reasons for refusing a kernel
                    fused = attention_pass(attention, x, gradient, mask, device, dtype, False)
            except RuntimeError as error:  # torch's words for a kernel that cannot run a case
                if not any(words in str(error) for words in ("No available kernel", "No viable backend")):
                    raise  # the kernel was chosen, then broke: the finding
                figures.append(f"{case} unavailable")
                continue
            ran += 1
            errors = [relative_error(f, r) for f, r in zip(fused, reference)]
            within = all(e <= times * o + plus for e, o in zip(errors, own))  # NaN: False
            ok &= within
            figures.append(f"{case} out {errors[0]:.1e} grad {errors[1]:.1e}" + " FAIL" * (not within))
        verdicts[backend] = ("ok" if ok else "wrong") if ran else "unavailable"
        rows.append(row(f"3. fused attention, {backend}", ok if ran else "skip", "; ".join(figures)
                        + f" (allowed: {times:g}x the explicit path's error + {plus:g})", available=ran))
    if device.type == "cuda":
        keep_verdicts(devices.gpu_build(device), verdicts)
    return rows


def keep_verdicts(build: str, verdicts: dict) -> None:
    """{backend: ok | wrong | unavailable} for this GPU and build into devices.attention_record."""
    path = devices.attention_record()
    try:
        with open(path, encoding="utf-8") as f:
            record = dict(json.load(f))
    except (OSError, ValueError, TypeError):  # none yet, or damaged: started again
        record = {}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    runfolder.write_json(path, {**record, build: verdicts})


# 4. DeAR steps under autocast, their speed and MFU ------------------------------------------

def build_step(clip, config: dict, device: torch.device, batch: int, classes: int, dtype):
    """A DeAR on `clip` (a mixed role map), one batch and class list, and train.py's step:
    autocast forward and losses, scaled backward, AdamW -> (model, step, images, last: the last
    step's loss and unscaled gradients, and the prompts' length)."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = quiet_dear(clip, mixed_roles(config["vision_layers"], config["vision_heads"])).to(device)
    size = config["image_resolution"]
    images = torch.randn(batch, 3, size, size, generator=generator).to(device)
    labels = torch.randint(0, classes, (batch,), generator=generator).to(device)
    prompts = class_prompts(classes, generator, config["context_length"], config["vocab_size"]).to(device)
    with amp(device, dtype):
        prepared = model.prepare_classes(prompts)  # once per class list, as in train.py
    optimizer = torch.optim.AdamW(model.learnable_parameters(), lr=1e-3)
    scaler = devices.grad_scaler(device, enabled=dtype == torch.float16)
    last = {"prompt_tokens": int(prompts.argmax(dim=-1).max()) + 1}  # cut after the longest

    def step():
        with amp(device, dtype):
            loss = dear.dear_loss(model(images, prepared, with_frozen=True), labels)["total"]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # the gradients read below are the true ones
        last["loss"], last["grads"] = loss.detach(), [p.grad for p in model.learnable_parameters()]
        scaler.step(optimizer)
        scaler.update()

    return model, step, images, last


def check_amp_steps(clip, config: dict, device: torch.device, quick: bool) -> list:
    """6 steps in fp16 with the loss scaler (which may skip the first while it backs off) and in
    bf16 where the GPU has it."""
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        name = f"4. DeAR steps, autocast {devices.precision_name(dtype)}" + " + grad scaler" * (dtype == torch.float16)
        if not has_bf16(device) and dtype == torch.bfloat16:
            rows.append(row(name, "skip", "no bf16 in hardware on this GPU (--amp bf16 is refused)"))
            continue
        frozen = {key: value.clone() for key, value in clip.state_dict().items()}
        model, step, _, last = build_step(clip, config, device, 4, 10 if quick else 100, dtype)
        before = {n: p.detach().clone() for n, p in model.learnable_tensors().items()}
        for _ in range(6):
            step()
        grads_ok = all(g is not None and bool(torch.isfinite(g).all()) for g in last["grads"])
        loss_ok = bool(torch.isfinite(last["loss"]))
        still = [n for n, p in model.learnable_tensors().items() if torch.equal(p.detach(), before[n])]
        changed = [key for key, value in clip.state_dict().items() if not torch.equal(value, frozen[key])]
        rows.append(row(name, loss_ok and grads_ok and not still and not changed,
                        f"loss {last['loss'].item():.3f} {'finite' if loss_ok else 'NOT finite'}, grads "
                        f"{'finite' if grads_ok else 'NOT finite'} (the last of 6 steps); learnables "
                        f"{'all moved' if not still else 'unmoved: ' + ', '.join(still)}; CLIP "
                        f"{'unchanged' if not changed else 'CHANGED: ' + ', '.join(changed[:3])}",
                        loss=last["loss"].item(), unmoved=still, clip_changed=changed))
    return rows


def check_speed(config: dict, device: torch.device, dtype, quick: bool, peak_given) -> list:
    """bench_train_step.py's step at batch 32 in train.py's precision: images/s against the frozen
    image forward of the same batch, the peak memory on a GPU, and the MFU where the peak is known."""
    classes, cuda = 10 if quick else 100, device.type == "cuda"
    torch.cuda.reset_peak_memory_stats(device) if cuda else None
    amp_flag = {None: "off", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    r = bench_train_step.measure("step", str(device), 32, classes, 1 if quick else 10, "separate", config, amp_flag)
    flops = step_flops(config, 32, classes, r["prompt_tokens"])
    achieved = flops / r["seconds"] / 1e12
    peak, source = peak_tflops(torch.cuda.get_device_name(device) if cuda else "the CPU", peak_given)
    mfu = achieved / peak if peak else None
    return [row(f"4. speed and MFU, batch 32, {classes} classes, --amp {amp_flag}", mfu is None or 0 < mfu < 1,
                f"step {32 / r['seconds']:,.1f} img/s, frozen image forward {32 / r['image_seconds']:,.1f} img/s: "
                f"ratio {r['seconds'] / r['image_seconds']:.2f}" + (f", peak {r['peak_bytes'] / 2**20:,.0f} MB"
                                                                   * cuda) + f"; {flops / 1e9:,.1f} GFLOP per step, "
                f"{achieved:,.3g} TFLOP/s" + (f" of {peak:,.3g} ({source}): MFU {100 * mfu:.1f}%" if peak else
                                              f"; no peak known for {source} (give --peak-tflops)"),
                flops=flops, achieved_tflops=achieved, mfu=mfu)]


# 5. train.py end to end ---------------------------------------------------------------------

def train_py(logs: str, tag: str, *argv, launcher=None) -> int:
    """train.py's exit status, its output in logs/<tag>.txt: under `launcher` (torchrun) in a
    subprocess, else through train.main in this process (the command line's code)."""
    with open(os.path.join(logs, f"{tag}.txt"), "a", encoding="utf-8") as log:
        if launcher is not None:
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            return subprocess.run([*launcher, "train.py", *argv], cwd=REPO, env=env, stdout=log,
                                  stderr=subprocess.STDOUT).returncode
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                return train.main(list(argv))
            except Exception:  # noqa: BLE001 -- a crash is this run's result: its last line is shown
                traceback.print_exc()
                return 1


def log_line(logs: str, tag: str, containing: str = "") -> str:
    """The first line of logs/<tag>.txt containing `containing`; without it, the last line."""
    with open(os.path.join(logs, f"{tag}.txt"), encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip() and containing in line]
    return lines[0 if containing else -1][:200] if lines else "(no such line)"


def largest_gap(a: str, b: str) -> float:
    """The largest difference of two run folders' table cells, in accuracy points."""
    found = []
    for folder in (a, b):
        with open(os.path.join(folder, "summary.json"), encoding="utf-8") as f:
            found.append([v for table in json.load(f)["tables"].values() for values in table["rows"].values()
                          for v in values])  # None: an empty cell
    same = len(found[0]) == len(found[1]) and [v is None for v in found[0]] == [v is None for v in found[1]]
    return max((abs(x - y) for x, y in zip(*found) if x is not None), default=0.0) if same else math.inf


def learnable_tensors(folder: str) -> dict:
    return {root: torch.load(os.path.join(root, "checkpoint.pt"), weights_only=True)["learnable"]
            for root, _, files in sorted(os.walk(folder)) if "checkpoint.pt" in files}


def check_train_py(device: torch.device, quick: bool, scale: str, scratch: str, logs: str) -> list:
    import toyworld

    assets = toyworld.prepare(scale, log=lambda line: None)
    rows, kind = [], device.type
    # (a) The toy world end to end in train.py's precision, against the CPU; (b) the same run
    # stopped after one epoch and resumed: bit-identical on the CPU; on a GPU within 1e-3 (sums
    # in no fixed order).
    toy = ["--dataset", "toyworld", "--toy-scale", scale, "--seeds", "1", "--epochs", "2" if quick else "5",
           "--device", str(device)] + (["--method", "zeroshot", "dear", "--roles", "analyse"] if quick else [])
    folder = os.path.join(scratch, "toy")
    code = train_py(logs, "toy", *toy, "--output", folder)
    if code != 0:
        return [row(f"5. train.py toy world on {kind}", False, f"exit {code}: {log_line(logs, 'toy')}")]
    cpu = folder
    if kind != "cpu":
        cpu = os.path.join(scratch, "toy-cpu")
        train_py(logs, "toy-cpu", *toy[:-2], "--device", "cpu", "--output", cpu)
    gap = largest_gap(folder, cpu)
    rows.append(row(f"5. train.py toy world ({scale}) on {kind}, default precision", gap <= TOLERANCE_POINTS_AMP,
                    f"exit 0; largest cell gap to the CPU run {gap:.2f} points (<= {TOLERANCE_POINTS_AMP:g})"
                    + " (the CPU run is this run)" * (kind == "cpu"), gap=gap))
    broken = os.path.join(scratch, "toy-broken")
    code = train_py(logs, "toy-broken", *toy, "--output", broken, "--max-epochs-per-call", "1")
    stopped = code == 0 and not os.path.isfile(os.path.join(broken, "summary.json"))
    code = train_py(logs, "toy-broken", "--output", broken, "--resume") if stopped else code
    unbroken, resumed = learnable_tensors(folder), learnable_tensors(broken)
    same = stopped and code == 0 and [os.path.relpath(k, folder) for k in unbroken] == \
        [os.path.relpath(k, broken) for k in resumed] and bool(unbroken)
    difference = max(float((b[key].float() - a[key].float()).abs().max()) for a, b in
                     zip(unbroken.values(), resumed.values()) for key in a) if same else math.inf
    rows.append(row(f"5. resume after a stop = unbroken run, {kind}", difference <= (0 if kind == "cpu" else 1e-3),
                    f"learnable tensors {'bit-identical' if difference == 0 else f'differ by {difference:.1e}'}"
                    if same else f"stop or resume failed: {log_line(logs, 'toy-broken')}",
                    difference=difference, bit_identical=difference == 0))
    # (c) train.py in 2 processes, 2 steps each, rank 0 analysing the heads alone while the other
    # waits: NCCL with 2 GPUs, gloo on the CPU. The toy world runs in one process: its task is
    # copied as a CoOp dataset ('dtd').
    if kind == "cuda" and torch.cuda.device_count() < 2:
        rows.append(row("5. torchrun x 2 train.py", "info", "one GPU: NCCL across processes not checked"))
    else:
        root = os.path.join(scratch, "data", "dtd")
        os.makedirs(root)
        os.symlink(os.path.join(assets.data_root, "toyworld", "images"), os.path.join(root, "images"))
        os.symlink(os.path.join(assets.data_root, "toyworld", "split_toyworld.json"),
                   os.path.join(root, "split_zhou_DescribableTextures.json"))
        folder = os.path.join(scratch, "torchrun-2")
        code = train_py(logs, "torchrun-2", "--dataset", "dtd", "--root", os.path.dirname(root), "--weights",
                        assets.weights, "--bpe", assets.bpe, "--head-width", str(assets.head_width), "--method",
                        "dear", "--roles", "analyse", "--descriptions", "4", "--seeds", "1", "--shots", "1",
                        "--epochs", "1", "--batch-size", "3", "--device", kind, "--output", folder,
                        launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node=2"])
        with open(os.path.join(folder, "dtd", "dear", "seed1", "log.txt"), encoding="utf-8") as f:
            steps = "step 2/2 " in f.read()
        rows.append(row(f"5. torchrun x 2 train.py on {kind}, the analysis on rank 0", code == 0 and steps,
                        f"exit {code}, 2 steps per process" if steps else log_line(logs, "torchrun-2")))
    return rows + guarded("5. fp16, every 5th loss NaN", check_nan_stop, device, scratch, logs)


def check_nan_stop(device: torch.device, scratch: str, logs: str) -> list:
    """Every 5th step's loss made NaN, in fp16 with the loss scaler (forced on the CPU): the run
    must end as diverged (exit 1, a 'diverged' line: at the NaN, or once the scaler's skipped
    steps pass their bound), not exit 0; --resume without the NaN then finishes it."""
    folder = os.path.join(scratch, "nan")
    argv = ["--dataset", "toyworld", "--toy-scale", "miniature", "--method", "dear", "--roles", "all-mixed",
            "--seeds", "1", "--shots", "4", "--epochs", "5", "--batch-size", "4", "--device", str(device),
            "--output", folder]
    real, calls = dear.dear_loss, []

    def poisoned(*args, **kwargs):
        losses = real(*args, **kwargs)
        calls.append(1)
        if len(calls) % 5 == 0:
            losses["total"] = losses["total"] * float("nan")
        return losses

    with forced_precision(torch.float16) if device.type != "cuda" else contextlib.nullcontext():
        dear.dear_loss = poisoned  # what train.py calls: dear.dear_loss
        try:
            stopped = train_py(logs, "nan", *argv)
        finally:
            dear.dear_loss = real
        resumed = train_py(logs, "nan", "--output", folder, "--resume")
    line = log_line(logs, "nan", "diverged at epoch")
    done = os.path.isfile(os.path.join(folder, "toyworld", "dear-all-mixed", "seed1", "results.json"))
    return [row(f"5. fp16, every 5th loss NaN: the run ends as diverged, {device.type}",
                stopped == 1 and "diverged at epoch" in line and resumed == 0 and done,
                f"exit {stopped}, then --resume exit {resumed}; {line[:150]}", steps=len(calls))]


# 6. The precision table ---------------------------------------------------------------------

def check_precision(device: torch.device, quick: bool) -> list:
    """benchmarks/precision_table.py on the device: the toy trained and scored in fp32, fp16 and
    bf16, each against fp32's. --quick: the miniature toy, 2 epochs, near chance and so near
    ties: figures alone."""
    scale, epochs = ("miniature", 2) if quick else ("full", 20)
    return [row(f"6. precision {r['precision']}, the {scale} toy world", "info" if quick else
                max(r["changed"].values()) <= TOY_CHANGES_BOUND,
                f"HM {r['hm_fused']:.2f} fused / {r['hm_class']:.2f} class-on-unseen; predictions changed vs "
                f"fp32: {', '.join(f'{k} {n}' for k, n in r['changed'].items())} (<= {TOY_CHANGES_BOUND} "
                f"each); largest logit change {r['max_logit_change']:.3f} (scale {r['toy_scale']:.1f}), "
                f"{r['max_logit_change_100']:.3f} (scale 100)", **r)
            for r in measure(device, epochs, scale, log=lambda line: None)]


# The command ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Prove the GPU path of this project and measure it.")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny CLIP, short runs: for the CPU")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for the MFU")
    parser.add_argument("--toy-scale", default="miniature", choices=("miniature", "full"),
                        help="the toy world of the train.py runs (full: slower)")
    parser.add_argument("--output", default=os.path.join("runs", "device_check"), help="folder for the table")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("device_check.py: error: --device cuda: no CUDA device here; use --device cpu --quick", file=sys.stderr)
        return 2
    started, config = time.time(), TINY if args.quick else B16
    if args.quick:  # the tiny model gains nothing from more threads: fewer wait on a busy machine
        torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # as train.py
    if device.type == "cuda":
        dtype, why = devices.choose_precision("cuda", "on", torch.cuda.get_device_capability(device))
        where = torch.cuda.get_device_name(device)
    else:
        dtype, why = torch.float16, "fp16 autocast, simulated on the CPU"
        where = f"cpu, {torch.get_num_threads()} threads"
    title = f"{'tiny CLIP (--quick)' if args.quick else 'ViT-B/16'}, {where}, torch {torch.__version__}"
    print(f"device check: {title}; train.py's precision here: {why}; attention probed: DeAR's vision and "
          f"text calls with grad, and issue 196678's inputs", flush=True)
    logs = os.path.join(args.output, "logs")
    os.makedirs(logs, exist_ok=True)
    rows = []

    def report(new_rows: list) -> None:  # each row printed as it comes
        for name, status, figures, _ in new_rows:
            print(f"  [{time.time() - started:4.0f} s] {status:<5} {name}: {figures}", flush=True)
        rows.extend(new_rows)

    clip = random_clip(config).to(device)
    report(guarded("1. parity", check_parity, config, device))
    report(guarded("2. scores", check_scores, device))
    report(guarded("3. fused attention", check_attention, config, device))
    report(guarded("4. DeAR steps", check_amp_steps, clip, config, device, args.quick))
    # The speed in train.py's precision: autocast on CUDA, fp32 on the CPU (as train.py runs there).
    report(guarded("4. speed", check_speed, config, device, dtype if device.type == "cuda" else None,
                   args.quick, args.peak_tflops))
    del clip
    with tempfile.TemporaryDirectory(prefix="device_check-") as scratch:
        report(guarded("5. train.py", check_train_py, device, args.quick, args.toy_scale, scratch, logs))
        report(guarded("6. precision", check_precision, device, args.quick))
    failed = [name for name, status, _, _ in rows if status == "fail"]
    skipped = [f"{name}: {figures[:80]}" for name, status, figures, _ in rows if status == "skip"]
    verdict = (f"FAILED ({len(failed)} of {len(rows)} checks: {'; '.join(failed)})" if failed else
               f"passed with {len(skipped)} skipped ({'; '.join(skipped)})" if skipped else "passed")
    title = f"Device check: {title}, {time.time() - started:.0f} s; {verdict}"
    table = "\n".join(["| check | result | figures |", "|---|---|---|"]
                      + [f"| {name} | {status} | {figures} |" for name, status, figures, _ in rows])
    print(f"\n{title}\n\n{table}")
    stem = os.path.join(args.output, f"device_check_{device.type}{'_quick' * args.quick}")
    runfolder.write_text(stem + ".md", f"{title}\n\n{table}\n")
    runfolder.write_text(stem + ".json", json.dumps(dict(
        title=title, quick=args.quick, passed=not failed, checks=[dict(check=n, status=s, figures=f, values=v)
                                                                for n, s, f, v in rows]), indent=1, default=str))
    print(f"\nwritten: {stem}.md, {stem}.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
