"""
train.py -- the command line: DeAR (or zero-shot CLIP) on the paper's four protocols.

How the files fit: clip_model.py is CLIP (weights, tokenizer), data.py reads the datasets in
CoOp's layout, dear.py is the method (head roles, attribute tokens, role masks, losses).
This file ties them together and reads top to bottom like nanoGPT's train.py:

    1. settings ...... argparse flags (grouped, each with help) + one table of defaults per
                       dataset (DESIGN.md Sec. 5-7); the resolved settings go into every run
    2. device ........ --device auto: cuda, then mps, then cpu; torchrun -> DDP
    3. data .......... the train/test lists of each protocol (DESIGN.md Sec. 6)
    4. model ......... CLIP + head roles (analysed now, a file, or an ablation) -> DeAR
    5. optimizer ..... AdamW, one constant warm-up epoch, then cosine (per epoch, as Dassl)
    6. evaluation .... accuracy with the fused logits and with the class branch alone, in one
                       pass; task-adaptive fusion picks per test set (zero-shot: CLIP alone)
    7. loop .......... the runs of a protocol, checkpoints, progress lines
    8. tables ........ results.json + markdown tables in the paper's shape

Protocols (--protocol):
    base2novel  train on the base half of the classes, test base and novel; Base, Novel, HM
    fewshot     1/2/4/8/16 shots of every class, test every class
    cross       train on ImageNet (--source), test the ten other datasets
    dg          train on ImageNet (--source), test ImageNet-V2, -Sketch, -A and -R

Run it:
    python train.py --dataset toyworld                       # the toy world: no downloads, CPU, minutes
    python train.py --dataset oxford_pets --root $DATA       # base-to-novel, seeds 1 2 3, ViT-B/16
    python train.py --dataset all --root $DATA --protocol fewshot --seeds 1
    python train.py --output runs/base2novel-oxford_pets --resume       # continue a stopped run
    python train.py --output runs/base2novel-oxford_pets --eval-only    # evaluate it again
    torchrun --nproc_per_node=4 train.py --dataset imagenet --root $DATA --protocol dg

A run folder holds, per dataset / method / seed: settings.json, checkpoint.pt (only the
learnable tensors, the optimizer state and the settings, written atomically at each epoch
end), results.json and results.md; per dataset and run the head roles
(<dataset>/roles/<run>/roles.json, roles.txt, roles.png, masks.png); at the top summary.json
and summary.md. A run is complete when its results.json exists; summary.md is written when
every run is. The call that writes a folder holds <output>/.lock; a --roles file is copied to
roles_file.json, and settings.json records the SHA-256 of the weights, BPE and roles files.

Layer numbers: the paper counts from 1 ("J = 9"); so do --first-layer and every printed line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

try:
    import fcntl  # POSIX: the run folder's lock (one writer per folder)
except ImportError:  # Windows: no lock; do not start two calls on one folder there
    fcntl = None

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

import clip_model
import data
import dear

# ------------------------------------------------------------------------------------------
# 1. Settings
# ------------------------------------------------------------------------------------------
# Training defaults per dataset, in one table (DESIGN.md Sec. 7: MMRL's recipe, the closest
# public relative of DeAR). "J" is the paper's 1-based first layer with attribute tokens;
# "auto" means the first of the last four layers (9 for ViT-B/16's 12). "K" is the number of
# text tokens. Every value can be overridden by its flag; the values used are saved per run.


@dataclass(frozen=True)
class Recipe:
    epochs: int
    batch_size: int
    lr: float
    shots: int
    lambda_reg: float
    lambda_fusion: float
    beta: float
    first_layer: str  # "auto" or a 1-based layer number
    text_tokens: int
    augment: bool  # random resized crop + flip (CoOp's); off where position is a class cue


# fmt: off
RECIPES: Dict[str, Recipe] = {
    #                         epochs batch  lr     shots  lambda_reg lambda_fusion beta  J       K  augment
    "imagenet":        Recipe(5,     32,    1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "caltech101":      Recipe(10,    4,     1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "oxford_pets":     Recipe(10,    4,     1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "stanford_cars":   Recipe(10,    4,     1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "oxford_flowers":  Recipe(10,    4,     1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "food101":         Recipe(10,    4,     1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "fgvc_aircraft":   Recipe(10,    4,     1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "sun397":          Recipe(10,    4,     1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "dtd":             Recipe(10,    4,     1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "eurosat":         Recipe(10,    4,     1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "ucf101":          Recipe(10,    4,     1e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, True),
    "toyworld":        Recipe(20,    8,     5e-3,  16,    1.0,       0.1,          0.5,  "auto", 4, False),
}
# fmt: on
WARMUP_EPOCHS, WARMUP_LR, WEIGHT_DECAY = 1, 1e-5, 5e-4  # Dassl's constant warm-up; its decay

PROTOCOLS = ("base2novel", "fewshot", "cross", "dg")
# Which logits a test set is scored with (DeAR's task-adaptive fusion, as MMRL evaluates):
#   adaptive    the fused logits where the test classes are the trained classes in the trained
#               domain (base2novel's base set, fewshot, the source set of cross and dg); the
#               class branch alone everywhere else, whose classes the attribute branches never saw
#   everywhere  the fused logits on every test set (the ablation)
FUSION_MODES = ("adaptive", "everywhere")
METHODS = ("zeroshot", "linear-probe", "dear")
ROLE_ABLATIONS = ("all-mixed", "all-generalization")  # besides "analyse" and a roles file
BASE2NOVEL_DATASETS = [name for name in RECIPES if name != "toyworld"]  # the paper's 11
DG_TARGETS = ["imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r"]
FEWSHOT_SHOTS = [1, 2, 4, 8, 16]

# Flags that say how to run, not what to compute: they may change on --resume / --eval-only.
RUN_CONTROL = {"output", "resume", "eval_only", "device", "workers", "log_every", "eval_batch_size",
               "max_epochs_per_call", "amp", "root", "weights", "bpe"}  # (and the files' places)


class TrainError(Exception):
    """Bad input to the command line: one line naming the flag or file and what to do."""


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage before an error; a user wants the one line that says
    what is wrong (and `--help` for the rest). Exit status 2, as argparse's own."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    # Every default is None so that the per-dataset table (or a resumed run's saved
    # settings) can fill in what the user did not type.
    p = OneLineParser(prog="train.py", description="DeAR on CLIP: train and evaluate on the paper's protocols. "
                      "Unset DeAR and optimisation flags come from the per-dataset table (RECIPES in train.py).")

    g = p.add_argument_group("what to run")
    g.add_argument("--dataset", nargs="+", help="dataset name(s) from data.py, 'all' for the protocol's "
                   "datasets, or 'toyworld' (the project's own world: no downloads)")
    g.add_argument("--protocol", choices=PROTOCOLS, help="base2novel | fewshot | cross | dg (default base2novel)")
    g.add_argument("--method", nargs="+", choices=METHODS, help="rows of the table: zeroshot = CLIP with the "
                   "dataset's template, no training; linear-probe = logistic regression on the frozen image "
                   "features (training classes only); dear = DeAR (default: zeroshot dear; toyworld: all three)")
    g.add_argument("--roles", nargs="+", help="head roles for DeAR: 'analyse' (concept entropy on the training "
                   "images, saved in the run folder), a roles JSON file, 'all-mixed' (no mask: plain deep "
                   "prompting) or 'all-generalization'; several give one table row each (default analyse; toyworld: "
                   "all-mixed all-generalization analyse)")
    g.add_argument("--fusion", nargs="+", choices=FUSION_MODES, help="logits DeAR is scored with: adaptive = "
                   "fused on the trained classes (base, fewshot, the source dataset), the class branch alone "
                   "elsewhere; everywhere = fused on every test set. Several give the DeAR row once each, "
                   "from the same trained model (the role ablations use the first) (default adaptive; toyworld: both)")
    g.add_argument("--seeds", nargs="+", type=int, help="seeds; tables report the mean (default 1 2 3)")
    g.add_argument("--shots", nargs="+", type=int, help="shots per class (fewshot default: 1 2 4 8 16; "
                   "others: the dataset's table value, 16)")
    g.add_argument("--source", help="training dataset of cross and dg (default imagenet)")

    g = p.add_argument_group("where things are")
    g.add_argument("--root", help="the $DATA folder in CoOp's layout (toyworld: made in the cache)")
    g.add_argument("--weights", help="CLIP: ViT-B/32, ViT-B/16, ViT-L/14 or a checkpoint path (default ViT-B/16)")
    g.add_argument("--head-width", type=int, help="channels per attention head when loading --weights "
                   "(default: what the file says -- files written by clip_model.save carry it -- else "
                   "64, as in every OpenAI model)")
    g.add_argument("--bpe", help="CLIP's BPE merges file (default: $CLIP_BPE_PATH, the cache, or a download)")
    g.add_argument("--output", help="run folder (default runs/<protocol>-<datasets>)")

    g = p.add_argument_group("DeAR (defaults from the per-dataset table in train.py)")
    g.add_argument("--first-layer", type=int, help="J, the first vision and text layer with learnable "
                   "tokens, 1-based as in the paper (default: the first of the last four layers)")
    g.add_argument("--beta", type=float, help="weight of each layer's fresh tokens against the previous "
                   "layer's output tokens, in [0, 1]")
    g.add_argument("--text-tokens", type=int, help="K, learnable tokens inserted in the text tower")
    g.add_argument("--lambda-reg", type=float, help="weight of the self-regularisation loss")
    g.add_argument("--lambda-fusion", type=float, help="weight of the fusion-weight regularisation loss")
    g.add_argument("--analysis-images", type=int, help="at most this many of the run's training images for "
                   "the head analysis, spread evenly over its classes, drawn with the run's seed (default 2000)")
    g.add_argument("--descriptions", type=int, help="TextSpan descriptions per head (default 20)")
    g.add_argument("--low-bits", type=float, help="attribute heads have concept entropy at most this "
                   "(default: the lower third of the observed entropies)")
    g.add_argument("--high-bits", type=float, help="generalization heads have concept entropy at least "
                   "this (default: the upper third)")

    g = p.add_argument_group("optimisation (defaults from the per-dataset table in train.py)")
    g.add_argument("--epochs", type=int, help="training epochs, the warm-up epoch included")
    g.add_argument("--batch-size", type=int, help="images per step (per process under torchrun)")
    g.add_argument("--lr", type=float, help="AdamW learning rate after the warm-up epoch (cosine decay)")
    g.add_argument("--augment", choices=("on", "off"), help="random resized crop + flip for training")

    g = p.add_argument_group("running")
    g.add_argument("--device", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps (default auto)")
    g.add_argument("--amp", choices=("on", "off"), help="mixed precision by autocast, CUDA only (default on)")
    g.add_argument("--workers", type=int, help="data-loading processes (default: 4 on CUDA, 0 on CPU)")
    g.add_argument("--eval-batch-size", type=int, help="images per evaluation batch (default 64)")
    g.add_argument("--log-every", type=int, help="a progress line every N steps (default 20)")
    g.add_argument("--resume", action="store_true", help="continue the runs in --output from their last checkpoint")
    g.add_argument("--eval-only", action="store_true", help="evaluate the finished runs in --output again")
    g.add_argument("--max-epochs-per-call", type=int, help="stop after this many epochs in this call "
                   "(for time-limited jobs); --resume continues")

    g = p.add_argument_group("toy world")
    g.add_argument("--toy-scale", choices=("full", "miniature"), help="size of the toy world (default full; "
                   "miniature is the seconds-long version the tests run)")
    return p


def _given(args: argparse.Namespace) -> Dict[str, object]:
    """The flags typed on the command line (0 and "" included: a typed 0 is a value)."""
    return {key: value for key, value in vars(args).items() if value is not None and value is not False}


def _default(value, default):
    """The flag's value if it was given, else the default. Never `value or default`, which
    would turn a typed 0 into the default (--epochs 0 training 10 epochs)."""
    return default if value is None else value


def _dataset_names(typed: List[str], protocol: str, source: Optional[str]) -> List[str]:
    names = [n.strip().lower().replace("-", "_") for n in typed]
    if names == ["all"]:
        names = {"base2novel": BASE2NOVEL_DATASETS, "fewshot": BASE2NOVEL_DATASETS,
                 "cross": [n for n in BASE2NOVEL_DATASETS if n != (source or "imagenet")],
                 "dg": DG_TARGETS}[protocol]
    return list(names)


def _role_choices(typed: List[str]) -> List[str]:
    return list(dict.fromkeys("analyse" if r == "analyze" else r for r in typed))


def resolve_settings(args: argparse.Namespace) -> Dict[str, object]:
    """Flags + the per-dataset table -> every setting of the call, explicit, as saved."""
    if not args.dataset:
        raise TrainError("--dataset is required (e.g. --dataset toyworld, --dataset oxford_pets --root $DATA, "
                         "--dataset all)")
    protocol = _default(args.protocol, "base2novel")
    names = _dataset_names(args.dataset, protocol, args.source)
    toy = names == ["toyworld"]
    if "toyworld" in names and not toy:
        raise TrainError("--dataset toyworld runs on its own; give it alone")
    for flag in ("weights", "bpe", "head_width"):
        if toy and getattr(args, flag) is not None:  # it would be replaced by the toy world's own
            raise TrainError(f"--{flag.replace('_', '-')}: the toy world brings its own model, BPE file and "
                             f"head width (made in the cache); drop --{flag.replace('_', '-')}")
    for name in names:
        if name != "toyworld":
            data.get_spec(name)  # unknown names stop here, with the list of known ones
    source = None
    if protocol in ("cross", "dg"):
        source = (args.source or "imagenet").lower().replace("-", "_")
        data.get_spec(source)
        if data.get_spec(source).evaluation_only:
            raise TrainError(f"--source {source}: a test set only; train on a dataset with training images")
    elif args.source:
        raise TrainError(f"--source is for --protocol cross or dg, not {protocol}")
    if protocol == "dg":
        for name in names:
            if not data.get_spec(name).evaluation_only:
                raise TrainError(f"--protocol dg tests on {', '.join(DG_TARGETS)}; {name} is not one of them "
                                 "(use --protocol cross)")
    if protocol in ("base2novel", "fewshot"):
        for name in names:
            if name != "toyworld" and data.get_spec(name).evaluation_only:
                raise TrainError(f"--dataset {name} is a test set only; use it with --protocol dg")

    trained = source or names[0]
    recipe = RECIPES.get(trained, RECIPES["caltech101"])
    methods = list(dict.fromkeys(args.method or (METHODS if toy else ("zeroshot", "dear"))))
    # The toy world's table: zero-shot, the linear probe, the two role ablations, DeAR (both
    # fusions, below).
    toy_roles = ["all-mixed", "all-generalization", "analyse"]
    roles = _role_choices(args.roles or (toy_roles if toy else ["analyse"]))
    fusion = list(dict.fromkeys(args.fusion or (FUSION_MODES if toy else ["adaptive"])))
    for choice in roles:
        if choice not in ("analyse", *ROLE_ABLATIONS) and not os.path.isfile(choice):
            raise TrainError(f"--roles {choice}: no such file; give a roles JSON written by the head analysis, "
                             f"'analyse', {' or '.join(repr(r) for r in ROLE_ABLATIONS)}")
    if sum(choice not in ROLE_ABLATIONS for choice in roles) > 1:
        raise TrainError(f"--roles {' '.join(roles)}: give at most one of 'analyse' or a roles file (both make the "
                         "DeAR row); add the ablations all-mixed / all-generalization beside it")
    shots = list(dict.fromkeys(args.shots or (FEWSHOT_SHOTS if protocol == "fewshot" else [recipe.shots])))
    if protocol != "fewshot" and len(shots) > 1:
        raise TrainError(f"--shots takes several values only with --protocol fewshot")
    settings = dict(
        dataset=names, protocol=protocol, source=source, method=methods, roles=roles, fusion=fusion,
        seeds=list(dict.fromkeys(args.seeds or [1, 2, 3])), shots=list(shots),
        root=args.root, weights=_default(args.weights, None if toy else "ViT-B/16"),  # toy: its own
        head_width=args.head_width,  # None: from the file (clip_model.save records it)
        bpe=args.bpe, output=_default(args.output, os.path.join("runs", f"{protocol}-{'-'.join(args.dataset)}")),
        first_layer=args.first_layer if args.first_layer is not None else recipe.first_layer,
        beta=args.beta if args.beta is not None else recipe.beta,
        text_tokens=args.text_tokens if args.text_tokens is not None else recipe.text_tokens,
        lambda_reg=args.lambda_reg if args.lambda_reg is not None else recipe.lambda_reg,
        lambda_fusion=args.lambda_fusion if args.lambda_fusion is not None else recipe.lambda_fusion,
        analysis_images=_default(args.analysis_images, 2000), descriptions=_default(args.descriptions, 20),
        low_bits=args.low_bits, high_bits=args.high_bits,
        epochs=_default(args.epochs, recipe.epochs), batch_size=_default(args.batch_size, recipe.batch_size),
        lr=_default(args.lr, recipe.lr), warmup_epochs=WARMUP_EPOCHS, warmup_lr=WARMUP_LR, weight_decay=WEIGHT_DECAY,
        augment=(args.augment == "on") if args.augment else recipe.augment,
        device=_default(args.device, "auto"), amp=_default(args.amp, "on"), workers=args.workers,
        eval_batch_size=_default(args.eval_batch_size, 64), log_every=_default(args.log_every, 20),
        max_epochs_per_call=args.max_epochs_per_call, toy_scale=_default(args.toy_scale, "full"),
        fingerprints=None,  # SHA-256 of the weights, BPE and roles files: filled in once they are read
    )
    return settings


MAX_SEED = 2**32 - 1  # numpy's range; torch's per-epoch seeds are derived from it (seed * 100003 + epoch)


def validate_settings(settings: dict) -> None:
    """Every number in range and finite, before anything is read or written (fresh runs and
    resumed ones alike: a resumed call may change the run-control flags). One line per error."""

    def refuse(key: str, expected: str):
        value = settings[key]
        shown = " ".join(map(str, value)) if isinstance(value, list) else value
        raise TrainError(f"--{key.replace('_', '-')} {shown}: expected {expected}")

    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def is_number(value) -> bool:  # finite: an inf lr trains on NaN, a NaN is not even valid JSON
        return (is_int(value) or isinstance(value, float)) and math.isfinite(value)

    for key, least in (("epochs", 1), ("batch_size", 1), ("eval_batch_size", 1), ("log_every", 1),
                       ("analysis_images", 1), ("descriptions", 1), ("text_tokens", 0)):
        if not (is_int(settings[key]) and settings[key] >= least):
            refuse(key, "a positive integer" if least else "an integer >= 0")
    for key, least in (("head_width", 1), ("workers", 0), ("max_epochs_per_call", 1)):
        if settings[key] is not None and not (is_int(settings[key]) and settings[key] >= least):
            refuse(key, "a positive integer" if least else "an integer >= 0")
    if settings["first_layer"] != "auto" and not (is_int(settings["first_layer"]) and settings["first_layer"] >= 1):
        refuse("first_layer", "a layer number >= 1 (1-based, as in the paper)")
    if not settings["seeds"] or not all(is_int(s) and 0 <= s <= MAX_SEED for s in settings["seeds"]):
        refuse("seeds", f"integers from 0 to {MAX_SEED}")
    if not settings["shots"] or not all(is_int(k) and k >= 1 for k in settings["shots"]):
        refuse("shots", "positive integers")
    if not (is_number(settings["beta"]) and 0.0 <= settings["beta"] <= 1.0):
        refuse("beta", "a value in [0, 1]")
    if not (is_number(settings["lr"]) and settings["lr"] > 0):
        refuse("lr", "a positive, finite learning rate")
    for key in ("lambda_reg", "lambda_fusion"):
        if not (is_number(settings[key]) and settings[key] >= 0):
            refuse(key, "a finite weight >= 0")
    for key in ("low_bits", "high_bits"):
        if settings[key] is not None and not (is_number(settings[key]) and settings[key] >= 0):
            refuse(key, "a finite entropy in bits, >= 0")
    if None not in (settings["low_bits"], settings["high_bits"]) and settings["low_bits"] > settings["high_bits"]:
        raise TrainError(f"--low-bits {settings['low_bits']:g} is above --high-bits {settings['high_bits']:g}; "
                         "the low threshold must be the smaller (attribute heads lie at or below it, "
                         "generalization heads at or above --high-bits)")
    pick_device(settings["device"])  # an unknown or absent device stops here


def settings_for_resume(args: argparse.Namespace) -> Dict[str, object]:
    """--resume / --eval-only: the run folder's saved settings; a flag that would change what
    is computed is refused (it would silently mix two experiments in one folder)."""
    if args.resume and args.eval_only:
        raise TrainError("--resume and --eval-only: give one (--resume finishes the runs, --eval-only "
                         "evaluates the finished runs again)")
    if not args.output:
        raise TrainError("--resume and --eval-only need --output, the run folder to continue")
    path = os.path.join(args.output, "settings.json")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)["settings"]
    except FileNotFoundError:
        raise TrainError(f"{path}: not found; --output must be a run folder made by train.py") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
        raise TrainError(f"{path}: unreadable ({type(error).__name__}); the run folder is damaged") from None
    expected_keys = set(resolve_settings(build_parser().parse_args(["--dataset", "dtd"])))
    if not isinstance(saved, dict) or set(saved) != expected_keys or not isinstance(saved["fingerprints"], dict):
        raise TrainError(f"{path}: not the settings of this train.py (damaged, or made by another version); "
                         "start a new run with another --output")
    # The typed flags in the form settings.json stores them (--augment off -> False, ...):
    # the same value is accepted, another one refused.
    stored_as = {"dataset": lambda v: _dataset_names(v, saved["protocol"], saved["source"]),
                 "source": lambda v: v.strip().lower().replace("-", "_"), "augment": lambda v: v == "on",
                 "roles": _role_choices, "method": lambda v: list(dict.fromkeys(v)),
                 "seeds": lambda v: list(dict.fromkeys(v)), "shots": lambda v: list(dict.fromkeys(v)),
                 "fusion": lambda v: list(dict.fromkeys(v))}
    for key, value in _given(args).items():
        if key in ("resume", "eval_only"):
            continue
        value = stored_as.get(key, lambda v: v)(value)
        if key in RUN_CONTROL:
            saved[key] = value
        elif saved.get(key) != value:
            raise TrainError(f"--{key.replace('_', '-')} cannot change in a saved run (it holds "
                             f"{saved.get(key)!r}); drop it, or start a new run with another --output")
    saved["max_epochs_per_call"] = args.max_epochs_per_call  # a limit of an earlier call is not this one's
    return saved


def check_output_folder(output: str) -> None:
    """A fresh run's --output must be a folder that can be made and written, and not already
    hold a run. Checked before the data and the model are read."""
    if not output:
        raise TrainError("--output '': expected a folder for the run")
    if os.path.exists(output) and not os.path.isdir(output):
        raise TrainError(f"--output {output}: is a file, not a folder; choose another --output")
    existing = os.path.abspath(output)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise TrainError(f"--output {output}: lies under {existing}, which is a file; choose another --output")
    try:  # os.access is not enough (root, read-only mounts): try to write
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".tmp-write-test-")
        os.close(handle)
        os.remove(probe)
    except OSError as error:
        raise TrainError(f"--output {output}: cannot write in {existing} ({error.strerror or error}); "
                         "choose a folder you can write to") from None
    if os.path.exists(os.path.join(output, "settings.json")):
        raise TrainError(f"{output}: already holds a run; continue it with --resume, evaluate it with "
                         "--eval-only, or choose another --output")


def lock_run_folder(output: str, stack: contextlib.ExitStack) -> None:
    """One writer per run folder: an exclusive lock on <output>/.lock, held until the call
    ends (the OS drops it when the process dies, even by SIGKILL: no stale lock to clean)."""
    if fcntl is None:
        return
    handle = open(os.path.join(output, ".lock"), "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip()
        handle.close()
        raise TrainError(f"{output}: in use by another train.py process{f' (pid {holder})' if holder else ''}; "
                         "wait for it to end, or choose another --output") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    stack.callback(handle.close)  # closing the file releases the lock


def remove_temporary_files(output: str) -> None:
    """Under the lock: a write killed half-way leaves a .tmp-* file (every file of a run is
    written to one and renamed); no other process can be writing it now."""
    for folder, _, files in os.walk(output):
        for name in files:
            if name.startswith(".tmp-"):
                os.remove(os.path.join(folder, name))


# ------------------------------------------------------------------------------------------
# 2. Device and processes
# ------------------------------------------------------------------------------------------


@dataclass
class Runtime:
    device: torch.device
    rank: int = 0
    world: int = 1
    amp_dtype: Optional[torch.dtype] = None  # autocast dtype on CUDA, None = fp32

    @property
    def main(self) -> bool:  # rank 0 alone prints and writes files
        return self.rank == 0

    def log(self, line: str) -> None:
        if self.main:
            print(line, flush=True)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    # torch knows more device types (meta, xla, hpu, ...) than this script drives.
    if device is None or device.type not in ("cpu", "cuda", "mps") or (device.type != "cuda" and device.index):
        raise TrainError(f"--device {name}: not a device; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"--device {name}: this machine has no CUDA device; use --device auto or cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise TrainError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices "
                         f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise TrainError(f"--device {name}: MPS is not available here; use --device auto or cpu")
    return device


def setup_runtime(settings: dict) -> Runtime:
    """One process, or one of several started by torchrun (which sets RANK and WORLD_SIZE):
    each process then drives one device and DistributedDataParallel averages the gradients."""
    device = pick_device(settings["device"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        # NCCL for GPUs; gloo, PyTorch's CPU backend, otherwise (and in the tests).
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    amp_dtype = None
    if device.type == "cuda" and settings["amp"] == "on":  # autocast on CUDA only (STYLE.md)
        amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return Runtime(device, rank, world, amp_dtype)


def autocast(runtime: Runtime):
    if runtime.amp_dtype is None:
        return torch.autocast("cpu", enabled=False)
    return torch.autocast(runtime.device.type, dtype=runtime.amp_dtype)


def _sum_over_processes(values: List[float], runtime: Runtime) -> List[float]:
    if runtime.world == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


# ------------------------------------------------------------------------------------------
# 3. Data: what each protocol trains on and tests on (DESIGN.md Sec. 6)
# ------------------------------------------------------------------------------------------


@dataclass
class EvalSet:
    name: str  # column of the table: "base", "novel", "all", or a dataset name
    items: List[data.Item]
    classnames: List[str]
    template: str
    trained: bool  # its classes are the trained classes, in the trained domain (fused logits)


@dataclass
class Job:
    """One row x dataset x seed x shots of a protocol: train once (unless zero-shot), then
    evaluate on every EvalSet."""

    dataset: str  # the dataset trained on (the source, for cross and dg)
    row: str  # "zeroshot", "dear", "dear-all-mixed", "dear-all-generalization"
    roles: Optional[str]  # "analyse", an ablation, or a roles file (None for zeroshot)
    seed: Optional[int]  # None for zero-shot: it has no randomness, one run serves every seed
    shots: Optional[int]  # None for zero-shot (it does not train)
    folder: str

    @property
    def label(self) -> str:
        parts = [self.dataset, self.row] + ([f"seed {self.seed}"] if self.seed is not None else [])
        return " / ".join(parts + ([f"{self.shots} shots"] if self.shots is not None else []))


def row_name(roles: str) -> str:
    return "dear" if roles not in ROLE_ABLATIONS else f"dear-{roles}"


ROW_LABELS = {"zeroshot": "CLIP (zero-shot)", "linear-probe": "Linear probe (frozen image features)", "dear": "DeAR",
              "dear-all-mixed": "DeAR, all heads mixed (no mask)",
              "dear-all-generalization": "DeAR, all heads generalization"}
EVERYWHERE = "-fused-everywhere"  # table rows scored with --fusion everywhere end in this


def table_rows(settings: dict) -> Dict[str, tuple]:
    """{table row: (job row, fusion mode)}: zero-shot; the linear probe; each --roles row under the first
    --fusion mode; the DeAR row (analysed or a file) once more under every further mode.
    Rows under "everywhere" get the suffix EVERYWHERE; all come from the same trained runs."""
    fusion = settings.get("fusion") or ["adaptive"]
    rows = {"zeroshot": ("zeroshot", None), "linear-probe": ("linear-probe", None)}
    for roles in settings["roles"]:
        for mode in (fusion if roles not in ROLE_ABLATIONS else fusion[:1]):
            rows[row_name(roles) + (EVERYWHERE if mode == "everywhere" else "")] = (row_name(roles), mode)
    return rows


def row_label(row: str) -> str:
    if row.endswith(EVERYWHERE):
        return ROW_LABELS.get(row[: -len(EVERYWHERE)], row[: -len(EVERYWHERE)]) + ", fused everywhere"
    return ROW_LABELS.get(row, row)


def plan_jobs(settings: dict) -> List[Job]:
    """Every run of the call, in order. Zero-shot does not depend on seed or shots, so it is
    one run per dataset; it fills every seed's place in the tables."""
    protocol, out = settings["protocol"], settings["output"]
    trained = [settings["source"]] if settings["source"] else settings["dataset"]
    jobs = []
    for dataset in trained:
        if "zeroshot" in settings["method"]:
            jobs.append(Job(dataset, "zeroshot", None, None, None, os.path.join(out, dataset, "zeroshot")))
        if "linear-probe" in settings["method"]:
            for shots in settings["shots"]:
                for seed in settings["seeds"]:
                    leaf = f"seed{seed}" if protocol != "fewshot" else f"shots{shots}-seed{seed}"
                    jobs.append(Job(dataset, "linear-probe", None, seed, shots,
                                    os.path.join(out, dataset, "linear-probe", leaf)))
        if "dear" not in settings["method"]:
            continue
        for roles in settings["roles"]:
            for shots in settings["shots"]:
                for seed in settings["seeds"]:
                    leaf = f"seed{seed}" if protocol != "fewshot" else f"shots{shots}-seed{seed}"
                    jobs.append(Job(dataset, row_name(roles), roles, seed, shots,
                                    os.path.join(out, dataset, row_name(roles), leaf)))
    return jobs


def training_split(settings: dict, dataset: str, seed: int, shots: int) -> data.DatasetSplits:
    subsample = "base" if settings["protocol"] == "base2novel" else "all"
    split = data.load_dataset(dataset, settings["root"], num_shots=shots, seed=seed, subsample=subsample)
    if not split.train:  # training on nothing would still write a row of the table
        raise TrainError(f"{split.dataset_dir}: no training images{' of the base classes' if subsample == 'base' else ''}; "
                         "the split's 'train' list must name some")
    return split


def evaluation_sets(settings: dict, dataset: str) -> List[EvalSet]:
    """The test sets of a protocol, each with its own class list, and whether its classes are
    the trained ones (which decides the logits under task-adaptive fusion)."""
    root, protocol = settings["root"], settings["protocol"]

    def full(name: str, column: str, trained: bool, subsample: str = "all") -> EvalSet:
        d = data.load_dataset(name, root, num_shots=None, subsample=subsample)
        if not d.test:  # an accuracy over no images would print as 0.00
            which = {"base": " of the base classes", "new": " of the novel classes"}.get(subsample, "")
            raise TrainError(f"{d.dataset_dir}: no test images{which} ({len(d.classnames)} classes); the "
                             f"{column} column needs some: the split's 'test' list must name them")
        return EvalSet(column, d.test, d.classnames, d.template, trained)

    if protocol == "base2novel":
        return [full(dataset, "base", True, "base"), full(dataset, "novel", False, "new")]
    if protocol == "fewshot":
        return [full(dataset, "all", True)]
    return [full(dataset, dataset, True)] + [full(target, target, False) for target in settings["dataset"]]


def train_loader(split: data.DatasetSplits, settings: dict, seed: int, resolution: int, runtime: Runtime):
    transform = data.train_transform(resolution) if settings["augment"] else data.test_transform(resolution)
    dataset = data.ImageDataset(split.train, transform)
    # A DistributedSampler also in a single process: its order is a pure function of
    # (seed, epoch), which is what makes --resume land on the same result as an unbroken run.
    sampler = DistributedSampler(dataset, num_replicas=runtime.world, rank=runtime.rank, shuffle=True,
                                 seed=seed)
    return DataLoader(dataset, batch_size=settings["batch_size"], sampler=sampler,
                      num_workers=settings["workers"], pin_memory=runtime.device.type == "cuda")


# ------------------------------------------------------------------------------------------
# 4. Model: CLIP, head roles, DeAR
# ------------------------------------------------------------------------------------------


def load_clip(settings: dict, runtime: Runtime):
    """-> (frozen CLIP on the device, tokenizer). Errors are one line (clip_model.CLIPFileError)."""
    clip, _ = clip_model.load(settings["weights"], device=runtime.device, head_width=settings["head_width"])
    tokenizer = clip_model.SimpleTokenizer(settings["bpe"])
    if tokenizer.vocab_size != clip.token_embedding.num_embeddings:  # ids past the table, or other words
        raise TrainError(f"--bpe {tokenizer.bpe_path}: gives a vocabulary of {tokenizer.vocab_size} tokens, the "
                         f"model {settings['weights']} has {clip.token_embedding.num_embeddings}; pass the BPE "
                         "file the model was trained with")
    return clip.eval().requires_grad_(False), tokenizer


def load_role_file(path: str) -> dear.RoleMap:
    """dear.RoleMap.load, with valid JSON of the wrong shape (a list, a string layer number)
    as one line too."""
    try:
        return dear.RoleMap.load(path)
    except dear.DeARError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError, RecursionError) as error:
        raise TrainError(f"{path}: not a DeAR role file ({type(error).__name__}); give a roles JSON "
                         "written by the head analysis") from None


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def input_fingerprints(settings: dict, tokenizer: clip_model.SimpleTokenizer) -> dict:
    """SHA-256 of every input file that decides the result but is named as a place (--weights,
    --bpe, a --roles file): another file at the same place, or the same file elsewhere, is
    told apart by its content. A named model is its published file, whose SHA-256 clip_model
    checks on every load (the last part of its URL's path)."""
    weights, role_file = settings["weights"], role_file_of(settings)
    if role_file is not None and not os.path.isfile(role_file):  # resumed after the file was moved
        raise TrainError(f"--roles {role_file}: no such file; put it back (the run folder keeps a copy, "
                         "roles_file.json)")
    named = clip_model._MODELS.get(weights)  # noqa: SLF001 -- the published checksums
    return dict(weights=named.split("/")[-2] if named else file_sha256(weights),
                bpe=file_sha256(tokenizer.bpe_path),
                roles_file=file_sha256(role_file) if role_file else None)


def role_file_of(settings: dict) -> Optional[str]:
    """The --roles choice that is a file, if any (at most one per call)."""
    return next((choice for choice in settings["roles"] if choice not in ("analyse", *ROLE_ABLATIONS)), None)


def first_layer_of(settings: dict, clip: clip_model.CLIP) -> int:
    """The paper's 1-based J; "auto" = the first of the last four vision layers."""
    if settings["first_layer"] == "auto":
        return max(1, len(clip.visual.transformer.resblocks) - 3)
    return int(settings["first_layer"])


def analysed_layers(clip: clip_model.CLIP) -> int:
    return min(4, len(clip.visual.transformer.resblocks))  # DeAR analyses the last four


def role_map_for(choice: str, settings: dict, clip: clip_model.CLIP, attributes: List[str],
                 analysed: Optional[dear.RoleMap]) -> dear.RoleMap:
    """A RoleMap for --roles CHOICE: the analysis of this call, an ablation, or a file."""
    vision_layers = len(clip.visual.transformer.resblocks)
    heads = clip.visual.transformer.heads
    if choice == "analyse":
        return analysed
    if choice in ROLE_ABLATIONS:
        role = choice.split("-", 1)[1]
        layers = range(vision_layers - analysed_layers(clip), vision_layers)
        return dear.RoleMap.uniform(role, vision_layers, heads, layers, attributes)
    try:  # dear.py's messages name arguments; say which flag the value came from
        role_map = load_role_file(choice)
        role_map.validate(vision_layers, heads, attributes)
    except dear.DeARError as error:
        raise TrainError(f"--roles {choice}: {error}") from None
    return role_map


def analysis_images(items: List[data.Item], cap: int, seed: int) -> List[data.Item]:
    """At most `cap` of a run's training images, spread evenly over its classes: each class's
    images in a seeded random order, then one image per class in turn (the classes too in a
    seeded order, so that a cap below the class count still samples classes at random), until
    the cap or the images run out. Never the first images of a list sorted by label, which
    would cover only the first classes of a large dataset."""
    generator = torch.Generator().manual_seed(seed)
    by_class: Dict[int, List[data.Item]] = {}
    for item in items:
        by_class.setdefault(item.label, []).append(item)
    queues = [[group[i] for i in torch.randperm(len(group), generator=generator).tolist()]
              for _, group in sorted(by_class.items())]
    queues = [queues[i] for i in torch.randperm(len(queues), generator=generator).tolist()]
    chosen: List[data.Item] = []
    for depth in range(max((len(q) for q in queues), default=0)):
        for queue in queues:
            if depth < len(queue) and len(chosen) < cap:
                chosen.append(queue[depth])
    return chosen


def role_key(job: Job) -> tuple:
    """Role maps are per run: the analysis reads that run's own training images."""
    return (job.dataset, job.roles, job.seed, job.shots)


def analyse_heads(settings: dict, job: Job, clip, tokenizer, world, runtime: Runtime) -> dear.RoleMap:
    """DeAR Sec. 3.2 on this run's training images (its own few-shot draw, evenly over its
    classes, drawn with its seed; `analysis_images`), saved as roles.json / roles.txt /
    roles.png / masks.png in <output>/<dataset>/roles/<seedS or shotsK-seedS>/."""
    dataset = job.dataset
    folder = os.path.join(settings["output"], dataset, "roles", os.path.basename(job.folder))
    path = os.path.join(folder, "roles.json")
    if os.path.isfile(path):  # made by an earlier call of this run (--resume) or by rank 0
        role_map = load_role_file(path)
        if runtime.main and world.get("after_analysis"):  # a step the earlier call did not finish
            world["after_analysis"](clip, tokenizer, role_map, folder, runtime.log)
        return role_map
    if runtime.main:
        split = world["train_splits"][(dataset, job.seed, job.shots)]
        items = analysis_images(split.train, settings["analysis_images"], job.seed)
        classes = len({item.label for item in items})
        runtime.log(f"[{job.label}] head analysis: concept entropy of every head of the last "
                    f"{analysed_layers(clip)} layers over {len(items)} training images of {classes} classes")
        loader = DataLoader(data.ImageDataset(items, data.test_transform(clip.visual.input_resolution)),
                            batch_size=settings["eval_batch_size"], num_workers=settings["workers"])
        role_map = dear.analyze_heads(
            clip, (images for images, _ in loader), tokenizer, world["bank"], world["attributes"],
            num_layers=analysed_layers(clip), num_descriptions=settings["descriptions"],
            rank=80, low_bits=settings["low_bits"], high_bits=settings["high_bits"], log=runtime.log)
        role_map.source = (f"concept entropy on {len(items)} {dataset} training images "
                           f"({classes} classes, seed {job.seed})")
        table = role_map.table()
        runtime.log(table)
        dear.draw_heatmap(role_map, os.path.join(folder, "roles.png"))
        J, image_tokens = first_layer_of(settings, clip), 1 + clip.visual.grid_size**2
        masks = dear.build_role_masks(role_map, J, len(clip.visual.transformer.resblocks), image_tokens)
        dear.draw_role_masks(masks, image_tokens, role_map.attributes, J, os.path.join(folder, "masks.png"))
        write_text(os.path.join(folder, "roles.txt"), table + "\n")
        role_map.save(path)  # last: its presence means the analysis is complete
        if world.get("after_analysis"):
            world["after_analysis"](clip, tokenizer, role_map, folder, runtime.log)
    if runtime.world > 1:
        dist.barrier()  # the other processes read what rank 0 wrote
    return load_role_file(path)


# ------------------------------------------------------------------------------------------
# 5. Optimizer and schedule
# ------------------------------------------------------------------------------------------


def learning_rate(settings: dict, epoch: int) -> float:
    """Dassl's schedule, per epoch: a constant warm-up (1e-5) for the first epoch(s), then
    cosine annealing of the base lr over all epochs (epoch 0-based)."""
    if epoch < settings["warmup_epochs"]:
        return settings["warmup_lr"]
    return 0.5 * settings["lr"] * (1 + math.cos(math.pi * epoch / settings["epochs"]))


# ------------------------------------------------------------------------------------------
# 6. Evaluation
# ------------------------------------------------------------------------------------------


def logits_used(eval_set: EvalSet, fusion: str) -> str:
    """"fused" or "class": which of DeAR's logits score this test set under this fusion mode."""
    return "fused" if fusion == "everywhere" or eval_set.trained else "class"


@torch.no_grad()
def evaluate(model, clip, tokenizer, eval_set: EvalSet, settings: dict, runtime: Runtime) -> Dict[str, float]:
    """Top-1 accuracy (%) on eval_set -> {"clip": acc} for zero-shot CLIP (model=None), or
    {"fused": acc, "class": acc} for DeAR: the fused logits and the class branch alone
    (s * cos(f_cls, t_c)), both from one pass over the images. Under torchrun each process
    takes every world-th image and the counts are summed."""
    prompts = [eval_set.template.format(name) for name in eval_set.classnames]
    ids = tokenizer.tokenize(prompts, clip.context_length, truncate=True).to(runtime.device)
    with autocast(runtime):
        # The class prompts are encoded once per test set, not once per batch.
        if model is None:
            text = F.normalize(clip.encode_text(ids).float(), dim=-1)  # (C, E)
        else:
            text = model.encode_text(model.prepare_classes(ids))  # (C, E) with the learned text tokens
    items = eval_set.items[runtime.rank::runtime.world]
    loader = DataLoader(data.ImageDataset(items, data.test_transform(clip.visual.input_resolution)),
                        batch_size=settings["eval_batch_size"], num_workers=settings["workers"])
    kinds = ["clip"] if model is None else ["fused", "class"]
    correct = [0] * len(kinds)
    for images, labels in loader:
        images = images.to(runtime.device)
        with autocast(runtime):
            if model is None:
                scores = [F.normalize(clip.encode_image(images).float(), dim=-1) @ text.T]
            else:
                f_cls, f_attr, _ = model.encode_image(images)
                fused, branches = model.fused_logits(torch.cat([f_cls[:, None], f_attr], dim=1), text)
                scores = [fused, branches[:, 0]]  # (B, C) each
        for i, logits in enumerate(scores):
            correct[i] += (logits.argmax(dim=-1).cpu() == labels).sum().item()
    *correct, total = _sum_over_processes(correct + [len(items)], runtime)
    return {kind: 100.0 * c / max(total, 1) for kind, c in zip(kinds, correct)}


@torch.no_grad()
def image_features(clip, items: list, settings: dict, runtime: Runtime) -> Tuple[torch.Tensor, torch.Tensor]:
    """Normalised frozen CLIP image embeddings of `items` (test transform) -> ((N, E), labels (N,))."""
    loader = DataLoader(data.ImageDataset(items, data.test_transform(clip.visual.input_resolution)),
                        batch_size=settings["eval_batch_size"], num_workers=settings["workers"])
    features, labels = [], []
    for images, batch_labels in loader:
        with autocast(runtime):
            features.append(F.normalize(clip.encode_image(images.to(runtime.device)).float(), dim=-1).cpu())
        labels.append(batch_labels)
    return torch.cat(features), torch.cat(labels)


def linear_probe(clip, split: data.DatasetSplits, eval_sets: List[EvalSet], settings: dict,
                 runtime: Runtime) -> Dict[str, float]:
    """CLIP's linear probe (Radford et al. 2021, Sec. 3.2): multinomial logistic regression on
    the frozen, normalised image embeddings of the few-shot training images -- the same images
    DeAR trains on -- with its L2 strength picked on the validation images. It tells how much
    the frozen features can separate the training classes, a ceiling for the base column that
    tells weak training from weak features. It has no classifier for classes it did not train
    on: sets with other classes get no number (novel and HM stay empty). -> {set name: top-1 %}"""
    train_x, train_y = image_features(clip, split.train, settings, runtime)
    val_x, val_y = image_features(clip, split.val, settings, runtime) if split.val else (train_x, train_y)
    n_classes = len(split.classnames)

    def fit(l2: float) -> torch.nn.Linear:
        torch.manual_seed(0)
        probe = torch.nn.Linear(train_x.shape[1], n_classes)
        optimizer = torch.optim.LBFGS(probe.parameters(), lr=1.0, max_iter=300, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            loss = F.cross_entropy(probe(train_x), train_y) + l2 * probe.weight.pow(2).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            optimizer.step(closure)
        return probe

    def accuracy(probe, x, y) -> float:
        with torch.no_grad():
            return 100.0 * (probe(x).argmax(dim=-1) == y).float().mean().item()

    # The largest accuracy on validation wins; ties go to the stronger regularisation.
    probes = {l2: fit(l2) for l2 in (1e-1, 1e-2, 1e-3, 1e-4)}
    best = max(probes, key=lambda l2: accuracy(probes[l2], val_x, val_y))
    metrics = {}
    for eval_set in eval_sets:
        if list(eval_set.classnames) == list(split.classnames):
            metrics[eval_set.name] = accuracy(probes[best], *image_features(clip, eval_set.items, settings, runtime))
    runtime.log(f"linear probe: L2 {best:g} picked on {len(val_y)} validation images; "
                + ", ".join(f"{name} {value:.2f}%" for name, value in metrics.items()))
    return metrics


# ------------------------------------------------------------------------------------------
# 7. The loop
# ------------------------------------------------------------------------------------------

CHECKPOINT_FORMAT = "dear-from-scratch checkpoint, version 1"


# Every file of a run is written to a temporary name and renamed (dear.atomic_write): a
# reader never sees half a file, and a run killed mid-write keeps its previous checkpoint.


def write_text(path: str, text: str) -> None:
    dear.atomic_write(path, lambda tmp: open(tmp, "w", encoding="utf-8").write(text))


def write_json(path: str, value) -> None:
    write_text(path, json.dumps(value, indent=2, allow_nan=False) + "\n")  # NaN is not JSON


def job_settings(settings: dict, job: Job) -> dict:
    """What decides a run's result: saved with it and compared on --resume."""
    keep = {k: v for k, v in settings.items() if k not in RUN_CONTROL}
    return dict(keep, job=dict(dataset=job.dataset, row=job.row, roles=job.roles, seed=job.seed, shots=job.shots))


def load_checkpoint(path: str, expected: dict) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        assert checkpoint.get("format") == CHECKPOINT_FORMAT
        assert isinstance(checkpoint.get("epoch"), int) and isinstance(checkpoint.get("settings"), dict)
        assert all(isinstance(checkpoint.get(key), dict) for key in ("learnable", "optimizer", "scaler"))
    except Exception as error:  # noqa: BLE001 -- any unreadable file gets the same advice
        raise TrainError(f"{path}: unreadable checkpoint ({type(error).__name__}); delete it to restart "
                         "that run from scratch") from None
    if checkpoint["settings"] != expected:
        raise TrainError(f"{path}: made with other settings than this run's "
                         f"({differences(checkpoint['settings'], expected)}); use another --output")
    return checkpoint


def differences(found: dict, expected: dict) -> str:
    """'lr 0.002 (expected 0.001), ...': what makes two settings dicts differ."""
    keys = [k for k in sorted(set(found) | set(expected)) if found.get(k) != expected.get(k)]
    return ", ".join(f"{k} {str(found.get(k))[:40]} (expected {str(expected.get(k))[:40]})" for k in keys[:3])


def check_finished_runs(settings: dict, jobs: List[Job]) -> None:
    """--resume / --eval-only: every results.json and checkpoint of the folder was made with
    this run's settings. A folder that mixes two runs (two writers before the lock existed,
    or files copied in) is refused rather than summarised."""
    for job in jobs:
        path = os.path.join(job.folder, "results.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    result = json.load(f)
                assert isinstance(result, dict) and isinstance(result.get("metrics"), dict)
                assert all(isinstance(v, float) for v in result["metrics"].values())
                assert isinstance(result.get("job"), dict) and isinstance(result.get("settings"), dict)
            except (OSError, ValueError, AssertionError, RecursionError) as error:
                raise TrainError(f"{path}: unreadable results ({type(error).__name__}); delete it and "
                                 "--resume evaluates that run again") from None
            if result["settings"] != job_settings(settings, job):
                raise TrainError(f"{path}: made with other settings than this run's "
                                 f"({differences(result['settings'], job_settings(settings, job))}): the folder "
                                 "mixes two runs; start again with another --output")
        elif job.row != "zeroshot":
            load_checkpoint(os.path.join(job.folder, "checkpoint.pt"), job_settings(settings, job))


def grad_scaler(enabled: bool):
    """fp16 autocast's loss scaler. torch.amp.GradScaler("cuda") is torch >= 2.3; older
    torch (requirements.txt allows 2.1) has the same class as torch.cuda.amp.GradScaler."""
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


def save_checkpoint(path: str, state: dict) -> None:
    def write(temporary: str) -> None:
        try:
            torch.save(state, temporary)
        except RuntimeError as error:  # torch's file writer reports a full disk this way
            raise TrainError(f"{path}: cannot write the checkpoint ({' '.join(str(error).split())[:100]}); "
                             "free disk space, then continue with --resume") from None

    dear.atomic_write(path, write)


def format_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def train_job(job: Job, settings: dict, clip, tokenizer, role_map, world, runtime: Runtime) -> Optional[dear.DeAR]:
    """Train one DeAR run; return the model, or None when --max-epochs-per-call stopped it."""
    split = world["train_splits"][(job.dataset, job.seed, job.shots)]
    J = first_layer_of(settings, clip)
    torch.manual_seed(job.seed)  # the learnable tokens' initialisation
    model = dear.DeAR(clip, role_map, world["attributes"], first_layer=J, beta=settings["beta"],
                      num_text_tokens=settings["text_tokens"]).to(runtime.device)
    runtime.log(f"[{job.label}] {len(split.train)} training images, {len(split.classnames)} classes; "
                f"attribute tokens from layer J={J} (1-based); {model.parameter_summary()}")
    optimizer = torch.optim.AdamW(model.learnable_parameters(), lr=settings["lr"],
                                  weight_decay=settings["weight_decay"])
    scaler = grad_scaler(enabled=runtime.amp_dtype == torch.float16)

    expected = job_settings(settings, job)
    checkpoint_path = os.path.join(job.folder, "checkpoint.pt")
    start_epoch = 0
    checkpoint = load_checkpoint(checkpoint_path, expected) if settings.get("resume") else None
    if checkpoint is not None:
        model.load_learnable_state_dict(checkpoint["learnable"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"]
        runtime.log(f"[{job.label}] resumed after epoch {start_epoch}/{settings['epochs']}")
    if start_epoch >= settings["epochs"]:
        return model

    network = model
    if runtime.world > 1:  # gradients of the learnable tensors averaged over processes
        network = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
            broadcast_buffers=False, find_unused_parameters=settings["text_tokens"] == 0)
    prompts = split.prompts
    class_ids = tokenizer.tokenize(prompts, clip.context_length, truncate=True).to(runtime.device)
    with autocast(runtime):
        classes = model.prepare_classes(class_ids)  # the class list's frozen text side, once
    loader = train_loader(split, settings, job.seed, clip.visual.input_resolution, runtime)
    steps_per_epoch = len(loader)
    stop_at = settings["epochs"]
    if settings.get("max_epochs_per_call") is not None:
        stop_at = min(stop_at, start_epoch + settings["max_epochs_per_call"])
    started, steps_done = time.time(), 0
    total_steps = (stop_at - start_epoch) * steps_per_epoch

    model.train()
    for epoch in range(start_epoch, stop_at):
        # Everything random in an epoch (the order, the augmentation) is seeded by
        # (seed, epoch) alone, so an epoch replays identically after a --resume.
        loader.sampler.set_epoch(epoch)
        torch.manual_seed(job.seed * 100_003 + epoch)
        lr = learning_rate(settings, epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        sums = {"total": 0.0, "ce": 0.0, "reg": 0.0, "fusion": 0.0, "correct": 0.0, "images": 0.0}
        epoch_start = time.time()
        for step, (images, labels) in enumerate(loader, 1):
            images, labels = images.to(runtime.device, non_blocking=True), labels.to(runtime.device)
            with autocast(runtime):
                output = network(images, classes, with_frozen=True)
                losses = dear.dear_loss(output, labels, settings["lambda_reg"], settings["lambda_fusion"])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(losses["total"]).backward()
            scaler.step(optimizer)
            scaler.update()

            for key in ("total", "ce", "reg", "fusion"):
                sums[key] += losses[key].item() * len(labels)
            sums["correct"] += (output.logits.argmax(-1) == labels).sum().item()
            sums["images"] += len(labels)
            steps_done += 1
            if step % settings["log_every"] == 0 or step == steps_per_epoch:
                elapsed = time.time() - started
                left = elapsed / steps_done * (total_steps - steps_done)
                rate = sums["images"] * runtime.world / max(time.time() - epoch_start, 1e-9)
                runtime.log(f"[{job.label}] epoch {epoch + 1}/{settings['epochs']} step {step}/{steps_per_epoch} "
                            f"loss {sums['total'] / sums['images']:.4f} (ce {sums['ce'] / sums['images']:.4f} "
                            f"reg {sums['reg'] / sums['images']:.4f} fusion {sums['fusion'] / sums['images']:.4f}) "
                            f"acc {100 * sums['correct'] / sums['images']:.1f}% lr {lr:.2e} "
                            f"{rate:.1f} img/s, {format_time(left)} left")
        if runtime.main:
            state = dict(format=CHECKPOINT_FORMAT, settings=expected, epoch=epoch + 1,
                         learnable=model.learnable_state_dict(), optimizer=optimizer.state_dict(),
                         scaler=scaler.state_dict())
            save_checkpoint(checkpoint_path, state)
        alpha = ", ".join(f"{a:.2f}" for a in model.fusion_weights().tolist())
        runtime.log(f"[{job.label}] epoch {epoch + 1} done in {format_time(time.time() - epoch_start)}; "
                    f"fusion weights alpha (cls, {', '.join(world['attributes'])}) = {alpha}; checkpoint saved")
    if runtime.world > 1:
        dist.barrier()
    if stop_at < settings["epochs"]:
        runtime.log(f"[{job.label}] stopped after epoch {stop_at}/{settings['epochs']} (--max-epochs-per-call); "
                    f"continue with: python train.py --output {settings['output']} --resume")
        return None
    return model


def run_job(job: Job, settings: dict, clip, tokenizer, role_maps, world, runtime: Runtime) -> Optional[dict]:
    """Train (unless zero-shot) and evaluate one job -> its results, or None if not finished."""
    results_path = os.path.join(job.folder, "results.json")
    if os.path.isfile(results_path) and not settings.get("eval_only"):
        with open(results_path, encoding="utf-8") as f:
            return json.load(f)  # finished in an earlier call (checked by check_finished_runs)
    model = None
    if job.row == "linear-probe":
        split = world["train_splits"][(job.dataset, job.seed, job.shots)]
        metrics = linear_probe(clip, split, world["eval_sets"][job.dataset], settings, runtime)
        result = dict(job=dataclasses.asdict(job), metrics=metrics, settings=job_settings(settings, job))
        if runtime.main:
            write_text(os.path.join(job.folder, "results.md"), job_table(job, metrics))
            write_json(results_path, result)
        return result
    if job.row != "zeroshot":
        if settings.get("eval_only"):
            checkpoint = load_checkpoint(os.path.join(job.folder, "checkpoint.pt"), job_settings(settings, job))
            if checkpoint is None or checkpoint["epoch"] < settings["epochs"]:
                raise TrainError(f"{job.folder}: no finished checkpoint to evaluate; finish it with --resume")
            model = dear.DeAR(clip, role_maps[role_key(job)], world["attributes"],
                              first_layer=first_layer_of(settings, clip), beta=settings["beta"],
                              num_text_tokens=settings["text_tokens"]).to(runtime.device)
            model.load_learnable_state_dict(checkpoint["learnable"])
        else:
            model = train_job(job, settings, clip, tokenizer, role_maps[role_key(job)], world, runtime)
            if model is None:
                return None
        model.eval()
    # One pass per test set gives every kind of logits; each fusion mode then picks per set.
    accuracy, logits = {}, {mode: {} for mode in settings["fusion"]}
    for eval_set in world["eval_sets"][job.dataset]:
        accuracy[eval_set.name] = evaluate(model, clip, tokenizer, eval_set, settings, runtime)
        for mode in settings["fusion"]:
            logits[mode][eval_set.name] = "clip" if model is None else logits_used(eval_set, mode)
        runtime.log(f"[{job.label}] test {eval_set.name}: " + ", ".join(
            f"{v:.2f}% ({kind} logits)" for kind, v in accuracy[eval_set.name].items()) +
            f" ({len(eval_set.items)} images, {len(eval_set.classnames)} classes)")
    by_fusion = {}
    for mode in settings["fusion"]:
        metrics = {name: accuracy[name][kind] for name, kind in logits[mode].items()}
        if settings["protocol"] == "base2novel":
            metrics["hm"] = harmonic_mean(metrics["base"], metrics["novel"])
        by_fusion[mode] = metrics
    first = settings["fusion"][0]
    # "metrics" and "logits": the run's own numbers (the first --fusion mode), and which logits
    # scored each test set; the *_by_fusion fields hold the same for every mode asked for.
    result = dict(job=dataclasses.asdict(job), metrics=by_fusion[first], fusion=first, logits=logits[first],
                  metrics_by_fusion=by_fusion, logits_by_fusion=logits, accuracy_by_logits=accuracy,
                  settings=job_settings(settings, job))
    if runtime.main:
        write_text(os.path.join(job.folder, "results.md"), job_table(job, metrics))
        write_json(results_path, result)  # last: its presence marks the run complete
    return result


def harmonic_mean(base: float, novel: float) -> float:
    if math.isnan(base) or math.isnan(novel):
        return math.nan  # a row without a novel number (the linear probe) has no HM
    return 2 * base * novel / (base + novel) if base + novel > 0 else 0.0


# ------------------------------------------------------------------------------------------
# 8. Tables in the paper's shape
# ------------------------------------------------------------------------------------------
# Each table cell is the mean over seeds. For base-to-novel, HM is computed from the mean
# base and mean novel accuracies, and the "Average" block's HM from the average base and
# average novel over datasets -- as CoCoOp, MaPLe and the DeAR paper compute it.

DG_NAMES = {"imagenet": "ImageNet", "imagenet_v2": "-V2", "imagenet_sketch": "-Sketch",
            "imagenet_a": "-A", "imagenet_r": "-R"}


def job_table(job: Job, metrics: dict) -> str:
    header = "| " + " | ".join(["run"] + list(metrics)) + " |"
    return "\n".join([header, "|" + "---|" * (len(metrics) + 1),
                      "| " + " | ".join([job.label] + [f"{v:.2f}" for v in metrics.values()]) + " |"]) + "\n"


def mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def spread(values: List[float]) -> float:
    """Sample standard deviation over seeds (0 for a single run, e.g. zero-shot)."""
    if len(values) < 2:
        return 0.0
    average = mean(values)
    return math.sqrt(sum((v - average) ** 2 for v in values) / (len(values) - 1))


def summarise(settings: dict, results: List[dict]) -> dict:
    """-> {"rows": [...], "tables": {name: {"columns": [...], "rows": {row: [values]}}}} with the
    values rounded to two decimals exactly as the markdown shows them."""
    protocol = settings["protocol"]
    spec = {row: (job_row, mode) for row, (job_row, mode) in table_rows(settings).items()
            if any(res["job"]["row"] == job_row for res in results)}
    rows = list(spec)

    def of_row(row: str) -> List[dict]:
        return [res for res in results if res["job"]["row"] == spec[row][0]]

    def metrics(res: dict, row: str) -> dict:  # the run's numbers under the row's fusion mode
        return res.get("metrics_by_fusion", {}).get(spec[row][1], res["metrics"])

    def seed_values(dataset: str, row: str, metric: str, shots: Optional[int] = None) -> List[float]:
        return [metrics(res, row).get(metric, math.nan) for res in of_row(row) if res["job"]["dataset"] == dataset
                and (shots is None or res["job"]["shots"] in (None, shots))]

    def cell(dataset: str, row: str, metric: str, shots: Optional[int] = None) -> float:
        return mean(seed_values(dataset, row, metric, shots))

    # Which logits scored each test set, per row (the same for every seed and dataset of a row).
    logits = {}
    for row in rows:
        res = of_row(row)[0]
        logits[row] = res.get("logits_by_fusion", {}).get(spec[row][1], res.get("logits", {}))

    tables: Dict[str, dict] = {}
    if protocol == "base2novel":
        datasets = settings["dataset"]
        per = {d: {row: [cell(d, row, "base"), cell(d, row, "novel")] for row in rows} for d in datasets}
        for d in datasets:
            for row in rows:
                per[d][row].append(harmonic_mean(*per[d][row]))
        if len(datasets) > 1:
            average = {}
            for row in rows:
                base, novel = mean([per[d][row][0] for d in datasets]), mean([per[d][row][1] for d in datasets])
                average[row] = [base, novel, harmonic_mean(base, novel)]
            tables[f"Average over {len(datasets)} datasets"] = dict(columns=["Base", "Novel", "HM"], rows=average)
        for d in datasets:
            # The spread over seeds of base, novel and each seed's own HM.
            spreads = {row: [spread(seed_values(d, row, "base")), spread(seed_values(d, row, "novel")),
                             spread([harmonic_mean(b, n) for b, n in zip(seed_values(d, row, "base"),
                                                                           seed_values(d, row, "novel"))])]
                       for row in rows}
            tables[d] = dict(columns=["Base", "Novel", "HM"], rows=per[d], spread=spreads)
    elif protocol == "fewshot":
        datasets, shots = settings["dataset"], settings["shots"]
        per = {d: {row: [cell(d, row, "all", k) for k in shots] for row in rows} for d in datasets}
        columns = [f"{k} shot{'s' if k > 1 else ''}" for k in shots]
        if len(datasets) > 1:
            tables[f"Average over {len(datasets)} datasets"] = dict(
                columns=columns, rows={row: [mean([per[d][row][i] for d in datasets]) for i in range(len(shots))]
                                       for row in rows})
        for d in datasets:
            tables[d] = dict(columns=columns, rows=per[d])
    else:
        source, targets = settings["source"], settings["dataset"]
        values = {row: [cell(source, row, source)] + [cell(source, row, t) for t in targets] for row in rows}
        for row in rows:
            values[row].append(mean(values[row][1:]))
        names = [DG_NAMES.get(n, n) if protocol == "dg" else n for n in [source] + targets]
        title = ("Cross-dataset evaluation" if protocol == "cross" else "Domain generalization") + \
            f": trained on {source}, tested on {len(targets)} targets"
        tables[title] = dict(columns=[f"{names[0]} (source)"] + names[1:] + ["Average"], rows=values)
    for table in tables.values():  # an empty cell (nan) is stored as null
        for key in ("rows", "spread"):
            if key in table:
                table[key] = {row: [None if math.isnan(v) else round(v, 2) for v in vals]
                              for row, vals in table[key].items()}
    return dict(protocol=protocol, seeds=settings["seeds"], rows=rows, tables=tables, logits=logits)


def markdown(summary: dict, settings: dict) -> str:
    titles = {"base2novel": "Base-to-novel generalization", "fewshot": "Few-shot classification",
              "cross": "Cross-dataset evaluation", "dg": "Domain generalization"}
    seeds = ", ".join(map(str, settings["seeds"]))
    lines = [f"# {titles[settings['protocol']]}", "",
             f"Accuracy (%), mean over seeds {seeds}; {settings['weights']}; "
             f"{'shots ' + ', '.join(map(str, settings['shots'])) if settings['protocol'] == 'fewshot' else str(settings['shots'][0]) + ' shots'}. "
             "Zero-shot CLIP does not train: one run serves every seed. ± = standard deviation over seeds; "
             "- = no number (the linear probe has no classifier for unseen classes).", ""]
    for name, table in summary["tables"].items():
        lines += [f"## {name}", "", "| Method | " + " | ".join(table["columns"]) + " |",
                  "|---|" + "---:|" * len(table["columns"])]
        for row, values in table["rows"].items():
            spreads = table.get("spread", {}).get(row, [None] * len(values))
            lines.append(f"| {row_label(row)} | " + " | ".join(
                "-" if v is None else f"{v:.2f}" + (f" ± {d:.2f}" if d else "") for v, d in zip(values, spreads)) + " |")
        lines.append("")
    names = {"fused": "fused", "class": "class branch alone", "clip": "CLIP"}
    lines.append("Logits per test set (task-adaptive fusion: fused where the test classes are the trained ones):")
    for row, used in summary.get("logits", {}).items():
        if used:
            lines.append(f"- {row_label(row)}: " + ", ".join(f"{test} {names.get(kind, kind)}"
                                                             for test, kind in used.items()))
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# main: settings -> device -> data -> model -> runs -> tables
# ------------------------------------------------------------------------------------------


def prepare_world(settings: dict, runtime: Runtime) -> dict:
    """Attributes, description bank and, for the toy world, its model, BPE file and data."""
    world = dict(attributes=list(dear.CORE_ATTRIBUTES), bank=None)
    if settings["dataset"] == ["toyworld"]:
        import toyworld  # the project's own world (toyworld/), only needed here

        if runtime.world > 1:
            raise TrainError("--dataset toyworld runs in one process; start it without torchrun")
        assets = toyworld.prepare(settings["toy_scale"], log=runtime.log)
        # A fresh run takes the cache's files (--weights, --bpe, --head-width are refused with
        # toyworld); a resumed one keeps the files it was made with (their content is checked).
        settings["root"] = settings["root"] or assets.data_root
        settings["weights"] = settings["weights"] or assets.weights
        settings["head_width"] = settings["head_width"] or assets.head_width
        settings["bpe"] = settings["bpe"] or assets.bpe
        world.update(attributes=list(assets.attributes), bank=list(assets.bank),
                     after_analysis=toy_causal_check)
    return world


def toy_causal_check(clip, tokenizer, role_map: dear.RoleMap, folder: str, log) -> None:
    """Toy world only: is concept entropy right? Mean-ablate each analysed head and see which
    attribute's zero-shot accuracy falls (the ground truth is known here), then compare with
    the head's role. Saved as causal_check.md / .json next to roles.json."""
    import toyworld

    if os.path.isfile(os.path.join(folder, "causal_check.json")):
        return  # done in an earlier call (a call killed during the check redoes it on --resume)
    log("[toyworld] causal check: mean-ablating every analysed head, zero-shot accuracy per attribute")
    result = toyworld.causal_check(clip, tokenizer, role_map, role_map.attributes, log=log)
    write_text(os.path.join(folder, "causal_check.md"), result["table"] + "\n")
    write_json(os.path.join(folder, "causal_check.json"), result)  # last: marks the check done
    log(result["table"])


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # data.py's warnings (a class with fewer than K images, a rebuilt cache) as one line each.
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    try:
        settings = settings_for_resume(args) if (args.resume or args.eval_only) else resolve_settings(args)
        settings["resume"], settings["eval_only"] = bool(args.resume), bool(args.eval_only)
        validate_settings(settings)
        with contextlib.ExitStack() as stack:  # holds the run folder's lock until the call ends
            return run(settings, stack)
    except (TrainError, data.DatasetError, dear.DeARError, clip_model.CLIPError) as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a full disk, a folder made read-only mid-run: one line too
        where = f"{error.filename}: " if error.filename else ""
        print(f"train.py: error: {where}{error.strerror or error}; fix it, then continue with --resume",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("train.py: interrupted; the last finished epoch is saved: continue with --resume", file=sys.stderr)
        return 130


def run(settings: dict, stack: contextlib.ExitStack) -> int:
    output = settings["output"]
    fresh = not (settings["resume"] or settings["eval_only"])
    main_process = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 alone writes
    jobs = plan_jobs(settings)
    if fresh:
        check_output_folder(output)
    elif main_process:  # the folder exists: lock it before reading it
        lock_run_folder(output, stack)
        remove_temporary_files(output)
        check_finished_runs(settings, jobs)
    if settings["workers"] is None:
        settings["workers"] = 4 if pick_device(settings["device"]).type == "cuda" else 0

    # 2. device (and processes, under torchrun)
    runtime = setup_runtime(settings)
    world = prepare_world(settings, runtime)

    # 3. data: every list is read (and every listed image checked) before anything is written
    trained = sorted({job.dataset for job in jobs})
    world["eval_sets"] = {d: evaluation_sets(settings, d) for d in trained}
    # Read once per (dataset, seed, shots): rows that differ only in --roles share the split,
    # and a load checks every listed image (over a million files for ImageNet).
    world["train_splits"] = {}
    for job in jobs:
        key = (job.dataset, job.seed, job.shots)
        if job.seed is not None and key not in world["train_splits"]:
            world["train_splits"][key] = training_split(settings, *key)

    # 4. model
    clip, tokenizer = load_clip(settings, runtime)
    fingerprints = input_fingerprints(settings, tokenizer)
    if not fresh:  # the files may have moved (--weights, --bpe are places), not changed
        for key, flag in (("weights", f"--weights {settings['weights']}"), ("bpe", f"--bpe {tokenizer.bpe_path}"),
                          ("roles_file", f"--roles {role_file_of(settings)}")):
            now, then = fingerprints[key], settings["fingerprints"].get(key)
            if now != then:
                copy = f" (a copy is {os.path.join(output, 'roles_file.json')})" if key == "roles_file" else ""
                raise TrainError(f"{flag}: not the file this run was made with (SHA-256 {str(now)[:12]}... now, "
                                 f"{str(then)[:12]}... then); resume with the original file{copy}, or start a "
                                 "new run with another --output")
    settings["fingerprints"], settings["bpe"] = fingerprints, tokenizer.bpe_path
    for choice in settings["roles"]:  # a roles file that does not fit this model stops here
        if choice not in ("analyse", *ROLE_ABLATIONS) and "dear" in settings["method"]:
            role_map_for(choice, settings, clip, world["attributes"], None)
    if settings["text_tokens"] > clip.context_length:  # memory grows with (77 + K)^2: a typo, not a setting
        raise TrainError(f"--text-tokens {settings['text_tokens']}: expected at most the model's context "
                         f"length ({clip.context_length})")
    if "dear" in settings["method"]:  # J, beta, K checked against the model before any run
        probe_roles = role_map_for("all-mixed", settings, clip, world["attributes"], None)
        dear.DeAR(clip, probe_roles, world["attributes"], first_layer=first_layer_of(settings, clip),
                  beta=settings["beta"], num_text_tokens=settings["text_tokens"])

    # From here on the run folder exists; a run inside it counts as done only once its
    # results.json is written, the whole call only once summary.md is.
    if runtime.main:
        os.makedirs(output, exist_ok=True)
        if fresh:
            lock_run_folder(output, stack)
            check_output_folder(output)  # again, under the lock: another call may have started it
            remove_temporary_files(output)
            if role_file_of(settings) is not None:  # the run keeps the roles it used
                with open(role_file_of(settings), encoding="utf-8") as f:
                    write_text(os.path.join(output, "roles_file.json"), f.read())
            saved = {k: v for k, v in settings.items() if k not in ("resume", "eval_only")}
            write_json(os.path.join(output, "settings.json"), dict(
                settings=saved, torch=torch.__version__, python=platform.python_version(),
                command="python train.py " + " ".join(sys.argv[1:]), world_size=runtime.world))
    runtime.log(f"train.py: {settings['protocol']} on {', '.join(settings['dataset'])}; {len(jobs)} runs "
                f"({', '.join(dict.fromkeys(job.row for job in jobs))}); device {runtime.device}"
                f"{f' x {runtime.world} processes' if runtime.world > 1 else ''}"
                f"{f', autocast {runtime.amp_dtype}' if runtime.amp_dtype else ''}; output {output}")

    role_maps = {}
    for job in jobs:
        if job.roles is not None:
            analysed = (analyse_heads(settings, job, clip, tokenizer, world, runtime)
                        if job.roles == "analyse" else None)
            role_maps[role_key(job)] = role_map_for(job.roles, settings, clip, world["attributes"], analysed)

    started, results = time.time(), []
    for index, job in enumerate(jobs, 1):
        runtime.log(f"== run {index}/{len(jobs)}: {job.label} "
                    f"(elapsed {format_time(time.time() - started)}) ==")
        result = run_job(job, settings, clip, tokenizer, role_maps, world, runtime)
        if result is None:
            return 0  # stopped by --max-epochs-per-call; resumable
        results.append(result)

    summary = summarise(settings, results)
    text = markdown(summary, settings)
    if runtime.main:
        write_json(os.path.join(output, "summary.json"), summary)
        write_text(os.path.join(output, "summary.md"), text)
    runtime.log("\n" + text)
    runtime.log(f"train.py: done in {format_time(time.time() - started)}; tables in {os.path.join(output, 'summary.md')}")
    if runtime.world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
