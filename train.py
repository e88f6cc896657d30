"""
train.py -- the command line: DeAR (or zero-shot CLIP) on the paper's four protocols.

How the files fit: clip_model.py is CLIP (weights, tokenizer), data.py reads the datasets in
CoOp's layout, dear.py is the method (head roles, attribute tokens, role masks, losses).
This file ties them together and reads top to bottom like nanoGPT's train.py:

    1. settings ...... argparse flags (grouped, each with help) + the defaults, each written
                       once: a recipe per protocol and dataset (docs/METHOD.md Sec. 7) and
                       one table for the rest; resolved and checked once, saved with every run
    2. device ........ --device auto: cuda, then mps, then cpu; torchrun -> DDP
    3. data .......... the train/test lists of each protocol (docs/METHOD.md Sec. 6)
    4. model ......... CLIP (or the toy world's), head roles (one cached analysis per model
                       and image pool, a file, or an ablation) -> DeAR, built by one function
    5. optimizer ..... AdamW, a constant warm-up, then cosine recounted after it (Dassl's)
    6. evaluation .... accuracy with the fused logits and with the class branch alone, in one
                       pass; the DeAR row under both rules (fused everywhere; the class
                       branch alone on unseen classes); zero-shot: CLIP alone
    7. loop .......... one DeAR run: the training loop, then its evaluation (train_job, run_job)
    8. tables ........ results.json + markdown tables in the paper's shape
    9. run folder .... files written whole, checkpoints, the lock (plumbing, out of the way)
    main ............. the order of a call: every check first, then the runs, then the tables

Protocols (--protocol):
    base2novel  train on the base half of the classes, test base and novel; Base, Novel, HM
    fewshot     1/2/4/8/16 shots of every class, test every class
    cross, dg   one training on ImageNet (--source), tested on every --dataset: 'all' is
                the ten other datasets (the cross-dataset table) and ImageNet-V2, -Sketch,
                -A and -R (the domain-generalization table), from the same trained models

Run it:
    python train.py --dataset toyworld                       # the toy world: no downloads, CPU, minutes
    python train.py --dataset oxford_pets --root $DATA       # base-to-novel, seeds 1 2 3, ViT-B/16
    python train.py --dataset all --root $DATA --protocol fewshot --seeds 1
    python train.py --output runs/base2novel-oxford_pets --resume       # continue a stopped run
    python train.py --output runs/base2novel-oxford_pets --eval-only    # evaluate it again
    python train.py --dataset dtd --root $DATA --analyse-only     # the head roles alone, then stop
    torchrun --nproc_per_node=4 train.py --dataset all --root $DATA --protocol cross

A run folder holds, per dataset / method / seed: settings.json, checkpoint.pt (only the
learnable tensors, the optimizer state and the settings, written atomically at each epoch
end), results.json and results.md; per trained dataset a copy of the head roles it used
(<dataset>/roles/: roles.json, roles.txt, roles.png, analysis.json from the cache, and
masks.png for this run's J); at the top summary.json and summary.md. A run is complete when
its results.json exists; summary.md is written when every run is. The call that writes a folder holds <output>/.lock; a --roles file is copied to
roles_file.json, and settings.json records its format version, the SHA-256 of the weights,
BPE and roles files, and each analysed role map's fingerprint, pool and SHA-256.

Layer numbers: the paper counts from 1 ("J = 9"); so do --first-layer and every printed line.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import platform
import sys
import time
import types
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
import runs

# ------------------------------------------------------------------------------------------
# 1. Settings
# ------------------------------------------------------------------------------------------
# What a call computes is decided here, once, before anything is read or written: each flag
# is the value typed, else the trained dataset's recipe (RECIPES), else DEFAULTS. Every
# default is written once, in one of these two tables; build_parser generates the
# "(default ...)" part of each help line from them. The resolved settings are saved with the
# run (settings.json, and inside every results.json and checkpoint); a resumed call reads
# them back instead of resolving them again, and nothing rewrites them afterwards.


@dataclass(frozen=True)
class Recipe:
    """How one protocol trains one dataset (docs/METHOD.md Sec. 7, a table of every default
    with its source: where the paper is silent, MMRL++'s config files, the closest public
    relative of DeAR, whose token rule DeAR uses). The field defaults are MMRL++'s
    base-to-novel yaml; each field is the default of the flag of the same name."""

    epochs: int = 10  # training epochs, the warm-up epochs included
    batch_size: int = 4  # images per step (per process under torchrun)
    lr: float = 1e-3  # AdamW's learning rate after the warm-up, then cosine decay
    warmup_epochs: int = 1  # epochs at the constant WARMUP_LR before the cosine (Dassl's recount)
    shots: int = 16  # training images per class (every protocol but fewshot, which sweeps)
    lambda_reg: float = 1.0  # weight of the self-regularisation loss (docs/METHOD.md Sec. 5)
    lambda_fusion: float = 0.1  # weight of the fusion-weight regularisation loss (our choice)
    beta: float = 0.9  # each layer's fresh tokens against the previous layer's output tokens
    first_layer: str = "auto"  # J, 1-based as in the paper; auto = first of the last four layers
    text_tokens: int = 4  # K, learnable tokens in the text tower
    augment: bool = True  # random resized crop + flip (CoOp's)


# The paper's eleven datasets, in its tables' order.
PAPER_DATASETS = ["imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101",
                  "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101"]
# Each protocol's recipe, from MMRL++'s yaml files (yunncheng/MMRL, configs/trainers/MMRLpp/):
# vit_b16.yaml, vit_b16_few_shot.yaml, vit_b16_cross_datasets.yaml (cross and dg share one
# ImageNet training), and vit_b16_imagenet.yaml for ImageNet in base2novel and fewshot.
PROTOCOL_RECIPES = {"base2novel": Recipe(), "fewshot": Recipe(epochs=100, batch_size=32, lr=2e-3),
                    "cross": Recipe(epochs=1, batch_size=32, warmup_epochs=0)}
PROTOCOL_RECIPES["dg"] = PROTOCOL_RECIPES["cross"]
# (beta, lambda_reg) per dataset: MMRL++'s trainers/config.py, which MMRL's train.py merges
# after the yaml (so it wins); B2N and FS share one table, CD sets ImageNet's training.
MMRLPP_B2N_FS = {"imagenet": (0.9, 0.2), "fgvc_aircraft": (0.9, 2.0), "ucf101": (0.9, 3.0), "dtd": (0.9, 7.0),
                 "oxford_pets": (0.7, 0.01), "stanford_cars": (0.7, 6.0), "caltech101": (0.6, 3.0),
                 "sun397": (0.5, 3.0), "oxford_flowers": (0.4, 7.0), "eurosat": (0.2, 0.01), "food101": (0.1, 1.0)}
MMRLPP_CD = {"imagenet": (0.9, 0.1)}


def _recipes() -> Dict[str, Dict[str, Recipe]]:
    """{protocol: {dataset: Recipe}}: the protocol's recipe with each dataset's exceptions."""
    recipes: Dict[str, Dict[str, Recipe]] = {}
    for protocol in ("base2novel", "fewshot", "cross"):
        usual, table = PROTOCOL_RECIPES[protocol], MMRLPP_CD if protocol == "cross" else MMRLPP_B2N_FS
        recipes[protocol] = {}
        for name in PAPER_DATASETS:
            recipe = usual
            if name == "imagenet" and protocol in ("base2novel", "fewshot"):  # vit_b16_imagenet.yaml
                recipe = dataclasses.replace(recipe, epochs=5, batch_size=32, lr=1e-3)
            if name in table:
                recipe = dataclasses.replace(recipe, beta=table[name][0], lambda_reg=table[name][1])
            recipes[protocol][name] = recipe
        # The toy world's tiny CLIP learns from few, small images: more epochs at a larger lr
        # (our choice); no crop or flip, which would move the object and so change its
        # position, one of the attributes; beta 0.5 (our choice: no MMRL++ value exists for it).
        recipes[protocol]["toyworld"] = Recipe(epochs=20, batch_size=8, lr=5e-3, beta=0.5, augment=False)
    del recipes["cross"]["toyworld"]  # the toy world has no cross-dataset protocol
    recipes["dg"] = recipes["cross"]  # one ImageNet training serves both
    return recipes


RECIPES = _recipes()

WARMUP_LR, WEIGHT_DECAY = 1e-5, 5e-4  # MMRL++'s WARMUP_CONS_LR; Dassl's OPTIM.WEIGHT_DECAY
PROTOCOLS = ("base2novel", "fewshot", "cross", "dg")
# How DeAR's two kinds of logits score a test set. Both rules are shown in every table by
# default, because DeAR's public material does not settle which its tables use (docs/METHOD.md
# Sec. 5):
#   fused-everywhere   the fused logits, with the fusion weights learned on the training
#                      classes, on every test set (DeAR's description of its inference)
#   class-on-unseen    the fused logits where the test classes are the trained classes in the
#                      trained domain; the class branch alone on classes that were not trained
#                      (novel classes, other datasets, ImageNet's variants): MMRL's code
FUSION_MODES = ("fused-everywhere", "class-on-unseen")
OLD_FUSION_NAMES = {"everywhere": "fused-everywhere", "adaptive": "class-on-unseen"}
METHODS = ("zeroshot", "linear-probe", "dear")
ROLE_ABLATIONS = ("all-mixed", "all-generalization")  # besides "analyse" and a roles file
DG_TARGETS = ["imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r"]
FEWSHOT_SHOTS = [1, 2, 4, 8, 16]  # the few-shot protocol's sweep (CoOp)
MAX_SEED = 2**32 - 1  # numpy's range; torch's per-epoch seeds are derived from it (seed * 100003 + epoch)

# The defaults of the flags that are not part of a recipe. A flag missing here and from
# Recipe has no fixed default: its help says what an unset value means (e.g. --workers).
DEFAULTS = dict(
    protocol="base2novel",  # the paper's main table
    method=["zeroshot", "dear"],  # CLIP as it is, and DeAR
    roles=["analyse"],  # DeAR's own head analysis: one role map per model and image pool, cached
    fusion=list(FUSION_MODES),  # both rules of scoring DeAR, one table row each (Sec. 5 of METHOD.md)
    seeds=[1, 2, 3],  # CoOp's three seeds; the tables report the mean
    source="imagenet",  # what cross and dg train on (the paper's protocol)
    weights="ViT-B/16",  # the paper's backbone
    analysis_pool="train",  # the trained dataset's whole training split (base classes in base2novel)
    analysis_images=2000,  # at most this many images of the pool for the head analysis
    device="auto",  # cuda, then mps, then cpu
    amp="on",  # autocast on CUDA (CPU and MPS always run fp32)
    eval_batch_size=64,  # images per evaluation batch
    log_every=20,  # steps between progress lines
    toy_scale="full",  # the toy world the README's table comes from
)
# The toy world shows more rows by default: the linear probe (how far the frozen features
# separate the classes) and the two role ablations beside DeAR. It brings its own model
# (--weights, --bpe, --head-width refused).
TOY_DEFAULTS = dict(method=list(METHODS), roles=["all-mixed", "all-generalization", "analyse"])

# Flags that say how to run, not what to compute: they may change on --resume / --eval-only.
RUN_CONTROL = {"output", "resume", "eval_only", "device", "workers", "log_every", "eval_batch_size",
               "max_epochs_per_call", "amp", "root", "weights", "bpe"}  # (and the files' places)


class TrainError(Exception):
    """Bad input to the command line: one line naming the flag or file and what to do."""


def build_parser() -> argparse.ArgumentParser:
    # Every argparse default is None, so that an unset flag is told apart from a typed one:
    # the tables above fill in what the user did not type, and --resume refuses a typed
    # change. The help texts say what a flag means; "(default ...)" is added from the tables.
    p = data.OneLineParser(prog="train.py", description="DeAR on CLIP: train and evaluate on the paper's protocols. "
                      "Unset DeAR and optimisation flags come from the trained dataset's recipe (RECIPES in train.py).")

    g = p.add_argument_group("what to run")
    g.add_argument("--dataset", nargs="+", help="dataset name(s) from data.py, 'all' for the protocol's "
                   "datasets, 'toyworld' (the project's own world: no downloads), or the PATH of your own data: "
                   "a folder of class folders (PATH/<class>/<image>; the split is drawn once, 50/20/30 per class, "
                   "and written to PATH/split_<name>.json) or a split file in CoOp's format (image paths "
                   "relative to its folder); its name in tables and run folders is its folder's name")
    g.add_argument("--protocol", choices=PROTOCOLS, help="base2novel | fewshot | cross | dg")
    g.add_argument("--method", nargs="+", choices=METHODS, help="rows of the table: zeroshot = CLIP with the "
                   "dataset's template, no training; linear-probe = logistic regression on the frozen image "
                   "features (training classes only); dear = DeAR")
    g.add_argument("--roles", nargs="+", help="head roles for DeAR: 'analyse' (concept entropy on "
                   "--analysis-pool, once per model and pool, cached and copied into the run folder), a roles "
                   "JSON file, 'all-mixed' (no mask: plain deep prompting) or 'all-generalization'; several "
                   "give one table row each")
    g.add_argument("--fusion", nargs="+", type=fusion_name, metavar="{" + ",".join(FUSION_MODES) + "}",
                   help="how DeAR is scored: fused-everywhere = the fused logits (weights learned on the "
                   "training classes) on every test set; class-on-unseen = fused on the trained classes, the "
                   "class branch alone on classes not trained (MMRL's rule). Each gives the DeAR row once, "
                   "from the same trained model (the role ablations use the first)")
    g.add_argument("--seeds", nargs="+", type=int, help="seeds; tables report the mean")
    g.add_argument("--shots", nargs="+", type=int, help="shots per class")
    g.add_argument("--source", help="training dataset of cross and dg")
    g.add_argument("--template", help="class prompt template, '{}' standing for the class name, for every "
                   f"dataset of the call (unset: each benchmark's CoOp template; your own data: {data.OWN_TEMPLATE!r})")

    g = p.add_argument_group("where things are")
    g.add_argument("--root", help="the $DATA folder in CoOp's layout (toyworld: made in the cache)")
    g.add_argument("--weights", help="CLIP: ViT-B/32, ViT-B/16, ViT-L/14 or a checkpoint path")
    g.add_argument("--head-width", type=int, help="channels per attention head when loading --weights "
                   "(unset: what the file says -- files written by clip_model.save carry it -- else "
                   "64, as in every OpenAI model)")
    g.add_argument("--bpe", help="CLIP's BPE merges file (unset: $CLIP_BPE_PATH, the cache, or a download)")
    g.add_argument("--output", help="run folder (unset: runs/<protocol>-<datasets>)")

    g = p.add_argument_group("DeAR")
    g.add_argument("--first-layer", type=int, help="J, the first vision and text layer with learnable "
                   "tokens, 1-based as in the paper; auto = the first of the last four layers")
    g.add_argument("--beta", type=float, help="weight of each layer's fresh tokens against the previous "
                   "layer's output tokens, in [0, 1]")
    g.add_argument("--text-tokens", type=int, help="K, learnable tokens inserted in the text tower")
    g.add_argument("--lambda-reg", type=float, help="weight of the self-regularisation loss")
    g.add_argument("--lambda-fusion", type=float, help="weight of the fusion-weight regularisation loss")
    g.add_argument("--analysis-pool", help="images of the head analysis: 'train' = the trained dataset's whole "
                   "training split (base2novel: its base classes only; never the few-shot draw), or "
                   "DATASET:SPLIT of the registry, e.g. imagenet:test (ImageNet's validation images, "
                   "TextSpan's pool)")
    g.add_argument("--analysis-images", type=int, help="at most this many images of the pool, spread evenly "
                   "over its classes with a fixed seed")
    g.add_argument("--descriptions", type=int, help="TextSpan descriptions per head (unset: what the bank "
                   "supports, the fewest values of an attribute: 16 for the project's bank, 4 for the toy world's; "
                   "capped with a warning where the images or TextSpan's rank cannot support it; a typed value "
                   "above that is refused)")
    g.add_argument("--analyse-only", action="store_true", help="run the head analysis alone (roles.json, "
                   "roles.png, masks.png in --output and the cache), then stop")
    g.add_argument("--low-bits", type=float, help="attribute heads have concept entropy at most this "
                   "(unset: a third of log2(min(descriptions, concepts)), the most the picks can spread)")
    g.add_argument("--high-bits", type=float, help="generalization heads have concept entropy at least "
                   "this (unset: two thirds of it)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, help="training epochs, the warm-up epochs included")
    g.add_argument("--batch-size", type=int, help="images per step (per process under torchrun)")
    g.add_argument("--lr", type=float, help="AdamW learning rate after the warm-up (cosine decay)")
    g.add_argument("--warmup-epochs", type=int, help=f"epochs at a constant {WARMUP_LR:g} before the cosine")
    g.add_argument("--augment", choices=("on", "off"), help="random resized crop + flip for training")

    g = p.add_argument_group("running")
    g.add_argument("--device", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    g.add_argument("--amp", choices=("on", "off"), help="mixed precision by autocast, CUDA only")
    g.add_argument("--workers", type=int, help="data-loading processes (unset: 4 on CUDA, 0 on CPU)")
    g.add_argument("--eval-batch-size", type=int, help="images per evaluation batch")
    g.add_argument("--log-every", type=int, help="a progress line every N steps")
    g.add_argument("--resume", action="store_true", help="continue the runs in --output from their last checkpoint")
    g.add_argument("--eval-only", action="store_true", help="evaluate the finished runs in --output again")
    g.add_argument("--max-epochs-per-call", type=int, help="stop after this many epochs in this call "
                   "(for time-limited jobs); --resume continues")

    g = p.add_argument_group("toy world")
    g.add_argument("--toy-scale", choices=("full", "miniature"), help="size of the toy world (miniature is "
                   "the seconds-long version the tests run)")
    for action in p._actions:  # noqa: SLF001 -- argparse keeps no public list of its flags
        if action.help and action.dest != "help":
            action.help += default_help(action.dest)
    return p


def default_help(key: str) -> str:
    """' (default ...)' for a flag's help, from the tables above: the one place defaults live."""

    def shown(value) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        return " ".join(map(str, value)) if isinstance(value, list) else str(value)

    parts = [shown(DEFAULTS[key])] if key in DEFAULTS else []
    if key in TOY_DEFAULTS:
        parts.append(f"toyworld: {shown(TOY_DEFAULTS[key])}")
    if key in Recipe.__dataclass_fields__:  # per protocol, then the datasets that differ
        per_protocol = []
        for protocols in (("base2novel",), ("fewshot",), ("cross", "dg")):
            usual = getattr(PROTOCOL_RECIPES[protocols[0]], key)
            others = [f"{name}: {shown(getattr(r, key))}" for name, r in RECIPES[protocols[0]].items()
                      if getattr(r, key) != usual]
            exceptions = f" ({', '.join(others)})" if others else ""
            per_protocol.append(f"{', '.join(protocols)} {shown(usual)}{exceptions}")
        parts.append("; ".join(per_protocol) + ", from RECIPES")
    if key == "shots":
        parts.append(f"fewshot: {shown(FEWSHOT_SHOTS)}")
    return f" (default {'; '.join(parts)})" if parts else ""


def recipe_of(protocol: str, dataset: str) -> Recipe:
    if dataset not in RECIPES[protocol] and data.get_spec(dataset).own:  # your own data: the protocol's recipe
        return PROTOCOL_RECIPES[protocol]
    if dataset not in RECIPES[protocol]:  # a dataset added to data.py without a recipe here
        raise TrainError(f"--dataset {dataset}: train.py has no {protocol} recipe for it; add it to RECIPES "
                         "in train.py")
    return RECIPES[protocol][dataset]


def fusion_name(value: str) -> str:
    """--fusion's type: a mode of FUSION_MODES; the names of earlier versions get a one-line hint."""
    if value in OLD_FUSION_NAMES:
        raise argparse.ArgumentTypeError(f"'{value}' is an old name: use {OLD_FUSION_NAMES[value]} (the rows are "
                                         "now named by what they do)")
    if value not in FUSION_MODES:
        raise argparse.ArgumentTypeError(f"invalid choice: '{value}' (choose from {', '.join(FUSION_MODES)})")
    return value


def resolve_settings(args: argparse.Namespace) -> Dict[str, object]:
    """The settings of this call, complete and checked: those of a new run from the flags, or
    those saved in --output for --resume / --eval-only (with the run-control flags that may
    change). The one place settings are made; the places and SHA-256 of the input files are
    added once they are found (open_inputs), and nothing changes them after that."""
    settings = settings_from_run_folder(args) if (args.resume or args.eval_only) else settings_from_flags(args)
    settings["resume"], settings["eval_only"] = bool(args.resume), bool(args.eval_only)
    settings["analyse_only"] = bool(args.analyse_only)
    validate_settings(settings)
    if settings["workers"] is None:  # loading processes help on CUDA; on CPU they compete with the model
        settings["workers"] = 4 if pick_device(settings["device"]).type == "cuda" else 0
    return settings


def _given(args: argparse.Namespace) -> Dict[str, object]:
    """The flags typed on the command line (0 and "" included: a typed 0 is a value)."""
    return {key: value for key, value in vars(args).items() if value is not None and value is not False}


def _default(value, default):
    """The flag's value if it was given, else the default. Never `value or default`, which
    would turn a typed 0 into the default (--epochs 0 training 10 epochs)."""
    return default if value is None else value


def _dataset_names(typed: List[str], protocol: str, source: Optional[str]) -> List[str]:
    names = [data.own_dataset_name(n) if data.is_own_data(n) else data.dataset_key(n) for n in typed]
    if names == ["all"]:  # cross and dg: one training on the source, tested on all fourteen targets
        source = data.dataset_key(_default(source, DEFAULTS["source"]))
        names = PAPER_DATASETS if protocol in ("base2novel", "fewshot") else \
            [n for n in PAPER_DATASETS if n != source] + DG_TARGETS
    return list(names)


def _role_choices(typed: List[str]) -> List[str]:
    return list(dict.fromkeys("analyse" if r == "analyze" else r for r in typed))


def settings_from_flags(args: argparse.Namespace) -> Dict[str, object]:
    """A new run: the flags + the trained dataset's recipe + DEFAULTS -> every setting, explicit."""
    if not args.dataset:
        raise TrainError("--dataset is required (e.g. --dataset toyworld, --dataset oxford_pets --root $DATA, "
                         "--dataset all)")
    protocol = _default(args.protocol, DEFAULTS["protocol"])
    names = _dataset_names(args.dataset, protocol, args.source)
    typed = [data.own_dataset_name(n) if data.is_own_data(n) else n for n in args.dataset]  # no paths in a folder name
    output = _default(args.output, os.path.join("runs", f"{protocol}-{'-'.join(typed)}"))
    own = [(data.own_dataset_name(n), os.path.abspath(n)) for n in args.dataset if data.is_own_data(n)]
    if len({name for name, _ in own}) < len(own):
        raise TrainError(f"--dataset {' '.join(path for _, path in own)}: two have the same folder name; rename "
                         "one (the name is used in tables and run folders)")
    dataset_paths = dict(own)
    register_own_data(dataset_paths, output)
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
        source = data.dataset_key(_default(args.source, DEFAULTS["source"]))
        if data.get_spec(source).evaluation_only:
            raise TrainError(f"--source {source}: a test set only; train on a dataset with training images")
    elif args.source:
        raise TrainError(f"--source is for --protocol cross or dg, not {protocol}")
    if source in names:
        raise TrainError(f"--dataset {source}: it is the --source; its test set is already the first column")
    if protocol in ("base2novel", "fewshot"):
        for name in names:
            if name != "toyworld" and data.get_spec(name).evaluation_only:
                raise TrainError(f"--dataset {name} is a test set only; use it with --protocol dg")

    recipe = recipe_of(protocol, source or names[0])
    defaults = dict(DEFAULTS, **TOY_DEFAULTS) if toy else DEFAULTS

    def flag(key: str):  # typed, else the recipe's, else the default
        return _default(getattr(args, key), getattr(recipe, key) if hasattr(recipe, key) else defaults.get(key))

    roles, fusion = _role_choices(flag("roles")), list(dict.fromkeys(flag("fusion")))
    for choice in roles:
        if choice not in ("analyse", *ROLE_ABLATIONS) and not os.path.isfile(choice):
            raise TrainError(f"--roles {choice}: no such file; give a roles JSON written by the head analysis, "
                             f"'analyse', {' or '.join(repr(r) for r in ROLE_ABLATIONS)}")
    if sum(choice not in ROLE_ABLATIONS for choice in roles) > 1:
        raise TrainError(f"--roles {' '.join(roles)}: give at most one of 'analyse' or a roles file (both make the "
                         "DeAR row); add the ablations all-mixed / all-generalization beside it")
    shots = list(dict.fromkeys(_default(args.shots, FEWSHOT_SHOTS if protocol == "fewshot" else [recipe.shots])))
    if protocol != "fewshot" and len(shots) > 1:
        raise TrainError("--shots takes several values only with --protocol fewshot")
    # The order of the keys is the order of settings.json.
    return dict(
        dataset=names, dataset_paths=dataset_paths, template=args.template, protocol=protocol, source=source,
        method=list(dict.fromkeys(flag("method"))), roles=roles, fusion=fusion,
        seeds=list(dict.fromkeys(flag("seeds"))), shots=shots,
        root=args.root, weights=None if toy else flag("weights"),  # toy: its own, found by open_inputs
        head_width=args.head_width,  # None: from the file (clip_model.save records it)
        bpe=args.bpe, output=output,
        first_layer=flag("first_layer"), beta=flag("beta"), text_tokens=flag("text_tokens"),
        lambda_reg=flag("lambda_reg"), lambda_fusion=flag("lambda_fusion"),
        analysis_pool=flag("analysis_pool"), analysis_images=flag("analysis_images"),
        descriptions=args.descriptions,  # None: dear.analysis_picks's default
        low_bits=args.low_bits, high_bits=args.high_bits,
        epochs=flag("epochs"), batch_size=flag("batch_size"), lr=flag("lr"),
        warmup_epochs=flag("warmup_epochs"), warmup_lr=WARMUP_LR, weight_decay=WEIGHT_DECAY,
        augment=recipe.augment if args.augment is None else args.augment == "on",
        device=flag("device"), amp=flag("amp"), workers=args.workers,
        eval_batch_size=flag("eval_batch_size"), log_every=flag("log_every"),
        max_epochs_per_call=args.max_epochs_per_call, toy_scale=flag("toy_scale"),
        fingerprints=None,  # SHA-256 of the weights, BPE and roles files: added by open_inputs
        role_maps=None,  # {trained dataset: the analysed role map's fingerprint, pool, SHA-256}: added by run
    )


def register_own_data(dataset_paths: Dict[str, str], output: str) -> None:
    """Your own data (--dataset PATH): registered in data.py under its folder's name, every
    file checked; a split drawn for a read-only folder goes to <output>/<name>/."""
    for name, path in dataset_paths.items():
        data.own_dataset(path, split_fallback_dir=os.path.join(output, name))


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
                       ("analysis_images", 1), ("warmup_epochs", 0), ("text_tokens", 0)):
        if not (is_int(settings[key]) and settings[key] >= least):
            refuse(key, "a positive integer" if least else "an integer >= 0")
    for key, least in (("head_width", 1), ("workers", 0), ("max_epochs_per_call", 1), ("descriptions", 1)):
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
    analysis_pool_of(settings["analysis_pool"])  # a malformed pool stops here
    template = settings["template"]
    try:
        well_formed = template is None or template.format("x") != template.format("y")
    except (IndexError, KeyError, ValueError):
        well_formed = False
    if not well_formed:
        raise TrainError(f"--template {template!r}: expected a prompt with one '{{}}' for the class name, "
                         "e.g. 'a photo of a {}, a kind of flower.'")
    pick_device(settings["device"])  # an unknown or absent device stops here


def settings_from_run_folder(args: argparse.Namespace) -> Dict[str, object]:
    """--resume / --eval-only: the run folder's saved settings; a flag that would change what
    is computed is refused (it would silently mix two experiments in one folder)."""
    if args.resume and args.eval_only:
        raise TrainError("--resume and --eval-only: give one (--resume finishes the runs, --eval-only "
                         "evaluates the finished runs again)")
    if not args.output:
        raise TrainError("--resume and --eval-only need --output, the run folder to continue")
    if args.analyse_only:
        raise TrainError("--analyse-only starts nothing to resume; drop --resume / --eval-only")
    path = os.path.join(args.output, "settings.json")
    try:
        with open(path, encoding="utf-8") as f:
            saved_file = json.load(f)
        saved = saved_file["settings"]
    except FileNotFoundError:
        raise TrainError(f"{path}: not found; --output must be a run folder made by train.py") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
        raise TrainError(f"{path}: unreadable ({type(error).__name__}); the run folder is damaged") from None
    if saved_file.get("format") != RUN_FORMAT:  # what a folder means changed: refused, not misread
        raise TrainError(f"{path}: a run folder of an earlier train.py ({saved_file.get('format') or 'format 1'}; "
                         f"this one reads {RUN_FORMAT}: one cached head analysis per model, Dassl's warm-up "
                         "recount, renamed fusion rows); finish it with that version, or start a new run")
    expected_keys = set(settings_from_flags(build_parser().parse_args(["--dataset", "dtd"])))
    if not isinstance(saved, dict) or set(saved) != expected_keys or not isinstance(saved["fingerprints"], dict) \
            or not isinstance(saved["dataset_paths"], dict):
        raise TrainError(f"{path}: not the settings of this train.py (damaged, or made by another version); "
                         "start a new run with another --output")
    register_own_data(saved["dataset_paths"], args.output)  # your own data, found and checked again
    # The typed flags in the form settings.json stores them (--augment off -> False, ...):
    # the same value is accepted, another one refused.
    stored_as = {"dataset": lambda v: _dataset_names(v, saved["protocol"], saved["source"]),
                 "source": data.dataset_key, "augment": lambda v: v == "on",
                 "roles": _role_choices, "method": lambda v: list(dict.fromkeys(v)),
                 "seeds": lambda v: list(dict.fromkeys(v)), "shots": lambda v: list(dict.fromkeys(v)),
                 "fusion": lambda v: list(dict.fromkeys(v))}
    for key, value in _given(args).items():
        if key in ("resume", "eval_only", "analyse_only"):
            continue
        value = stored_as.get(key, lambda v: v)(value)
        if key in RUN_CONTROL:
            saved[key] = value
        elif saved.get(key) != value:
            raise TrainError(f"--{key.replace('_', '-')} cannot change in a saved run (it holds "
                             f"{saved.get(key)!r}); drop it, or start a new run with another --output")
    saved["max_epochs_per_call"] = args.max_epochs_per_call  # a limit of an earlier call is not this one's
    return saved


def analysis_pool_of(value: str) -> Tuple[Optional[str], str]:
    """--analysis-pool -> (registry dataset or None for the trained dataset's own, split)."""
    if value == "train":
        return None, "train"
    name, _, split = value.partition(":")
    name = data.dataset_key(name)
    if split not in ("train", "val", "test"):
        raise TrainError(f"--analysis-pool {value}: expected 'train' or DATASET:SPLIT with SPLIT train, val or "
                         "test (e.g. imagenet:test, ImageNet's validation images)")
    data.get_spec(name)  # an unknown name stops here, with the list of known ones
    if data.get_spec(name).evaluation_only and split != "test":
        raise TrainError(f"--analysis-pool {value}: {name} is a test set only; use {name}:test")
    return name, split


# ------------------------------------------------------------------------------------------
# 2. Device and processes
# ------------------------------------------------------------------------------------------
# Where the tensors live, and how many processes share the work. Decided once per call;
# everything below asks the Runtime (device, rank, autocast dtype) instead of deciding again.


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
    if device.type == "cuda" and settings["amp"] == "on":  # autocast on CUDA only; CPU and MPS run fp32
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
# 3. Data: what each protocol trains on and tests on (docs/METHOD.md Sec. 6)
# ------------------------------------------------------------------------------------------
# A call is a list of Jobs (a table row x dataset x seed x shots). Each job trains on one
# few-shot draw and is tested on its protocol's sets, each set with its own class list.


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
# The DeAR row once per --fusion mode; its table key and label say what the mode does.
FUSION_ROWS = {"fused-everywhere": ("-fused", ", fused on every test set"),
               "class-on-unseen": ("-class-on-unseen", ", class branch alone on unseen classes")}


def table_rows(settings: dict) -> Dict[str, tuple]:
    """{table row: (job row, fusion mode)}: zero-shot; the linear probe; the DeAR row (analysed
    or a file) once under every --fusion mode (its key ends in that mode's suffix); each role
    ablation under the first mode only. All DeAR rows of one job row come from the same runs."""
    fusion = settings["fusion"]
    rows = {"zeroshot": ("zeroshot", None), "linear-probe": ("linear-probe", None)}
    for roles in settings["roles"]:
        if roles in ROLE_ABLATIONS:
            rows[row_name(roles)] = (row_name(roles), fusion[0])
        else:
            for mode in fusion:
                rows[row_name(roles) + FUSION_ROWS[mode][0]] = (row_name(roles), mode)
    return rows


def row_label(row: str) -> str:
    for suffix, label in FUSION_ROWS.values():
        if row.endswith(suffix):
            return ROW_LABELS.get(row[: -len(suffix)], row[: -len(suffix)]) + label
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
        # The rows that train, one run per shots x seed: the linear probe, then DeAR once per
        # --roles choice.
        rows = [("linear-probe", None)] if "linear-probe" in settings["method"] else []
        if "dear" in settings["method"]:
            rows += [(row_name(roles), roles) for roles in settings["roles"]]
        for row, roles in rows:
            for shots in settings["shots"]:
                for seed in settings["seeds"]:
                    leaf = f"seed{seed}" if protocol != "fewshot" else f"shots{shots}-seed{seed}"
                    jobs.append(Job(dataset, row, roles, seed, shots, os.path.join(out, dataset, row, leaf)))
    return jobs


def training_split(settings: dict, dataset: str, seed: int, shots: int) -> data.DatasetSplits:
    subsample = "base" if settings["protocol"] == "base2novel" else "all"
    split = data.load_dataset(dataset, settings["root"], num_shots=shots, seed=seed, subsample=subsample)
    split.template = settings["template"] or split.template  # --template overrides the dataset's own
    if not split.train:  # training on nothing would still write a row of the table
        raise TrainError(f"{split.dataset_dir}: no training images{' of the base classes' if subsample == 'base' else ''}; "
                         "the split's 'train' list must name some")
    return split


def evaluation_sets(settings: dict, dataset: str) -> List[EvalSet]:
    """The test sets of a protocol, each with its own class list, and whether its classes are
    the trained ones (which decides the logits under class-on-unseen)."""
    root, protocol = settings["root"], settings["protocol"]

    def full(name: str, column: str, trained: bool, subsample: str = "all") -> EvalSet:
        d = data.load_dataset(name, root, num_shots=None, subsample=subsample)
        if not d.test:  # an accuracy over no images would print as 0.00
            which = {"base": " of the base classes", "new": " of the novel classes"}.get(subsample, "")
            raise TrainError(f"{d.dataset_dir}: no test images{which} ({len(d.classnames)} classes); the "
                             f"{column} column needs some: the split's 'test' list must name them")
        return EvalSet(column, d.test, d.classnames, settings["template"] or d.template, trained)

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


@dataclass
class RunData:
    """Every list of a call, read (and every listed image checked) before anything is written."""

    train: Dict[tuple, data.DatasetSplits]  # (dataset, seed, shots) -> that run's few-shot draw
    test: Dict[str, List[EvalSet]]  # trained dataset -> its protocol's test sets


def read_data(settings: dict, jobs: List[Job]) -> RunData:
    # Each training split is read once per (dataset, seed, shots): rows that differ only in
    # --roles share it, and a load checks every listed image (over a million for ImageNet).
    test = {dataset: evaluation_sets(settings, dataset) for dataset in sorted({job.dataset for job in jobs})}
    train: Dict[tuple, data.DatasetSplits] = {}
    for job in jobs:
        if job.seed is not None and split_key(job) not in train:
            train[split_key(job)] = training_split(settings, *split_key(job))
    return RunData(train, test)


def split_key(job: Job) -> tuple:
    return (job.dataset, job.seed, job.shots)


# ------------------------------------------------------------------------------------------
# 4. Model: CLIP, head roles, DeAR
# ------------------------------------------------------------------------------------------
# The frozen CLIP and its tokenizer are read once per call (open_inputs); each DeAR run
# then gets its head roles (analysed on its own training images, a file, or an ablation)
# and its own learnable tokens on top of the shared CLIP (build_dear).


def load_clip(files: dict, runtime: Runtime):
    """files (weights, head_width, bpe) -> (frozen CLIP on the device, tokenizer). Errors are one line
    (clip_model.CLIPFileError)."""
    clip, _ = clip_model.load(files["weights"], device=runtime.device, head_width=files["head_width"])
    tokenizer = clip_model.SimpleTokenizer(files["bpe"])
    if tokenizer.vocab_size != clip.token_embedding.num_embeddings:  # ids past the table, or other words
        raise TrainError(f"--bpe {tokenizer.bpe_path}: gives a vocabulary of {tokenizer.vocab_size} tokens, the "
                         f"model {files['weights']} has {clip.token_embedding.num_embeddings}; pass the BPE "
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


def input_fingerprints(weights: str, tokenizer: clip_model.SimpleTokenizer, role_file: Optional[str]) -> dict:
    """SHA-256 of every input file that decides the result but is named as a place (--weights,
    --bpe, a --roles file): another file at the same place, or the same file elsewhere, is
    told apart by its content. A named model is its published file, whose SHA-256 clip_model
    checks on every load (the last part of its URL's path)."""
    sha256 = clip_model._sha256  # noqa: SLF001 -- one file hasher for the project (clip_model's)
    if role_file is not None and not os.path.isfile(role_file):  # resumed after the file was moved
        raise TrainError(f"--roles {role_file}: no such file; put it back (the run folder keeps a copy, "
                         "roles_file.json)")
    named = clip_model._MODELS.get(weights)  # noqa: SLF001 -- the published checksums
    return dict(weights=named.split("/")[-2] if named else sha256(weights),
                bpe=sha256(tokenizer.bpe_path),
                roles_file=sha256(role_file) if role_file else None)


def role_file_of(settings: dict) -> Optional[str]:
    """The --roles choice that is a file, if any (at most one per call)."""
    return next((choice for choice in settings["roles"] if choice not in ("analyse", *ROLE_ABLATIONS)), None)


def first_layer_of(settings: dict, clip: clip_model.CLIP) -> int:
    """The paper's 1-based J; "auto" = dear.default_first_layer."""
    if settings["first_layer"] == "auto":
        return dear.default_first_layer(len(clip.visual.transformer.resblocks))
    return int(settings["first_layer"])


def analysed_layers(clip: clip_model.CLIP) -> int:
    return dear.analysed_layers(len(clip.visual.transformer.resblocks))


def role_map_for(choice: str, clip: clip_model.CLIP, attributes: List[str],
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


@dataclass
class Inputs:
    """What every run of a call shares, read once: the frozen CLIP and its tokenizer, the
    attributes (one attribute token each) and the description bank of the head analysis,
    and `files`, the part of the settings known only once the files are found."""

    clip: clip_model.CLIP
    tokenizer: clip_model.SimpleTokenizer
    attributes: List[str]
    bank: List[tuple]  # (text, concept) pairs of the head analysis: dear.py's bank, or the toy world's own
    toy: bool  # the toy world: a causal check follows each head analysis (the ground truth is known)
    files: dict  # root, weights, head_width, bpe, fingerprints: merged into the settings once, by run


def open_inputs(settings: dict, runtime: Runtime) -> Inputs:
    """Find and read the model, the BPE file and a --roles file, and check each against the
    settings before any run folder is written. The toy world enters here, through one call
    (toyworld.prepare) that makes or reuses its model, BPE file and data in the cache."""
    files = {key: settings[key] for key in ("root", "weights", "head_width", "bpe")}
    toy = settings["dataset"] == ["toyworld"]
    attributes, bank = list(dear.CORE_ATTRIBUTES), description_bank(toy)
    if toy:
        import toyworld  # the project's own world (toyworld/), only needed here

        if runtime.world > 1:
            raise TrainError("--dataset toyworld runs in one process; start it without torchrun")
        assets = toyworld.prepare(settings["toy_scale"], log=runtime.log)
        # A new run takes the cache's files (--weights, --bpe, --head-width are refused with
        # toyworld); a resumed one keeps the files it was made with (their content is checked).
        found = dict(root=assets.data_root, weights=assets.weights, head_width=assets.head_width, bpe=assets.bpe)
        files = {key: _default(value, found[key]) for key, value in files.items()}
        attributes, bank = list(assets.attributes), [tuple(entry) for entry in assets.bank]

    clip, tokenizer = load_clip(files, runtime)
    fingerprints = input_fingerprints(files["weights"], tokenizer, role_file_of(settings))
    if settings["resume"] or settings["eval_only"]:  # the files may have moved (a place may change), not changed
        for key, flag in (("weights", f"--weights {files['weights']}"), ("bpe", f"--bpe {tokenizer.bpe_path}"),
                          ("roles_file", f"--roles {role_file_of(settings)}")):
            now, then = fingerprints[key], settings["fingerprints"].get(key)
            if now != then:
                copy = (f" (a copy is {os.path.join(settings['output'], 'roles_file.json')})"
                        if key == "roles_file" else "")
                raise TrainError(f"{flag}: not the file this run was made with (SHA-256 {str(now)[:12]}... now, "
                                 f"{str(then)[:12]}... then); resume with the original file{copy}, or start a "
                                 "new run with another --output")
    files.update(bpe=tokenizer.bpe_path, fingerprints=fingerprints)

    # What DeAR's settings must fit in this model, checked now rather than at the first run.
    if "dear" in settings["method"]:
        if role_file_of(settings) is not None:  # a roles file made for another model stops here
            role_map_for(role_file_of(settings), clip, attributes, None)
        if settings["text_tokens"] > clip.context_length:  # memory grows with (77 + K)^2: a typo, not a setting
            raise TrainError(f"--text-tokens {settings['text_tokens']}: expected at most the model's context "
                             f"length ({clip.context_length})")
        layers = min(len(clip.visual.transformer.resblocks), len(clip.transformer.resblocks))
        if first_layer_of(settings, clip) > layers:  # J counts in both towers
            raise TrainError(f"--first-layer {settings['first_layer']}: expected at most {layers}, the model's "
                             "number of layers (1-based, as in the paper)")
    return Inputs(clip, tokenizer, attributes, bank, toy, files)


def build_dear(settings: dict, inputs: Inputs, role_map: dear.RoleMap) -> dear.DeAR:
    """DeAR on the frozen CLIP, from the settings: the one place it is built (to train a run,
    and to evaluate a finished one with --eval-only). Its learnable tokens are drawn from
    torch's global generator: the caller seeds it."""
    return dear.DeAR(inputs.clip, role_map, inputs.attributes, first_layer=first_layer_of(settings, inputs.clip),
                     beta=settings["beta"], num_text_tokens=settings["text_tokens"])


def analysis_images(items: List[data.Item], cap: int, seed: int) -> List[data.Item]:
    """At most `cap` of the pool's images, spread evenly over its classes: each class's
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


# The head analysis (paper Sec. 3.2) belongs to the CLIP model and the images it was measured
# on, not to a run: it is computed once per (weights, image pool, bank, analysis settings),
# cached under <cache>/head-analysis/<fingerprint>/ (clip_model.default_cache_dir()), and
# reused by every seed, shot count, protocol and dataset that asks for the same thing. Each
# run folder keeps a copy of the map it used (<dataset>/roles/), so --resume and --eval-only
# never need the cache, and settings.json records its fingerprint, pool and SHA-256.
ANALYSIS_SEED = 0  # the pool's draw (analysis_images): fixed, so every run of a model draws the same images
ANALYSIS_RANK = dear.TEXTSPAN_RANK  # TextSpan's rank r (the authors' default, 80)


def role_key(job: Job) -> tuple:
    """Role maps are per trained dataset and --roles choice (every seed and shot count shares one)."""
    return (job.dataset, job.roles)


def analysing(settings) -> bool:
    return settings["analyse_only"] or ("dear" in settings["method"] and "analyse" in settings["roles"])


def description_bank(toy: bool) -> List[tuple]:
    """The bank of the head analysis: the toy world's own, or dear.py's for real CLIP."""
    if toy:
        from toyworld import world  # only the word lists: cheap, builds nothing

        return [tuple(entry) for entry in world.toy_bank()]
    return [tuple(entry) for entry in dear.description_bank()]


def analysis_pool(settings, dataset: str) -> Tuple[List[data.Item], str]:
    """The images the head analysis of trained dataset `dataset` reads (--analysis-pool, capped
    by --analysis-images, evenly over its classes, drawn with ANALYSIS_SEED) and a one-line
    description of them. 'train' is the whole training split, never a few-shot draw, and in
    base2novel its base classes only, so that no image of a novel class is seen before the test."""
    name, split = analysis_pool_of(settings["analysis_pool"])
    if name is None:
        subsample = "base" if settings["protocol"] == "base2novel" else "all"
        items = data.load_dataset(dataset, settings["root"], num_shots=None, subsample=subsample).train
        what = f"{dataset} train" + (" (base classes)" if subsample == "base" else "")
    else:
        items = getattr(data.load_dataset(name, settings["root"], num_shots=None), split)
        what = f"{name} {split}"
    chosen = analysis_images(items, settings["analysis_images"], ANALYSIS_SEED)
    if len(chosen) < 2:  # TextSpan measures variation across images
        raise TrainError(f"--analysis-pool {settings['analysis_pool']}: {what} has {len(chosen)} images; the "
                         "head analysis needs at least 2 (choose another pool, e.g. imagenet:test)")
    return chosen, f"{what}, {len(chosen)} of {len(items)} images, {len({i.label for i in chosen})} classes"


def analysis_fingerprint(settings, inputs: "Inputs", items: List[data.Item], picks: int) -> str:
    """SHA-256 of everything the role map depends on: the weights' and BPE file's SHA-256, the
    pool as its list of images (path under --root) and their sizes in bytes (not their bytes:
    that would read every image), the bank, the analysis settings, and the source of dear.py
    and clip_model.py (a changed TextSpan or head decomposition must not reuse an old map)."""
    import hashlib
    import inspect

    clip = inputs.clip
    key = dict(
        weights=inputs.files["fingerprints"]["weights"], bpe=inputs.files["fingerprints"]["bpe"],
        heads=clip.visual.transformer.heads, layers=analysed_layers(clip),
        images=[[os.path.relpath(item.path, settings["root"]), os.path.getsize(item.path)] for item in items],
        bank=[list(entry) for entry in inputs.bank], attributes=list(inputs.attributes), picks=picks,
        rank=ANALYSIS_RANK, low_bits=settings["low_bits"], high_bits=settings["high_bits"],
        code=hashlib.sha256((inspect.getsource(dear) + inspect.getsource(clip_model)).encode()).hexdigest())
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def cached_analysis(settings, inputs: "Inputs", items: List[data.Item], pool: str, picks: int,
                    runtime: Runtime) -> dict:
    """The role map of these images: from the cache, or analysed now and cached. -> its record
    {fingerprint, pool, images, picks, sha256, cache} (the cache folder holds roles.json,
    roles.txt, roles.png, analysis.json, and in the toy world the causal check)."""
    import shutil

    fingerprint = analysis_fingerprint(settings, inputs, items, picks)
    root = os.path.join(clip_model.default_cache_dir(), "head-analysis")
    entry = os.path.join(root, fingerprint[:16])
    if runtime.main:
        reason = runs.unwritable_reason(root)
        if reason:
            raise TrainError(f"{root}: the head-analysis cache {reason}; set $CLIP_CACHE_DIR to a writable folder")
        os.makedirs(root, exist_ok=True)
        with runs.waiting_lock(entry + ".lock", "head analysis: another process is analysing the same "
                                     f"heads ({entry}.lock); waiting for it", runtime.log):
            if os.path.isfile(os.path.join(entry, "roles.json")):
                runtime.log(f"head analysis: reusing the role map cached in {entry} ({pool})")
            else:
                temporary = os.path.join(root, f".tmp-{os.getpid()}-{fingerprint[:16]}")
                shutil.rmtree(temporary, ignore_errors=True)
                run_head_analysis(settings, inputs, items, pool, picks, temporary, runtime)
                write_json(os.path.join(temporary, "analysis.json"), dict(fingerprint=fingerprint, pool=pool,
                                                                          images=len(items), picks=picks))
                shutil.rmtree(entry, ignore_errors=True)  # an entry without roles.json is incomplete
                os.replace(temporary, entry)  # whole or not at all
    if runtime.world > 1:
        dist.barrier()  # the other processes read what rank 0 wrote
    path = os.path.join(entry, "roles.json")
    return dict(fingerprint=fingerprint, pool=pool, images=len(items), picks=picks,
                sha256=file_sha256(path), cache=entry)


def run_head_analysis(settings, inputs: "Inputs", items: List[data.Item], pool: str, picks: int, folder: str,
                      runtime: Runtime) -> None:
    """DeAR Sec. 3.2 on `items`: concept entropy of every head of the last four layers ->
    roles.json, roles.txt, roles.png in `folder` (and the toy world's causal check)."""
    clip, started = inputs.clip, time.time()
    runtime.log(f"head analysis: concept entropy of every head of the last {analysed_layers(clip)} layers on "
                f"{pool}; {picks} TextSpan picks per head (done once per model and pool, then cached)")
    loader = DataLoader(data.ImageDataset(items, data.test_transform(clip.visual.input_resolution)),
                        batch_size=settings["eval_batch_size"], num_workers=settings["workers"])
    role_map = dear.analyze_heads(
        clip, (images for images, _ in loader), inputs.tokenizer, inputs.bank, inputs.attributes,
        num_layers=analysed_layers(clip), num_descriptions=picks, rank=ANALYSIS_RANK,
        low_bits=settings["low_bits"], high_bits=settings["high_bits"], log=runtime.log)
    role_map.source = f"concept entropy on {pool}"
    table = role_map.table()
    runtime.log(table)
    dear.draw_heatmap(role_map, os.path.join(folder, "roles.png"))
    write_text(os.path.join(folder, "roles.txt"), table + "\n")
    if inputs.toy:
        toy_causal_check(inputs, role_map, folder, runtime.log)
    role_map.save(os.path.join(folder, "roles.json"))
    runtime.log(f"head analysis: done in {format_time(time.time() - started)}")


def analysed_role_maps(settings, inputs: "Inputs", runtime: Runtime) -> Tuple[Dict[str, dear.RoleMap], dict]:
    """{trained dataset: its analysed RoleMap}, {trained dataset: the map's record}. A new run
    takes them from the cache (analysing what is not there); --resume / --eval-only read the
    run folder's copies and check them against the SHA-256 that settings.json recorded."""
    maps, records = {}, {}
    if not analysing(settings):
        return maps, records
    for dataset in trained_datasets(settings):
        if settings["resume"] or settings["eval_only"]:
            record, path = (settings["role_maps"] or {}).get(dataset), role_copy(settings, dataset)
            if record is None or not os.path.isfile(path) or file_sha256(path) != record["sha256"]:
                raise TrainError(f"{path}: missing or not the role map this run was made with; the run folder is "
                                 "damaged, start a new run with another --output")
        else:
            items, pool = analysis_pool(settings, dataset)
            picks = dear.analysis_picks(settings["descriptions"], len(inputs.bank), len(items), rank=ANALYSIS_RANK,
                                        embed_dim=inputs.clip.visual.proj.shape[1],
                                        default=dear.default_picks(inputs.bank, inputs.attributes))
            record = cached_analysis(settings, inputs, items, pool, picks, runtime)
            path = os.path.join(record["cache"], "roles.json")
        maps[dataset], records[dataset] = load_role_file(path), record
        record.setdefault("class_branch_only", dear.falls_back_to_class_branch(maps[dataset]))
        if record["class_branch_only"]:
            runtime.log(f"head analysis ({dataset}): no attribute head; DeAR falls back to the class branch alone")
    return maps, records


def file_sha256(path: str) -> str:
    return clip_model._sha256(path)  # noqa: SLF001 -- one file hasher for the project (clip_model's)


def role_copy(settings, dataset: str) -> str:
    return os.path.join(settings["output"], dataset, "roles", "roles.json")


def copy_role_maps(settings, inputs: "Inputs", records: dict) -> None:
    """The run folder keeps what the cache holds for each map it uses, and the masks of its own
    J (masks.png: the role map does not fix J, so it is drawn per run)."""
    import shutil

    for dataset, record in records.items():
        folder = os.path.dirname(role_copy(settings, dataset))
        os.makedirs(folder, exist_ok=True)
        for name in sorted(os.listdir(record["cache"])):  # each file whole (clip_model.atomic_write)
            source = os.path.join(record["cache"], name)
            dear.atomic_write(os.path.join(folder, name), lambda tmp: shutil.copyfile(source, tmp))
        role_map, clip = load_role_file(role_copy(settings, dataset)), inputs.clip
        J, image_tokens = first_layer_of(settings, clip), 1 + clip.visual.grid_size**2
        masks = dear.build_role_masks(role_map, J, len(clip.visual.transformer.resblocks), image_tokens)
        dear.draw_role_masks(masks, image_tokens, role_map.attributes, J, os.path.join(folder, "masks.png"))


def trained_datasets(settings) -> List[str]:
    return [settings["source"]] if settings["source"] else list(settings["dataset"])


def toy_causal_check(inputs: Inputs, role_map: dear.RoleMap, folder: str, log) -> None:
    """Toy world only: is concept entropy right? Mean-ablate each analysed head and see which
    attribute's zero-shot accuracy falls (the ground truth is known here), then compare with
    the head's role. Saved as causal_check.md / .json next to roles.json."""
    import toyworld

    if os.path.isfile(os.path.join(folder, "causal_check.json")):
        return  # done in an earlier call (a call killed during the check redoes it on --resume)
    log("[toyworld] causal check: mean-ablating every analysed head, zero-shot accuracy per attribute")
    # The check draws its images and prompts on the CPU: on a GPU it runs on a CPU copy of the
    # toy CLIP (1.6M parameters), which also gives the same table on every device.
    clip = inputs.clip if inputs.clip.visual.conv1.weight.is_cpu else copy.deepcopy(inputs.clip).cpu()
    result = toyworld.causal_check(clip, inputs.tokenizer, role_map, role_map.attributes, log=log)
    write_text(os.path.join(folder, "causal_check.md"), result["table"] + "\n")
    write_json(os.path.join(folder, "causal_check.json"), result)  # last: marks the check done
    log(result["table"])


# ------------------------------------------------------------------------------------------
# 5. Optimizer and schedule
# ------------------------------------------------------------------------------------------
# Dassl's (CoOp's) schedule, which MMRL and so DeAR's recipe use: set once per epoch, not
# per step, so a resumed epoch starts at exactly the learning rate an unbroken run had.


def learning_rate(settings: dict, epoch: int) -> float:
    """Dassl's schedule for epoch `epoch` (0-based): the constant warm-up lr (1e-5) for the first
    warmup_epochs, then cosine annealing over `epochs` whose count restarts after the warm-up
    (WARMUP_RECOUNT = True, Dassl's default: dassl/optim/lr_scheduler.py, ConstantWarmupScheduler
    hands over to a CosineAnnealingLR(T_max = epochs) that was never stepped). So the first
    epoch after the warm-up runs at the full lr, and epoch e at lr (1 + cos(pi (e - W) / T)) / 2."""
    warmup = settings["warmup_epochs"]
    if epoch < warmup:
        return settings["warmup_lr"]
    return 0.5 * settings["lr"] * (1 + math.cos(math.pi * (epoch - warmup) / settings["epochs"]))


def grad_scaler(enabled: bool):
    """fp16 autocast's loss scaler. torch.amp.GradScaler("cuda") is torch >= 2.3; older
    torch (requirements.txt allows 2.1) has the same class as torch.cuda.amp.GradScaler."""
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


# ------------------------------------------------------------------------------------------
# 6. Evaluation
# ------------------------------------------------------------------------------------------
# Top-1 accuracy. DeAR gives two kinds of logits in one pass (fused, and the class branch
# alone); the fusion mode decides per test set which one is reported (logits_used).


def logits_used(eval_set: EvalSet, fusion: str) -> str:
    """"fused" or "class": which of DeAR's logits score this test set under this fusion mode."""
    return "fused" if fusion == "fused-everywhere" or eval_set.trained else "class"


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


# Attribute-conditioned retrieval (the paper's check that an attribute token carries its
# attribute): the test images ranked by each feature of a trained DeAR (dear.rank_gallery).
RETRIEVAL_GALLERY = 2000  # test images at most, spread over the classes (our choice: cost)
RETRIEVAL_QUERIES, RETRIEVAL_SHOWN, RETRIEVAL_K = 4, 8, 10


@torch.no_grad()
def retrieval_check(model: dear.DeAR, job: Job, settings: dict, inputs: Inputs, lists: RunData,
                    runtime: Runtime) -> Optional[dict]:
    """For a trained DeAR run: retrieval_<feature>.png in its folder (per row, a test image
    then its nearest test images by that feature: each attribute token that can read the
    image, the class feature, frozen CLIP). In the toy world, where every image's attributes
    are known, also precision@10 of same-value retrieval: {feature: {attribute: share}}, with
    "blind" for a token that cannot read the image. Returns that (None elsewhere)."""
    names = ("base", "novel", "all", job.dataset)  # the trained dataset's own test split
    items = list({item.path: item for s in lists.test[job.dataset] if s.name in names for item in s.items}.values())
    gallery = analysis_images(items, RETRIEVAL_GALLERY, seed=0)  # evenly over the classes
    size = inputs.clip.visual.input_resolution
    loader = DataLoader(data.ImageDataset(gallery, data.test_transform(size)),
                        batch_size=settings["eval_batch_size"], num_workers=settings["workers"])
    parts = [dear.retrieval_features(model, images.to(runtime.device)) for images, _ in loader]
    features = {name: torch.cat([p[name] for p in parts]).cpu() for name in parts[0]}  # {name: (G, E)}
    rankings = {name: dear.rank_gallery(f, f, max(RETRIEVAL_K, RETRIEVAL_SHOWN), same_images=True)
                for name, f in features.items()}  # {name: (G, k)}

    import torchvision  # torch's own companion (requirements.txt): the picture grid

    unnormalised = torchvision.transforms.Compose(data.test_transform(size).transforms[:-1])  # pixels in [0, 1]
    shown = data.ImageDataset(gallery, unnormalised)
    for name, ranking in rankings.items():
        tiles = [shown[i][0] for q in range(min(RETRIEVAL_QUERIES, len(gallery)))
                 for i in [q] + ranking[q, :RETRIEVAL_SHOWN].tolist()]
        tiles = F.interpolate(torch.stack(tiles), scale_factor=max(1, 96 // size), mode="nearest")  # small: enlarged
        path = os.path.join(job.folder, f"retrieval_{name.replace(' ', '_')}.png")
        dear.atomic_write(path, lambda tmp: torchvision.utils.save_image(
            tiles, tmp, nrow=1 + RETRIEVAL_SHOWN, padding=2, pad_value=1.0, format="PNG"))
    runtime.log(f"[{job.label}] retrieval: {len(gallery)} test images ranked by {', '.join(rankings)}; "
                f"pictures retrieval_*.png in {job.folder}")
    if not inputs.toy:
        return None
    from toyworld.task import split_scenes  # the toy world knows every test image's attributes

    images_dir = os.path.join(settings["root"], "toyworld", "images")
    scenes = split_scenes(settings["root"])
    scenes = [scenes[os.path.relpath(item.path, images_dir).replace(os.sep, "/")] for item in gallery]
    table = {name: {} for name in ["class"] + inputs.attributes + ["frozen CLIP"]}
    for name in table:
        for attribute in inputs.attributes:
            values = [getattr(scene, attribute) for scene in scenes]
            table[name][attribute] = ("blind" if name not in rankings else
                                      dear.precision_at_k(rankings[name][:, :RETRIEVAL_K], values, values))
    return table


def retrieval_summary(results: List[dict], attributes: List[str]) -> Tuple[dict, str]:
    """Precision@10 per (feature, attribute), mean and spread over a DeAR row's seeds ->
    (JSON, markdown)."""
    summary, lines = {}, []
    for row in dict.fromkeys(res["job"]["row"] for res in results if res.get("retrieval")):
        tables = [res["retrieval"] for res in results if res["job"]["row"] == row and res.get("retrieval")]
        seeds = lambda name, a: [t[name][a] for t in tables]  # noqa: E731
        summary[row] = {name: {a: "blind" if "blind" in seeds(name, a) else
                               [100 * mean(seeds(name, a)), 100 * spread(seeds(name, a))]
                               for a in attributes} for name in tables[0]}
        lines += [f"## {row_label(row)}: precision@{RETRIEVAL_K} (%) of same-value retrieval, "
                  f"mean ± sd over {len(tables)} seeds", "",
                  "| ranked by | " + " | ".join(f"same {a}" for a in attributes) + " |", "|---|" + "---:|" * len(attributes)]
        for name, cells in summary[row].items():
            label = {"class": "class feature", "frozen CLIP": "frozen CLIP"}.get(name, f"{name} token")
            lines.append(f"| {label} | " + " | ".join(
                "blind" if v == "blind" else f"{v[0]:.1f} ± {v[1]:.1f}" for v in cells.values()) + " |")
        lines.append("")
    text = ("# Attribute-conditioned retrieval\n\nGallery: the test split; each test image queries the others "
            f"by one feature (cosine); a hit is a neighbour with the query's value. Chance = the value's share "
            "of the test images. A blind token cannot read the image and ranks nothing.\n\n" + "\n".join(lines))
    return summary, text


# ------------------------------------------------------------------------------------------
# 7. The loop
# ------------------------------------------------------------------------------------------
# One DeAR run: AdamW on the learnable tokens and fusion weights alone (CLIP stays frozen),
# the per-epoch learning rate of section 5, the losses of dear.dear_loss, and a checkpoint
# at every epoch end. run_job wraps it: train (or load), evaluate, write results.json.


def train_job(job: Job, settings: dict, inputs: Inputs, role_map: dear.RoleMap, split: data.DatasetSplits,
              runtime: Runtime) -> Optional[dear.DeAR]:
    """Train one DeAR run; return the model, or None when --max-epochs-per-call stopped it."""
    clip = inputs.clip
    torch.manual_seed(job.seed)  # the learnable tokens' initialisation
    model = build_dear(settings, inputs, role_map).to(runtime.device)
    runtime.log(f"[{job.label}] {len(split.train)} training images, {len(split.classnames)} classes; "
                f"attribute tokens from layer J={model.first_layer} (1-based)"
                f"{'; class branch alone (no attribute head)' if model.class_branch_only else ''}; "
                f"{model.parameter_summary()}")
    optimizer = torch.optim.AdamW(model.learnable_parameters(), lr=settings["lr"],
                                  weight_decay=settings["weight_decay"])
    scaler = grad_scaler(enabled=runtime.amp_dtype == torch.float16)  # fp16 only; bf16 needs no scaling

    # A resumed run continues after its last finished epoch, with the optimizer's moments.
    expected = job_settings(settings, job)
    checkpoint_path = os.path.join(job.folder, "checkpoint.pt")
    start_epoch = 0
    checkpoint = load_checkpoint(checkpoint_path, expected) if settings["resume"] else None
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
    # The class prompts' frozen text side is computed once per run (the learned text tokens
    # enter at layer J inside every forward pass).
    class_ids = inputs.tokenizer.tokenize(split.prompts, clip.context_length, truncate=True).to(runtime.device)
    with autocast(runtime):
        classes = model.prepare_classes(class_ids)
    loader = train_loader(split, settings, job.seed, clip.visual.input_resolution, runtime)
    stop_at = settings["epochs"]
    if settings["max_epochs_per_call"] is not None:
        stop_at = min(stop_at, start_epoch + settings["max_epochs_per_call"])
    progress = Progress(job, settings, runtime, steps=(stop_at - start_epoch) * len(loader))

    model.train()
    for epoch in range(start_epoch, stop_at):
        # Everything random in an epoch (the order, the augmentation) is seeded by
        # (seed, epoch) alone, so an epoch replays identically after a --resume.
        loader.sampler.set_epoch(epoch)
        torch.manual_seed(job.seed * 100_003 + epoch)
        lr = learning_rate(settings, epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        progress.start_epoch()
        for step, (images, labels) in enumerate(loader, 1):
            images, labels = images.to(runtime.device, non_blocking=True), labels.to(runtime.device)
            with autocast(runtime):
                output = network(images, classes, with_frozen=True)  # also frozen CLIP's, for L_reg
                losses = dear.dear_loss(output, labels, settings["lambda_reg"], settings["lambda_fusion"])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(losses["total"]).backward()
            scaler.step(optimizer)
            scaler.update()
            progress.step(epoch, step, len(loader), lr, losses, output.logits, labels)
        if runtime.main:  # rank 0 writes; every rank holds the same tokens (DDP)
            save_checkpoint(checkpoint_path, dict(
                format=CHECKPOINT_FORMAT, settings=expected, epoch=epoch + 1, learnable=model.learnable_state_dict(),
                optimizer=optimizer.state_dict(), scaler=scaler.state_dict()))
        alpha = ", ".join(f"{a:.2f}" for a in model.fusion_weights().tolist())
        runtime.log(f"[{job.label}] epoch {epoch + 1} done in {format_time(time.time() - progress.epoch_started)}; "
                    f"fusion weights alpha (cls, {', '.join(inputs.attributes)}) = {alpha}; checkpoint saved")
    if runtime.world > 1:
        dist.barrier()
    if stop_at < settings["epochs"]:
        runtime.log(f"[{job.label}] stopped after epoch {stop_at}/{settings['epochs']} (--max-epochs-per-call); "
                    f"continue with: python train.py --output {settings['output']} --resume")
        return None
    return model


class Progress:
    """The running sums of an epoch and its progress lines (every --log-every steps and at the
    epoch's end): the losses and the training accuracy averaged over the images seen so far,
    the speed, and the time left of this call from the speed so far."""

    def __init__(self, job: Job, settings: dict, runtime: Runtime, steps: int):
        self.job, self.settings, self.runtime, self.steps = job, settings, runtime, steps
        self.started, self.done = time.time(), 0

    def start_epoch(self) -> None:
        self.sums = {"total": 0.0, "ce": 0.0, "reg": 0.0, "fusion": 0.0, "correct": 0.0, "images": 0.0}
        self.epoch_started = time.time()

    def step(self, epoch: int, step: int, steps_per_epoch: int, lr: float, losses: dict, logits, labels) -> None:
        sums, settings = self.sums, self.settings
        for key in ("total", "ce", "reg", "fusion"):
            sums[key] += losses[key].item() * len(labels)
        sums["correct"] += (logits.argmax(-1) == labels).sum().item()
        sums["images"] += len(labels)
        self.done += 1
        if step % settings["log_every"] == 0 or step == steps_per_epoch:
            left = (time.time() - self.started) / self.done * (self.steps - self.done)
            rate = sums["images"] * self.runtime.world / max(time.time() - self.epoch_started, 1e-9)
            n = sums["images"]
            self.runtime.log(
                f"[{self.job.label}] epoch {epoch + 1}/{settings['epochs']} step {step}/{steps_per_epoch} "
                f"loss {sums['total'] / n:.4f} (ce {sums['ce'] / n:.4f} reg {sums['reg'] / n:.4f} "
                f"fusion {sums['fusion'] / n:.4f}) acc {100 * sums['correct'] / n:.1f}% lr {lr:.2e} "
                f"{rate:.1f} img/s, {format_time(left)} left")


def run_job(job: Job, settings: dict, inputs: Inputs, role_maps: dict, lists: RunData,
            runtime: Runtime) -> Optional[dict]:
    """Train (unless zero-shot) and evaluate one job -> its results, or None if not finished."""
    results_path = os.path.join(job.folder, "results.json")
    if os.path.isfile(results_path) and not settings["eval_only"]:
        with open(results_path, encoding="utf-8") as f:
            return json.load(f)  # finished in an earlier call (checked by check_finished_runs)
    model = None
    if job.row == "linear-probe":
        metrics = linear_probe(inputs.clip, lists.train[split_key(job)], lists.test[job.dataset], settings, runtime)
        result = dict(job=dataclasses.asdict(job), metrics=metrics, settings=job_settings(settings, job))
        if runtime.main:
            write_text(os.path.join(job.folder, "results.md"), job_table(job, metrics))
            write_json(results_path, result)
        return result
    if job.row != "zeroshot":
        if settings["eval_only"]:
            checkpoint = load_checkpoint(os.path.join(job.folder, "checkpoint.pt"), job_settings(settings, job))
            if checkpoint is None or checkpoint["epoch"] < settings["epochs"]:
                raise TrainError(f"{job.folder}: no finished checkpoint to evaluate; finish it with --resume")
            model = build_dear(settings, inputs, role_maps[role_key(job)]).to(runtime.device)
            model.load_learnable_state_dict(checkpoint["learnable"])
        else:
            model = train_job(job, settings, inputs, role_maps[role_key(job)], lists.train[split_key(job)], runtime)
            if model is None:
                return None
        model.eval()
    # One pass per test set gives every kind of logits; each fusion mode then picks per set.
    accuracy, logits = {}, {mode: {} for mode in settings["fusion"]}
    for eval_set in lists.test[job.dataset]:
        accuracy[eval_set.name] = evaluate(model, inputs.clip, inputs.tokenizer, eval_set, settings, runtime)
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
    # role_map: which analysed map (fingerprint, pool, SHA-256) the run used, if it used one.
    result = dict(job=dataclasses.asdict(job), metrics=by_fusion[first], fusion=first, logits=logits[first],
                  metrics_by_fusion=by_fusion, logits_by_fusion=logits, accuracy_by_logits=accuracy,
                  role_map=(settings["role_maps"] or {}).get(job.dataset) if job.roles == "analyse" else None,
                  settings=job_settings(settings, job))
    if runtime.main:
        if model is not None:  # pictures in the run folder; the toy world's precision@10 in the result
            result["retrieval"] = retrieval_check(model, job, settings, inputs, lists, runtime)
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
    else:  # cross and dg: one training on the source; other datasets and ImageNet's variants get a table each
        source = settings["source"]
        for title, dg in (("Cross-dataset evaluation", False), ("Domain generalization", True)):
            targets = [t for t in settings["dataset"] if data.get_spec(t).evaluation_only == dg]
            if not targets:
                continue
            values = {row: [cell(source, row, source)] + [cell(source, row, t) for t in targets] for row in rows}
            for row in rows:
                values[row].append(mean(values[row][1:]))
            names = [DG_NAMES.get(n, n) if dg else n for n in [source] + targets]
            tables[f"{title}: trained on {source}, tested on {len(targets)} targets"] = dict(
                columns=[f"{names[0]} (source)"] + names[1:] + ["Average"], rows=values)
    for table in tables.values():  # an empty cell (nan) is stored as null
        for key in ("rows", "spread"):
            if key in table:
                table[key] = {row: [None if math.isnan(v) else round(v, 2) for v in vals]
                              for row, vals in table[key].items()}
    return dict(protocol=protocol, seeds=settings["seeds"], rows=rows, tables=tables, logits=logits)


def markdown(summary: dict, settings: dict) -> str:
    titles = {"base2novel": "Base-to-novel generalization", "fewshot": "Few-shot classification",
              "cross": "Cross-dataset evaluation and domain generalization",
              "dg": "Cross-dataset evaluation and domain generalization"}
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
    lines.append("Logits per test set (fused = DeAR's fusion with the weights learned on the training classes; "
                 "class branch alone = MMRL's rule for classes not trained):")
    for row, used in summary.get("logits", {}).items():
        if used:
            lines.append(f"- {row_label(row)}: " + ", ".join(f"{test} {names.get(kind, kind)}"
                                                             for test, kind in used.items()))
    fallen = [name for name, record in (settings.get("role_maps") or {}).items() if record.get("class_branch_only")]
    if fallen:  # dear.falls_back_to_class_branch: both DeAR rows are then the class branch's
        lines.append(f"- The head analysis of {', '.join(fallen)} names no attribute head: DeAR falls back to the "
                     "class branch alone there.")
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# 9. The run folder: files written whole, checkpoints, the lock
# ------------------------------------------------------------------------------------------
# The plumbing that makes a run folder trustworthy: every file is written to a temporary
# name and renamed (a reader never sees half a file), a checkpoint or results.json is
# accepted only with the settings of this run, and one process at a time writes a folder.

CHECKPOINT_FORMAT = "dear-from-scratch checkpoint, version 1"  # checked on load: not some other .pt
# What a run folder means. Version 2: one cached head analysis per model and pool (copied to
# <dataset>/roles/), Dassl's warm-up recount, the fusion rows named by what they do, the
# lineage's per-protocol recipes. An older folder is refused on --resume / --eval-only.
RUN_FORMAT = "dear-from-scratch run folder, version 2"


def write_text(path: str, text: str) -> None:
    # clip_model.atomic_write (dear.py re-exports it): a run killed mid-write keeps the old file.
    dear.atomic_write(path, lambda tmp: open(tmp, "w", encoding="utf-8").write(text))


def write_json(path: str, value) -> None:
    write_text(path, json.dumps(value, indent=2, allow_nan=False) + "\n")  # NaN is not JSON


def job_settings(settings: dict, job: Job) -> dict:
    """What decides a run's result: saved with it and compared on --resume."""
    keep = {k: v for k, v in settings.items() if k not in RUN_CONTROL}
    return dict(keep, job=dict(dataset=job.dataset, row=job.row, roles=job.roles, seed=job.seed, shots=job.shots))


class WrongShape(ValueError):
    """A run file that parses but does not hold what this script writes."""


def well_shaped(condition: bool) -> None:
    """Raise WrongShape unless `condition`: an explicit check, where `assert` would vanish
    under `python -O` and let a damaged file through to a traceback later."""
    if not condition:
        raise WrongShape("wrong shape")


def load_checkpoint(path: str, expected: dict) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        well_shaped(isinstance(checkpoint, dict) and checkpoint.get("format") == CHECKPOINT_FORMAT
                    and isinstance(checkpoint.get("epoch"), int) and isinstance(checkpoint.get("settings"), dict)
                    and all(isinstance(checkpoint.get(key), dict) for key in ("learnable", "optimizer", "scaler")))
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
                well_shaped(isinstance(result, dict) and isinstance(result.get("metrics"), dict)
                            and all(isinstance(v, float) for v in result["metrics"].values())
                            and isinstance(result.get("job"), dict) and isinstance(result.get("settings"), dict))
            except (OSError, ValueError, RecursionError) as error:
                raise TrainError(f"{path}: unreadable results ({type(error).__name__}); delete it and "
                                 "--resume evaluates that run again") from None
            if result["settings"] != job_settings(settings, job):
                raise TrainError(f"{path}: made with other settings than this run's "
                                 f"({differences(result['settings'], job_settings(settings, job))}): the folder "
                                 "mixes two runs; start again with another --output")
        elif job.row != "zeroshot":
            load_checkpoint(os.path.join(job.folder, "checkpoint.pt"), job_settings(settings, job))


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


def check_output_folder(output: str) -> None:
    """A fresh run's --output must be a folder that can be made and written, and not already
    hold a run. Checked before the data and the model are read."""
    if not output:
        raise TrainError("--output '': expected a folder for the run")
    if os.path.exists(output) and not os.path.isdir(output):
        raise TrainError(f"--output {output}: is a file, not a folder; choose another --output")
    reason = runs.unwritable_reason(output)  # tried by writing, before any data is read
    if reason:
        raise TrainError(f"--output {output}: {reason}; choose another --output")
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


def start_run_folder(settings: dict, inputs: Inputs, runtime: Runtime, stack: contextlib.ExitStack) -> None:
    """A new run's folder: made, locked, checked again under the lock (another call may have
    started it meanwhile), then the roles it uses and, last, settings.json written."""
    output = settings["output"]
    os.makedirs(output, exist_ok=True)
    lock_run_folder(output, stack)
    check_output_folder(output)
    remove_temporary_files(output)
    if role_file_of(settings) is not None:  # the run keeps the roles it used
        with open(role_file_of(settings), encoding="utf-8") as f:
            write_text(os.path.join(output, "roles_file.json"), f.read())
    copy_role_maps(settings, inputs, settings["role_maps"] or {})  # --resume / --eval-only read these
    saved = {k: v for k, v in settings.items() if k not in ("resume", "eval_only", "analyse_only")}
    write_json(os.path.join(output, "settings.json"), dict(
        format=RUN_FORMAT, settings=saved, torch=torch.__version__, python=platform.python_version(),
        command="python train.py " + " ".join(sys.argv[1:]), world_size=runtime.world))


# ------------------------------------------------------------------------------------------
# main: settings -> device -> inputs -> data -> runs -> tables
# ------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # data.py's warnings (a class with fewer than K images, a rebuilt cache) as one line each.
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    try:
        settings = resolve_settings(args)
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
    """Every check first (the folder, the device, the files, the data), then the run folder,
    then the runs in order, then the tables. Nothing is written before the last check."""
    jobs = plan_jobs(settings)
    fresh = not (settings["resume"] or settings["eval_only"])
    if fresh:
        check_output_folder(settings["output"])
    elif int(os.environ.get("RANK", "0")) == 0:  # the folder exists: lock it before reading it
        lock_run_folder(settings["output"], stack)
        remove_temporary_files(settings["output"])
        check_finished_runs(settings, jobs)

    if analysing(settings) and fresh and settings["descriptions"] is not None:  # before any work: a typed
        # --descriptions against the bank and the pool's cap (the default is capped, with a warning, later)
        dear.analysis_picks(settings["descriptions"], len(description_bank(settings["dataset"] == ["toyworld"])),
                            settings["analysis_images"], rank=ANALYSIS_RANK)
    runtime = setup_runtime(settings)  # 2. device (and processes, under torchrun)
    inputs = open_inputs(settings, runtime)  # 4. model: CLIP, tokenizer, the toy world, checked
    settings = dict(settings, **inputs.files)  # the files' places and SHA-256 complete the settings
    # 3. data: every list read, every listed image checked (the analysis alone needs none of it)
    lists = read_data(settings, jobs) if not settings["analyse_only"] else None
    analysed, records = analysed_role_maps(settings, inputs, runtime)  # one cached analysis per pool
    if fresh:
        settings["role_maps"] = records or None
    settings = types.MappingProxyType(settings)  # read-only from here on
    if settings["analyse_only"]:
        if runtime.main:
            check_output_folder(settings["output"])
            copy_role_maps(settings, inputs, records)
            for dataset in records:
                runtime.log(f"train.py: head roles of {dataset} in {os.path.dirname(role_copy(settings, dataset))} "
                            "(roles.json, roles.txt, roles.png, masks.png); train with them by leaving out "
                            "--analyse-only (the cache is reused)")
        return 0

    if runtime.main and fresh:  # from here on the run folder exists
        start_run_folder(settings, inputs, runtime, stack)
    runtime.log(f"train.py: {settings['protocol']} on {', '.join(settings['dataset'])}; {len(jobs)} runs "
                f"({', '.join(dict.fromkeys(job.row for job in jobs))}); device {runtime.device}"
                f"{f' x {runtime.world} processes' if runtime.world > 1 else ''}"
                f"{f', autocast {runtime.amp_dtype}' if runtime.amp_dtype else ''}; output {settings['output']}")

    # The head roles of every DeAR run: one map per trained dataset and --roles choice.
    role_maps = {role_key(job): role_map_for(job.roles, inputs.clip, inputs.attributes, analysed.get(job.dataset))
                 for job in jobs if job.roles is not None}

    # A run counts as done once its results.json is written, the whole call once summary.md is.
    started, results = time.time(), []
    for index, job in enumerate(jobs, 1):
        runtime.log(f"== run {index}/{len(jobs)}: {job.label} "
                    f"(elapsed {format_time(time.time() - started)}) ==")
        result = run_job(job, settings, inputs, role_maps, lists, runtime)
        if result is None:
            return 0  # stopped by --max-epochs-per-call; resumable
        results.append(result)

    summary = summarise(settings, results)
    text = markdown(summary, settings)
    if runtime.main:
        write_json(os.path.join(settings["output"], "summary.json"), summary)
        write_text(os.path.join(settings["output"], "summary.md"), text)
    runtime.log("\n" + text)
    if any(res.get("retrieval") for res in results):  # the toy world: attribute-conditioned retrieval
        retrieval, text = retrieval_summary(results, inputs.attributes)
        if runtime.main:
            write_json(os.path.join(settings["output"], "retrieval.json"), retrieval)
            write_text(os.path.join(settings["output"], "retrieval.md"), text)
        runtime.log(text)
    runtime.log(f"train.py: done in {format_time(time.time() - started)}; tables in "
                f"{os.path.join(settings['output'], 'summary.md')}")
    if runtime.world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
