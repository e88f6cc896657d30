"""One command that proves the GPU path and measures it: `python benchmarks/device_check.py`.

It prints one table, a row per check (pass, fail, skip, or info: figures alone), writes it as Markdown
and JSON in --output, and exits 1 if a check fails. The checks run train.py's precisions (fp16
autocast with a loss scaler; bf16 from compute capability 8.0); on the CPU, autocast simulates them.

  1. parity     features on the device against the CPU in fp32 (TF32 off); the head decomposition
  2. scores     DeAR's scores under autocast: fp32, and fp32's predictions exactly
  3. attention  the kernel torch picks on DeAR's calls (with grad); each fused backend against the
                explicit fp32 path: DeAR's masks, text lengths around 64, PyTorch issue 196678's
                inputs; the verdicts kept for --attention auto (devices.attention_record)
  4. steps      DeAR steps in fp16 + loss scaler and in bf16: finite, learnables moved, CLIP not
  5. train.py   the toy world against the CPU; stop and --resume; torchrun x 2: a run, and a NaN
                loss on rank 1 alone (both must stop at one step); every 5th loss NaN, one process
  6. precision  benchmarks/precision_table.py on the device

    python benchmarks/device_check.py                         # CUDA: a few minutes
    python benchmarks/device_check.py --device cpu --quick    # every check on a tiny CLIP

The speeds, on the device too: bench_train_step.py (its MFU), bench_clip.py, bench_loader.py.
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
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clip_model  # noqa: E402
import dear  # noqa: E402
from harness import devices, runfolder  # noqa: E402
import toyworld  # noqa: E402
import train  # noqa: E402
from bench_train_step import B16, TINY, class_prompts, mixed_roles  # noqa: E402
from precision_table import measure  # noqa: E402
import nan_on_rank  # noqa: E402

TOLERANCE_FP32 = 1e-3  # max abs difference of features, device vs CPU, both fp32 (TF32 off)
TOLERANCE_POINTS_AMP = 6.3  # accuracy points the toy run on the device may differ from the same run
# on the CPU in any cell: a test column of the miniature toy holds 48 images (2.08 points each), its
# logits near ties; fp32 may move 2 images, autocast one more (bf16 on the CPU moved 1: docs/MEASURED.md).
TOY_CHANGES_BOUND = 3  # the toy's predictions with half-precision encoders changed at most 1 of 360
# per set in the CPU simulation (docs/MEASURED.md); 3 allows another summation order on a GPU.


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


def random_clip(config: dict) -> clip_model.CLIP:
    """Random weights, biases and gains too (a bias lost on one device must show)."""
    torch.manual_seed(0)
    clip = clip_model.CLIP(**config).eval().requires_grad_(False)
    with torch.no_grad():
        for p in clip.parameters():
            p.add_(torch.randn(p.shape) * 0.02)
    return clip


# 1. Parity ----------------------------------------------------------------------------------

def check_parity(config: dict, device: torch.device) -> list:
    clip, generator = random_clip(config), torch.Generator().manual_seed(1)
    images = torch.randn(4, 3, config["image_resolution"], config["image_resolution"], generator=generator)
    texts = class_prompts(8, generator, config["context_length"], config["vocab_size"])
    with torch.no_grad():
        cpu = clip.encode_image(images), clip.encode_text(texts)
        clip, images = clip.to(device), images.to(device)
        image, text = clip.encode_image(images), clip.encode_text(texts.to(device))
        decomposition = (clip_model.head_contributions(clip, images, 4).total() - image).abs().max().item()
    image_diff, text_diff = ((a.cpu() - b).abs().max().item() for a, b in zip((image, text), cpu))
    return [row(f"1. parity {device.type} vs cpu, fp32, TF32 off", max(image_diff, text_diff) <= TOLERANCE_FP32,
                f"image {image_diff:.1e}, text {text_diff:.1e} max abs (<= {TOLERANCE_FP32:g})",
                image=image_diff),
            row("1. per-head decomposition sum vs encode_image", decomposition <= TOLERANCE_FP32,
                f"{decomposition:.1e} max abs (<= {TOLERANCE_FP32:g})", difference=decomposition)]


# 2. Scores in fp32 under autocast: a bf16 logit near CLIP's scale of 100 moves in steps of 0.5 --

def check_scores(device: torch.device) -> list:
    """fused_logits on fixed fp32 features near one direction (every logit within about 0.1 at a
    scale of 100), under autocast: float32, and fp32's predictions, fused and every branch."""
    model = dear.DeAR(random_clip(TINY), mixed_roles(TINY["vision_layers"], TINY["vision_heads"])).to(device)
    with torch.no_grad():
        model.clip.logit_scale.fill_(math.log(100.0))
    torch.manual_seed(0)
    centre = torch.randn(512)
    text, features = ((centre + noise * torch.randn(*shape, 512)).to(device) for noise, shape in
                      ((0.02, (200,)), (0.05, (64, 6))))  # (C, E) classes; (B, 1 + A, E) images
    rows = []
    with torch.no_grad():
        fused, branches = model.fused_logits(features, text)
        for dtype in (torch.bfloat16, torch.float16):
            name = devices.precision_name(dtype)
            with amp(device, dtype):
                fused_amp, branches_amp = model.fused_logits(features, text)
            pairs = ((fused_amp, fused), *zip(branches_amp.unbind(1), branches.unbind(1)))
            changed = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in pairs)
            dtypes = {str(t.dtype)[6:] for t in (fused_amp, branches_amp)}
            rows.append(row(f"2. scores under autocast {name}, 64 images x 200 close classes",
                            dtypes == {"float32"} and changed == 0, f"logits {'/'.join(sorted(dtypes))}; "
                            f"{changed} predictions changed vs fp32 (must be 0)", changed=changed))
    return rows


# 3. The fused attention kernels under DeAR's masks -------------------------------------------
# Each backend, forced alone, against the explicit per-head path in fp32: its error (max abs
# difference over the largest |value|, of the output and of the input's gradient) may be at most
# twice the explicit path's own in the same precision, plus 1e-3. PyTorch issue 196678: cuDNN's
# kernel goes wrong where a row's logsumexp falls below about -88.7 (exp underflows in fp32),
# masked, at lengths such as 64 and 192: here every raw score near -120 sqrt(D).
TEXT_LENGTHS, TEXT_TOKENS = (63, 64, 65), 4  # around 64, a kernel's block size; and K
ADVERSARIAL_LENGTHS, ADVERSARIAL_SCORE = (64, 192), -120.0


def attention_cases(config: dict) -> list:
    """(name, attention, x (2, N, W), mask) of DeAR's calls: vision at 1 + G*G + A tokens under a
    role map's masks (H, N, N), text under the causal mask (N, N), issue 196678's inputs."""
    layers, heads, width = config["vision_layers"], config["vision_heads"], config["vision_width"]
    image_tokens = 1 + (config["image_resolution"] // config["vision_patch_size"]) ** 2
    masks = dear.build_role_masks(mixed_roles(layers, heads), dear.default_first_layer(layers), layers,
                                  image_tokens)[0]  # (H, N, N)
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
                attention.in_proj_weight[:2 * width] = torch.cat([torch.eye(width), -torch.eye(width)])
                attention.in_proj_weight[:2 * width] *= scale
                attention.in_proj_bias.zero_()
        cases.append((name, attention, x, mask))
    return cases


def relative_error(value, reference) -> float:
    return float((value - reference).abs().max() / reference.abs().max())


def attention_pass(attention, x, gradient, mask, device, dtype, explicit: bool):
    """(output, the input's gradient) of one forward and backward, both float32."""
    x = x.clone().requires_grad_(True)
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
    cases = [(n, a.to(device), x.to(device), m.to(device)) for n, a, x, m in attention_cases(config)]
    dtypes = {devices.precision_name(d): d for d in [torch.float16] + [torch.bfloat16] * has_bf16(device)}
    picked = {f"{p} {n}": kernel_picked(a, x, m, device, d) for p, d in dtypes.items()
              for n, a, x, m in (cases[0], cases[4])}  # vision, and text at context + K
    rows, runs, verdicts = [row("3. the kernel torch picks", "info", ", ".join(f"{n} {k}" for n, k in
                                picked.items()) + " (DeAR's calls, with grad)", picked=picked)], [], {}
    for case, attention, x, mask in cases:
        gradient = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(device)
        reference = attention_pass(attention, x, gradient, mask, device, None, True)
        for precision, dtype in dtypes.items():
            explicit = attention_pass(attention, x, gradient, mask, device, dtype, True)
            runs.append((f"{precision} {case}", dtype, attention, x, gradient, mask, reference,
                         [relative_error(e, r) for e, r in zip(explicit, reference)]))
    times, plus = 2.0, 1e-3  # the error allowed: times the explicit path's own, plus
    for backend in devices.SDPA_BACKENDS.values():  # MATH, FLASH_ATTENTION, ...: train.py's choices
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
    path, record = devices.attention_record(), {}  # none yet, or damaged: started again
    with contextlib.suppress(OSError, ValueError, TypeError), open(path, encoding="utf-8") as f:
        record = dict(json.load(f))
    runfolder.write_json(path, {**record, build: verdicts})


# 4. DeAR steps under autocast ----------------------------------------------------------------

def build_step(clip, config: dict, device: torch.device, batch: int, classes: int, dtype):
    """A DeAR on `clip`, one batch and class list, train.py's step (autocast, loss scaler, AdamW)
    -> (model, step, images, last: the last step's loss and gradients, the prompts' length)."""
    generator, size = torch.Generator().manual_seed(0), config["image_resolution"]
    torch.manual_seed(0)
    model = dear.DeAR(clip, mixed_roles(config["vision_layers"], config["vision_heads"])).to(device)
    images, labels, prompts = (t.to(device) for t in (
        torch.randn(batch, 3, size, size, generator=generator),
        torch.randint(0, classes, (batch,), generator=generator),
        class_prompts(classes, generator, config["context_length"], config["vocab_size"])))
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
    """6 steps in fp16 with the loss scaler (it may skip the first few) and in bf16 (where allowed)."""
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        name = f"4. DeAR steps, autocast {devices.precision_name(dtype)}"
        name += " + grad scaler" * (dtype == torch.float16)
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


# 5. train.py end to end ---------------------------------------------------------------------

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
TORCHRUN_TIMEOUT = 300  # seconds; a process left waiting on a collective: a failed row, not a hang


def train_py(logs: str, tag: str, *argv, script=None) -> int:
    """train.py's exit status (124: timed out), its output in logs/<tag>.txt: `script` (train.py or
    a wrapper) in 2 processes under torchrun, else train.main in this process (the command's code)."""
    with open(os.path.join(logs, f"{tag}.txt"), "a", encoding="utf-8") as log:
        if script is not None:
            with subprocess.Popen([*TORCHRUN, script, *argv], cwd=REPO, env={"OMP_NUM_THREADS": "1",
                                  **os.environ}, stdout=log, stderr=subprocess.STDOUT) as child:
                try:
                    return child.wait(TORCHRUN_TIMEOUT)
                except subprocess.TimeoutExpired:  # SIGTERM: torchrun ends its processes
                    child.terminate()  # and the with waits for it
            print(f"device_check: timed out after {TORCHRUN_TIMEOUT} s", file=log, flush=True)
            return 124
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                return train.main(list(argv))
            except Exception:  # noqa: BLE001 -- a crash is this run's result: its last line is shown
                traceback.print_exc()
                return 1


def log_lines(folder: str, name: str, containing: str = "") -> list:
    """The lines of <folder>/<name>.txt containing `containing`, stripped, cut at 200 characters."""
    path = os.path.join(folder, f"{name}.txt")
    with open(path if os.path.isfile(path) else os.devnull, encoding="utf-8", errors="replace") as f:
        lines = [line.strip()[:200] for line in f if line.strip() and containing in line]
    return lines or ["(no such line)"]


def table_cells(folder: str) -> list:
    """Every cell of a run folder's tables, in accuracy points (None: an empty cell)."""
    with open(os.path.join(folder, "summary.json"), encoding="utf-8") as f:
        return [v for table in json.load(f)["tables"].values() for row in table["rows"].values() for v in row]


def learnable_tensors(folder: str) -> dict:
    return {os.path.relpath(root, folder): torch.load(os.path.join(root, "checkpoint.pt"), weights_only=True)
            ["learnable"] for root, _, files in sorted(os.walk(folder)) if "checkpoint.pt" in files}


def check_train_py(device: torch.device, quick: bool, scratch: str, logs: str) -> list:
    assets, kind = toyworld.prepare("miniature", log=lambda line: None), device.type
    # (a) The toy world end to end in train.py's precision, against the CPU; (b) the same run stopped
    # after one epoch and resumed: bit-identical on the CPU, on a GPU within 1e-3 (sums in no fixed order).
    toy = ["--dataset", "toyworld", "--toy-scale", "miniature", "--seeds", "1",
           "--epochs", "2" if quick else "5"]
    toy += ["--method", "zeroshot", "dear", "--roles", "analyse"] * quick
    folder, cpu = os.path.join(scratch, "toy"), os.path.join(scratch, "toy-cpu")
    code = train_py(logs, "toy", *toy, "--device", str(device), "--output", folder)
    if code != 0:
        return [row(f"5. train.py toy world on {kind}", False, f"exit {code}: {log_lines(logs, 'toy')[-1]}")]
    if kind != "cpu" and train_py(logs, "toy-cpu", *toy, "--device", "cpu", "--output", cpu) != 0:
        return [row("5. train.py toy world on the CPU", False, log_lines(logs, "toy-cpu")[-1])]
    found, reference = table_cells(folder), table_cells(cpu if kind != "cpu" else folder)
    gap = max((abs(a - b) for a, b in zip(found, reference) if a is not None), default=0.0) \
        if [a is None for a in found] == [b is None for b in reference] else math.inf
    rows = [row(f"5. train.py toy world on {kind}, default precision", gap <= TOLERANCE_POINTS_AMP,
                f"exit 0; largest cell gap to the CPU run {gap:.2f} points (<= {TOLERANCE_POINTS_AMP:g})"
                + " (the CPU run is this run)" * (kind == "cpu"), gap=gap)]
    broken = os.path.join(scratch, "toy-broken")
    code = train_py(logs, "toy-broken", *toy, "--device", str(device), "--output", broken,
                    "--max-epochs-per-call", "1")
    stopped = code == 0 and not os.path.isfile(os.path.join(broken, "summary.json"))
    code = train_py(logs, "toy-broken", "--output", broken, "--resume") if stopped else code
    unbroken, resumed = learnable_tensors(folder), learnable_tensors(broken)
    same = stopped and code == 0 and list(unbroken) == list(resumed) and bool(unbroken)
    difference = max(float((resumed[run][key].float() - tensor.float()).abs().max()) for run, tensors in
                     unbroken.items() for key, tensor in tensors.items()) if same else math.inf
    figures = "bit-identical" if difference == 0 else f"differ by {difference:.1e}"
    rows.append(row(f"5. resume after a stop = unbroken run, {kind}", difference <= (kind == "cuda") * 1e-3,
                    f"learnable tensors {figures}" if same else log_lines(logs, "toy-broken")[-1],
                    difference=difference, bit_identical=difference == 0))
    rows += guarded("5. fp16, every 5th loss NaN", check_nan_stop, device, scratch, logs)
    # (c) train.py in 2 processes (NCCL with 2 GPUs, gloo on the CPU), the toy world's task as a CoOp
    # dataset ('dtd'): 2 steps each, rank 0 analysing the heads alone; rank 1's loss NaN at its 2nd step
    # (nan_on_rank.py): both stop seed 1 at one step, go on to seed 2 together (no collective left waiting).
    names = (f"5. torchrun x 2 train.py on {kind}, the analysis on rank 0",
             f"5. torchrun x 2, a NaN loss on rank 1 alone: both stop at the same step, {kind}")
    if kind == "cuda" and torch.cuda.device_count() < 2:
        return rows + [row(name, "info", "one GPU: NCCL across processes not checked") for name in names]
    root = os.path.join(scratch, "data", "dtd")
    os.makedirs(root)
    os.symlink(os.path.join(assets.data_root, "toyworld", "images"), os.path.join(root, "images"))
    os.symlink(os.path.join(assets.data_root, "toyworld", "split_toyworld.json"),
               os.path.join(root, "split_zhou_DescribableTextures.json"))
    common = ["--dataset", "dtd", "--root", os.path.dirname(root), "--weights", assets.weights, "--bpe",
              assets.bpe, "--head-width", str(assets.head_width), "--method", "dear", "--epochs", "1",
              "--device", kind]
    folder = os.path.join(scratch, "torchrun-2")
    code = train_py(logs, "torchrun-2", *common, "--roles", "analyse", "--descriptions", "4", "--seeds",
                    "1", "--shots", "1", "--batch-size", "3", "--output", folder, script="train.py")
    steps = "step 2/2 " in log_lines(os.path.join(folder, "dtd", "dear", "seed1"), "log", "step 2/2 ")[0]
    rows.append(row(names[0], code == 0 and steps,
                    f"exit {code}, 2 steps per process" if steps else log_lines(logs, "torchrun-2")[-1]))
    folder = os.path.join(scratch, "torchrun-nan")
    code = train_py(logs, "torchrun-nan", *common, "--roles", "all-mixed", "--seeds", "1", "2", "--shots",
                    "4", "--augment", "off", "--batch-size", "2", "--output", folder,
                    script=nan_on_rank.__file__)
    said = log_lines(logs, "torchrun-nan", "train.py: [")  # rank 0 alone prints: one line, the divergence
    went_on = os.path.isfile(os.path.join(folder, "dtd", "dear-all-mixed", "seed2", "results.json"))
    return rows + [row(names[1], code == 1 and len(said) == 1 and "diverged at epoch" in said[0] and went_on,
                       f"exit {code}: {'; '.join(line.split(';')[0] for line in said)}; seed 2 "
                       + ("finished" if went_on else "NOT finished"))]


def check_nan_stop(device: torch.device, scratch: str, logs: str) -> list:
    """Every 5th loss NaN in fp16 with the loss scaler (nan_on_rank.nan_loss): the run must end as
    diverged (exit 1, a 'diverged' line: at the NaN, or past the bound on skipped steps)."""
    argv = ["--dataset", "toyworld", "--toy-scale", "miniature", "--method", "dear", "--roles", "all-mixed",
            "--seeds", "1", "--shots", "4", "--epochs", "5", "--batch-size", "4", "--device", str(device)]
    with nan_on_rank.nan_loss(lambda step: step % 5 == 0):
        stopped = train_py(logs, "nan", *argv, "--output", os.path.join(scratch, "nan"))
    line = log_lines(logs, "nan", "diverged at epoch")[0]
    return [row(f"5. fp16, every 5th loss NaN: the run ends as diverged, {device.type}",
                stopped == 1 and "diverged at epoch" in line, f"exit {stopped}: {line}")]


# 6. The precision table ---------------------------------------------------------------------

def check_precision(device: torch.device, quick: bool) -> list:
    """benchmarks/precision_table.py on the device: the toy trained and scored in each precision
    against fp32. --quick: the miniature toy, 2 epochs, near chance (near ties): figures alone."""
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
    parser.add_argument("--output", default=os.path.join("runs", "device_check"), help="folder for the table")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "device_check.py: error: --device cuda: no CUDA device here; use --device cpu "
                       "--quick\n")
    started, config = time.time(), TINY if args.quick else B16
    if args.quick:  # the tiny model gains nothing from more threads: fewer wait on a busy machine
        torch.set_num_threads(1)
    warnings.simplefilter("ignore", dear.LeftOutWarning)  # the tiny model's blind attribute tokens
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # as train.py
    cuda = device.type == "cuda"
    why = devices.choose_precision("cuda", "on", torch.cuda.get_device_capability(device))[1] if cuda \
        else "fp16 autocast, simulated on the CPU"
    where = torch.cuda.get_device_name(device) if cuda else f"cpu, {torch.get_num_threads()} threads"
    title = f"{'tiny CLIP (--quick)' if args.quick else 'ViT-B/16'}, {where}, torch {torch.__version__}"
    print(f"device check: {title}; train.py's precision here: {why}; attention probed: DeAR's vision and "
          f"text calls with grad, and issue 196678's inputs", flush=True)
    logs, rows = os.path.join(args.output, "logs"), []
    os.makedirs(logs, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="device_check-") as scratch:
        for name, check, *inputs in (
                ("1. parity", check_parity, config, device), ("2. scores", check_scores, device),
                ("3. attention", check_attention, config, device),
                ("4. DeAR steps", check_amp_steps, random_clip(config).to(device), config, device,
                 args.quick),
                ("5. train.py", check_train_py, device, args.quick, scratch, logs),
                ("6. precision", check_precision, device, args.quick)):
            for new in guarded(name, check, *inputs):  # each row printed as it comes
                print(f"  [{time.time() - started:4.0f} s] {new[1]:<5} {new[0]}: {new[2]}", flush=True)
                rows.append(new)
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
    checks = [dict(zip(("check", "status", "figures", "values"), new)) for new in rows]
    runfolder.write_text(stem + ".json", json.dumps(dict(title=title, quick=args.quick, passed=not failed,
                                                         checks=checks), indent=1, default=str))
    print(f"\nwritten: {stem}.md, {stem}.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
