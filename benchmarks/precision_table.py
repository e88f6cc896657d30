"""What the autocast precision does to the toy world's answers: the measurement behind train.py's
default precision (docs/USAGE.md, "Precision").

    python benchmarks/precision_table.py                 # CPU, simulating a GPU (~6 minutes)
    python benchmarks/precision_table.py --device cuda   # the GPU's own arithmetic (device_check)
    python benchmarks/precision_table.py --toy-scale miniature --epochs 1   # seconds

On the full toy world (the shipped toy CLIP, its 24-class task), for fp32, fp16 and bf16
autocast:
  * DeAR trained in that precision (the quick start's DeAR row: the analysed roles, 20 epochs
    of 16 shots, seed 1), fp16 with its loss scaler: HM under each fusion rule;
  * the fp32-trained DeAR and zero-shot CLIP evaluated in that precision against fp32: how many
    predictions change per test set (360 images each) and the largest move of a logit, at the
    toy's logit scale (25.5) and at CLIP's (100: the same features, scored as ViT-B/16 scores).
On the CPU the precisions are simulated: CPU autocast with clip_model's fp32 LayerNorm and
softmax, the dtype flow of CUDA's autocast (tests/test_clip_model.py checks it).
"""

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import warnings

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import clip_model  # noqa: E402
import data  # noqa: E402
from harness import devices  # noqa: E402
import train  # noqa: E402

PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
CLIP_SCALE = 100.0  # ViT-B/16's logit scale


@contextlib.contextmanager
def forced_precision(dtype, why: str = None):
    """train.py's precision, in this process, `dtype` whatever the device would choose (the CPU
    chooses fp32; autocast then runs on the CPU), said as `why` (default: "<name> (forced)")."""
    chosen = devices.choose_precision
    said = why or f"{devices.precision_name(dtype)} (forced)"
    devices.choose_precision = lambda *args: (dtype, said)
    try:
        yield
    finally:
        devices.choose_precision = chosen


def trained(folder: str, device: torch.device, dtype, epochs: int, scale: str) -> dict:
    """The quick start's DeAR row, seed 1, trained in `dtype` -> its results.json."""
    argv = ["--dataset", "toyworld", "--toy-scale", scale, "--method", "dear", "--roles", "analyse",
            "--seeds", "1", "--epochs", str(epochs), "--device", str(device), "--output", folder]
    with forced_precision(dtype), contextlib.redirect_stdout(io.StringIO()):
        assert train.main(argv) == 0, f"train.py failed in {devices.precision_name(dtype)}"
    with open(os.path.join(folder, "toyworld", "dear", "seed1", "results.json"),
              encoding="utf-8") as f:
        return json.load(f)


def scores(folder: str, device: torch.device, dtype, scale: float, assets) -> dict:
    """The trained run of `folder` and zero-shot CLIP on both test sets, encoders in `dtype`,
    logit scale `scale` -> {(set, kind): (n, C) logits}."""
    import dear

    clip, _ = clip_model.load(assets.weights, device=device, head_width=assets.head_width)
    clip = clip.eval().requires_grad_(False)
    tokenizer = clip_model.SimpleTokenizer(assets.bpe)
    run = os.path.join(folder, "toyworld", "dear", "seed1")
    roles = dear.RoleMap.load(os.path.join(folder, "toyworld", "roles", "roles.json"))
    with warnings.catch_warnings():  # a map without attribute heads: the trained run said so
        warnings.simplefilter("ignore", dear.LeftOutWarning)
        model = dear.DeAR(clip, roles, beta=0.5, first_layer=1).to(device).eval()
    state = torch.load(os.path.join(run, "checkpoint.pt"), map_location="cpu", weights_only=True)
    model.load_learnable_state_dict(state["learnable"])
    with torch.no_grad():
        clip.logit_scale.fill_(math.log(scale))
    found = {}
    for column, subsample in (("base", "base"), ("novel", "new")):
        split = data.load_dataset("toyworld", assets.data_root, subsample=subsample)
        loader = torch.utils.data.DataLoader(data.ImageDataset(
            split.test, data.test_transform(clip.visual.input_resolution)), batch_size=120)
        ids = tokenizer.tokenize(split.prompts, clip.context_length, truncate=True).to(device)
        autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                    else contextlib.nullcontext())
        parts = {"zero-shot": [], "DeAR fused": [], "DeAR class": []}
        with torch.no_grad(), autocast:
            plain_text = clip.encode_text(ids)
            text = model.encode_text(model.prepare_classes(ids))
            for images, _ in loader:
                images = images.to(device)
                parts["zero-shot"].append(train.zero_shot_logits(clip, clip.encode_image(images),
                                                                 plain_text))
                f_cls, f_attr, _ = model.encode_image(images)
                fused, branches = model.fused_logits(torch.cat([f_cls[:, None], f_attr], 1), text)
                parts["DeAR fused"].append(fused)
                parts["DeAR class"].append(branches[:, 0])
        for kind, logits in parts.items():
            found[column, kind] = torch.cat(logits).float().cpu()
    return found


def measure(device: torch.device, epochs: int = 20, toy: str = "full", log=print) -> list:
    """-> one row per precision: {precision, hm_fused, hm_class, changed: {set kind: n},
    max_logit_change at the toy's and CLIP's scale}, on the `toy` world (full or miniature)."""
    import toyworld

    assets = toyworld.prepare(toy, log=lambda line: None)
    toy_scale = float(clip_model.load(assets.weights)[0].logit_scale.detach().exp())  # about 25.5
    rows = []
    with tempfile.TemporaryDirectory(prefix="precision_table-") as scratch:
        fp32_folder = os.path.join(scratch, "fp32")  # the run every precision evaluates
        for name, dtype in PRECISIONS.items():
            folder = os.path.join(scratch, name)
            result = trained(folder, device, dtype, epochs, toy)
            fused, by = result["metrics_by_fusion"], "class-on-unseen"
            row = dict(precision=name, hm_fused=fused["fused-everywhere"]["hm"],
                       hm_class=fused[by]["hm"])
            if dtype is None:
                reference = {scale: scores(folder, device, None, scale, assets)
                             for scale in (toy_scale, CLIP_SCALE)}
            moved = reference if dtype is None else {  # fp32's own scores are the reference
                scale: scores(fp32_folder, device, dtype, scale, assets)
                for scale in (toy_scale, CLIP_SCALE)}
            row["changed"] = {f"{kind} {column}": int((moved[toy_scale][column, kind].argmax(-1)
                                                        != reference[toy_scale][column, kind]
                                                        .argmax(-1)).sum())
                              for column, kind in reference[toy_scale]}
            for scale, key in ((toy_scale, "max_logit_change"), (CLIP_SCALE, "max_logit_change_100")):
                row[key] = max(float((moved[scale][k] - reference[scale][k]).abs().max())
                               for k in reference[scale])
            row["toy_scale"] = toy_scale
            log(f"  {name}: HM {row['hm_fused']:.2f} fused / {row['hm_class']:.2f} class-on-unseen; "
                f"changed {row['changed']}; max logit change {row['max_logit_change']:.3f} "
                f"(scale {toy_scale:.1f}), {row['max_logit_change_100']:.3f} (scale 100)")
            rows.append(row)
    return rows


def markdown(rows: list) -> str:
    lines = ["| precision | HM, fused on every test set | HM, class branch on unseen | predictions "
             "changed vs fp32 (per test set) | largest logit change, toy's scale / CLIP's 100 |",
             "|---|---:|---:|---|---:|"]
    for row in rows:
        changed = ", ".join(f"{k} {v}" for k, v in row["changed"].items())
        lines.append(f"| {row['precision']} | {row['hm_fused']:.2f} | {row['hm_class']:.2f} | "
                     f"{changed} | {row['max_logit_change']:.3f} / {row['max_logit_change_100']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (a simulation) or cuda")
    parser.add_argument("--epochs", type=int, default=20, help="training epochs (the toy's 20)")
    parser.add_argument("--toy-scale", default="full", choices=("full", "miniature"),
                        help="the toy world (miniature: seconds, near chance)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the toy world's one thread
    rows = measure(torch.device(args.device), args.epochs, args.toy_scale)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
