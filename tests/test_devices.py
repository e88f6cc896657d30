"""Tests of what a GPU run and several processes do differently from one CPU process, on the CPU:
scores in fp32 under autocast (CPU autocast casts the same matrix products as CUDA's; CUDA's
also keeps LayerNorm and softmax in fp32, which clip_model.LayerNorm and the explicit attention
do themselves, so that the CPU simulation's dtype flow is CUDA's), the
precision chosen from the run's own device, resume across precisions (an enabled CPU loss
scaler), the process group left on every way out, DDP told of every learnable tensor without a
gradient, rank 0's head analysis outlasting the process group's timeout (gloo, 2 processes),
the analysis lock's bound, and augmentation that does not depend on --workers.

    python -m pytest -q tests/test_devices.py
"""

import dataclasses
import datetime
import gzip
import json
import os
import socket
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import clip_model  # noqa: E402
import data  # noqa: E402
import dear  # noqa: E402
from harness import analysis, cli, config, devices, errors, plan, runfolder  # noqa: E402
import train  # noqa: E402
from conftest import perturb_, torchrun  # noqa: E402
from test_train import merges_for  # noqa: E402

CLASSES = ["banded", "blotchy", "braided", "bubbly", "cracked"]  # 3 base, 2 novel


@pytest.fixture(autouse=True)
def registry_and_cache(tmp_path, monkeypatch):
    """The shipped dataset registry and an empty analysis cache for each test."""
    monkeypatch.setattr(train.data, "DATASETS", dict(train.data.DATASETS))
    monkeypatch.setenv("DEAR_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny CLIP, its BPE file and a dtd in CoOp's layout whose images are noise: a crop of a
    solid colour is the same tensor whatever the seed, a crop of noise is not."""
    tmp = tmp_path_factory.mktemp("textured_world")
    merges = merges_for(" ".join(["a photo of texture"] + CLASSES).split())
    bpe = tmp / "bpe_tiny.txt.gz"
    with gzip.open(bpe, "wt", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    torch.manual_seed(0)
    clip = perturb_(clip_model.CLIP(embed_dim=32, image_resolution=32, vision_layers=3,
                                    vision_width=64, vision_patch_size=8, vision_heads=2,
                                    context_length=16, vocab_size=512 + len(merges) + 2,
                                    transformer_width=64, transformer_heads=2,
                                    transformer_layers=2))
    torch.save(clip.state_dict(), tmp / "tiny_clip.pt")
    generator = torch.Generator().manual_seed(0)
    root, split = tmp / "data", {"train": [], "val": [], "test": []}
    for label, name in enumerate(CLASSES):
        for part, count in (("train", 6), ("val", 2), ("test", 4)):
            for i in range(count):
                relative = f"{name}/{name}_{part}{i}.png"
                path = root / "dtd" / "images" / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                pixels = torch.randint(0, 256, (40, 40, 3), generator=generator, dtype=torch.uint8)
                pixels[..., label % 3] //= 2  # a class's tint under the noise
                Image.fromarray(pixels.numpy()).save(path)
                split[part].append([relative, label, name])
    (root / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))
    return dict(weights=str(tmp / "tiny_clip.pt"), bpe=str(bpe), root=str(root))


def common(world, output, *extra):
    return ["--dataset", "dtd", "--root", world["root"], "--weights", world["weights"],
            "--bpe", world["bpe"], "--head-width", "32", "--output", str(output), "--epochs", "2",
            "--batch-size", "4", "--log-every", "100", "--device", "cpu", "--descriptions", "6",
            "--seeds", "1", "--shots", "4", *extra]


def learnable(folder: Path) -> dict:
    return torch.load(folder / "checkpoint.pt", weights_only=True)


# ------------------------------------------------------------------------------------------
# Scores in fp32 under autocast
# ------------------------------------------------------------------------------------------


def small_margin_batch(images: int, classes: int, branches: int, width: int, seed: int = 0):
    """Image features (images, branches, width) and text features (classes, width), all near one
    direction: every cosine close to every other, the case where a bf16 score (steps of 1/16
    between 8 and 16) swaps classes."""
    generator = torch.Generator().manual_seed(seed)
    centre = torch.randn(width, generator=generator)
    text = centre + 0.02 * torch.randn(classes, width, generator=generator)
    return centre + 0.05 * torch.randn(images, branches, width, generator=generator), text


def mixed_dear(tiny_clip) -> dear.DeAR:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the uniform map's blind tokens
        roles = dear.RoleMap.uniform("mixed", 3, 2, range(3), ["colour", "shape"])
        return dear.DeAR(tiny_clip, roles)


def test_scores_under_bf16_autocast_are_fp32_and_predict_exactly_as_fp32(tiny_clip):
    """DeAR's fused and branch logits and the zero-shot logits, on fixed fp32 features, under
    CPU autocast bf16: float32, equal to the fp32 ones, on a batch where bf16 scores would
    change predictions."""
    model = mixed_dear(tiny_clip)
    features, text = small_margin_batch(64, 200, 3, 32)
    fused, branches = model.fused_logits(features, text)
    zero_shot = train.zero_shot_logits(tiny_clip, features[:, 0], text)
    unit = [F.normalize(t, dim=-1).bfloat16() for t in (features[:, 0], text)]
    changed = ((unit[0] @ unit[1].T).argmax(-1) != zero_shot.argmax(-1)).sum().item()
    assert changed >= 10, f"bf16 scores change {changed} of 64 predictions: not a small margin"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_amp, branches_amp = model.fused_logits(features, text)
        zero_shot_amp = train.zero_shot_logits(tiny_clip, features[:, 0], text)
    for name, amp, plain in (("fused", fused_amp, fused), ("branches", branches_amp, branches),
                             ("zero-shot", zero_shot_amp, zero_shot)):
        assert amp.dtype == torch.float32, f"{name} logits are {amp.dtype} under autocast"
        assert torch.equal(amp.argmax(-1), plain.argmax(-1)), f"{name}: predictions changed"
        assert torch.equal(amp, plain), name


def test_evaluate_under_bf16_autocast_scores_as_fp32_does(tiny_clip, tmp_path):
    """train.evaluate end to end under a bf16 runtime, the encoders replaced by fixed fp32
    features on the small-margin batch: zero-shot and both DeAR logits score as in fp32."""
    features, text = small_margin_batch(48, 200, 3, 32, seed=1)
    model = mixed_dear(tiny_clip)
    labels = model.fused_logits(features, text)[0].argmax(-1)  # fp32's prediction is right
    items = []
    for i, label in enumerate(labels.tolist()):
        path = tmp_path / f"image{i}.png"
        Image.new("RGB", (32, 32), (i, 0, 0)).save(path)  # read, then replaced by features[i]
        items.append(data.Item(str(path), label, f"class {label}"))
    eval_set = train.EvalSet("base", items, [f"class {c}" for c in range(200)], "{}", trained=True)
    def tokenize(texts, length, truncate):  # the ids are never read: the encoders are replaced
        return torch.zeros(len(texts), length, dtype=torch.long)

    tokenizer = types.SimpleNamespace(tokenize=tokenize)
    tiny_clip.encode_text = lambda ids: text
    tiny_clip.encode_image = lambda images: features[:len(images), 0]
    model.prepare_classes = lambda ids: None
    model.encode_text = lambda classes, beta=None: text
    model.encode_image = lambda images, beta=None: (features[:len(images), 0],
                                                    features[:len(images), 1:], None)
    settings = dict(eval_batch_size=64, workers=0)
    cpu = torch.device("cpu")
    for which in (None, model):
        fp32 = train.evaluate(which, tiny_clip, tokenizer, eval_set, settings, devices.Runtime(cpu))
        bf16 = train.evaluate(which, tiny_clip, tokenizer, eval_set, settings,
                              devices.Runtime(cpu, amp_dtype=torch.bfloat16))
        assert bf16 == fp32, f"{'DeAR' if which else 'zero-shot'}: bf16 {bf16}, fp32 {fp32}"
    assert fp32["fused"] == 100.0


# ------------------------------------------------------------------------------------------
# The precision from the run's own device
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device, amp, capability, dtype", [
    ("cuda", "on", (7, 0), torch.float16),  # V100
    ("cuda", "on", (9, 0), torch.float16),  # H100, H200: fp16 too, the measured default
    ("cuda", "fp16", (8, 0), torch.float16),
    ("cuda", "bf16", (8, 0), torch.bfloat16),  # A100
    ("cuda", "bf16", (9, 0), torch.bfloat16),
    ("cuda", "off", (9, 0), None),
    ("cpu", "on", None, None),
    ("cpu", "bf16", None, None),
    ("mps", "on", None, None),
])
def test_the_precision_is_fp16_unless_asked_and_says_why(device, amp, capability, dtype):
    chosen, why = devices.choose_precision(device, amp, capability)
    assert chosen == dtype
    assert why.startswith({torch.float16: "fp16", torch.bfloat16: "bf16", None: "fp32"}[dtype])
    if dtype is not None:
        assert f"--amp {amp}" in why and (dtype == torch.bfloat16 or "training and evaluation" in why)


def test_bf16_on_a_gpu_without_it_in_hardware_is_refused_in_one_line():
    with pytest.raises(errors.TrainError, match=r"--amp bf16: this GPU \(compute capability 7.5\) has "
                                              "no bf16 in hardware; use --amp on"):
        devices.choose_precision("cuda", "bf16", (7, 5))


def test_one_process_on_cuda_1_makes_it_current_and_reads_its_own_capability(monkeypatch):
    """--device cuda:1 in one process: set_device(cuda:1), and the precision from cuda:1 (a V100
    here), not from the current device (an H100) nor torch.cuda.is_bf16_supported() (which
    counts emulation)."""
    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: (7, 0) if torch.device(device).index == 1 else (9, 0))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        runtime = devices.setup_runtime(dict(device="cuda:1", amp="on", attention="explicit"))
        # fp32 means fp32 on a GPU: TF32 set off for matmuls and cuDNN's convolutions, and said
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert made_current == [torch.device("cuda", 1)]
    assert runtime.device == torch.device("cuda", 1) and runtime.amp_dtype == torch.float16
    assert runtime.precision.endswith("; TF32 off")
    assert (runtime.kernel, runtime.attention) == ("explicit", "explicit")
    # bf16 asked for: refused on cuda:1 (compute capability 7.0), whatever the current device
    with pytest.raises(errors.TrainError, match=r"compute capability 7\.0"):
        devices.setup_runtime(dict(device="cuda:1", amp="bf16", attention="explicit"))


# ------------------------------------------------------------------------------------------
# The attention kernel, a stated choice (--attention)
# ------------------------------------------------------------------------------------------


def test_each_attention_choice_gives_its_kernel_and_auto_drops_what_device_check_found_wrong(
        monkeypatch, registry_and_cache):
    """--attention -> (clip_model's kernel, the fused backends allowed): explicit, sdpa (torch's
    choice), one backend alone; on a GPU, auto = torch's choice without a backend
    device_check.py found wrong on this GPU and build, and cuDNN's only once it passed there."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert devices.attention_choice("explicit", gpu)[:2] == ("explicit", None)
    assert devices.attention_choice("sdpa", gpu)[:2] == ("sdpa", None)
    assert devices.attention_choice("efficient", cpu)[:2] == ("sdpa", ["EFFICIENT_ATTENTION"])
    assert devices.attention_choice("cudnn", gpu)[:2] == ("sdpa", ["CUDNN_ATTENTION"])
    assert devices.attention_choice("auto", cpu)[:2] == ("sdpa", None)  # the CPU: torch's own
    monkeypatch.setattr(devices, "gpu_build", lambda device: "NVIDIA H200, torch 2.x, cuDNN 9")
    never_checked = devices.attention_choice("auto", gpu)
    assert never_checked[1] == ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    assert never_checked[2] == ("torch's choice of fused kernel, except cudnn (not yet passed by "
                                "device_check on this GPU)")
    record = Path(devices.attention_record())
    record.parent.mkdir(parents=True)
    verdicts = {"FLASH_ATTENTION": "unavailable", "EFFICIENT_ATTENTION": "wrong",
                "CUDNN_ATTENTION": "ok", "MATH": "ok"}
    record.write_text(json.dumps({"NVIDIA H200, torch 2.x, cuDNN 9": verdicts,
                                  "another GPU": {"CUDNN_ATTENTION": "wrong"}}))
    checked = devices.attention_choice("auto", gpu)
    assert checked[1] == ["FLASH_ATTENTION", "CUDNN_ATTENTION", "MATH"]
    assert checked[2] == ("torch's choice of fused kernel, except efficient (found wrong by "
                          "device_check on this GPU)")
    record.write_text("{ damaged")  # a damaged record: as if never checked
    assert devices.attention_choice("auto", gpu)[1] == never_checked[1]


def test_the_fused_kernel_torch_runs_is_found_by_running_it():
    """sdpa_kernel_used: the backend whose output equals torch's own choice bit for bit (the
    CPU's fused kernel here); allowed one backend, that one."""
    cpu = torch.device("cpu")
    assert devices.sdpa_kernel_used(cpu, None, ["MATH"]) == "math"
    assert devices.sdpa_kernel_used(cpu, None, None) in cli.SDPA_BACKENDS
    assert devices.sdpa_kernel_used(cpu, torch.bfloat16, ["MATH"]) == "math"


@pytest.mark.parametrize("choice", cli.ATTENTION_CHOICES)
def test_every_attention_choice_on_the_cpu_runs_or_is_refused_in_one_line(
        world, tmp_path, capsys, choice):
    """A fused kernel the CPU lacks (efficient, cudnn: CUDA's alone) is one line and exit status
    2 before any work, not torch's traceback ("No viable backend"); every other choice runs."""
    out = tmp_path / "run"
    capsys.readouterr()
    status = train.main(common(world, out, "--method", "zeroshot", "--attention", choice))
    printed, stderr = capsys.readouterr()
    if choice in ("efficient", "cudnn"):
        assert status == 2 and not out.exists()
        assert stderr.strip().splitlines() == [
            f"train.py: error: --attention {choice}: torch's fused kernel cannot run on this cpu; "
            "use --attention auto, sdpa or explicit"]
    else:
        assert status == 0 and f"train.py: attention {'explicit' if choice == 'explicit' else 'sdpa'}" \
            in printed


def test_train_py_with_explicit_attention_never_calls_a_fused_kernel_and_says_so(
        world, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(clip_model.F, "scaled_dot_product_attention",
                        lambda *a, **k: pytest.fail("a fused attention kernel was called"))
    capsys.readouterr()
    assert train.main(common(world, tmp_path / "run", "--method", "zeroshot", "dear", "--roles",
                             "all-mixed", "--attention", "explicit")) == 0
    assert "train.py: attention explicit: --attention explicit, clip_model's per-head maths" \
        in capsys.readouterr().out
    assert runfolder.read_metrics(str(tmp_path / "run/dtd/dear-all-mixed/seed1/metrics.jsonl"))


# ------------------------------------------------------------------------------------------
# Resume across precisions
# ------------------------------------------------------------------------------------------


def simulated(monkeypatch, dtype):
    """train.py's runtime on the CPU with autocast `dtype` (None: fp32), as a GPU would choose;
    fp16 gets train.py's loss scaler, enabled, on the CPU."""
    real = devices.setup_runtime
    name = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    monkeypatch.setattr(devices, "setup_runtime", lambda settings: dataclasses.replace(
        real(settings), amp_dtype=dtype, precision=f"{name} (simulated on the CPU)"))


@pytest.mark.parametrize("before, after", [(torch.bfloat16, torch.float16), (None, torch.float16),
                                           (torch.float16, None)])
def test_resume_continues_in_another_precision_with_a_fresh_or_an_unused_scaler(
        world, tmp_path, monkeypatch, capsys, before, after):
    out = tmp_path / "run"
    run = common(world, out, "--method", "dear", "--roles", "all-mixed", "--augment", "off")
    with monkeypatch.context() as patch:
        simulated(patch, before)
        assert train.main([*run, "--max-epochs-per-call", "1"]) == 0
    leaf = out / "dtd" / "dear-all-mixed" / "seed1"
    saved = learnable(leaf)["scaler"]
    assert bool(saved) == (before == torch.float16)  # only fp16 has a scaler to save
    capsys.readouterr()
    with monkeypatch.context() as patch:
        simulated(patch, after)
        assert train.main(["--output", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    checkpoint = learnable(leaf)
    assert checkpoint["epoch"] == 2 and (leaf / "results.json").is_file()
    assert all(torch.isfinite(t).all() for t in checkpoint["learnable"].values())
    if after == torch.float16:  # an enabled scaler ran the second epoch and was saved
        assert ("resumed in fp16 from a run without a loss scaler (bf16 or fp32): a fresh scaler"
                in printed)
        assert checkpoint["scaler"]["scale"] > 0
    else:
        assert "its loss scaler is not needed" in printed and checkpoint["scaler"] == {}
    assert f"{'fp16' if after else 'fp32'} (simulated on the CPU)" in printed  # the header


def test_a_cpu_run_says_its_precision_and_why(world, tmp_path, capsys):
    assert train.main(common(world, tmp_path / "run", "--method", "zeroshot")) == 0
    assert "device cpu, fp32 (autocast on CUDA only; cpu runs fp32)" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------
# Processes: the group left on every way out; DDP told of every tensor without a gradient
# ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("way_out", ["done", "analyse-only", "max-epochs-per-call", "error"])
def test_every_way_out_of_a_call_leaves_the_process_group(world, tmp_path, monkeypatch, way_out):
    """A real process group (gloo, one process) joined where setup_runtime joins torchrun's:
    gone after a finished call, each early return and an error mid-run."""
    real = devices.setup_runtime

    def joined(settings):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
        return dataclasses.replace(real(settings), waiting_group=dist.new_group(backend="gloo"))

    monkeypatch.setattr(devices, "setup_runtime", joined)
    flags = {"done": [], "analyse-only": ["--analyse-only"], "error": [],
             "max-epochs-per-call": ["--max-epochs-per-call", "1"]}[way_out]
    if way_out == "error":  # an error after the group is joined (e.g. a corrupt test image)
        def broken(*args):
            raise errors.TrainError("a test image is broken")

        monkeypatch.setattr(train, "evaluate", broken)
    try:
        epochs = "2" if way_out == "max-epochs-per-call" else "1"
        code = train.main(common(world, tmp_path / "run", "--method", "dear", "--roles", "analyse",
                                 "--epochs", epochs, *flags))
        assert code == (2 if way_out == "error" else 0)
        assert not dist.is_initialized(), f"{way_out}: the process group was not left"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def role_map_of(kind: str, attributes=("colour", "shape")) -> dear.RoleMap:
    """Role maps of the tiny CLIP (3 layers of 2 heads) for each case of the configurations."""
    if kind in ("all-mixed", "all-generalization"):
        return dear.RoleMap.uniform(kind.split("-")[1], 3, 2, range(3), list(attributes))
    roles = {  # (layer, head) -> (role, attribute); entropies make it a measured map
        "analysed": {(0, 0): ("attribute", "colour"), (0, 1): ("generalization", None),
                     (1, 0): ("attribute", "shape"), (1, 1): ("mixed", None),
                     (2, 0): ("mixed", None), (2, 1): ("generalization", None)},
        "blind": {(0, 0): ("attribute", "colour"), (0, 1): ("generalization", None),  # shape: none
                  (1, 0): ("attribute", "colour"), (1, 1): ("generalization", None),
                  (2, 0): ("generalization", None), (2, 1): ("generalization", None)},
        "fallback": {(layer, head): ("mixed" if head else "generalization", None)  # none attribute
                     for layer in range(3) for head in range(2)},
    }[kind]
    heads = [dear.HeadRole(layer, head, role, attribute, entropy=1.0)
             for (layer, head), (role, attribute) in roles.items()]
    return dear.RoleMap(3, 2, list(attributes), heads, low_bits=0.5, high_bits=1.5)


# Every configuration a run can train: (name, settings changed, role map, ablation). Another
# construction of the tokens is one more entry (its setting in the dict).
CONFIGURATIONS = [
    ("analysed roles", {}, "analysed", None),
    ("all heads mixed", {}, "all-mixed", None),
    ("all heads generalization", {}, "all-generalization", None),
    *[(f"ablation {name}", {}, "analysed", name) for name in dear.ABLATIONS
      if name not in ("no-role-mask", "true-heads")],  # (the all-mixed row; the toy's alone)
    ("blind branch", {}, "blind", None),
    ("class-branch fallback", {}, "fallback", None),
    ("K = 0 text tokens", {"text_tokens": 0}, "analysed", None),
    ("K = 0, no attribute tokens", {"text_tokens": 0}, "analysed", "no-attribute-tokens"),
    *[(f"shared tokens, {name}", {"tokens": "shared", "text_tokens": None}, roles, ablation)
      for name, roles, ablation in [("analysed roles", "analysed", None),
                                    ("blind branch", "blind", None),
                                    ("class-branch fallback", "fallback", None),
                                    ("no attribute tokens", "analysed", "no-attribute-tokens")]],
]


@pytest.mark.parametrize("name, changed, roles, ablation", CONFIGURATIONS,
                         ids=[c[0] for c in CONFIGURATIONS])
def test_every_learnable_tensor_gets_a_gradient_or_ddp_is_told(tiny_clip, name, changed, roles,
                                                                ablation):
    """One training step's forward and backward (train.py's model and loss) per configuration:
    DDP is told (find_unused_parameters) exactly the learnable tensors without a gradient. One
    it was not told of would stop a torchrun run at its second step; one told of needlessly
    costs a graph walk per step (and a warning)."""
    settings = dict(beta=0.7, text_tokens=3, first_layer="auto", lambda_reg=1.0,
                    lambda_fusion=0.1, tokens="separate")
    settings.update(changed)
    inputs = types.SimpleNamespace(clip=tiny_clip, attributes=["colour", "shape"])
    config.resolve_text_tokens(settings, len(inputs.attributes))  # K as train.py resolves it
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # blind tokens, the fallback
        change = dear.ablate(ablation, role_map_of(roles), inputs.attributes, 0.1)
        model = train.build_dear(settings, inputs, change)
    ids = torch.randint(1, 590, (4, 16))
    ids[:, 6] = 599  # the end-of-text token, the largest id
    output = model(torch.randn(3, 3, 32, 32), model.prepare_classes(ids), with_frozen=True)
    # as train_job
    lambda_fusion = 0.0 if ablation == "no-fusion-reg" else settings["lambda_fusion"]
    losses = dear.dear_loss(output, torch.tensor([0, 3, 1]), settings["lambda_reg"], lambda_fusion,
                            branch_ce=ablation == "branch-ce")
    losses["total"].backward()
    without = {n for n, p in model.learnable_tensors().items() if p.grad is None}
    assert not without, f"{name}: without a gradient: {without}"  # DDP looks for none


# ------------------------------------------------------------------------------------------
# Rank 0's work alone outlasting the group's timeout; the analysis lock's bound
# ------------------------------------------------------------------------------------------

DRIVER = """
import datetime, sys, time
sys.path.insert(0, {repo!r})
import torch.distributed as dist
import train
from harness import analysis as harness_analysis

joined = dist.init_process_group
short = datetime.timedelta(seconds={timeout})
dist.init_process_group = lambda *args, **kwargs: joined(*args, **dict(kwargs, timeout=short))
analysis = harness_analysis.run_head_analysis

def slow(*args, **kwargs):
    time.sleep({sleep})  # rank 0 alone runs the analysis: longer than the group's timeout
    return analysis(*args, **kwargs)

harness_analysis.run_head_analysis = slow
sys.exit(train.main(sys.argv[1:]))
"""


def test_two_processes_outlast_the_group_timeout_while_rank_0_analyses(world, tmp_path):
    """torchrun, 2 processes, gloo: the process group's timeout forced to 4 s, rank 0's head
    analysis made to take 8 s; rank 1 waits on the CPU-side group and the run finishes. K = 0
    (empty text tokens), 3 steps per process (DDP checks at each step that the last one's
    gradients all arrived)."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO), timeout=4, sleep=8))
    out = tmp_path / "ddp"
    args = common(world, out, "--method", "dear", "--roles", "analyse", "--text-tokens", "0",
                  "--batch-size", "2", "--epochs", "1")
    done = torchrun(driver, *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "the other processes wait for it up to 2:00:00 (devices.MAIN_WORK_TIMEOUT)" in done.stdout
    assert "x 2 processes" in done.stdout and done.stdout.count("train.py: done") == 1
    assert "step 3/3 " in (out / "dtd/dear/seed1/log.txt").read_text()  # 12 images: 6 a process
    assert (out / "dtd/dear/seed1/results.json").is_file()


HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from harness import files
with files.lock(sys.argv[1], "unused"):
    print("held", flush=True)
    time.sleep(20)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="no file locks on this system")
def test_the_analysis_lock_is_waited_for_at_most_its_bound_then_one_line_names_the_holder(
        world, tmp_path, monkeypatch, capsys, registry_and_cache):
    monkeypatch.setattr(analysis, "ANALYSIS_LOCK_TIMEOUT", datetime.timedelta(seconds=1))
    monkeypatch.setattr(analysis, "analysis_fingerprint", lambda *args: "f" * 64)
    lock = registry_and_cache / "head-analysis" / ("f" * 16 + ".lock")
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=str(REPO)), str(lock)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = tmp_path / "run"
        code = train.main(common(world, out, "--method", "dear", "--roles", "analyse"))
        captured = capsys.readouterr()
        assert code == 2
        lines = captured.err.strip().splitlines()
        named = f"held by another process (pid {holder.pid}) for more than 0:00:01"
        assert len(lines) == 1 and named in lines[0]
        assert f"waiting for it (held by pid {holder.pid}, at most 0:00:01)" in captured.out
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------------------------------
# Augmentation whatever --workers; Dassl's drop_last
# ------------------------------------------------------------------------------------------


def loader_for(world, workers: int, batch_size: int = 4, images=None, world_size=1, rank=0,
               image_cache=False):
    """train.py's training loader over the dtd images (or `images` of them, repeated), augmented."""
    split = data.load_dataset("dtd", world["root"])
    if images is not None:
        split.train = (split.train * 10)[:images]
    settings = dict(augment=True, batch_size=batch_size, workers=workers, warmup_epochs=1,
                    warmup_lr=1e-5, lr=1e-3, epochs=3, image_cache=image_cache)
    job = plan.Job("dtd", "dear", "analyse", 1, 4, "unused")
    runtime = devices.Runtime(torch.device("cpu"), rank=rank, world=world_size,
                           loaders=dict(train=(workers, 2), eval=(workers, 2)))
    clip = types.SimpleNamespace(visual=types.SimpleNamespace(input_resolution=32))
    return train.training_loader(job, settings, split, clip, runtime), job, settings


def epoch_batches(loader, job, settings, epoch: int):
    """-> (the epoch's batches, the images' indices in their order)."""
    optimizer = types.SimpleNamespace(param_groups=[{}])
    train.start_epoch(epoch, job, settings, loader, optimizer)
    return list(loader), [index for _, index in loader.sampler]  # the sampler's (epoch, index)


@pytest.mark.parametrize("image_cache", [False, True])
def test_training_batches_are_bitwise_the_same_at_0_and_2_workers(world, image_cache):
    (serial, job, settings), (parallel, _, _) = (loader_for(world, 0, image_cache=image_cache),
                                                 loader_for(world, 2, image_cache=image_cache))
    by_index = []  # per epoch, {image index: its augmented tensor}
    for epoch in (0, 1):
        (one, order), (two, _) = (epoch_batches(loader, job, settings, epoch)
                                  for loader in (serial, parallel))
        for (images, labels), (images2, labels2) in zip(one, two):
            assert torch.equal(labels, labels2) and torch.equal(images, images2), f"epoch {epoch}"
        assert len(one) == len(two) == 7  # 30 images, batch 4: the short last batch dropped
        by_index.append(dict(zip(order, torch.cat([images for images, _ in one]))))
    # Still augmented: each image's crop differs from one epoch to the next.
    same = [i for i, image in by_index[0].items() if i in by_index[1]
            and torch.equal(image, by_index[1][i])]
    assert not same, f"images {same} got the same augmentation in two epochs"


def test_the_loaders_fit_the_cores_and_a_small_dev_shm_without_dying(world, monkeypatch):
    """One process per core but one on a GPU (none on the CPU), and the batches in flight held to
    half of /dev/shm's free space, a lone batch to all of it: with the common 64 MB /dev/shm,
    ViT-B/16's training batch of 32 (18 MB) and evaluation batch of 64 (37 MB) keep one worker
    with one batch each, said in a line; a typed --workers too."""
    gpu = devices.Runtime(torch.device("cuda", 0))
    said = []
    monkeypatch.setattr(devices.Runtime, "log", lambda self, line: said.append(line))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(devices, "usable_cpus", lambda: 16)
    monkeypatch.setattr(devices, "shared_memory_free", lambda: 64 * 2**20)
    settings = dict(workers=None, batch_size=32, eval_batch_size=64)
    assert devices.loader_plan(settings, gpu, 224) == dict(train=(1, 1), eval=(1, 1))
    assert said == ["loader: train 1 workers x 1 batch of 18 MB, eval 1 workers x 1 batch of "
                    "37 MB in flight, fewer than asked: /dev/shm has 64 MB free, and they may "
                    "fill half of it (a lone batch: all of it)"]
    monkeypatch.setattr(devices, "shared_memory_free", lambda: 64 * 2**30)  # room for everything
    said.clear()
    assert devices.loader_plan(settings, gpu, 224) == dict(train=(15, 2), eval=(15, 2))
    assert devices.loader_plan(dict(settings, workers=3), gpu, 224)["train"] == (3, 2) and not said
    cpu = devices.Runtime(torch.device("cpu"))
    assert devices.loader_plan(settings, cpu, 224) == dict(train=(0, 2), eval=(0, 2))
    batch = 4 * 3 * 32 * 32 * 4  # bytes: 4 images of 32 x 32
    monkeypatch.setattr(devices, "shared_memory_free", lambda: 2 * 3 * batch)  # room for 2 x 1
    assert devices.loader_plan(dict(settings, workers=2, batch_size=4), cpu, 32)["train"] == (2, 1)


def test_the_loader_plan_is_per_node_eight_processes_share_its_cores_and_dev_shm(monkeypatch):
    """torchrun's 8 processes on a node of 96 cores and 2 GB of /dev/shm: each plans for its
    eighth, so that together they start no more workers than the cores and fill at most half of
    /dev/shm (each alone used to plan 16 workers x 2 batches: 128 workers, 4.7 GB); with 64 MB,
    a batch fits no process's 8 MB: the main processes load, and the line says why."""
    gpu, said = devices.Runtime(torch.device("cuda", 0)), []
    monkeypatch.setattr(devices.Runtime, "log", lambda self, line: said.append(line))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(devices, "usable_cpus", lambda: 96)
    monkeypatch.setattr(devices, "shared_memory_free", lambda: 2 * 2**30)
    settings = dict(workers=None, batch_size=32, eval_batch_size=64)
    plan = devices.loader_plan(settings, gpu, 224)
    for name, batch in (("train", 32), ("eval", 64)):
        workers, in_flight = plan[name]
        assert 1 <= workers and 8 * (workers + 1) <= 96, plan  # a core each, main processes too
        assert 8 * workers * in_flight * batch * 3 * 224 * 224 * 4 <= 2**30, plan
    assert plan == dict(train=(6, 1), eval=(3, 1))
    assert said[-1].endswith("/dev/shm has 2048 MB free, 256 MB for each of this node's 8 "
                             "processes, and they may fill half of it (a lone batch: all of it)")
    monkeypatch.setattr(devices, "shared_memory_free", lambda: 64 * 2**20)
    assert devices.loader_plan(settings, gpu, 224) == dict(train=(0, 1), eval=(0, 1))
    assert said[-1] == ("loader: train 0 workers x 1 batch of 18 MB (one batch is more than all "
                        "of it: the main process loads), eval 0 workers x 1 batch of 37 MB (one "
                        "batch is more than all of it: the main process loads) in flight, fewer "
                        "than asked: /dev/shm has 64 MB free, 8 MB for each of this node's 8 "
                        "processes, and they may fill half of it (a lone batch: all of it)")


FORKSERVER_LOADER = """
import multiprocessing, os, resource, sys, types
sys.path.insert(0, {repo!r})
import torch
from PIL import Image
import data, train
from harness import devices, plan

if __name__ == "__main__":  # forkserver's workers import this file again
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, limit))
    multiprocessing.set_start_method("forkserver")  # Python 3.14's default on Linux
    multiprocessing.set_forkserver_preload(["train"])  # each worker starts with torch imported
    devices.LOADER_START = "forkserver"  # then the dataset is pickled to each worker
    items = []
    for index in range({images}):
        path = os.path.join({folder!r}, f"{{index}}.png")
        Image.new("RGB", (6, 6), (index % 256, 7, 9)).save(path)
        items.append(data.Item(path, index % 3, "class"))
    split = types.SimpleNamespace(train=items)
    settings = dict(augment=True, batch_size=500, image_cache=True)
    runtime = devices.Runtime(torch.device("cpu"), loaders=dict(train=(2, 1), eval=(0, 2)))
    clip = types.SimpleNamespace(visual=types.SimpleNamespace(input_resolution=8))
    job = plan.Job("dtd", "dear", "analyse", 1, 4, "")
    loader = train.training_loader(job, settings, split, clip, runtime)
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        print(epoch, sum(len(labels) for _, labels in loader), flush=True)
"""


def test_decoded_images_reach_forkserver_workers_under_an_open_file_limit_of_1024(tmp_path):
    """3,000 decoded images, the training loader's 2 workers started by forkserver (which pickles
    the dataset to each, in shared memory), `ulimit -n 1024`: two epochs load every image. One
    buffer is one shared-memory file, where one tensor per image was 3,000 ("Too many open
    files")."""
    script = tmp_path / "loader.py"
    script.write_text(FORKSERVER_LOADER.format(repo=str(REPO), images=3000, folder=str(tmp_path)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["0 3000", "1 3000"]


def test_evaluation_loaders_pin_memory_on_cuda_and_every_loader_keeps_its_workers():
    """pin_memory follows the device, evaluation's loaders too (they were never pinned); workers
    start as devices.LOADER_START says and live across epochs."""
    for device, pinned in ((torch.device("cuda", 0), True), (torch.device("cpu"), False)):
        runtime = devices.Runtime(device, loaders=dict(train=(2, 1), eval=(2, 1)))
        loader = devices.loader_of([], dict(eval_batch_size=4), 32, runtime)
        assert loader.pin_memory == pinned and loader.persistent_workers
        assert loader.multiprocessing_context.get_start_method() == devices.LOADER_START


def test_each_image_draws_its_own_augmentation_from_seed_epoch_and_index(world):
    """One file at two indices: two crops; the same index again: the same crop; another epoch or
    seed: another crop; torch's global generator left as it was."""
    item = data.load_dataset("dtd", world["root"]).train[0]
    dataset = data.ImageDataset([item, item], data.train_transform(32), seed=1)
    before = torch.get_rng_state()
    first, again, other = dataset[0][0], dataset[0][0], dataset[1][0]
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(dataset[(0, 0)][0], first)  # (epoch, index), as EpochSampler asks
    assert not torch.equal(dataset[(1, 0)][0], first)
    dataset.seed = 2
    assert not torch.equal(dataset[0][0], first)


def test_a_short_training_ends_with_the_same_tensors_at_0_and_2_workers(world, tmp_path):
    tensors = []
    for workers in ("0", "2"):
        out = tmp_path / f"workers{workers}"
        assert train.main(common(world, out, "--method", "dear", "--roles", "all-mixed",
                                 "--augment", "on", "--workers", workers)) == 0
        tensors.append(learnable(out / "dtd" / "dear-all-mixed" / "seed1")["learnable"])
    for name, tensor in tensors[0].items():
        assert torch.equal(tensor, tensors[1][name]), name


@pytest.mark.parametrize("images, batch, world_size, batches", [
    (10, 4, 1, [4, 4]),  # the short last batch dropped
    (8, 4, 1, [4, 4]),
    (3, 4, 1, [3]),  # the only batch: kept
    (10, 4, 2, [4]),  # 5 images per process
    (6, 4, 2, [3]),  # 3 per process: kept, no process without a step
])
def test_training_drops_a_short_last_batch_unless_it_is_a_processs_only_one(world, images, batch,
                                                                              world_size, batches):
    for rank in range(world_size):
        loader, _, _ = loader_for(world, 0, batch, images, world_size, rank)
        assert [len(b) for b in loader.batch_sampler] == batches


def test_one_process_reads_distributed_samplers_order_and_torchrun_processes_shards_of_their_own():
    """One process: DistributedSampler's order, exactly (what the golden record and --resume
    stand on). 3 processes, 10 images: shards of 4 (2 topped up), the same every epoch, together
    every image; each epoch a new order of each shard."""
    from harness import imagecache
    from torch.utils.data import DistributedSampler

    ours, theirs = imagecache.EpochSampler(10, seed=3), DistributedSampler(range(10), 1, 0, seed=3)
    for epoch in (0, 1):
        ours.set_epoch(epoch), theirs.set_epoch(epoch)
        assert [index for _, index in ours] == list(theirs)
    shards = [imagecache.EpochSampler(10, 3, rank, seed=3) for rank in range(3)]
    assert [len(shard) for shard in shards] == [4, 4, 4]
    assert set().union(*(shard.shard for shard in shards)) == set(range(10))
    for sampler in shards:
        orders = []
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            orders.append([index for e, index in sampler if e == epoch])
        assert sorted(orders[0]) == sorted(orders[1]) == sorted(sampler.shard)
        assert orders[0] != orders[1]


def test_under_torchrun_each_process_decodes_only_the_images_it_reads(world):
    """2 processes, 12 images: each decodes its 6 (half the one-process buffer), and an image it
    holds is augmented as in one process (the seed is the image's number in the split); an image
    it does not hold is an error, not an empty tensor."""
    one = loader_for(world, 0, images=12, image_cache=True)[0].dataset
    for rank in (0, 1):
        loader = loader_for(world, 0, images=12, world_size=2, rank=rank, image_cache=True)[0]
        dataset, shard = loader.dataset, loader.sampler.shard
        assert dataset.buffer.numel() * 2 == one.buffer.numel()
        for index in range(12):
            if index in shard:
                assert torch.equal(dataset[(1, index)][0], one[(1, index)][0])
            else:
                with pytest.raises(IndexError, match=f"image {index} was not decoded"):
                    dataset[(1, index)]
