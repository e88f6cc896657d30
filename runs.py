"""
runs.py -- the run-folder harness: the boilerplate a student of the method need not read.

train.py is the teaching path (recipes, data, model, head analysis, loop, evaluation); here is
what makes a run folder safe and repeatable: flags -> checked settings, the ablations (ablate:
each name's one change), the refusal to resume over other settings, the head analysis'
description pool, input fingerprints, locks, checkpoints and resuming, temporary-file cleanup,
devices and processes, summary tables, PNG pictures (roles, masks, retrieval) and one-line
errors.
It imports clip_model.py, dear.py and data.py (which never import it) and never train.py:
train.py passes in what it needs (a RecipeBook).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import hashlib
import importlib.metadata
import importlib.util
import inspect
import itertools
import json
import math
import os
import platform
import secrets
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import clip_model
import data
import dear

# What a call can ask for. DeAR gives two kinds of logits (fused, and the class branch alone),
# and its public material does not settle which its tables use (docs/METHOD.md Sec. 5), so
# every table shows the DeAR row under both rules by default:
#   fused-everywhere   the fused logits, weights learned on the training classes, on every test set
#   class-on-unseen    fused on the trained classes in the trained domain; the class branch alone
#                      on classes not trained (novel classes, other datasets, variants): MMRL's code
PROTOCOLS = ("base2novel", "fewshot", "cross", "dg")
METHODS = ("zeroshot", "linear-probe", "dear")
FUSION_MODES = ("fused-everywhere", "class-on-unseen")
OLD_FUSION_NAMES = {"everywhere": "fused-everywhere", "adaptive": "class-on-unseen"}
ROLE_ABLATIONS = ("all-mixed", "all-generalization")  # besides "analyse" and a roles file
# The ablations (--ablations), each a DeAR row with one change: ABLATIONS and ablate, Sec. 3.
# The head analysis as a whole (--analysis): the project's (its labelled bank, checked on the toy
# world against ablation) or the paper's Sec. 3.2 (analysis_preset; docs/METHOD.md Sec. 3's table
# of departures).
ANALYSES = ("project", "paper")
# SBERT, the paper's sentence encoder (--sentence-encoder sbert): sentence-transformers'
# all-MiniLM-L6-v2 unless another model is named. An optional extra, imported only when chosen.
SBERT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
SBERT_INSTALL = "pip install -r requirements-sbert.txt"
TEST_BETAS = ("per-target", "trained")  # cross, dg: DeAR's beta on a target (train.beta_at_test)
# numpy's range; the per-epoch seeds are derived from it (seed * 100003 + epoch)
MAX_SEED = 2**32 - 1
# Every setting of a run, in settings.json's order.
SETTING_KEYS = ("dataset dataset_paths template protocol source method roles ablations fusion "
                "seeds shots root weights head_width bpe output first_layer beta test_beta tokens "
                "text_tokens lambda_reg lambda_fusion analysis analysis_pool analysis_images bank "
                "concepts sentence_encoder min_cluster_size min_samples cluster_names descriptions "
                "low_bits high_bits epochs "
                "batch_size lr warmup_epochs warmup_lr weight_decay augment image_cache device amp "
                "workers "
                "eval_batch_size log_every max_epochs_per_call toy_scale attention fingerprints "
                "role_maps").split()
# Flags that say how to run, not what to compute: they may change on --resume / --eval-only.
RUN_CONTROL = {"output", "resume", "eval_only", "device", "workers", "log_every", "eval_batch_size",
               "max_epochs_per_call", "amp", "attention", "root", "weights",
               "bpe"}  # (and the files' places)
CHECKPOINT_FORMAT = "dear-from-scratch checkpoint, version 1"  # checked on load: not some other .pt
# What a run folder means. Version 2: one cached head analysis per model and pool (copied to
# <dataset>/roles/), Dassl's warm-up recount, the fusion rows named by what they do, the
# lineage's per-protocol recipes. Version 3: the analysis's concepts from clusters or labels,
# from a chosen description pool; the ablation rows; the test-time beta per target. Version 4: the
# token construction (--tokens separate | shared, a setting), K resolved and saved as a number
# (unset: 4 under separate, A under shared), the learnable parameters per component in each
# results.json; the analysis as a whole (--analysis) and its sentence encoder
# (--sentence-encoder); each training image's augmentation drawn from its own generator, seeded
# by (seed, epoch, image), whatever --workers (data.ImageDataset); Dassl's drop_last for the
# training loader (a short last batch dropped unless it is a process's only one). Version 5: the
# attention kernel (--attention, a run-control setting); each run's history (log.txt,
# metrics.jsonl, curves.png). An older folder is refused on --resume / --eval-only.
RUN_FORMAT = "dear-from-scratch run folder, version 5"


class TrainError(Exception):
    """Bad input to train.py: one line naming the flag or file and what to do."""


class RecipeBook(NamedTuple):
    """train.py's tables, handed to the settings code here (runs.py never imports train.py)."""
    recipes: dict  # {protocol: {dataset: Recipe}}
    protocol_recipes: dict  # {protocol: Recipe}: your own data's
    defaults: dict  # the flags outside a recipe
    toy_defaults: dict  # what the toy world shows by default instead
    paper_datasets: list  # --dataset all (base2novel, fewshot)
    dg_targets: list  # ImageNet's variants (cross and dg's 'all')
    fewshot_shots: list  # the few-shot sweep
    warmup_lr: float
    weight_decay: float
    attributes: Callable[[bool], List[str]]  # the attribute tokens' names (True: the toy world's)


# ------------------------------------------------------------------------------------------
# 1. Flags -> settings, checked once, before anything is read or written
# ------------------------------------------------------------------------------------------
# Each flag is the value typed, else the trained dataset's recipe, else the book's defaults.
# The result is saved with the run (settings.json, every results.json and checkpoint); a
# resumed call reads it back instead of resolving again, and nothing rewrites it afterwards.


def build_parser(book: RecipeBook) -> argparse.ArgumentParser:
    # Every default is None, so an unset flag is told apart from a typed one (--resume refuses
    # a typed change); "(default ...)" is added to each help line from the book. The parser is
    # data.py's (errors as one line, exit 2): the project's one copy.
    p = data.OneLineParser(prog="train.py", description="DeAR on CLIP: train and evaluate on the "
                      "paper's protocols. Unset DeAR and optimisation flags come from the trained "
                      "dataset's recipe (RECIPES in train.py).")
    g = p.add_argument_group("what to run").add_argument
    g("--dataset", nargs="+", help="data.py name(s); 'all' (the protocol's datasets); 'toyworld' "
      "(no downloads); or the PATH of your own data, named by its folder: class folders "
      "PATH/<class>/<image> (split once 50/20/30 per class into PATH/split_<name>.json) or a CoOp "
      "split file (paths relative to its folder)")
    g("--protocol", choices=PROTOCOLS, help="base2novel | fewshot | cross | dg")
    g("--method", nargs="+", choices=METHODS, help="table rows: zeroshot = CLIP with the dataset's "
      "template; linear-probe = logistic regression on frozen image features (training classes "
      "only); dear = DeAR")
    g("--roles", nargs="+", help="head roles: 'analyse' (concept entropy on --analysis-pool, "
      "cached per model and pool), a roles JSON file, 'all-mixed' (no mask) or "
      "'all-generalization'; one table row each")
    g("--ablations", nargs="+", choices=(*ABLATIONS, "all"), metavar="NAME",
      help="the paper's ablations, each a DeAR row with one change: "
      + "; ".join(f"{name} = {what}" for name, what in ABLATIONS.items()) + "; all = every one")
    g("--fusion", nargs="+", type=fusion_name, metavar="{" + ",".join(FUSION_MODES) + "}",
      help="DeAR's scoring, "
      "one row each from the same model: fused-everywhere = fused logits on every test set; "
      "class-on-unseen = the class branch alone on classes not trained (MMRL's rule); the role "
      "ablations use the first")
    g("--seeds", nargs="+", type=int, help="seeds; tables report the mean")
    g("--shots", nargs="+", type=int, help="shots per class")
    g("--source", help="training dataset of cross and dg")
    g("--template", help="class prompt, '{}' for the class name, for every dataset (unset: each "
      f"benchmark's CoOp template; your own data: {data.OWN_TEMPLATE!r})")
    g = p.add_argument_group("where things are").add_argument
    g("--root", help="the $DATA folder in CoOp's layout (toyworld: made in the cache)")
    g("--weights", help="CLIP: ViT-B/32, ViT-B/16, ViT-L/14 or a checkpoint path")
    g("--head-width", type=int, help="channels per head of --weights (unset: the file's, else "
      f"{clip_model.OPENAI_HEAD_WIDTH} as in OpenAI's)")
    g("--bpe", help="CLIP's BPE merges file (unset: $CLIP_BPE_PATH, the cache, or a download)")
    g("--output", help="run folder (unset: runs/<protocol>-<datasets>)")
    g = p.add_argument_group("DeAR").add_argument
    g("--first-layer", type=int, help="J, the first layer with learnable tokens (1-based; auto: "
                                      "first of last four)")
    g("--beta", type=float, help="weight of each layer's fresh tokens against the previous "
                                 "layer's, in [0, 1]")
    g("--test-beta", choices=TEST_BETAS, help="cross and dg: DeAR's beta on a target: "
      "per-target = MMRL++'s (trainers/config.py, task CD; a target it does not name: the "
      "training beta); trained = the training beta")
    g("--text-tokens", type=int, help="K, learnable tokens inserted in the text tower (unset: "
      f"{dear.TEXT_TOKENS} under --tokens separate; under shared A, the attribute tokens, "
      "and no other value)")
    g("--tokens", choices=dear.TOKEN_CONSTRUCTIONS, help="the tokens' construction: separate = "
      "each layer and tower its own tokens, a learnable copy of proj; shared = MMRL++'s: A latent "
      "tokens mapped into both towers by a shared linear map plus a rank-4 residual per layer, "
      "proj frozen plus a rank-64 residual")
    g("--lambda-reg", type=float, help="weight of the self-regularisation loss")
    g("--lambda-fusion", type=float, help="weight of the fusion-weight regularisation loss")
    g("--analysis", choices=ANALYSES, help="the head analysis as a whole: project = the "
      "project's (its labelled bank, the labels as concepts; checked on the toy world against "
      "ablation; not the paper's); paper = the paper's Sec. 3.2: TextSpan's pool (toyworld: its "
      "own bank, labels stripped), clusters of SBERT embeddings, 20 picks per head, ImageNet's "
      "validation images when ImageNet is under --root; a flag typed beside it wins")
    g("--analysis-pool", help="head-analysis images: 'train' = the trained dataset's training "
      "split (base2novel: base classes; never the few-shot draw), or DATASET:SPLIT, e.g. "
      "imagenet:test (TextSpan's pool)")
    g("--analysis-images", type=int, help="at most this many pool images, spread evenly over its "
                                          "classes (fixed seed)")
    g("--bank", help="the head analysis' description pool: 'project' (the project's labelled bank; "
      "toyworld: its own), 'project-unlabelled' (the same, its labels stripped: they only score "
      "the clusters), 'textspan' (TextSpan's general pool, 3,497 lines, downloaded once, "
      "SHA-256-checked) or a PATH: "
      "one description per line, '#' comments, 'text<TAB>concept' to label a line")
    g("--concepts", choices=dear.CONCEPT_SOURCES, help="where the analysis' concepts come from: "
      "clusters (the paper's: HDBSCAN over the picks' embeddings by --sentence-encoder) or labels "
      "(the pool's own; every line labelled) (unset: labels where every line of the pool has one, "
      "else clusters)")
    g("--sentence-encoder", type=sentence_encoder_name, metavar="clip|sbert[:NAME_OR_FOLDER]",
      help="what embeds the picks to cluster them: clip = CLIP's own text tower; sbert = SBERT "
      f"through sentence-transformers ({SBERT_INSTALL}), {SBERT_MODEL} unless a Hugging Face "
      "model name or a local model folder follows (offline: a folder)")
    g("--min-cluster-size", type=int, help="HDBSCAN's smallest concept, in distinct picks (unset: "
      "the picks per head)")
    g("--min-samples", type=int, help="HDBSCAN's neighbours for a core point (unset: "
                                      "--min-cluster-size)")
    g("--cluster-names", help="JSON file {cluster id: attribute or 'other'} overriding the names "
      "the analysis gave its clusters (ids as printed in roles/clusters.md)")
    g("--descriptions", type=int, help="TextSpan descriptions per head (unset: a labelled pool's "
      "fewest values of an attribute, else (and under --analysis paper) the paper's 20; capped "
      "with a warning where the images or TextSpan's rank fall short; typed: refused above that)")
    g("--analyse-only", action="store_true", help="run the head analysis alone (roles.json, "
      "roles.png, masks.png in --output and the cache), then stop")
    g("--low-bits", type=float, help="attribute heads have concept entropy at most this (unset: a "
      "third of log2(min(descriptions, concepts)), the most the picks can spread, but at least "
      "0.81: 3 of 4 on one concept)")
    g("--high-bits", type=float, help="generalization heads have concept entropy at least this "
                                      "(unset: two thirds)")
    g = p.add_argument_group("optimisation").add_argument
    g("--epochs", type=int, help="training epochs, the warm-up epochs included")
    g("--batch-size", type=int, help="images per step (per process under torchrun)")
    g("--lr", type=float, help="AdamW learning rate after the warm-up (cosine decay)")
    g("--warmup-epochs", type=int,
      help=f"epochs at a constant {book.warmup_lr:g} before the cosine")
    g("--augment", choices=("on", "off"), help="random resized crop + flip for training")
    g("--image-cache", choices=("on", "off"), help="decode the few-shot training images once "
      "and keep them in memory (uint8; 256 px on the shorter side for 224), a few times faster "
      "to load each epoch; off: decode each photo every epoch, CoOp's crop from the full photo")
    g = p.add_argument_group("running").add_argument
    g("--device", help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    g("--amp", choices=AMP_CHOICES, help="mixed precision by autocast, CUDA only: on = fp16 with "
      "a loss scaler (the lineage's; closest to fp32 as measured, docs/USAGE.md 'Precision'); "
      "bf16 (compute capability 8.0 on); off = fp32")
    g("--attention", choices=ATTENTION_CHOICES, help="the attention kernel: explicit = "
      "clip_model's per-head maths (the reference; more memory); sdpa = torch's fused kernel of "
      "its choice; efficient, cudnn, math = that fused kernel alone; auto = sdpa without a kernel "
      "benchmarks/device_check.py found wrong on this GPU, cuDNN's only once it passed there "
      "(docs/USAGE.md, 'Attention kernels')")
    g("--workers", type=int, help="data-loading processes (unset: 4 on CUDA, 0 on CPU)")
    g("--eval-batch-size", type=int, help="images per evaluation batch")
    g("--log-every", type=int, help="a progress line every N steps")
    g("--resume", action="store_true", help="continue the runs in --output from their last "
                                            "checkpoint")
    g("--eval-only", action="store_true", help="evaluate the finished runs in --output again")
    g("--max-epochs-per-call", type=int, help="stop after this many epochs (time-limited jobs); "
                                              "--resume continues")
    g("--toy-scale", choices=("full", "miniature"), help="toy world size (miniature: the tests' "
                                                         "seconds-long one)")
    for action in p._actions:  # noqa: SLF001 -- argparse keeps no public list of its flags
        if action.help and action.dest != "help":
            action.help += default_help(action.dest, book)
    return p


def default_help(key: str, book: RecipeBook) -> str:
    """' (default ...)' for a flag's help, from the book: the one place defaults live."""
    def shown(value) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, list):
            return " ".join(map(str, value)) or "none"
        return str(value)

    parts = [shown(book.defaults[key])] if key in book.defaults else []
    if key in book.toy_defaults:
        parts.append(f"toyworld: {shown(book.toy_defaults[key])}")
    # per protocol, then its exceptions
    if key in {f.name for f in fields(book.protocol_recipes["base2novel"])}:
        per_protocol = []
        for protocols in (("base2novel",), ("fewshot",), ("cross", "dg")):
            usual = getattr(book.protocol_recipes[protocols[0]], key)
            others = [f"{name}: {shown(getattr(r, key))}"
                      for name, r in book.recipes[protocols[0]].items()
                      if getattr(r, key) != usual]
            exceptions = f" ({', '.join(others)})" if others else ""
            per_protocol.append(f"{', '.join(protocols)} {shown(usual)}{exceptions}")
        parts.append("; ".join(per_protocol) + ", from RECIPES")
    if key == "shots":
        parts.append(f"fewshot: {shown(book.fewshot_shots)}")
    return f" (default {'; '.join(parts)})" if parts else ""


def fusion_name(value: str) -> str:
    """--fusion's type: a mode of FUSION_MODES; the names of earlier versions get a one-line
    hint."""
    if value in OLD_FUSION_NAMES:
        raise argparse.ArgumentTypeError(f"'{value}' is an old name: use {OLD_FUSION_NAMES[value]} "
                                         "(the rows are now named by what they do)")
    if value not in FUSION_MODES:
        raise argparse.ArgumentTypeError(f"invalid choice: '{value}' (choose from "
                                         f"{', '.join(FUSION_MODES)})")
    return value


def sentence_encoder_name(value: str) -> str:
    """--sentence-encoder's type -> 'clip', or 'sbert:' + a Hugging Face model name (a bare name is
    sentence-transformers', as that library reads it) or an absolute folder: one spelling per
    model, so that --resume compares like with like. Installed and there: check_sentence_encoder."""
    kind, colon, model = value.partition(":")
    if value == "clip":
        return value
    if kind != "sbert" or (colon and not model):
        raise argparse.ArgumentTypeError(f"'{value}': expected clip, sbert or sbert:NAME_OR_FOLDER "
                                         "(a Hugging Face model name, or a local model folder)")
    model = model or SBERT_MODEL
    if model.startswith(("/", ".", "~")) or os.path.isdir(model):  # a folder, not a hub name
        return "sbert:" + os.path.abspath(os.path.expanduser(model))
    return "sbert:" + (model if "/" in model else f"sentence-transformers/{model}")


def resolve_settings(args: argparse.Namespace, book: RecipeBook) -> Dict[str, object]:
    """The settings of this call, complete and checked: a new run's from the flags, or those
    saved in --output for --resume / --eval-only (with the run-control flags that may change).
    The files' places and SHA-256 are added once found (train.open_inputs), then never changed."""
    fresh = not (args.resume or args.eval_only)
    settings = settings_from_flags(args, book) if fresh else settings_from_run_folder(args, book)
    settings.update(resume=bool(args.resume), eval_only=bool(args.eval_only),
                    analyse_only=bool(args.analyse_only))
    validate_settings(settings)
    return settings


def _default(value, default):
    """Never `value or default`, which would turn a typed 0 into the default."""
    return default if value is None else value


def _unique(values: list) -> list:
    """Each value once, in order; --roles analyze is the same choice as analyse."""
    return list(dict.fromkeys("analyse" if v == "analyze" else v for v in values))


def typed_flags(args: argparse.Namespace, protocol: str, source: Optional[str],
                book: RecipeBook) -> dict:
    """The flags typed (a typed 0 or "" too), in the form settings.json stores them (--augment off
    -> False, --dataset all -> the names, each list without repeats): new and resumed runs alike."""
    stored_as = dict.fromkeys(("roles", "method", "seeds", "shots", "fusion"), _unique)
    stored_as["ablations"] = lambda v: list(ABLATIONS) if "all" in v else _unique(v)
    stored_as.update(dataset=lambda v: dataset_names(v, protocol, source, book),
                     source=data.dataset_key,
                     augment=lambda v: v == "on", image_cache=lambda v: v == "on")
    return {key: stored_as.get(key, lambda v: v)(value) for key, value in vars(args).items()
            if value is not None and value is not False
            and key not in ("resume", "eval_only", "analyse_only")}


def dataset_names(typed: List[str], protocol: str, source: Optional[str],
                  book: RecipeBook) -> List[str]:
    names = [data.own_dataset_name(n) if data.is_own_data(n) else data.dataset_key(n)
             for n in typed]
    if names == ["all"]:  # cross and dg: one training on the source, tested on all fourteen targets
        source = data.dataset_key(_default(source, book.defaults["source"]))
        names = book.paper_datasets if protocol in ("base2novel", "fewshot") else \
            [n for n in book.paper_datasets if n != source] + book.dg_targets
    return list(names)


def settings_from_flags(args: argparse.Namespace, book: RecipeBook) -> Dict[str, object]:
    """A new run: the flags + the trained dataset's recipe + the defaults -> every setting,
    explicit."""
    if not args.dataset:
        raise TrainError("--dataset is required (e.g. --dataset toyworld, --dataset oxford_pets "
                         "--root $DATA, --dataset all)")
    protocol = _default(args.protocol, book.defaults["protocol"])
    typed = typed_flags(args, protocol, args.source, book)
    names = typed["dataset"]
    # no paths in a folder name
    folder = [data.own_dataset_name(n) if data.is_own_data(n) else n for n in args.dataset]
    output = _default(args.output, os.path.join("runs", f"{protocol}-{'-'.join(folder)}"))
    own = [(data.own_dataset_name(n), os.path.abspath(n)) for n in args.dataset
           if data.is_own_data(n)]
    if len({name for name, _ in own}) < len(own):
        raise TrainError(f"--dataset {' '.join(path for _, path in own)}: two have the same folder "
                         "name; rename one (the name is used in tables and run folders)")
    register_own_data(dict(own), output)
    toy = names == ["toyworld"]
    if "toyworld" in names and not toy:
        raise TrainError("--dataset toyworld runs on its own; give it alone")
    for flag in ("weights", "bpe", "head_width"):
        if toy and getattr(args, flag) is not None:  # it would be replaced by the toy world's own
            raise TrainError(f"--{flag.replace('_', '-')}: the toy world brings its own model, BPE "
                             "file and head width (made in the cache); drop "
                             f"--{flag.replace('_', '-')}")
    for name in names:
        if (name != "toyworld" and data.get_spec(name).evaluation_only
                and protocol in ("base2novel", "fewshot")):
            # unknown: get_spec's
            raise TrainError(f"--dataset {name} is a test set only; use it with --protocol dg")
    source = None
    if protocol in ("cross", "dg"):
        source = data.dataset_key(_default(args.source, book.defaults["source"]))
        if data.get_spec(source).evaluation_only:
            raise TrainError(f"--source {source}: a test set only; train on a dataset with "
                             "training images")
        if source in names:
            raise TrainError(f"--dataset {source}: it is the --source; its test set is already the "
                             "first column")
    elif args.source:
        raise TrainError(f"--source is for --protocol cross or dg, not {protocol}")
    elif args.test_beta:
        raise TrainError(f"--test-beta is for --protocol cross or dg; {protocol} tests the trained "
                         "dataset, at the training beta")

    trained = source or names[0]
    # added to data.py, not here
    if trained not in book.recipes[protocol] and not data.get_spec(trained).own:
        raise TrainError(f"--dataset {trained}: train.py has no {protocol} recipe for it; add it "
                         "to RECIPES in train.py")
    # own data: the protocol's
    recipe = book.recipes[protocol].get(trained, book.protocol_recipes[protocol])
    defaults = dict(book.defaults, **book.toy_defaults) if toy else book.defaults
    # Each setting: typed, else the recipe's, else the default (else None: the later code's own
    # rule, e.g. descriptions -> dear.analysis_picks, head_width -> the file's); fingerprints
    # (SHA-256 of the weights, BPE and roles files) and role_maps are added by train.open_inputs and
    # train.run.
    settings = {key: copy.copy(typed[key] if key in typed
                               else getattr(recipe, key, defaults.get(key)))
                for key in SETTING_KEYS}  # (copied: no list shared with the book)
    resolve_text_tokens(settings, len(book.attributes(toy)))
    settings.update(analysis_preset(settings["analysis"], toy, settings["root"], typed))
    roles = settings["roles"]
    for choice in roles:
        if choice not in ("analyse", *ROLE_ABLATIONS) and not os.path.isfile(choice):
            raise TrainError(f"--roles {choice}: no such file; give a roles JSON written by the "
                             "head analysis, 'analyse', "
                             f"{' or '.join(repr(r) for r in ROLE_ABLATIONS)}")
    if sum(choice not in ROLE_ABLATIONS for choice in roles) > 1:
        raise TrainError(f"--roles {' '.join(roles)}: give at most one of 'analyse' or a roles "
                         "file (both make the DeAR row); add the ablations all-mixed / "
                         "all-generalization beside it")
    ablations = settings["ablations"]
    if ablations and "dear" not in settings["method"]:
        raise TrainError(f"--ablations {' '.join(ablations)}: each is a DeAR row; "
                         "add dear to --method")
    changed = [name for name in ablations if ablation_roles(name) is None]  # change the DeAR row
    if changed and all(choice in ROLE_ABLATIONS for choice in roles):
        raise TrainError(f"--ablations {changed[0]}: it changes the DeAR row, which --roles "
                         f"{' '.join(roles)} does not make; add analyse (or a roles file) "
                         "to --roles")
    shots = list(typed.get("shots", book.fewshot_shots if protocol == "fewshot"
                           else [recipe.shots]))
    if protocol != "fewshot" and len(shots) > 1:
        raise TrainError("--shots takes several values only with --protocol fewshot")
    settings.update(dataset_paths=dict(own), source=source, shots=shots, output=output,
                    warmup_lr=book.warmup_lr,
                    # toy: its own
                    weight_decay=book.weight_decay, weights=None if toy else settings["weights"])
    if source is None:  # no target: DeAR is tested at the training beta
        settings["test_beta"] = None
    return settings


def analysis_preset(analysis: str, toy: bool, root: Optional[str], typed: dict) -> dict:
    """--analysis paper -> the settings it gives, each unless typed: TextSpan's general pool (the
    toy world: its own bank without labels, as its tokenizer knows only toy words), concepts by
    clusters, SBERT, and ImageNet's validation images when ImageNet is under --root (else the
    trained dataset's training images); its 20 picks are the picks' default (train.default_picks).
    --analysis project: nothing (the defaults are the project's)."""
    if analysis != "paper":
        return {}
    imagenet = bool(root) and os.path.isdir(os.path.join(root, data.get_spec("imagenet").folder))
    preset = dict(bank="project-unlabelled" if toy else "textspan", concepts="clusters",
                  sentence_encoder=f"sbert:{SBERT_MODEL}",
                  analysis_pool="imagenet:test" if imagenet and not toy else "train")
    if typed.get("concepts") == "labels":  # labels need no encoder: SBERT would do nothing
        del preset["sentence_encoder"]
    return {key: value for key, value in preset.items() if key not in typed}


# What stays the project's under --analysis paper (docs/METHOD.md Sec. 3, the table of departures).
PAPER_DEPARTURES_KEPT = (
    "HDBSCAN's min_cluster_size = the picks per head",
    "a pick in no cluster is a concept of its own",
    "clusters named by mutual-nearest attribute names (a labelled pool: by its labels)",
    "role thresholds at thirds of log2(min(picks, concepts)) bits, the low one at least 0.81",
    "TextSpan's rank = the head width", "at most {analysis_images} images",
    "no attribute head measured: the class branch alone",
    "the tokens --tokens {tokens} (the paper note fits both separate and shared)",
    "K = {text_tokens} text tokens")


def analysis_header(settings, concepts: str, toy: bool) -> List[str]:
    """The lines that open a head analysis: which analysis runs, each setting --analysis paper
    changed (or a typed flag kept), and what stays unlike the paper's; the default says it is not
    the paper's and how to get it."""
    encoder = f", --sentence-encoder {settings['sentence_encoder']}" if concepts == "clusters" \
        else ""
    if settings["analysis"] != "paper":
        return [f"head analysis: --analysis project, the project's (not the paper's: --analysis "
                f"paper): --bank {settings['bank']}, concepts {concepts}{encoder}, "
                f"--analysis-pool {settings['analysis_pool']}"]
    preset = analysis_preset("paper", toy, settings["root"], {})
    if concepts != "clusters":  # typed labels: no encoder runs
        del preset["sentence_encoder"]
    shown = [f"--{key.replace('_', '-')} {settings[key]}" + ("" if settings[key] == value else
             f" (typed; the paper's: {value})") for key, value in preset.items()]
    picks = settings["descriptions"]
    shown.append(f"{dear.PAPER_PICKS} picks per head (capped where a head's width allows fewer)"
                 if picks is None else
                 f"--descriptions {picks} (typed; the paper's: {dear.PAPER_PICKS})")
    lines = ["head analysis: --analysis paper, the paper's Sec. 3.2:"]
    lines += [f"  {setting}" for setting in shown]
    if settings["analysis_pool"] == "train":
        where = "the toy world" if toy else "no ImageNet under --root"
        lines.append(f"  {where}: the trained dataset's training images, not ImageNet's "
                     "validation images (the paper's)")
    lines.append("head analysis: still the project's, not the paper's (docs/METHOD.md Sec. 3):")
    return lines + [f"  {d.format(**settings)}" for d in PAPER_DEPARTURES_KEPT]


def resolve_text_tokens(settings: dict, num_attributes: int) -> None:
    """K, resolved here once so that settings.json holds the number: unset, dear.default_text_tokens
    (4 under --tokens separate; A, this world's attribute tokens, under shared, where the text
    tower receives the vision tower's tokens); typed, under shared, A or refused."""
    try:
        dear.check_tokens(settings["tokens"], num_attributes, settings["text_tokens"])
    except dear.DeARError as error:
        raise TrainError(f"--text-tokens {settings['text_tokens']}: {error}") from None
    if settings["text_tokens"] is None:
        settings["text_tokens"] = dear.default_text_tokens(settings["tokens"], num_attributes)


def register_own_data(dataset_paths: Dict[str, str], output: str) -> None:
    """Your own data (--dataset PATH): registered in data.py under its folder's name, every file
    checked; a split drawn for a read-only folder goes to <output>/<name>/."""
    for name, path in dataset_paths.items():
        data.own_dataset(path, split_fallback_dir=os.path.join(output, name))


def validate_settings(settings: dict) -> None:
    """Every number in range and finite, before anything is read or written (resumed calls too:
    they may change the run-control flags). The method's own ranges are dear.py's checks."""
    def refuse(key: str, expected: str):
        value = settings[key]
        shown = " ".join(map(str, value)) if isinstance(value, list) else value
        raise TrainError(f"--{key.replace('_', '-')} {shown}: {expected}")

    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    # (key, least value, None or "auto" allowed): dear.check_first_layer checks J's top once the
    # model is read
    for key, least, optional in (("epochs", 1, 0), ("batch_size", 1, 0), ("eval_batch_size", 1, 0),
                                 ("log_every", 1, 0), ("analysis_images", 1, 0),
                                 ("warmup_epochs", 0, 0),
                                 ("text_tokens", 0, 0), ("head_width", 1, 1), ("workers", 0, 1),
                                 ("max_epochs_per_call", 1, 1), ("descriptions", 1, 1),
                                 ("first_layer", 1, 1),
                                 ("min_cluster_size", 2, 1), ("min_samples", 1, 1)):
        if not (optional and settings[key] in (None, "auto") or is_int(settings[key])
                and settings[key] >= least):
            refuse(key, f"expected an integer >= {least}" if least != 1
                   else "expected a positive integer")
    if not settings["seeds"] or not all(is_int(s) and 0 <= s <= MAX_SEED
                                        for s in settings["seeds"]):
        refuse("seeds", f"expected integers from 0 to {MAX_SEED}")
    if not settings["shots"] or not all(is_int(k) and k >= 1 for k in settings["shots"]):
        refuse("shots", "expected positive integers")
    # an inf lr trains on NaN; a NaN weight is not even valid JSON
    weight = "expected a finite weight >= 0"
    for key, expected in (("lr", "expected a positive, finite learning rate"),
                          ("lambda_reg", weight),
                          ("lambda_fusion", weight)):
        value = settings[key]
        finite = isinstance(value, (int, float)) and math.isfinite(value)
        if not (finite and (value > 0 if key == "lr" else value >= 0)):
            refuse(key, expected)
    # dear.py's message, under the flag
    for key, check, values in (("beta", dear.check_beta, [settings["beta"]]),
                               ("low_bits", dear.check_thresholds, [settings["low_bits"], None]),
                               ("high_bits", dear.check_thresholds, [None, settings["high_bits"]]),
                               ("low_bits", dear.check_thresholds,
                                [settings["low_bits"], settings["high_bits"]])):
        try:
            check(*values)
        except dear.DeARError as error:
            refuse(key, str(error))
    analysis_pool_of(settings["analysis_pool"])  # a malformed pool stops here
    template = settings["template"]
    try:
        well_formed = template is None or template.format("x") != template.format("y")
    # '{0}{1}', '{x}', '{', '{.x}', '{[a]}'
    except (IndexError, KeyError, ValueError, AttributeError, TypeError):
        well_formed = False
    if not well_formed:
        raise TrainError(f"--template {template!r}: expected a prompt with one '{{}}' for the "
                         f"class name, e.g. 'a photo of a {{}}, a kind of flower.'")
    pick_device(settings["device"])  # an unknown or absent device stops here


def settings_from_run_folder(args: argparse.Namespace, book: RecipeBook) -> Dict[str, object]:
    """--resume / --eval-only: the run folder's saved settings; a flag that would change what is
    computed is refused (it would silently mix two experiments in one folder)."""
    if args.resume and args.eval_only:
        raise TrainError("--resume and --eval-only: give one (--resume finishes the runs, "
                         "--eval-only evaluates the finished runs again)")
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
        raise TrainError(f"{path}: not found; --output must be a run folder made by "
                         "train.py") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
        raise TrainError(f"{path}: unreadable ({type(error).__name__}); the run folder is "
                         "damaged") from None
    if saved_file.get("format") != RUN_FORMAT:  # what a folder means changed: refused, not misread
        raise TrainError(f"{path}: a run folder of an earlier train.py "
                         f"({saved_file.get('format') or 'format 1'}; this one reads {RUN_FORMAT}: "
                         "one cached head analysis per model, Dassl's warm-up recount, renamed "
                         "fusion rows, the analysis' preset and sentence encoder); finish it with "
                         "that version, or start a new run")
    if not isinstance(saved, dict) or set(saved) != set(SETTING_KEYS) \
            or not isinstance(saved["fingerprints"], dict) \
            or not isinstance(saved["dataset_paths"], dict):
        raise TrainError(f"{path}: not the settings of this train.py (damaged, or made by another "
                         "version); start a new run with another --output")
    register_own_data(saved["dataset_paths"], args.output)  # your own data, found and checked again
    for key, value in typed_flags(args, saved["protocol"], saved["source"], book).items():
        if key in RUN_CONTROL:
            saved[key] = value
        elif saved.get(key) != value:
            raise TrainError(f"--{key.replace('_', '-')} cannot change in a saved run (it holds "
                             f"{saved.get(key)!r}); drop it, or start a new run with another "
                             "--output")
    # a limit of an earlier call is not this one's
    saved["max_epochs_per_call"] = args.max_epochs_per_call
    return saved


def analysis_pool_of(value: str):
    """--analysis-pool -> (registry dataset, or None for the trained dataset's own; split)."""
    if value == "train":
        return None, "train"
    name, _, split = value.partition(":")
    name = data.dataset_key(name)
    if split not in ("train", "val", "test"):
        raise TrainError(f"--analysis-pool {value}: expected 'train' or DATASET:SPLIT with SPLIT "
                         "train, val or test (e.g. imagenet:test, ImageNet's validation images)")
    # (an unknown name: data.py's one line)
    if data.get_spec(name).evaluation_only and split != "test":
        raise TrainError(f"--analysis-pool {value}: {name} is a test set only; use {name}:test")
    return name, split


def role_file_of(settings) -> Optional[str]:
    """The --roles choice that is a file, if any (at most one per call)."""
    return next((choice for choice in settings["roles"]
                 if choice not in ("analyse", *ROLE_ABLATIONS)), None)


# ------------------------------------------------------------------------------------------
# 2. Devices and processes
# ------------------------------------------------------------------------------------------


@dataclass
class Runtime:
    """Where the tensors live and how many processes share the work, decided once per call; and
    where its lines go: printed, and kept in the call's log.txt and the current run's."""
    device: torch.device
    rank: int = 0
    world: int = 1
    amp_dtype: Optional[torch.dtype] = None  # autocast dtype on CUDA, None = fp32
    precision: str = "fp32"  # the precision and why (choose_precision), for the header
    waiting_group: Optional[object] = None  # under torchrun: the gloo group of wait_for_main
    attention: str = "sdpa"  # the attention kernel: explicit, or sdpa (the backend torch runs)
    attention_why: str = "sdpa"  # the same and why, for the header (attention_choice)
    kernel: str = "sdpa"  # clip_model's: "sdpa" or "explicit"
    backends: Optional[List[str]] = None  # the sdpa backends allowed (None: torch's choice)
    loaders: Dict[str, Tuple[int, int]] = field(default_factory=lambda: dict(
        train=(0, PREFETCH), eval=(0, PREFETCH)))  # (workers, in flight): loader_plan's
    call_log: Optional[object] = None  # <output>/log.txt, open while the run folder exists
    run_log: Optional[object] = None  # the current run's <folder>/log.txt
    pending: List[str] = field(default_factory=list)  # lines before the run folder existed

    @property
    def main(self) -> bool:  # rank 0 alone prints and writes files
        return self.rank == 0

    def log(self, line: str) -> None:
        """A line for the reader: printed, and kept in the log files."""
        if self.main:
            print(line, flush=True)
            self.keep(line)

    def detail(self, line: str) -> None:
        """A line for the log files alone: every progress line, the long tables."""
        if self.main:
            self.keep(line)

    def keep(self, line: str) -> None:
        if self.call_log is None:
            self.pending.append(line)  # written once the run folder's log.txt opens
        for log in (self.call_log, self.run_log):
            if log is not None:
                log.write(line + "\n")
                log.flush()


def pick_device(name: str) -> torch.device:
    mps = torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None  # e.g. "gpu": refused below, in one line
    # torch knows more device types (meta, xla, hpu, ...) than this script drives.
    if (device is None or device.type not in ("cpu", "cuda", "mps")
            or (device.type != "cuda" and device.index)):
        raise TrainError(f"--device {name}: not a device; use auto, cpu, cuda, cuda:N or mps")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise TrainError(f"--device {name}: this machine has "
                         + (f"{count} CUDA devices (cuda:0 to cuda:{count - 1})"
                            if count else "no CUDA device; use --device auto or cpu"))
    if device.type == "mps" and not mps:
        raise TrainError(f"--device {name}: MPS is not available here; use --device auto or cpu")
    return device


# Rank 0 does some work alone (the head analysis, after waiting for another call's lock on it);
# the other processes wait for it on a CPU-side gloo group with this timeout, never in a
# collective of the device's group, whose timeout (NCCL's: 10 minutes) that work may outlast.
# Constants, not flags (our choice): they only end a wait on a rank 0 that hangs (one that dies
# ends the run at once: torchrun stops every process when one exits), so one generous value
# serves every run. The analysis lock's bound is the shorter, so that rank 0 still has an hour
# for the analysis itself (ViT-B/16's 2,000 images: minutes on a GPU).
ANALYSIS_LOCK_TIMEOUT = datetime.timedelta(hours=1)  # another call analysing the same heads
MAIN_WORK_TIMEOUT = datetime.timedelta(hours=2)  # the other processes, for rank 0's analysis
BF16_CAPABILITY = (8, 0)  # CUDA compute capability with bf16 in hardware (Ampere and later)
AMP_CHOICES = ("on", "off", "fp16", "bf16")  # on = fp16 (choose_precision)


def choose_precision(device_type: str, amp: str, capability: Optional[Tuple[int, int]]):
    """-> (the autocast dtype, None for fp32; the choice and why), training and evaluation
    alike. --amp on (the default): fp16 with a loss scaler, the lineage's (CoOp, MaPLe, MMRL run
    CLIP in fp16), chosen by measurement: on the toy world it moves the logits about a tenth as
    far as bf16 and changed no prediction where bf16 changed one (benchmarks/precision_table.py,
    docs/USAGE.md "Precision"). --amp bf16: bf16 (no scaler), from compute capability 8.0, where
    it is in hardware (below it emulated: refused). --amp off: fp32. Autocast on CUDA only: CPU
    and MPS run fp32."""
    if device_type != "cuda":
        return None, f"fp32 (autocast on CUDA only; {device_type} runs fp32)"
    if amp == "off":
        return None, "fp32 (--amp off)"
    where = f"compute capability {capability[0]}.{capability[1]}"
    if amp == "bf16":
        if tuple(capability) < BF16_CAPABILITY:
            raise TrainError(f"--amp bf16: this GPU ({where}) has no bf16 in hardware; use "
                             "--amp on (fp16 with a loss scaler) or --amp off")
        return torch.bfloat16, f"bf16 autocast (--amp bf16; {where})"
    return torch.float16, (f"fp16 autocast with a loss scaler (--amp {amp}: the lineage's, the "
                           "closest to fp32 as measured), training and evaluation")


def precision_name(amp_dtype: Optional[torch.dtype]) -> str:
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]


def setup_runtime(settings) -> Runtime:
    """One process, or one of several started by torchrun (which sets RANK and WORLD_SIZE):
    each then drives one device and DistributedDataParallel averages the gradients. A CUDA
    device is made the current one (kernels, the allocator and NCCL use that one); the process
    group is left by end_runtime."""
    device, world, rank = pick_device(settings["device"]), int(os.environ.get("WORLD_SIZE", "1")), 0
    if world > 1:
        rank = int(os.environ["RANK"])
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda" and device.index is not None:  # --device cuda:1 in one process too
        torch.cuda.set_device(device)
    waiting_group = None
    if world > 1:
        # gloo: CPU (and the tests)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        waiting_group = dist.new_group(backend="gloo", timeout=MAIN_WORK_TIMEOUT)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    amp_dtype, precision = choose_precision(device.type, settings["amp"], capability)
    if device.type == "cuda":  # fp32 means fp32: no TF32 in matmuls or cuDNN's convolutions
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        precision += "; TF32 off"
    kernel, backends, why = attention_choice(settings["attention"], device)
    attention = "explicit"
    if kernel == "sdpa":  # which fused kernel that is, found by running it
        attention = f"sdpa ({sdpa_kernel_used(device, amp_dtype, backends)})"
    # decided once: nothing below decides again
    return Runtime(device, rank, world, amp_dtype, precision, waiting_group, attention,
                   f"{attention}: --attention {settings['attention']}, {why}", kernel, backends)


# The attention kernel (--attention). clip_model computes attention one of two ways: its own
# explicit per-head maths, or torch's fused scaled_dot_product_attention ("sdpa"), which picks a
# backend among those allowed: flash (no arbitrary mask: never DeAR's), memory-efficient, cuDNN,
# math. A fused kernel can be wrong on a given GPU and torch build (cuDNN's attention has given
# NaN gradients with a mask at some sequence lengths, pytorch/pytorch#196678), so under "auto" a
# kernel that benchmarks/device_check.py found wrong on this GPU is not allowed, and cuDNN's only
# once device_check passed it here (its verdicts: ATTENTION_RECORD in the cache).
ATTENTION_CHOICES = ("auto", "explicit", "sdpa", "efficient", "cudnn", "math")
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION", "math": "MATH"}  # torch's SDPBackend names


def attention_record() -> str:
    """Where device_check.py keeps its verdict on each fused kernel, per GPU and torch build."""
    return os.path.join(clip_model.default_cache_dir(), "device_check", "attention.json")


def gpu_build(device: torch.device) -> str:
    """This GPU and the software that decides its kernels, as a key of attention_record."""
    return (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"cuDNN {torch.backends.cudnn.version()}")


def kernel_verdicts(device: torch.device) -> Dict[str, str]:
    """device_check's verdicts on this GPU and build: {backend: "ok" | "wrong" | "unavailable"};
    {} where it never ran."""
    try:
        with open(attention_record(), encoding="utf-8") as f:
            return dict(json.load(f).get(gpu_build(device), {}))
    except (OSError, ValueError, AttributeError):
        return {}


def attention_choice(choice: str, device: torch.device):
    """--attention -> (clip_model's kernel, the sdpa backends allowed or None for torch's own
    choice, the choice in a few words for the header)."""
    if choice == "explicit":
        return "explicit", None, "clip_model's per-head maths"
    if choice in SDPA_BACKENDS:
        return "sdpa", [SDPA_BACKENDS[choice]], f"torch's fused {choice} kernel alone"
    if choice == "sdpa" or device.type != "cuda":
        return "sdpa", None, "torch's choice of fused kernel"
    verdicts = kernel_verdicts(device)  # auto on a GPU
    wrong = [name for name, backend in SDPA_BACKENDS.items() if verdicts.get(backend) == "wrong"]
    allowed = [backend for name, backend in SDPA_BACKENDS.items() if name not in wrong
               and (name != "cudnn" or verdicts.get(backend) == "ok")]
    excluded = [f"{name} (found wrong by device_check on this GPU)" for name in wrong]
    if verdicts.get("CUDNN_ATTENTION") != "ok" and "cudnn" not in wrong:
        excluded.append("cudnn (not yet passed by device_check on this GPU)")
    return "sdpa", allowed, ("torch's choice of fused kernel"
                             + (f", except {' and '.join(excluded)}" if excluded else ""))


def sdpa_backends(backends: Optional[List[str]]):
    """A context in which torch's fused attention picks among `backends` alone (None: all)."""
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in backends])


def sdpa_kernel_used(device: torch.device, dtype: Optional[torch.dtype],
                     backends: Optional[List[str]]) -> str:
    """Which backend torch's fused attention runs for a DeAR-shaped case on this device (ViT-B/16:
    12 heads, 197 + 5 tokens, a generalization head's mask on every other head), found by
    running it once as allowed, then each backend alone: the one that gives the same bits."""
    import warnings

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, 202, 64, generator=generator).to(device, dtype or torch.float32)
               for _ in range(3))
    mask = torch.zeros(12, 202, 202)
    mask[::2, :197, 197:] = mask[::2, 197:, :197] = float("-inf")
    mask = mask.to(device, q.dtype)[None]  # (1, H, N, N)
    with warnings.catch_warnings():  # a backend that cannot run says why in a warning
        warnings.simplefilter("ignore")
        with sdpa_backends(backends):
            used = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        for name, backend in SDPA_BACKENDS.items():
            try:
                with sdpa_backends([backend]):
                    if torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), used):
                        return name
            except RuntimeError:  # this backend cannot run the case
                continue
    return "not found"


# The loaders' processes (--workers; unset: one per CPU core but one, at most MAX_WORKERS, on a
# GPU; none on the CPU, where they would compete with the model) and the batches each keeps in
# flight (torch's 2). Their batches travel through shared memory (/dev/shm), which a container
# often caps at 64 MB; ViT-B/16's training batch of 32 images is 19 MB, an evaluation batch of 64
# 39 MB. So the batches in flight are held to half of /dev/shm's free space: fewer in flight,
# then fewer processes, down to none (the main process loads: no shared memory), said in a line.
MAX_WORKERS = 16
PREFETCH = 2


def shared_memory_free() -> Optional[int]:
    """/dev/shm's free bytes (None where there is no /dev/shm: macOS, Windows)."""
    return shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None


def usable_cpus() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def loader_plan(settings, runtime: Runtime, size: int) -> Dict[str, Tuple[int, int]]:
    """{"train", "eval": (workers, batches in flight per worker)} for images of size x size, that
    fit the machine: --workers, else the default above; fewer where /dev/shm would overflow."""
    requested = settings["workers"]
    if requested is None:
        requested = min(usable_cpus() - 1, MAX_WORKERS) if runtime.device.type == "cuda" else 0
    free, plan, lowered = shared_memory_free(), {}, []
    for name, batch in (("train", settings["batch_size"]), ("eval", settings["eval_batch_size"])):
        workers, prefetch, batch_bytes = max(requested, 0), PREFETCH, batch * 3 * size * size * 4
        while workers and free is not None and workers * prefetch * batch_bytes > free // 2:
            prefetch, workers = (1, workers) if prefetch > 1 else (prefetch, workers - 1)
        plan[name] = (workers, prefetch)
        if (workers, prefetch) != (max(requested, 0), PREFETCH):
            lowered.append(f"{name} {workers} workers x {prefetch} batch{'es' * (prefetch > 1)}"
                           f" of {batch_bytes / 2**20:.0f} MB")
    if lowered:
        runtime.log(f"loader: {', '.join(lowered)} in flight, fewer than asked: /dev/shm has "
                    f"{free / 2**20:.0f} MB free, and they may fill half of it")
    return plan


@contextlib.contextmanager
def cpu_threads(toy: bool):
    """torch's CPU threads for this call -> (inside the block) a few words saying which: the toy
    world's fixed toyworld.THREADS (its numbers then do not depend on the machine's cores), else
    torch's default, left as it is (ViT-B/16's large matrices use every core). The caller's
    count is restored after the block (the tests call train.main in their own process)."""
    callers = torch.get_num_threads()
    if not toy:
        yield f"{callers} CPU threads (torch's default)"
        return
    import toyworld  # the project's own world: its one thread

    torch.set_num_threads(toyworld.THREADS)
    try:
        yield f"{toyworld.THREADS} CPU thread (the toy world's, on every machine)"
    finally:
        torch.set_num_threads(callers)


def end_runtime(runtime: Runtime) -> None:
    """Leave the process group setup_runtime joined: on every way out of a call (train.run holds
    this in its ExitStack), early returns and errors included."""
    if runtime.waiting_group is not None:
        dist.destroy_process_group()  # every group: the device's and the waiting one


def wait_for_main(runtime: Runtime, what: str) -> None:
    """Every process meets here once rank 0 has done `what` alone: the others wait on the gloo
    group, a CPU-side wait of up to MAIN_WORK_TIMEOUT (see there)."""
    if runtime.world == 1:
        return
    try:
        dist.barrier(group=runtime.waiting_group)
    except RuntimeError:  # gloo's timeout (DistBackendError)
        waited = format_time(MAIN_WORK_TIMEOUT.total_seconds())
        raise TrainError(f"process {runtime.rank}: waited {waited} for rank 0's {what} in vain "
                         "(runs.MAIN_WORK_TIMEOUT); see rank 0's output, then continue with "
                         "--resume") from None


def autocast(runtime: Runtime):
    if runtime.amp_dtype is None:
        return torch.autocast("cpu", enabled=False)  # a no-op context: fp32
    return torch.autocast(runtime.device.type, dtype=runtime.amp_dtype)  # choose_precision's


def grad_scaler(device: torch.device, enabled: bool):
    """fp16's loss scaler on the run's device (disabled: every call passes through); the CPU has
    one too (the tests run it enabled)."""
    return torch.amp.GradScaler(device.type, enabled=enabled)


def load_scaler_state(scaler, state: dict, log: Callable[[str], None]) -> None:
    """A checkpoint's loss-scaler state into this call's scaler: the precision may change on
    --resume (--amp, another GPU). A run that had no scaler (bf16 or fp32 save {}) resumed in fp16
    starts a fresh one; a saved scaler is left unused in bf16 or fp32. One line says which."""
    if scaler.is_enabled() and state:
        scaler.load_state_dict(state)
    elif scaler.is_enabled():
        log("resumed in fp16 from a run without a loss scaler (bf16 or fp32): a fresh scaler")
    elif state:
        log("resumed in bf16 or fp32 from an fp16 run: its loss scaler is not needed")


def sum_over_processes(values: List[float], runtime: Runtime) -> List[float]:
    if runtime.world == 1:
        return values  # one process: nothing to sum
    tensor = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor)  # in place: every process gets the sums
    return tensor.tolist()  # [correct..., total] summed over processes


# ------------------------------------------------------------------------------------------
# 3. Jobs, table rows and the ablations
# ------------------------------------------------------------------------------------------
# A call is a list of Jobs (a table row x dataset x seed x shots), each with its own folder.

# The paper's ablations are dear.py's (section 7); these names stay until train.py calls dear's.
ABLATIONS = dear.ABLATIONS
Ablated = dear.Ablated
ablate = dear.ablate


def ablation_roles(name: str) -> Optional[str]:
    """The --roles row an ablation is, where its one change is the role map alone and --roles
    makes that map (made once, whichever asks); None: the DeAR row with the change."""
    return "all-mixed" if name == "no-role-mask" else None



@dataclass
class Job:
    dataset: str  # the dataset trained on (the source, for cross and dg)
    row: str  # "zeroshot", "linear-probe", "dear", "dear-all-mixed", "dear-all-generalization"
    roles: Optional[str]  # "analyse", an ablation, or a roles file (None for zeroshot)
    seed: Optional[int]  # None for zero-shot: it has no randomness, one run serves every seed
    shots: Optional[int]  # None for zero-shot (it does not train)
    folder: str  # <output>/<dataset>/<row>/<seed leaf>: checkpoint.pt, results.json, results.md
    ablation: Optional[str] = None  # one of ABLATIONS (not no-role-mask: the --roles all-mixed row)

    @property
    def label(self) -> str:
        """e.g. "oxford_pets / dear / seed 1"; the shots too where they vary (fewshot)."""
        parts = [self.dataset, self.row] + ([f"seed {self.seed}"] if self.seed is not None else [])
        varies = os.path.basename(self.folder).startswith("shots")  # fewshot's leaf
        return " / ".join(parts + ([f"{self.shots} shots"] if varies else []))


ROW_LABELS = {"zeroshot": "CLIP (zero-shot)",
              "linear-probe": "Linear probe (frozen image features)", "dear": "DeAR",
              "dear-all-mixed": "DeAR, all heads mixed (no mask)",
              "dear-all-generalization": "DeAR, all heads generalization",
              "dear-no-attribute-tokens": "DeAR, no attribute tokens (class branch, text tokens)",
              "dear-no-fusion-reg": "DeAR, no fusion regularisation (lambda_fusion 0)",
              "dear-mask-generalization-only": "DeAR, mask on the generalization heads only",
              "dear-branch-ce": "DeAR + per-branch CE (MMRL's; not the paper's loss)"}
# The DeAR row once per --fusion mode; its table key and label say what the mode does.
FUSION_ROWS = {"fused-everywhere": ("-fused", ", fused on every test set"),
               "class-on-unseen": ("-class-on-unseen", ", class branch alone on unseen classes")}


# What a comparison row does by construction, said once in the header instead of a warning per
# run (dear.branches_in_fusion's warning is for a map that leaves a token blind unasked).
ROWS_SAID = {"dear-all-mixed": "dear-all-mixed: every head mixed, no mask (deep prompting)",
             "dear-all-generalization": "dear-all-generalization: no head lets an attribute token "
             "read the image, so the class branch alone scores (by construction, no warning)"}


def rows_said(jobs: List[Job]) -> List[str]:
    return [f"train.py: {ROWS_SAID[row]}" for row in dict.fromkeys(job.row for job in jobs)
            if row in ROWS_SAID]


def row_name(roles: str) -> str:
    # analysed or a file: the DeAR row
    return "dear" if roles not in ROLE_ABLATIONS else f"dear-{roles}"


def dear_rows(settings) -> List[tuple]:
    """(row, roles, ablation) of each DeAR row, in table order: each --roles choice, then each of
    --ablations on the DeAR row's roles (no-role-mask is --roles all-mixed's row: made once)."""
    rows = [(row_name(roles), roles, None) for roles in settings["roles"]]
    source = next((r for r in settings["roles"] if r not in ROLE_ABLATIONS), None)  # analyse/file
    for name in settings["ablations"]:
        roles = ablation_roles(name)
        row = row_name(roles) if roles is not None else f"dear-{name}"
        if row not in [r for r, _, _ in rows]:
            rows.append((row, roles, None) if roles is not None else (row, source, name))
    return rows


def trained_datasets(settings) -> List[str]:
    # cross, dg: the source alone
    return [settings["source"]] if settings["source"] else list(settings["dataset"])


def plan_jobs(settings) -> List[Job]:
    """Every run of the call, in order. Zero-shot depends on neither seed nor shots: one run
    per dataset fills every seed's place in the tables."""
    jobs, out = [], settings["output"]  # in order: zero-shot, then the trained rows
    for dataset in trained_datasets(settings):
        if "zeroshot" in settings["method"]:
            jobs.append(Job(dataset, "zeroshot", None, None, None,
                            os.path.join(out, dataset, "zeroshot")))
        rows = [("linear-probe", None, None)] if "linear-probe" in settings["method"] else []
        rows += dear_rows(settings) if "dear" in settings["method"] else []
        for row, roles, ablation in rows:  # one run per shots x seed
            for shots in settings["shots"]:
                for seed in settings["seeds"]:
                    leaf = (f"seed{seed}" if settings["protocol"] != "fewshot"
                            else f"shots{shots}-seed{seed}")
                    folder = os.path.join(out, dataset, row, leaf)
                    jobs.append(Job(dataset, row, roles, seed, shots, folder, ablation))
    return jobs


def table_rows(settings) -> Dict[str, tuple]:
    """{table row: (job row, fusion mode)}: zero-shot; the linear probe; the DeAR row once per
    --fusion mode (its key ends in the mode's suffix); each ablation under the first mode."""
    rows = {"zeroshot": ("zeroshot", None), "linear-probe": ("linear-probe", None)}
    for row, roles, ablation in dear_rows(settings):
        one_change = roles in ROLE_ABLATIONS or ablation is not None
        for mode in settings["fusion"][:1] if one_change else settings["fusion"]:
            rows[row + ("" if one_change else FUSION_ROWS[mode][0])] = (row, mode)
    return rows


def row_label(row: str) -> str:
    for suffix, label in FUSION_ROWS.values():
        if row.endswith(suffix):
            return ROW_LABELS.get(row[: -len(suffix)], row[: -len(suffix)]) + label
    return ROW_LABELS.get(row, row)  # a row without a label shows its key


def job_settings(settings, job: Job) -> dict:
    """What decides a run's result: saved with it and compared on --resume."""
    # how to run may change, not what
    keep = {k: v for k, v in settings.items() if k not in RUN_CONTROL}
    return dict(keep, job=dict(dataset=job.dataset, row=job.row, roles=job.roles, seed=job.seed,
                               shots=job.shots, ablation=job.ablation))


# ------------------------------------------------------------------------------------------
# 4. Input files: the model, the BPE file, the description pool, role files, fingerprints, the cache
# ------------------------------------------------------------------------------------------


# Offline, the files a named model needs are named by the flags that take them, and the toy CLIP
# (shipped, in OpenAI's formats) can stand in to try the flow on any data.
OFFLINE = ("without network give the files: --weights PATH (OpenAI's ViT-B-16.pt) and --bpe PATH "
           "(bpe_simple_vocab_16e6.txt.gz); or try the flow on the toy CLIP: --weights "
           "toyworld/assets/full/clip.pt --bpe toyworld/assets/full/bpe.txt.gz")


def load_clip(weights: str, head_width: Optional[int], bpe: Optional[str], device):
    """-> (frozen CLIP on the device, tokenizer), the tokenizer checked against the model. A file
    that cannot be fetched: one line naming the flags that give it instead."""
    try:
        clip, _ = clip_model.load(weights, device=device, head_width=head_width)
        tokenizer = clip_model.SimpleTokenizer(bpe)  # None: $CLIP_BPE_PATH, the cache, a download
    except clip_model.CLIPFileError as error:
        if "cannot download" not in str(error):
            raise  # clip_model's one line names the file and what is wrong with it
        raise TrainError(f"{str(error).split(';')[0]}; {OFFLINE}") from None
    try:
        # clip_model's one check: ids past the table, or other words
        tokenizer.check_fits(clip, weights)
    except clip_model.CLIPError as error:
        raise TrainError(f"--bpe {error}") from None  # named by the flag it came from
    # CLIP stays frozen: DeAR learns tokens only
    return clip.eval().requires_grad_(False), tokenizer


def load_role_file(path: str) -> dear.RoleMap:
    """dear.RoleMap.load, with valid JSON of the wrong shape (a list, a string layer) one line
    too."""
    try:
        return dear.RoleMap.load(path)
    except dear.DeARError:
        raise  # already one line, naming the file
    except (AttributeError, TypeError, ValueError, KeyError, RecursionError) as error:
        raise TrainError(f"{path}: not a DeAR role file ({type(error).__name__}); give a roles "
                         "JSON written by the head analysis") from None


# TextSpan's general description pool (yossigandelsman/clip_text_span, MIT), the one its authors'
# analysis of ViT heads reads: fetched once into the cache like CLIP's weights, checked by SHA-256.
TEXTSPAN_POOL_URL = ("https://raw.githubusercontent.com/yossigandelsman/clip_text_span/"
                     "49f70f31bb13437a870ff8de340626b225500a22/text_descriptions/"
                     "image_descriptions_general.txt")
TEXTSPAN_POOL_SHA256 = "39c6bf3e788684d9e0e8afa902c13aae1ee8eafefdbab94ba923fd05b9038630"


def description_pool(choice: str, project_bank: list, log: Callable[[str], None]):
    """--bank -> (the pool as (text, concept, value) triples, its record: what, SHA-256, size).
    'project': the project's own labelled bank; 'project-unlabelled': the same without its labels
    (its clusters are scored against them, never named by them); 'textspan': TextSpan's pool; else a
    file of the user's."""
    if choice == "project":
        pool, digest = [tuple(entry) for entry in project_bank], None
    elif choice == "project-unlabelled":
        pool, digest = [(entry[0], None, None) for entry in project_bank], None
    else:
        path = textspan_pool_file() if choice == "textspan" else choice
        try:
            pool, digest = [tuple(entry)
                            for entry in dear.read_descriptions(path, log)], sha256(path)
        except dear.DeARError as error:
            raise TrainError(f"--bank {error}") from None
    # the project's: of its entries
    digest = digest or hashlib.sha256(json.dumps(pool).encode()).hexdigest()
    return pool, dict(bank=choice, sha256=digest, descriptions=len(pool))


# The head analysis' description pool (--bank), read and checked before any model is read.


def analysing(settings) -> bool:
    """The call runs DeAR's own head analysis (--roles analyse), or --analyse-only."""
    return settings["analyse_only"] or ("dear" in settings["method"]
                                        and "analyse" in settings["roles"])


def description_bank(toy: bool) -> List[tuple]:
    if toy:
        from toyworld import world  # only the word lists: cheap, builds nothing

        return world.toy_bank()
    return [tuple(entry) for entry in dear.description_bank()]


def read_pool(settings, attributes: List[str]):
    """The head analysis' description pool (--bank), checked against what the analysis will ask
    of it before any model is read -> (triples, record); a call that analyses nothing (a resumed
    one reads its run folder's role map): None, and no pool is read or fetched."""
    if settings["resume"] or settings["eval_only"] or not analysing(settings):
        return None
    toy = settings["dataset"] == ["toyworld"]
    if settings["bank"] == "textspan":  # the pool that is downloaded: what costs nothing first
        check_encoder(settings, settings["concepts"] or "clusters")  # it has no labels
    try:
        bank, record = description_pool(settings["bank"], description_bank(toy), print)
    except TrainError as error:  # say why a pool never typed is read
        if settings["analysis"] == "paper" and settings["bank"] == "textspan":
            raise TrainError(f"--analysis paper reads TextSpan's pool: {error}") from None
        raise
    record["concepts"] = (settings["concepts"]  # unset: the pool decides
                          or dear.default_concepts(bank))
    check_pool(settings, bank, record["concepts"], attributes)
    check_encoder(settings, record["concepts"])
    record["header"] = analysis_header(settings, record["concepts"], toy)  # train.run logs it
    return bank, record


def check_encoder(settings, concepts: str) -> None:
    """--sentence-encoder against the concepts, then installed and there (before any download)."""
    if concepts == "labels" and settings["bank"] == "textspan":
        raise TrainError("--concepts labels: TextSpan's pool has no labels; "
                         "use --concepts clusters")
    if concepts == "labels" and settings["sentence_encoder"] != "clip":
        raise TrainError(f"--sentence-encoder {settings['sentence_encoder']}: the concepts are the "
                         f"pool's labels (--bank {settings['bank']}), which no encoder touches; "
                         "add --concepts clusters (or --analysis paper), or drop the encoder")
    check_sentence_encoder(settings["sentence_encoder"])


def check_pool(settings, bank: List[tuple], concepts: str, attributes: List[str]) -> None:
    """The pool against what the analysis will ask of it, before any model is read: its labels for
    --concepts labels, and enough distinct lines for the picks (typed, else the pool's default)."""
    try:
        dear.check_concepts(concepts, [dear.Description(*entry) for entry in bank])
        picks = default_picks(settings, bank, attributes)
    except dear.DeARError as error:
        raise TrainError(f"--bank {settings['bank']}: {error}") from None
    if settings["descriptions"] is not None:  # typed: refused past the pool, the images, the rank
        # TextSpan's rank is the head width: --head-width, else OpenAI's, until the model is read
        rank = settings["head_width"] or clip_model.OPENAI_HEAD_WIDTH
        dear.analysis_picks(settings["descriptions"], len(bank), settings["analysis_images"],
                            rank=rank, default=picks)
    elif len(bank) < picks:
        raise TrainError(f"--bank {settings['bank']}: {len(bank)} distinct descriptions, "
                         f"and TextSpan makes {picks} picks per head; give a pool of at least "
                         f"{picks}, or --descriptions {len(bank)} or fewer")


def default_picks(settings, bank: List[tuple], attributes: List[str]) -> int:
    """TextSpan's picks per head unless --descriptions says: the paper's 20 under --analysis paper,
    else the pool's rule (dear.default_picks: a labelled pool's fewest values of an attribute)."""
    if settings["analysis"] == "paper":
        return dear.PAPER_PICKS
    return dear.default_picks(bank, attributes)


def scoring_labels(choice: str, pool: list, project_bank: list) -> Dict[str, str]:
    """{text: label} that clusters.md scores the clusters against: the pool's own labels, or, for
    'project-unlabelled', the labels stripped from it."""
    labelled = project_bank if choice == "project-unlabelled" else pool
    return {entry[0]: entry[1] for entry in labelled if entry[1] is not None}


def textspan_pool_file() -> str:
    """TextSpan's pool in the cache (fetched once when the network allows), else one line saying
    where to put it."""
    cached = os.path.join(clip_model.default_cache_dir(), os.path.basename(TEXTSPAN_POOL_URL))
    try:
        return clip_model.download(TEXTSPAN_POOL_URL, TEXTSPAN_POOL_SHA256,
                                   what="TextSpan's description pool")
    except clip_model.CLIPError:
        raise TrainError(f"--bank textspan: cannot download {TEXTSPAN_POOL_URL}; without network, "
                         f"put that file (SHA-256 {TEXTSPAN_POOL_SHA256[:16]}...) at {cached}, or "
                         "give its path as --bank PATH") \
            from None


# The sentence encoder that embeds the picks before HDBSCAN (--sentence-encoder): CLIP's own text
# tower, or SBERT (the paper's) through sentence-transformers, an optional extra imported only
# here and only when chosen (never by dear.py, whose analyze_heads takes any embed_texts).


def check_sentence_encoder(encoder: str) -> None:
    """What costs nothing, before any download: SBERT's package is installed (looked up, not
    imported: the import takes seconds) and a model folder given is there."""
    if encoder == "clip":
        return
    flag, model = f"--sentence-encoder {encoder}", encoder.split(":", 1)[1]
    if os.path.isabs(model) and not os.path.isfile(os.path.join(model, "config.json")):
        what = ("no such folder" if not os.path.isdir(model)
                else "not a model folder (no config.json)")
        raise TrainError(f"{flag}: {what}; give the folder of a sentence-transformers model "
                         f"(e.g. all-MiniLM-L6-v2's), or a model name such as {SBERT_MODEL}")
    if importlib.util.find_spec("sentence_transformers") is None:
        raise TrainError(f"{flag}: sentence-transformers is not installed; {SBERT_INSTALL}")
    folder = model
    if not os.path.isabs(model):
        from huggingface_hub import snapshot_download  # sentence-transformers' own dependency
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(model)
        except ValueError:
            raise TrainError(f"{flag}: neither a model folder nor a Hugging Face model name "
                             f"(such as {SBERT_MODEL})") from None
        try:  # a cached copy is opened now too; one not cached is fetched later, when needed
            folder = snapshot_download(model, local_files_only=True)
        except OSError:
            return
    if problem := model_folder_problem(folder):
        raise TrainError(f"{flag}: {folder}: {problem}; fetch the model again, or give another "
                         "folder")


# The files a sentence-transformers model folder cannot do without: its tokenizer's (one of these
# sets: a fast tokenizer's file, a WordPiece vocabulary, a BPE vocabulary and its merges, a
# SentencePiece model) and a weights file.
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.txt",), ("vocab.json", "merges.txt"),
                   ("spiece.model",), ("sentencepiece.bpe.model",))
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")


def model_folder_problem(folder: str) -> Optional[str]:
    """What is wrong with a sentence-transformers model folder, read without loading the model
    (no import, a fraction of a second) -> a short phrase, or None. Its JSON files parse; a
    weights file is there and whole (a safetensors file's header fits it and accounts for every
    byte; a .bin file's zip index is there); a tokenizer's files are there. A damaged download or
    copy shows here, before any work, not as a traceback in the head analysis."""
    import zipfile

    for parent, _, names in os.walk(folder):
        for name in sorted(n for n in names if n.endswith(".json")):
            path = os.path.join(parent, name)
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except (OSError, ValueError) as error:
                return f"{os.path.relpath(path, folder)} is garbled ({type(error).__name__})"
    if not any(all(os.path.isfile(os.path.join(folder, n)) for n in files)
               for files in TOKENIZER_FILES):
        return ("no tokenizer files (" + ", or ".join(" + ".join(files) for files in
                                                      TOKENIZER_FILES[:3]) + ")")
    weights = [n for n in WEIGHTS_FILES if os.path.isfile(os.path.join(folder, n))]
    if not weights:
        return f"no weights file ({' or '.join(WEIGHTS_FILES)})"
    for name in weights:
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            problem = safetensors_problem(path)
        else:
            problem = None if zipfile.is_zipfile(path) else "not a whole torch file"
        if problem:
            return f"{name} is {problem}"
    return None


def safetensors_problem(path: str) -> Optional[str]:
    """A safetensors file read by its layout (8 bytes: the header's length; the header: JSON, each
    tensor's byte range; then the bytes) -> 'cut short', 'garbled' or None."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or length > size - 8:
            return "cut short or garbled"
        try:
            header = json.loads(f.read(length))
            ends = [entry["data_offsets"][1] for key, entry in header.items()
                    if key != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "garbled"
    end = 8 + length + max(ends, default=0)
    return None if end == size else "cut short" if end > size else "garbled (extra bytes)"


def sentence_encoder_record(encoder: str, log: Callable[[str], None]) -> dict:
    """What the analysis records of its encoder and keys its cache on -> {"name": "clip"} (its
    weights are keyed already), or SBERT's: the model asked for, its folder, every file's SHA-256
    by relative path, and the library versions. A named model comes from the Hugging Face cache
    (local files only), else is fetched once by name."""
    if encoder == "clip":
        return dict(name="clip")
    model = encoder.split(":", 1)[1]
    folder = model if os.path.isabs(model) else sbert_folder_of(model, log)
    files = {}
    for parent, _, names in sorted(os.walk(folder)):
        for name in sorted(names):  # a cache's snapshot holds links to its blobs: their content
            path = os.path.join(parent, name)
            files[os.path.relpath(path, folder).replace(os.sep, "/")] = sha256(path)
    versions = {package: importlib.metadata.version(package)
                for package in ("sentence-transformers", "transformers")}
    return dict(name="sbert", model=model, folder=folder, files=files, **versions)


def sbert_folder_of(name: str, log: Callable[[str], None]) -> str:
    """A named SBERT model's folder: the Hugging Face cache's copy, found with local files only,
    else fetched by sentence-transformers (the files its model needs) into that cache, once.
    Offline, one line saying how to pass a folder instead."""
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(name, local_files_only=True)
    except OSError:  # not in the cache (LocalEntryNotFoundError)
        pass
    flag = f"--sentence-encoder sbert:{name}"
    offline = (f"{flag}: not in the Hugging Face cache and {constants.ENDPOINT} cannot be "
               "reached; without network, pass a model folder: --sentence-encoder sbert:FOLDER "
               "(e.g. all-MiniLM-L6-v2's files, copied from a machine that has them)")
    if not reachable(constants.ENDPOINT):  # at once: the hub's client retries for minutes
        raise TrainError(offline)
    log(f"head analysis: fetching {name} into the Hugging Face cache (once)")
    from sentence_transformers import SentenceTransformer

    try:
        SentenceTransformer(name, device="cpu")
        return snapshot_download(name, local_files_only=True)
    except Exception as error:  # noqa: BLE001 -- the hub's and transformers' errors, one line
        raise TrainError(f"{offline} ({type(error).__name__})") from None


def reachable(url: str, timeout: float = 10.0) -> bool:
    """Whether a TCP connection to `url`'s host opens."""
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def sbert_embedder(record: dict, device: torch.device) -> Callable[[List[str]], torch.Tensor]:
    """SBERT from its model folder (local files only: no hub call) on the run's device, in fp32 and
    eval mode -> embed_texts for dear.analyze_heads: texts -> (n, d) on the CPU."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no warning when loaders fork later
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as error:
        raise TrainError(f"--sentence-encoder: sentence-transformers cannot be imported "
                         f"({error}); {SBERT_INSTALL}") from None
    from transformers.utils import logging as transformers_logging  # sentence-transformers' own

    transformers_logging.disable_progress_bar()  # no bar per model load in the run's log
    try:
        model = SentenceTransformer(record["folder"], device=str(device), local_files_only=True)
    except Exception as error:  # noqa: BLE001 -- transformers' and safetensors' errors, one line
        raise TrainError(f"--sentence-encoder sbert:{record['model']}: cannot load the model in "
                         f"{record['folder']} ({type(error).__name__}); give a "
                         "sentence-transformers model folder") from None
    model = model.float().eval()

    @torch.no_grad()
    def embed_texts(texts: List[str]) -> torch.Tensor:
        return model.encode(texts, batch_size=64, convert_to_tensor=True,
                            show_progress_bar=False).float().cpu()  # (n, d)
    return embed_texts


def encoder_line(encoder: dict) -> str:
    """The encoder in a few words, for clusters.md and the printed lines."""
    if encoder["name"] == "clip":
        return "CLIP's text tower"
    return (f"SBERT {encoder['model']} (sentence-transformers {encoder['sentence-transformers']}, "
            f"transformers {encoder['transformers']}; {len(encoder['files'])} files, SHA-256 in "
            "analysis.json)")


def cluster_names_of(path: Optional[str], attributes: List[str]) -> Optional[Dict[int, str]]:
    """--cluster-names FILE -> {cluster id: an attribute or 'other'}, or one line naming the
    problem."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as error:
        raise TrainError(f"--cluster-names {path}: unreadable ({type(error).__name__}); give a "
                         "JSON object such "
                         'as {"3": "colour", "7": "other"}') from None
    allowed = list(attributes) + ["other"]
    if not isinstance(raw, dict) or not all(str(k).isdigit() and v in allowed
                                            for k, v in raw.items()):
        raise TrainError(f"--cluster-names {path}: expected {{cluster id: name}} with names from "
                         f"{', '.join(allowed)}, e.g. {{\"3\": \"{allowed[0]}\"}}")
    return {int(k): v for k, v in raw.items()}


def adjusted_rand_index(a: list, b: list) -> float:
    """Hubert and Arabie's adjusted Rand index of two partitions of the same items (1: the same,
    about 0: as alike as chance)."""
    def pairs(counts) -> float:
        return sum(c * (c - 1) / 2 for c in counts)
    both, rows, cols = (pairs(Counter(zip(a, b)).values()), pairs(Counter(a).values()),
                        pairs(Counter(b).values()))
    expected, top = rows * cols / max(pairs([len(a)]), 1), (rows + cols) / 2
    return 1.0 if top == expected else (both - expected) / (top - expected)


def concepts_line(role_map: dear.RoleMap) -> str:
    """The analysis' concepts in one line: the pool's labels, or the clusters found (and, where
    none was, what that means for the roles)."""
    concepts = [c for h in role_map.heads for c in h.concepts]
    if role_map.concepts != "clusters":
        return f"concepts: the pool's labels ({', '.join(sorted(set(concepts)))})"
    picks = len({t for h in role_map.heads for t in h.descriptions})
    noise = len({t for h in role_map.heads for t, c in zip(h.descriptions, h.concepts)
                 if c == dear.NOISE})
    if not role_map.clusters:
        return (f"concepts: {picks} distinct picks in no cluster: each is a concept of its own, "
                "so every head spreads over its picks (no attribute head); clusters.md")
    named = ", ".join(f"{c.id} {c.name} ({c.size})" for c in role_map.clusters)
    return (f"concepts: {picks} distinct picks, {len(role_map.clusters)} clusters ({noise} in "
            f"none): {named}; clusters.md")


def clusters_table(role_map: dear.RoleMap, labels: Dict[str, str], encoder: dict) -> str:
    """clusters.md: the concepts of an analysis and the encoder that embedded them; where the picks
    have labels ({text: label}: scoring_labels), how the clusters agree with them over the distinct
    picks (noise picks each their own cluster, as in the entropy)."""
    picks = dict(zip((t for h in role_map.heads for t in h.descriptions),
                     (c for h in role_map.heads for c in h.concepts)))
    lines = [f"# Concepts of the head analysis: {role_map.concepts}", ""]
    if role_map.concepts != "clusters":
        return "\n".join(lines + [f"The pool's labels: {', '.join(sorted(set(picks.values())))}.",
                                  ""])
    lines += [f"Embedded by {encoder_line(encoder)}.", "",
              f"HDBSCAN over the {len(picks)} distinct picks of all heads; a name is a core "
              "attribute or other.",
              "", *md_table("cluster", ["name", "size", "its most central phrases"],
                            {str(c.id): [c.name, str(c.size), "; ".join(c.central)]
                             for c in role_map.clusters}),
              "", "In no cluster (noise, each a concept of its own): "
                  f"{list(picks.values()).count(dear.NOISE)} picks."]
    if all(labels.get(text) is not None for text in picks):
        found = [c if c != dear.NOISE else f"noise {text}" for text, c in picks.items()]
        truth = [labels[text] for text in picks]
        clustered = [(c, t) for c, t in zip(picks.values(), truth) if c != dear.NOISE]
        pure = sum(Counter(t for c2, t in clustered if c2 == c).most_common(1)[0][1]
                   for c in {c for c, _ in clustered})
        per_concept = {t: len({c for c, t2 in clustered if t2 == t}) for t in sorted(set(truth))}
        purity = f"{pure / len(clustered):.2f}" if clustered else "- (no pick in a cluster)"
        lines += ["", "Against the labels: adjusted Rand index "
                  f"{adjusted_rand_index(found, truth):.2f}, purity {purity} (clustered picks); "
                  "clusters per concept: "
                  + ", ".join(f"{t} {n}" for t, n in per_concept.items()) + "."]
    return "\n".join(lines + [""])


def role_map_for(choice: str, clip, attributes: List[str],
                 analysed: Optional[dear.RoleMap]) -> dear.RoleMap:
    """A RoleMap for --roles CHOICE: this call's analysis, an ablation, or a file (checked)."""
    depth, heads = len(clip.visual.transformer.resblocks), clip.visual.transformer.heads
    if choice == "analyse":
        return analysed  # measured by train.analysed_role_maps
    if choice in ROLE_ABLATIONS:
        # the analysed (last four) layers, 0-based
        layers = range(depth - dear.analysed_layers(depth), depth)
        return dear.RoleMap.uniform(choice.split("-", 1)[1], depth, heads, layers, attributes)
    try:  # dear.py's messages name arguments; say which flag the value came from
        role_map = load_role_file(choice)
        role_map.validate(depth, heads, attributes)
    except dear.DeARError as error:
        raise TrainError(f"--roles {choice}: {error}") from None
    return role_map


def first_layer(settings, clip) -> int:
    """The paper's 1-based J; "auto" = dear.default_first_layer."""
    auto = settings["first_layer"] == "auto"
    return (dear.default_first_layer(len(clip.visual.transformer.resblocks)) if auto
            else settings["first_layer"])


def check_model_fit(settings, clip, attributes: List[str]) -> None:
    """What DeAR's settings must fit in this model, checked before any run folder is written."""
    if "dear" not in settings["method"]:
        return
    if role_file_of(settings) is not None:  # a roles file made for another model stops here
        role_map_for(role_file_of(settings), clip, attributes, None)
    # memory grows with (77 + K)^2: a typo, not a setting
    if settings["text_tokens"] > clip.context_length:
        raise TrainError(f"--text-tokens {settings['text_tokens']}: expected at most the model's "
                         f"context length ({clip.context_length})")
    try:  # J counts in both towers
        dear.check_first_layer(first_layer(settings, clip),
                               min(len(clip.visual.transformer.resblocks),
                                                                len(clip.transformer.resblocks)))
    except dear.DeARError as error:
        raise TrainError(f"--first-layer {settings['first_layer']}: {error}") from None


def input_fingerprints(settings, weights: str, tokenizer) -> dict:
    """SHA-256 of each input that decides the result but is named by a place (--weights, --bpe, a
    --roles file); a named model's is its published one (in its URL; clip_model checks it on load).
    --resume / --eval-only: each must be the saved one (the files may have moved, not changed)."""
    role_file = role_file_of(settings)
    if role_file is not None and not os.path.isfile(role_file):  # resumed after the file was moved
        raise TrainError(f"--roles {role_file}: no such file; put it back (the run folder keeps a "
                         "copy, roles_file.json)")
    named = clip_model._MODELS.get(weights)  # noqa: SLF001 -- the published checksums
    fingerprints = dict(weights=named.split("/")[-2] if named else sha256(weights),
                        bpe=sha256(tokenizer.bpe_path),
                        roles_file=sha256(role_file) if role_file else None)
    for key, flag in (("weights", f"--weights {weights}"), ("bpe", f"--bpe {tokenizer.bpe_path}"),
                      ("roles_file", f"--roles {role_file}")):
        now, then = fingerprints[key], (settings["fingerprints"] or {}).get(key)
        if (settings["resume"] or settings["eval_only"]) and now != then:
            kept = (f" (a copy is {os.path.join(settings['output'], 'roles_file.json')})"
                    if key == "roles_file" else "")
            raise TrainError(f"{flag}: not the file this run was made with (SHA-256 "
                             f"{str(now)[:12]}... now, {str(then)[:12]}... then); resume with the "
                             f"original file{kept}, or start a new run with another --output")
    return fingerprints


sha256 = clip_model._sha256  # noqa: SLF001 -- one file hasher for the project (clip_model's)


def analysis_fingerprint(settings, clip, items: list, bank: list, attributes: list, picks: int,
                         rank: int,
                         concepts: dict, code: list) -> str:
    """SHA-256 of all a role map depends on: the weights' and BPE's SHA-256, the pool's images (path
    under --root and size: their bytes would mean reading every image), the description pool, where
    the concepts come from (the source, the encoder by its files' SHA-256 and library versions, not
    its folder's place; clustering settings, names), the analysis settings, the source of the
    code that makes and writes the map (`code`: modules and functions; changed code must not reuse
    a map), and the arithmetic it ran in (a GPU's name, torch's and cuDNN's versions; a CPU's
    vector kernels and torch's version), which may move a near tie between two picks."""
    depth = len(clip.visual.transformer.resblocks)  # vision layers
    encoder = {k: v for k, v in concepts["encoder"].items() if k not in ("model", "folder")}
    device = clip.visual.conv1.weight.device  # another device's arithmetic: another map, maybe
    arithmetic = (gpu_build(device) if device.type == "cuda" else
                  f"{device.type} ({torch.backends.cpu.get_cpu_capability()}), "
                  f"torch {torch.__version__}")
    key = dict(
        arithmetic=arithmetic,
        weights=settings["fingerprints"]["weights"], bpe=settings["fingerprints"]["bpe"],
        heads=clip.visual.transformer.heads, layers=dear.analysed_layers(depth),
        images=[[os.path.relpath(item.path, settings["root"]), os.path.getsize(item.path)]
                for item in items],
        bank=[list(entry) for entry in bank], attributes=list(attributes), picks=picks,
        rank=rank, low_bits=settings["low_bits"], high_bits=settings["high_bits"],
        concepts=dict(concepts, encoder=encoder), code=source_fingerprint(code))
    # sorted keys: one text per key
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def source_fingerprint(code: list) -> str:
    """SHA-256 of the source of each module or function in `code`, in order, each under its name."""
    parts = [f"{part.__name__}\n{inspect.getsource(part)}" for part in code]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def analysis_cache(fingerprint: str, pool: str, analyse: Callable[[str], None],
                   runtime: Runtime) -> str:
    """-> <cache>/head-analysis/<fingerprint>/, made if missing by analyse(folder) into a temporary
    folder renamed whole, under a lock: a second process waits, then reuses it."""
    root = os.path.join(clip_model.default_cache_dir(), "head-analysis")
    entry = os.path.join(root, fingerprint[:16])  # 64 bits of the SHA-256 name the folder
    if runtime.main:
        if reason := unwritable_reason(root):
            raise TrainError(f"{root}: the head-analysis cache {reason}; set $CLIP_CACHE_DIR to a "
                             "writable folder")
        os.makedirs(root, exist_ok=True)  # the lock file lives beside the entries
        if runtime.world > 1:
            bound = format_time(MAIN_WORK_TIMEOUT.total_seconds())
            runtime.log(f"head analysis: on rank 0 alone; the other processes wait for it up to "
                        f"{bound} (runs.MAIN_WORK_TIMEOUT)")
        with waiting_lock(entry + ".lock", "head analysis: another process is analysing the same "
                          f"heads ({entry}.lock); waiting for it", runtime.log,
                          timeout=ANALYSIS_LOCK_TIMEOUT.total_seconds()):
            if os.path.isfile(os.path.join(entry, "roles.json")):
                runtime.log(f"head analysis: reusing the role map cached in {entry} ({pool})")
            else:
                temporary = os.path.join(root, f".tmp-{os.getpid()}-{fingerprint[:16]}")
                # left by this pid's earlier killed call
                shutil.rmtree(temporary, ignore_errors=True)
                # roles.json, roles.txt, roles.png, analysis.json (toy: the causal check)
                analyse(temporary)
                # an entry without roles.json is incomplete
                shutil.rmtree(entry, ignore_errors=True)
                os.replace(temporary, entry)  # whole or not at all
    wait_for_main(runtime, "head analysis")  # the other processes then read what rank 0 wrote
    return entry  # its roles.json exists: complete


def role_copy(settings, dataset: str, checked: bool = False) -> str:
    """The run folder's copy of a trained dataset's analysed role map; `checked`: the one
    --resume / --eval-only read (never the cache's), refused unless its SHA-256 is the run's."""
    path, records = (os.path.join(settings["output"], dataset, "roles", "roles.json"),
                     settings["role_maps"] or {})
    if checked and (dataset not in records or not os.path.isfile(path)
                    or sha256(path) != records[dataset]["sha256"]):
        raise TrainError(f"{path}: missing or not the role map this run was made with; the run "
                         "folder is damaged, start a new run with another --output")
    return path


def copy_role_maps(settings, clip, records: dict) -> None:
    """The run folder keeps what the cache holds for each map it uses, and the masks of its own J
    (masks.png: a role map does not fix J, so it is drawn per run)."""
    for dataset, record in records.items():
        folder = os.path.dirname(role_copy(settings, dataset))  # <output>/<dataset>/roles/
        for name in sorted(os.listdir(record["cache"])):  # each file whole
            source = os.path.join(record["cache"], name)
            clip_model.atomic_write(os.path.join(folder, name),
                                    lambda tmp: shutil.copyfile(source, tmp))
        role_map, J = load_role_file(role_copy(settings, dataset)), first_layer(settings, clip)
        image_tokens = 1 + clip.visual.grid_size**2  # CLS + the patch grid
        masks = dear.build_role_masks(role_map, J, len(clip.visual.transformer.resblocks),
                                      image_tokens)
        draw_role_masks(masks, image_tokens, role_map.attributes, J,
                        os.path.join(folder, "masks.png"), role_map)


# ------------------------------------------------------------------------------------------
# 5. The run folder: files written whole, the lock, checkpoints, their checks, resuming
# ------------------------------------------------------------------------------------------
# Every file is written to a temporary name and renamed (clip_model.atomic_write: a reader
# never sees half a file), a checkpoint or results.json is accepted only with the settings of
# this run, and one process at a time writes a folder.


# whole or not at all, the file closed before the rename
def write_text(path: str, text: str) -> None:
    clip_model.atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json(path: str, value) -> None:
    write_text(path, json.dumps(value, indent=2, allow_nan=False) + "\n")  # NaN is not JSON


def unwritable_reason(path: str) -> Optional[str]:
    """None if files can be made in `path` (or the nearest existing folder above it, where a later
    makedirs writes), else the reason in a short phrase. Tried by writing a probe file: os.access
    is not enough (root, read-only mounts)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)  # up to the folder a makedirs would start from
    if not os.path.isdir(existing):
        return f"lies under {existing}, which is a file"
    probe = os.path.join(existing, f".tmp-write-test-{secrets.token_hex(6)}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)  # nothing is left behind by the check
    except OSError as error:
        return f"cannot write in {existing} ({error.strerror or error})"
    return None


@contextlib.contextmanager
def waiting_lock(path: str, waiting_message: str, log: Callable[[str], None] = print,
                 timeout: Optional[float] = None):
    """An exclusive lock on the file `path` around a cache entry checked, then written; its
    holder's pid is written in the file. A second process logs `waiting_message` and the holder
    once, and waits until the first leaves (then finds the entry made), or for at most `timeout`
    seconds: then one line naming the holder (TrainError). The OS drops the lock however its
    holder ends; no lock where fcntl is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"  # the pid its holder wrote
            bound = f", at most {format_time(timeout)}" if timeout is not None else ""
            log(f"{waiting_message} (held by pid {holder}{bound})")
            if not flock_within(handle, timeout):
                raise TrainError(f"{path}: held by another process (pid {holder}) for more "
                                 f"than {format_time(timeout)}; let it finish, or end it if it "
                                 "is stuck, then run again") from None
        handle.truncate(0)  # ours now: our pid, for the next caller ("a+": writes go to the end)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield


def flock_within(handle, timeout: Optional[float]) -> bool:
    """Take the exclusive lock on an open file, waiting at most `timeout` seconds (None: as long
    as it takes) -> whether it was taken. flock has no timeout of its own: it is tried each
    second."""
    import fcntl

    if timeout is None:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks until the holder's block ends
        return True
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.01)))


def check_output_folder(output: str) -> None:
    """A fresh run's --output: a folder that can be made and written, not already holding a run."""
    if not output:
        raise TrainError("--output '': expected a folder for the run")
    if os.path.exists(output) and not os.path.isdir(output):
        raise TrainError(f"--output {output}: is a file, not a folder; choose another --output")
    if reason := unwritable_reason(output):  # tried by writing, before any data is read
        raise TrainError(f"--output {output}: {reason}; choose another --output")
    if os.path.exists(os.path.join(output, "settings.json")):
        raise TrainError(f"{output}: already holds a run; continue it with --resume, evaluate it "
                         "with --eval-only, or choose another --output")


def lock_run_folder(output: str, stack: contextlib.ExitStack) -> None:
    """One writer per run folder: an exclusive lock on <output>/.lock held until the call ends
    (the OS drops it when the process dies, even by SIGKILL: no stale lock to clean), then the
    .tmp-* files of a write killed half-way removed (no other process can be writing them)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; do not start two calls on one folder there
        return
    handle = open(os.path.join(output, ".lock"), "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip()  # the pid its holder wrote
        handle.close()
        raise TrainError(f"{output}: in use by another train.py "
                         f"process{f' (pid {holder})' if holder else ''}; wait for it to end, or "
                         "choose another --output") from None
    # ours now: our pid, for the next caller's message ("a+": writes go to the end)
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    stack.callback(handle.close)  # closing the file releases the lock
    for folder, _, files in os.walk(output):
        for name in files:
            if name.startswith(".tmp-"):
                os.remove(os.path.join(folder, name))  # a write killed half-way


def check_run_folder(settings, jobs: List[Job], stack: contextlib.ExitStack) -> None:
    """Before any work: a fresh run's --output is usable; a resumed one is locked, cleaned, and
    every results.json and checkpoint in it was made with this run's settings."""
    if not (settings["resume"] or settings["eval_only"]):
        # a fresh run: its folder is made later, whole
        return check_output_folder(settings["output"])
    if int(os.environ.get("RANK", "0")) != 0:
        return
    lock_run_folder(settings["output"], stack)
    for job in jobs:
        if load_run_file(os.path.join(job.folder, "results.json"),
                         job_settings(settings, job)) is None \
                and job.row != "zeroshot":
            load_run_file(os.path.join(job.folder, "checkpoint.pt"), job_settings(settings, job))


def start_run_folder(settings, clip, world: int, stack: contextlib.ExitStack) -> None:
    """A new run's folder: made, locked, checked again under the lock (another call may have
    started it meanwhile), then the roles it uses and, last, settings.json written."""
    os.makedirs(settings["output"], exist_ok=True)
    lock_run_folder(settings["output"], stack)
    check_output_folder(settings["output"])
    if role_file_of(settings) is not None:  # the run keeps the roles it used
        clip_model.atomic_write(os.path.join(settings["output"], "roles_file.json"),
                                lambda tmp: shutil.copyfile(role_file_of(settings), tmp))
    copy_role_maps(settings, clip, settings["role_maps"] or {})  # --resume / --eval-only read these
    saved = {k: v for k, v in settings.items() if k not in ("resume", "eval_only", "analyse_only")}
    write_json(os.path.join(settings["output"], "settings.json"), dict(
        format=RUN_FORMAT, settings=saved, torch=torch.__version__,
        python=platform.python_version(),
        command="python train.py " + " ".join(sys.argv[1:]), world_size=world))


def load_run_file(path: str, expected: dict) -> Optional[dict]:
    """A run's results.json or checkpoint.pt (None if there is none), refused unless it holds what
    train.py writes and was made with the `expected` settings: a folder mixing two runs (files
    copied in, two writers) is refused rather than summarised or continued."""
    if not os.path.isfile(path):
        return None
    results = path.endswith(".json")
    try:
        if results:
            with open(path, encoding="utf-8") as f:
                found = json.load(f)
            shaped = isinstance(found, dict) and isinstance(found.get("metrics"), dict) \
                and all(isinstance(v, float) for v in found["metrics"].values()) \
                and isinstance(found.get("job"), dict)
        else:
            # tensors and plain data, no code
            found = torch.load(path, map_location="cpu", weights_only=True)
            shaped = isinstance(found, dict) and found.get("format") == CHECKPOINT_FORMAT \
                and isinstance(found.get("epoch"), int) \
                and all(isinstance(found.get(key), dict)
                        for key in ("learnable", "optimizer", "scaler"))
        if not (shaped and isinstance(found.get("settings"), dict)):
            raise ValueError("wrong shape")  # not `assert`, which vanishes under python -O
    except Exception as error:  # noqa: BLE001 -- any unreadable file gets the same advice
        advice = "delete it and --resume evaluates that run again" if results else \
            "delete it to restart that run from scratch"
        raise TrainError(f"{path}: unreadable {'results' if results else 'checkpoint'} "
                         f"({type(error).__name__}); {advice}") from None
    if found["settings"] != expected:
        raise TrainError(f"{path}: made with other settings than this run's "
                         f"({differences(found['settings'], expected)}): the folder mixes two "
                         "runs; start again with another --output")
    return found


# Each run's history, beside its checkpoint: log.txt (every line printed for it, and every
# progress line), metrics.jsonl (one JSON object per epoch: the loss terms, training accuracy,
# lr, fusion weights, images/s, the share of time spent waiting for data, the gradient norm) and
# curves.png drawn from it. Both files are appended to (--resume continues them); metrics.jsonl is
# first cut back to the epochs of the checkpoint it resumes from. The call's own lines go to
# <output>/log.txt.
METRICS_FILE = "metrics.jsonl"


@contextlib.contextmanager
def run_log(runtime: Runtime, folder: str):
    """Inside the block, the run's lines also go to <folder>/log.txt (appended)."""
    if not runtime.main:
        yield
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "log.txt"), "a", encoding="utf-8") as handle:
        runtime.run_log = handle
        try:
            yield
        finally:
            runtime.run_log = None


def open_call_log(runtime: Runtime, output: str, stack: contextlib.ExitStack) -> None:
    """From here to the call's end its lines (and those printed before, kept) are appended to
    <output>/log.txt."""
    if not runtime.main:
        return
    handle = open(os.path.join(output, "log.txt"), "a", encoding="utf-8")
    stack.callback(handle.close)
    stack.callback(setattr, runtime, "call_log", None)
    handle.write("".join(line + "\n" for line in runtime.pending))
    runtime.pending.clear()
    runtime.call_log = handle


def append_metrics(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


def read_metrics(path: str) -> List[dict]:
    """metrics.jsonl's records (a last line cut short by a killed call is left out)."""
    if not os.path.isfile(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                break
    return records


def trim_metrics(path: str, epochs: int) -> None:
    """--resume: metrics.jsonl back to the records of the first `epochs` epochs, those of the
    checkpoint it resumes from (a killed call may have written one more)."""
    kept = [record for record in read_metrics(path) if record["epoch"] <= epochs]
    if os.path.isfile(path):
        write_text(path, "".join(json.dumps(record) + "\n" for record in kept))


def save_checkpoint(path: str, settings: dict, epoch: int, model, optimizer, scaler) -> None:
    """Only the learnable tensors, the optimizer's and scaler's state and the run's settings."""
    state = dict(format=CHECKPOINT_FORMAT, settings=settings, epoch=epoch,
                 learnable=model.learnable_state_dict(),
                 optimizer=optimizer.state_dict(), scaler=scaler.state_dict())

    def write(temporary: str) -> None:
        try:
            torch.save(state, temporary)
        except RuntimeError as error:  # torch's file writer reports a full disk this way
            raise TrainError(f"{path}: cannot write the checkpoint "
                             f"({' '.join(str(error).split())[:100]}); free disk space, then "
                             "continue with --resume") from None

    clip_model.atomic_write(path, write)  # a run killed mid-save keeps the previous epoch's


def resume_checkpoint(job: Job, settings, model, optimizer, scaler, runtime: Runtime) -> int:
    """--resume: the run's last checkpoint loaded (the tokens, the optimizer's moments, the
    scaler) -> the epoch it ends (0: none saved yet)."""
    path = os.path.join(job.folder, "checkpoint.pt")
    checkpoint = load_run_file(path, job_settings(settings, job))
    trim_metrics(os.path.join(job.folder, METRICS_FILE), checkpoint["epoch"] if checkpoint else 0)
    if checkpoint is None:
        return 0
    model.load_learnable_state_dict(checkpoint["learnable"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    # the precision may have changed (--amp, another GPU): a fresh scaler where none was saved
    load_scaler_state(scaler, checkpoint["scaler"],
                      lambda line: runtime.log(f"[{job.label}] {line}"))
    runtime.log(f"[{job.label}] resumed after epoch {checkpoint['epoch']}/{settings['epochs']}")
    return checkpoint["epoch"]


def end_epoch(job: Job, settings, model: dear.DeAR, optimizer, scaler, progress: Progress,
              runtime: Runtime) -> None:
    """An epoch's end, after its last read (so nothing non-finite is saved): its record appended to
    the run's metrics.jsonl, its checkpoint (rank 0 writes; every rank holds the same tokens), its
    line in the logs, and, at each quarter of the run, a line printed."""
    epoch, epochs = progress.current + 1, settings["epochs"]
    alpha = dict(zip(["class"] + model.attributes, model.fusion_weights().tolist()))
    record = dict(progress.last, alpha=alpha, seconds=round(time.time() - progress.epoch_started, 3))
    if runtime.main:
        append_metrics(os.path.join(job.folder, METRICS_FILE), record)
        save_checkpoint(os.path.join(job.folder, "checkpoint.pt"), job_settings(settings, job),
                        epoch, model, optimizer, scaler)
    weights = ", ".join(f"{name} {value:.2f}" for name, value in alpha.items())
    runtime.detail(f"[{job.label}] epoch {epoch}/{epochs} done in "
                   f"{format_time(record['seconds'])}; fusion weights alpha: {weights}; "
                   "checkpoint saved")
    if epoch in {math.ceil(epochs * quarter / 4) for quarter in range(1, 5)}:
        runtime.log(f"[{job.label}] epoch {epoch}/{epochs}: {progress.summary()}")


def finish_job(job: Job, settings, model: dear.DeAR, stop: int, runtime: Runtime):
    """The trained model, or None where --max-epochs-per-call stopped the run first; either way
    its curves so far drawn (curves.png) from metrics.jsonl."""
    if runtime.main:
        draw_curves(read_metrics(os.path.join(job.folder, METRICS_FILE)), job.label,
                    settings["epochs"], os.path.join(job.folder, "curves.png"))
    if runtime.world > 1:
        dist.barrier()
    if stop < settings["epochs"]:
        runtime.log(f"[{job.label}] stopped after epoch {stop}/{settings['epochs']} "
                    "(--max-epochs-per-call); continue with: "
                    f"python train.py --output {settings['output']} --resume")
        return None
    return model


def finished(job: Job, settings) -> bool:
    """The run's results.json is there (an earlier call finished it) and the call does not
    evaluate it again (--eval-only)."""
    return os.path.isfile(os.path.join(job.folder, "results.json")) and not settings["eval_only"]


def finished_checkpoint(job: Job, settings) -> dict:
    """--eval-only: the run's checkpoint, checked against its settings and finished."""
    path = os.path.join(job.folder, "checkpoint.pt")
    checkpoint = load_run_file(path, job_settings(settings, job))
    if checkpoint is None or checkpoint["epoch"] < settings["epochs"]:
        raise TrainError(f"{job.folder}: no finished checkpoint to evaluate; "
                         "finish it with --resume")
    return checkpoint


def evaluation_record(job: Job, settings, model, accuracy: dict, logits: dict, betas: dict) -> dict:
    """A zero-shot or DeAR job's results.json (retrieval added by train.run_job): "metrics" and
    "logits", the first --fusion mode's numbers and which logits scored each set (accuracy: {set:
    {kind of logits: top-1 %}}, logits: {mode: {set: kind}}); *_by_fusion: the same for every
    mode; role_map: the analysed map this run used, if any; alpha: DeAR's learned fusion weight
    per branch; parameters: its learnable ones per component; test_beta: each set's beta at
    test ({set: beta})."""
    by_fusion = {mode: {name: accuracy[name][kind] for name, kind in logits[mode].items()}
                 for mode in settings["fusion"]}
    for metrics in by_fusion.values():
        if settings["protocol"] == "base2novel":
            metrics["hm"] = harmonic_mean(metrics["base"], metrics["novel"])
    first = settings["fusion"][0]
    alpha = parameters = None
    if model is not None:
        alpha = dict(zip(["class"] + model.attributes, model.fusion_weights().tolist()))
        counts = model.parameter_counts()  # per component of the token construction
        parameters = dict(tokens=model.construction, learnable=sum(counts.values()), components=counts)
    role_record = None
    if job.roles == "analyse":
        role_record = (settings["role_maps"] or {}).get(job.dataset)
    return dict(job=asdict(job), metrics=by_fusion[first], fusion=first, logits=logits[first],
                metrics_by_fusion=by_fusion, logits_by_fusion=logits, accuracy_by_logits=accuracy,
                role_map=role_record, alpha=alpha, parameters=parameters, test_beta=betas or None,
                settings=job_settings(settings, job))


def differences(found: dict, expected: dict) -> str:
    """'lr 0.002 (expected 0.001), ...': what makes two settings dicts differ."""
    keys = [k for k in sorted(set(found) | set(expected)) if found.get(k) != expected.get(k)]
    return ", ".join(f"{k} {str(found.get(k))[:40]} (expected {str(expected.get(k))[:40]})"
                     for k in keys[:3])


def format_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))  # h:mm:ss
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


LOSS_TERMS = ("total", "ce", "reg", "fusion", "branch")  # dear.dear_loss's (branch: branch-ce's)
# fp16: the loss scaler's skipped steps in a row that stop a run (our choice: its scale has then
# halved 20 times, from 65,536 to 1/16; an overflow that survives that is no overflow).
MAX_SKIPPED_IN_A_ROW = 20


class Diverged(TrainError):
    """A run met a non-finite loss or gradient: it stops, keeps its last finite checkpoint, and
    the call goes on with its other runs (--resume continues it from that checkpoint)."""


def gradient_norm(parameters: List[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of every gradient together, () on the device: non-finite if any entry is."""
    norms = [torch.linalg.vector_norm(p.grad.float()) for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


class Progress:
    """One run's training, watched. Per step, on the device (no host sync): the loss terms' and
    the training accuracy's running sums, the gradient norm, the time spent waiting for the
    loader, and the guard against a non-finite step. Every --log-every steps and at each epoch's
    end, one read of them all (the one host sync of those steps): the progress line, and the
    guard's verdict. The first non-finite loss term or gradient stops the run (Diverged) at that
    read, naming the step where it happened; under fp16 a non-finite gradient is the loss
    scaler's to skip (it halves its scale), counted, and MAX_SKIPPED_IN_A_ROW in a row stop the
    run the same way. Nothing non-finite reaches a checkpoint: end_epoch saves after the
    epoch's last read."""

    def __init__(self, job: Job, settings, runtime: Runtime, model: dear.DeAR, scaler,
                 steps: int, steps_per_epoch: int):
        self.job, self.settings, self.runtime, self.model = job, settings, runtime, model
        self.fp16 = scaler.is_enabled()  # non-finite gradients: skipped steps, not a stop
        self.steps, self.steps_per_epoch, self.done = steps, steps_per_epoch, 0
        self.started = time.time()  # for the time left of this call
        device = runtime.device
        self.first_bad = torch.tensor(-1, device=device)  # the first non-finite step, or -1
        self.bad_what = torch.zeros(len(LOSS_TERMS) + 2, dtype=torch.bool, device=device)
        self.in_a_row = torch.tensor(0, device=device)  # fp16: skipped steps in a row
        self.skipped = torch.tensor(0, device=device)  # fp16: skipped steps of this call

    def epoch(self, epoch: int, loader):
        """Epoch `epoch`'s batches as (step from 1, batch), timing the wait for each."""
        self.current = epoch
        self.epoch_started, self.waited, self.images = time.time(), 0.0, 0
        # per loss term, then correct predictions, the finite gradient norms' sum and count
        self.sums = torch.zeros(len(LOSS_TERMS) + 3, device=self.runtime.device)
        batches = iter(loader)
        for step in itertools.count(1):
            asked = time.perf_counter()
            batch = next(batches, None)
            self.waited += time.perf_counter() - asked  # the loader's share of the step
            if batch is None:
                return
            yield step, batch

    def step(self, step: int, lr: float, losses: dict, logits: torch.Tensor,
             labels: torch.Tensor) -> None:
        """The step's numbers into the sums and the guard; at a logged step, the read."""
        zero = torch.zeros((), device=self.runtime.device)
        terms = torch.stack([losses.get(key, zero).detach().float() for key in LOSS_TERMS])
        norm = gradient_norm(self.model.learnable_parameters())  # unscaled after scaler.step
        n = len(labels)
        correct = (logits.detach().argmax(-1) == labels).sum()
        gradients_finite = torch.isfinite(norm)
        finite_norm = torch.where(gradients_finite, norm, zero)  # fp16's skipped steps aside
        self.sums += torch.cat([terms * n, correct[None], finite_norm[None],
                                gradients_finite[None].float()])
        self.images += n
        self.done += 1
        # The guard: which of the loss terms, the gradients, the scaler's skips went wrong.
        self.in_a_row = (self.in_a_row + 1) * ~gradients_finite if self.fp16 else self.in_a_row
        self.skipped = self.skipped + (~gradients_finite).long() if self.fp16 else self.skipped
        wrong = torch.cat([~torch.isfinite(terms),
                           (~gradients_finite if not self.fp16 else zero.bool())[None],
                           (self.in_a_row >= MAX_SKIPPED_IN_A_ROW)[None]])
        first = wrong.any() & (self.first_bad < 0)
        global_step = self.current * self.steps_per_epoch + step
        self.first_bad = torch.where(first, global_step, self.first_bad)
        self.bad_what = torch.where(first, wrong, self.bad_what)
        if step % self.settings["log_every"] == 0 or step == self.steps_per_epoch:
            self.read(step, lr)

    def read(self, step: int, lr: float) -> None:
        """The one host sync of the last --log-every steps: the guard's verdict, then the line."""
        values = torch.cat([self.sums, self.first_bad[None].float(), self.bad_what.float(),
                            self.skipped[None].float()]).tolist()
        sums, first_bad = values[:len(self.sums)], int(values[len(self.sums)])
        bad_what = values[len(self.sums) + 1:-1]
        self.skipped_steps = int(values[-1])
        if first_bad >= 0:
            raise Diverged(self.diverged(first_bad, bad_what))
        elapsed = max(time.time() - self.epoch_started, 1e-9)
        mean = {key: value / self.images for key, value in zip(LOSS_TERMS, sums)}
        self.last = dict(epoch=self.current + 1, lr=lr, loss={k: mean[k] for k in LOSS_TERMS
                                                            if k != "branch" or mean[k]},
                         train_accuracy=100 * sums[-3] / self.images,
                         gradient_norm=sums[-2] / max(sums[-1], 1),
                         images_per_second=self.images * self.runtime.world / elapsed,
                         data_wait=self.waited / elapsed, skipped_steps=self.skipped_steps)
        left = (time.time() - self.started) / self.done * (self.steps - self.done)
        self.runtime.detail(f"[{self.job.label}] epoch {self.current + 1}/"
                            f"{self.settings['epochs']} step {step}/{self.steps_per_epoch} "
                            + self.summary() + f", {format_time(left)} left")

    def summary(self) -> str:
        """The last read in a few words: losses, training accuracy, lr, speed, data wait."""
        last = self.last
        terms = " ".join(f"{key} {value:.3f}" for key, value in last["loss"].items()
                         if key != "total")
        skipped = f", {last['skipped_steps']} steps skipped by fp16's loss scaler" \
            if self.fp16 and last["skipped_steps"] else ""
        return (f"loss {last['loss']['total']:.3f} ({terms}) acc {last['train_accuracy']:.1f}% "
                f"lr {last['lr']:.1e}, {last['images_per_second']:.0f} img/s "
                f"(data wait {100 * last['data_wait']:.0f}%){skipped}")

    def diverged(self, first_bad: int, bad_what: list) -> str:
        """The one line a non-finite step gets: which run, where, what, in what arithmetic, what
        was kept and what to try."""
        epoch, step = divmod(first_bad - 1, self.steps_per_epoch)
        terms = [key for key, bad in zip(LOSS_TERMS, bad_what) if bad]
        what = [f"loss ({', '.join(terms)})"] if terms else []
        what += ["gradients"] if bad_what[len(LOSS_TERMS)] else []
        what = " and ".join(what) + " not finite"
        if bad_what[len(LOSS_TERMS) + 1]:
            what = f"{MAX_SKIPPED_IN_A_ROW} steps in a row skipped by fp16's loss scaler"
        kept = f"epoch {epoch}'s checkpoint kept" if epoch else "no checkpoint yet"
        return (f"[{self.job.label}] diverged at epoch {epoch + 1}, step {step + 1}: {what} "
                f"({precision_name(self.runtime.amp_dtype)}, attention {self.runtime.attention}); "
                f"{kept}; try --attention explicit or another --amp, then --resume")


# ------------------------------------------------------------------------------------------
# 6. Tables in the paper's shape
# ------------------------------------------------------------------------------------------
# Each cell is the mean over seeds. For base-to-novel, HM is computed from the mean base and
# mean novel accuracies, and the "Average" block's HM from the average base and novel over
# datasets -- as CoCoOp, MaPLe and the DeAR paper compute it.

DG_NAMES = {"imagenet": "ImageNet", "imagenet_v2": "-V2", "imagenet_sketch": "-Sketch",
            "imagenet_a": "-A",
            "imagenet_r": "-R"}  # the DG table's columns, as the paper names them


def harmonic_mean(base: float, novel: float) -> float:
    if math.isnan(base) or math.isnan(novel):
        return math.nan  # a row without a novel number (the linear probe) has no HM
    return 2 * base * novel / (base + novel) if base + novel > 0 else 0.0


def mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else math.nan  # nan: an empty cell, stored as null


def spread(values: List[float]) -> float:
    """Sample standard deviation over seeds (0 for a single run, e.g. zero-shot)."""
    if len(values) < 2:
        return 0.0
    return math.sqrt(sum((v - mean(values)) ** 2 for v in values) / (len(values) - 1))


def paragraph(text: str) -> List[str]:
    """A paragraph of a markdown file in lines of at most 100 characters (it reads the same, and
    prints without a line that runs off the screen)."""
    import textwrap

    return textwrap.wrap(text, width=100, break_long_words=False, break_on_hyphens=False)


def md_table(corner: str, columns: List[str], rows: Dict[str, List[str]]) -> List[str]:
    """A markdown table's lines: the header, then one line per row (numbers right-aligned)."""
    return ["| " + " | ".join([corner, *columns]) + " |", "|---|" + "---:|" * len(columns)] + \
        ["| " + " | ".join([name, *cells]) + " |" for name, cells in rows.items()]


def job_table(label: str, metrics: dict) -> str:
    return "\n".join(md_table("run", list(metrics),
                              {label: [f"{v:.2f}" for v in metrics.values()]})) + "\n"


def summarise(settings, results: List[dict]) -> dict:
    """-> {"rows", "tables": {name: {"columns", "rows": {row: [values]}, "spread"?}}, "logits"}
    with the values rounded to two decimals exactly as the markdown shows them."""
    protocol, datasets = settings["protocol"], settings["dataset"]
    spec = {row: job_row_mode for row, job_row_mode in table_rows(settings).items()
            if any(res["job"]["row"] == job_row_mode[0] for res in results)}
    rows = list(spec)

    def seed_values(dataset: str, row: str, metric: str,
                    shots: Optional[int] = None) -> List[float]:
        return [res.get("metrics_by_fusion", {}).get(spec[row][1], res["metrics"])
                .get(metric, math.nan)
                for res in results if res["job"]["row"] == spec[row][0]
                and res["job"]["dataset"] == dataset
                # the row's fusion mode
                and (shots is None or res["job"]["shots"] in (None, shots))]

    def cell(dataset: str, row: str, metric: str, shots: Optional[int] = None) -> float:
        return mean(seed_values(dataset, row, metric, shots))

    logits = {}  # which logits scored each test set, per row (the same for every seed and dataset)
    for row in rows:
        res = next(res for res in results if res["job"]["row"] == spec[row][0])
        logits[row] = res.get("logits_by_fusion", {}).get(spec[row][1], res.get("logits", {}))
    tables: Dict[str, dict] = {}
    if protocol in ("base2novel", "fewshot"):  # a table per dataset, after their average's
        b2n = protocol == "base2novel"
        metrics = [("base", None), ("novel", None)] if b2n else [("all", k)
                                                                 for k in settings["shots"]]
        columns = ["Base", "Novel", "HM"] if b2n else [f"{k} shot{'s' if k > 1 else ''}"
                                                       for _, k in metrics]
        per = {d: {row: [cell(d, row, m, k) for m, k in metrics] for row in rows} for d in datasets}
        if len(datasets) > 1:  # base2novel: its HM below is of the average base and novel
            per = {f"Average over {len(datasets)} datasets": {
                row: [mean([per[d][row][i] for d in datasets]) for i in range(len(metrics))]
                for row in rows}, **per}
        for name, values in per.items():
            tables[name] = dict(columns=columns, rows={row: v + [harmonic_mean(*v)] if b2n else v
                                                       for row, v in values.items()})
            # the spread over seeds of base, novel and each seed's own HM
            if b2n and name in datasets:
                seeds = {row: (seed_values(name, row, "base"), seed_values(name, row, "novel"))
                         for row in rows}
                tables[name]["spread"] = {row: [spread(b), spread(n),
                                                spread(list(map(harmonic_mean, b, n)))]
                                          for row, (b, n) in seeds.items()}
    # cross and dg: one training on the source; other datasets and ImageNet's variants get a table
    # each
    else:
        source = settings["source"]
        for title, dg in (("Cross-dataset evaluation", False), ("Domain generalization", True)):
            targets = [t for t in datasets if data.get_spec(t).evaluation_only == dg]
            if targets:
                values = {row: [cell(source, row, t) for t in [source] + targets] for row in rows}
                names = [DG_NAMES.get(n, n) if dg else n for n in [source] + targets]
                tables[f"{title}: trained on {source}, tested on {len(targets)} targets"] = dict(
                    columns=[f"{names[0]} (source)"] + names[1:] + ["Average"],
                    # the targets' average
                    rows={row: v + [mean(v[1:])] for row, v in values.items()})
    for table in tables.values():  # an empty cell (nan) is stored as null
        for key in set(table) & {"rows", "spread"}:
            table[key] = {row: [None if math.isnan(v) else round(v, 2) for v in vals]
                          for row, vals in table[key].items()}
    betas = next((res["test_beta"] for res in results if res.get("test_beta")), None)  # {set: beta}
    test_beta = betas if settings["test_beta"] else None  # cross and dg: said under the table
    return dict(protocol=protocol, seeds=settings["seeds"], rows=rows, tables=tables, logits=logits,
                alpha=fusion_weights(settings, results), test_beta=test_beta)


def fusion_weights(settings, results: List[dict]) -> dict:
    """{trained dataset: {DeAR row (in fewshot: ", N shots" added): {branch: [mean, sd]}}}: the
    learned alpha of the class branch and of each attribute token over seeds (left out: 0)."""
    weights: Dict[str, dict] = {}
    for res in results:
        if res.get("alpha"):
            job = res["job"]
            shots = f", {job['shots']} shots" if settings["protocol"] == "fewshot" else ""
            key = job["row"] + shots
            row = weights.setdefault(job["dataset"], {}).setdefault(key, {})
            for branch, value in res["alpha"].items():
                row.setdefault(branch, []).append(value)
    def summed(values: List[float]) -> List[float]:
        return [round(mean(values), 3), round(spread(values), 3)]

    return {dataset: {key: {branch: summed(v) for branch, v in row.items()}
                      for key, row in rows.items()}
            for dataset, rows in weights.items()}


def markdown(summary: dict, settings) -> str:
    titles = dict(base2novel="Base-to-novel generalization", fewshot="Few-shot classification")
    # cross, dg:
    title = titles.get(settings["protocol"], "Cross-dataset evaluation and domain generalization")
    shots = settings["shots"]
    shots = ("shots " + ", ".join(map(str, shots)) if settings["protocol"] == "fewshot"
             else f"{shots[0]} shots")
    lines = [f"# {title}", "",
             *paragraph(f"Accuracy (%), mean over seeds {', '.join(map(str, settings['seeds']))}; "
                        f"{settings['weights']}; {shots}. Zero-shot CLIP does not train: one run "
                        "serves every seed. ± = standard deviation over seeds; - = no number (the "
                        "linear probe has no classifier for unseen classes)."), ""]
    diverged = summary.get("diverged") or {}  # {job row: its diverged runs' lines}
    job_rows = table_rows(settings)

    def label(row: str) -> str:  # a row with diverged runs says so
        runs_lost = len(diverged.get(job_rows.get(row, (row,))[0], []))
        return row_label(row) + (f" ({runs_lost} run{'s' * (runs_lost > 1)} diverged, "
                                 "not in the mean)" if runs_lost else "")

    for name, table in summary["tables"].items():
        spreads = table.get("spread", {})  # ± only where seeds differ
        cells = {label(row): ["-" if v is None else f"{v:.2f}" + (f" ± {d:.2f}" if d else "")
                              for v, d in zip(values, spreads.get(row, [None] * len(values)))]
                 for row, values in table["rows"].items()}
        lines += [f"## {name}", "", *md_table("Method", table["columns"], cells), ""]
    lines += [f"Diverged (no number; --resume continues it from its last finite checkpoint): "
              f"{line}" for lines_of_row in diverged.values() for line in lines_of_row]
    lines += [""] if diverged else []
    names = {"fused": "fused", "class": "class branch alone", "clip": "CLIP"}
    lines += paragraph("Logits per test set (fused = DeAR's fusion with the weights learned on "
                       "the training classes; class branch alone = MMRL's rule for classes not "
                       "trained):")
    for row, used in summary.get("logits", {}).items():
        if used:
            lines.append(f"- {row_label(row)}: " + ", ".join(f"{test} {names.get(kind, kind)}"
                                                             for test, kind in used.items()))
    fallen = [name for name, record in (settings.get("role_maps") or {}).items()
              if record.get("class_branch_only")]
    if fallen:  # dear.falls_back_to_class_branch: both DeAR rows are then the class branch's
        lines.append(f"- The head analysis of {', '.join(fallen)} names no attribute head: DeAR "
                     "falls back to the class branch alone there.")
    if summary.get("test_beta"):  # cross and dg: the beta DeAR was tested at, per test set
        rule = ("MMRL++'s per target (trainers/config.py, task CD; the trained set and a target "
                "it does not name: the training beta)" if settings["test_beta"] == "per-target"
                else "the training beta on every target (--test-beta trained)")
        betas = ", ".join(f"{name} {beta:g}" for name, beta in summary["test_beta"].items())
        lines.append(f"- DeAR's beta at test time, {rule}: {betas}")
    return "\n".join(lines + [""] + fusion_weights_markdown(summary.get("alpha") or {}))


def fusion_weights_markdown(alpha: dict) -> List[str]:
    """The learned fusion weights: a row per DeAR row (and dataset), a column per branch."""
    if not alpha:
        return []

    def label(dataset: str, key: str) -> str:  # key: a row, in fewshot with ", N shots"
        row, _, shots = key.partition(", ")
        where = f"{dataset}: " if len(alpha) > 1 else ""
        return where + row_label(row) + (f", {shots}" if shots else "")

    branches = list(dict.fromkeys(b for rows in alpha.values() for row in rows.values()
                                  for b in row))
    cells = {label(dataset, key): [f"{row[b][0]:.2f} ± {row[b][1]:.2f}" if b in row else "-"
                                   for b in branches]
             for dataset, rows in alpha.items() for key, row in rows.items()}
    return ["## Learned fusion weights alpha (mean ± sd over seeds)", "",
            "Each branch's weight in the fused logits (class branch, then each attribute token); "
            "- = no such branch.", "", *md_table("DeAR run", branches, cells), ""]


def retrieval_summary(results: List[dict], attributes: List[str], k: int):
    """Precision@k per (feature, attribute), mean and spread over a DeAR row's seeds -> (JSON,
    markdown)."""
    summary, lines = {}, []
    for row in dict.fromkeys(res["job"]["row"] for res in results if res.get("retrieval")):
        tables = [res["retrieval"] for res in results if res["job"]["row"] == row
                  and res.get("retrieval")]
        seeds = lambda name, a: [t[name][a] for t in tables]  # noqa: E731
        summary[row] = {name: {a: "blind" if "blind" in seeds(name, a) else
                               [100 * mean(seeds(name, a)), 100 * spread(seeds(name, a))]
                               for a in attributes} for name in tables[0]}
        cells = {{"class": "class feature",
                  "frozen CLIP": "frozen CLIP"}.get(name, f"{name} token"):
                 ["blind" if v == "blind" else f"{v[0]:.1f} ± {v[1]:.1f}" for v in values.values()]
                 for name, values in summary[row].items()}
        lines += [f"## {row_label(row)}: precision@{k} (%) of same-value retrieval, mean ± sd "
                  f"over {len(tables)} seeds", "",
                  *md_table("ranked by", [f"same {a}" for a in attributes], cells), ""]
    text = "\n".join(["# Attribute-conditioned retrieval", "", *paragraph(
        "Gallery: the test split; each test image queries the others by one feature (cosine); a "
        "hit is a neighbour with the query's value. Chance = the value's share of the test "
        "images. A blind token cannot read the image and ranks nothing."), "", *lines])
    return summary, text


def write_summaries(settings, results: List[dict], diverged: List[dict], attributes: List[str],
                    k: int, runtime: Runtime) -> None:
    """summary.json / .md (and, where a run measured retrieval, retrieval.json / .md), printed
    too. A diverged run has no number: its row says so, and the means are over the others."""
    summary = summarise(settings, results)
    summary["diverged"] = {record["job"]["row"]: [] for record in diverged}
    for record in diverged:
        summary["diverged"][record["job"]["row"]].append(record["diverged"])
    files = dict(summary=(summary, markdown(summary, settings)))
    # the toy world: attribute-conditioned retrieval
    if any(res.get("retrieval") for res in results):
        files["retrieval"] = retrieval_summary(results, attributes, k)
    for name, (value, text) in files.items():
        if runtime.main:
            write_json(os.path.join(settings["output"], f"{name}.json"), value)
            write_text(os.path.join(settings["output"], f"{name}.md"), text)
        if name == "summary":  # the tables, printed; retrieval's in its file (and the logs)
            runtime.log("\n" + text)
        else:
            runtime.detail("\n" + text)
            runtime.log(f"train.py: {name} tables in "
                        f"{os.path.join(settings['output'], name + '.md')}")


# ------------------------------------------------------------------------------------------
# 7. PNG pictures: head roles, role masks, retrieval
# ------------------------------------------------------------------------------------------
# One hue per attribute, grey-blue for generalization, light grey for mixed. Pillow is
# torchvision's own dependency.
ATTRIBUTE_COLOURS = [(214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207),
                     (227, 119, 194), (188, 189, 34), (140, 86, 75)]
GENERALIZATION_COLOUR, MIXED_COLOUR = (52, 78, 120), (200, 200, 200)


def draw_heatmap(role_map: dear.RoleMap, path: str) -> None:
    """layers (rows, 1-based) x heads (columns); each cell coloured by role, with the head's
    concept entropy written in it, and a legend."""
    from PIL import Image, ImageDraw

    # pixels
    cell_w, cell_h, left, top, layers, H = 58, 34, 96, 52, role_map.layers, role_map.num_heads
    legend = {f"attribute: {a}": ATTRIBUTE_COLOURS[i % len(ATTRIBUTE_COLOURS)] for i, a in
              enumerate(role_map.attributes)} | {"generalization": GENERALIZATION_COLOUR,
                                                 "mixed": MIXED_COLOUR}
    # the legend: three per line
    height = top + len(layers) * cell_h + 30 + 18 * ((len(legend) + 2) // 3)
    # 560: the title's width
    image = Image.new("RGB", (max(left + H * cell_w + 10, 560), height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((8, 4), f"DeAR head roles; number = concept entropy (bits)\n{role_map.source}",
              fill="black")
    for head in range(H):
        draw.text((left + head * cell_w + cell_w // 2 - 8, top - 16), f"h{head}", fill="black")
    for row, layer in enumerate(layers):
        y = top + row * cell_h
        draw.text((8, y + cell_h // 2 - 6), f"layer {layer + 1}", fill="black")
        for head in range(H):
            entry = role_map.role_of(layer, head)
            colour = legend[f"attribute: {entry.attribute}" if entry.role == "attribute"
                            else entry.role]
            x = left + head * cell_w
            draw.rectangle([x, y, x + cell_w - 2, y + cell_h - 2], fill=colour)
            label = "" if entry.entropy is None else f"{entry.entropy:.2f}"
            # which cluster named it
            if entry.role == "attribute" and role_map.concepts == "clusters":
                # e.g. "cl. 3"
                label += "\ncl. " + dear.dominant_concept(entry.concepts).split()[-1]
            draw.text((x + 6, y + cell_h // 2 - 6 * label.count("\n") - 6), label,
                      fill="black" if sum(colour) > 450 else "white")
    y = top + len(layers) * cell_h + 12
    for i, (name, colour) in enumerate(legend.items()):
        x, yy = 8 + (i % 3) * 180, y + (i // 3) * 18
        draw.rectangle([x, yy, x + 12, yy + 12], fill=colour)
        draw.text((x + 18, yy), name, fill="black")
    clip_model.atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))


def draw_role_masks(masks: torch.Tensor, num_image_tokens: int, attributes: List[str],
                    first_layer: int, path: str, role_map: Optional[dear.RoleMap] = None) -> None:
    """masks.png: the masks (L, H, T, T) folded to the image and the attribute tokens, one small
    grid per head (row = query token, column = key token), one row of grids per layer (1-based),
    each grid's head and role above it. White = may attend, black = may not."""
    from PIL import Image, ImageDraw

    layers, H, A = masks.shape[0], masks.shape[1], len(attributes)
    kept = [0, *range(num_image_tokens, masks.shape[-1])]  # the image tokens folded into one
    names = ["I"] + [a[0] for a in attributes]  # the tokens' initials, in mask order
    cell, left, top, gap = 12, 84, 96, 22  # pixels
    grid = (1 + A) * cell
    width = max(left + H * (grid + gap), 640)
    image = Image.new("RGB", (width, top + layers * (grid + gap + 12) + 10), "white")
    draw = ImageDraw.Draw(image)
    lines = ["DeAR role masks: one grid per head, one row of grids per layer (1-based)",
             "row = query token, column = key token; white = may attend, black = may not",
             "tokens: I = the image's (the class token and the patches, alike), then "
             + ", ".join(f"{a[0]} = {a}" for a in attributes),
             "above each grid: the head and its role (A:col = attribute head for colour, "
             "G = generalization, M = mixed)"]
    for row, text in enumerate(lines):
        draw.text((6, 6 + 14 * row), text, fill="black")
    for li in range(layers):
        y0 = top + li * (grid + gap + 12)
        draw.text((6, y0 + grid // 2 - 6), f"layer {first_layer + li}", fill="black")
        for head in range(H):
            x0 = left + head * (grid + gap)
            entry = role_map.role_of(first_layer - 1 + li, head) if role_map else None
            tag = ("M" if entry is None else {"attribute": f"A:{(entry.attribute or '')[:3]}",
                                              "generalization": "G", "mixed": "M"}[entry.role])
            draw.text((x0, y0 - 12), f"h{head} {tag}" if role_map else f"h{head}", fill="black")
            folded = masks[li, head][kept][:, kept]  # (1 + A, 1 + A)
            for r in range(1 + A):
                for c in range(1 + A):
                    draw.rectangle([x0 + c * cell, y0 + r * cell, x0 + (c + 1) * cell - 1,
                                    y0 + (r + 1) * cell - 1],
                                   fill="white" if folded[r, c] == 0 else "black",
                                   outline=(150, 150, 150))
            if head == 0:  # the tokens' initials: query rows at the left, key columns below
                for index, name in enumerate(names):
                    draw.text((x0 - 10, y0 + index * cell), name, fill=(90, 90, 90))
                    draw.text((x0 + index * cell + 3, y0 + grid + 1), name, fill=(90, 90, 90))
    clip_model.atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))


def draw_curves(records: List[dict], title: str, epochs: int, path: str) -> None:
    """curves.png from a run's metrics.jsonl, one point per epoch: the loss terms (left), the
    training accuracy and the class branch's fusion weight alpha_cls, both in % (right). No
    record (no epoch trained): no picture."""
    from PIL import Image, ImageDraw

    if not records:
        return
    width, height, plot_w, plot_h, top = 960, 430, 360, 290, 44  # pixels
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 8), f"{title}: training curves, one point per epoch (metrics.jsonl)",
              fill="black")
    x = [record["epoch"] for record in records]
    losses = {key: [record["loss"].get(key) for record in records] for key in LOSS_TERMS
              if any(key in record["loss"] for record in records)}
    shares = {"training accuracy": [record["train_accuracy"] for record in records],
              "alpha of the class branch": [100 * record["alpha"]["class"] for record in records]}
    for panel, (name, series, low, high) in enumerate(
            [("loss (mean over the epoch's images)", losses, 0.0, None), ("%", shares, 0, 100)]):
        left = 70 + panel * 480
        values = [v for ys in series.values() for v in ys if v is not None]
        high = high if high is not None else max(max(values, default=1.0), 1e-6) * 1.05

        def point(epoch: float, value: float) -> tuple:
            return (left + (epoch - 1) / max(epochs - 1, 1) * plot_w,
                    top + plot_h - (value - low) / (high - low) * plot_h)

        draw.rectangle([left, top, left + plot_w, top + plot_h], outline="black")
        for tick in range(5):  # the y axis: five values
            value = low + (high - low) * tick / 4
            y = point(1, value)[1]
            draw.line([left - 4, y, left, y], fill="black")
            draw.text((left - 46, y - 6), f"{value:.3g}", fill="black")
        for epoch in sorted({1, epochs, *range(5, epochs, 5)}):  # the x axis
            tick_x = point(epoch, low)[0]
            draw.line([tick_x, top + plot_h, tick_x, top + plot_h + 4], fill="black")
            draw.text((tick_x - 6, top + plot_h + 6), str(epoch), fill="black")
        draw.text((left + plot_w // 2 - 16, top + plot_h + 20), "epoch", fill="black")
        draw.text((left, top - 16), name, fill="black")
        for index, (label, ys) in enumerate(series.items()):
            colour = ATTRIBUTE_COLOURS[index % len(ATTRIBUTE_COLOURS)]
            points = [point(e, v) for e, v in zip(x, ys) if v is not None]
            if len(points) > 1:
                draw.line(points, fill=colour, width=2)
            for px, py in points:
                draw.ellipse([px - 2, py - 2, px + 2, py + 2], fill=colour)
            legend_y = top + plot_h + 40 + 16 * (index // 3)
            legend_x = left + 125 * (index % 3)
            draw.rectangle([legend_x, legend_y + 2, legend_x + 10, legend_y + 12], fill=colour)
            draw.text((legend_x + 16, legend_y), label, fill="black")
    clip_model.atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))


def draw_retrieval(gallery: list, rankings: Dict[str, torch.Tensor], size: int, queries: int,
                   shown: int, folder: str, label: str) -> None:
    """retrieval_<feature>.png in `folder`, one per feature that ranks the gallery: a title
    naming the feature, then per row a query test image (framed in red) and its `shown` nearest
    gallery images by that feature's cosine, nearest first (rankings: {feature: (M, k)})."""
    from PIL import Image, ImageDraw

    tile = max(size, 64)  # pixels: small images enlarged (nearest neighbour)
    import torchvision  # the test transform's resize and centre crop, on a PIL image

    pictures = data.ImageDataset(gallery, torchvision.transforms.Compose(
        data.test_transform(size).transforms[:2]))
    for name, ranking in rankings.items():
        feature = {"class": "the class feature", "frozen CLIP": "frozen CLIP's image feature"}.get(
            name, f"the {name} token's feature")
        rows = min(queries, len(gallery))
        image = Image.new("RGB", (12 + (1 + shown) * (tile + 4) + 8, 56 + rows * (tile + 4)),
                          "white")
        draw = ImageDraw.Draw(image)
        draw.text((8, 6), f"{label}: retrieval by {feature}", fill="black")
        draw.text((8, 22), f"each row: a test image (red frame), then its {shown} nearest test "
                  f"images by cosine, nearest first", fill="black")
        for row in range(rows):
            for column, index in enumerate([row] + ranking[row, :shown].tolist()):
                x, y = 12 + column * (tile + 4), 44 + row * (tile + 4)
                picture = pictures[index][0].resize((tile, tile), Image.NEAREST)
                image.paste(picture, (x, y))
                if column == 0:
                    draw.rectangle([x - 2, y - 2, x + tile + 1, y + tile + 1], outline=(220, 30, 30),
                                   width=2)
        clip_model.atomic_write(os.path.join(folder, f"retrieval_{name.replace(' ', '_')}.png"),
                                lambda tmp: image.save(tmp, format="PNG"))


# ------------------------------------------------------------------------------------------
# 8. Errors: one line, exit status 2
# ------------------------------------------------------------------------------------------


def one_line_errors(call: Callable[[], int]) -> int:
    """call() -> its exit status; a known error is one line on stderr and exit status 2, before
    any work where the checks come first (and --resume continues after one that came later)."""
    import warnings

    # data.py's warnings (a class with fewer than K images, a rebuilt cache) as one line each.
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    try:
        return call()
    except (TrainError, data.DatasetError, dear.DeARError, clip_model.CLIPError) as error:
        message = str(error)
    except OSError as error:  # a full disk, a folder made read-only mid-run: one line too
        where = f"{error.filename}: " if error.filename else ""
        message = f"{where}{error.strerror or error}; fix it, then continue with --resume"
    except KeyboardInterrupt:
        print("train.py: interrupted; the last finished epoch is saved: continue with --resume",
              file=sys.stderr)
        return 130
    print(f"train.py: error: {message}", file=sys.stderr)
    return 2
