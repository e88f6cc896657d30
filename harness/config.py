"""harness/config.py -- the parsed flags -> a run's settings, complete and checked once, before
anything is read or written: each flag typed, else the trained dataset's recipe, else the book's
default; the presets (--analysis paper), K's resolution, every range check, and --resume's saved
settings with the run-control flags that may change. Called by train.run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from typing import Dict, List, Optional

import data
import dear
from .errors import TrainError
from .cli import (ABLATIONS, ROLE_ABLATIONS, TOY_ONLY_ABLATIONS, RecipeBook, SBERT_MODEL,
                  ablation_roles, check_values)
from .devices import pick_device
from . import splitfiles


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
    every = [a for a in ABLATIONS if args.dataset == ["toyworld"] or a not in TOY_ONLY_ABLATIONS]
    stored_as["ablations"] = lambda v: every if "all" in v else _unique(v)
    stored_as.update(dataset=lambda v: dataset_names(v, protocol, source, book),
                     source=data.dataset_key,
                     augment=lambda v: v == "on", image_cache=lambda v: v == "on")
    return {key: stored_as.get(key, lambda v: v)(value) for key, value in vars(args).items()
            if value is not None and value is not False
            and key not in ("resume", "eval_only", "analyse_only")}


def dataset_names(typed: List[str], protocol: str, source: Optional[str],
                  book: RecipeBook) -> List[str]:
    own = splitfiles.is_own_data
    names = [splitfiles.own_dataset_name(n) if own(n) else data.dataset_key(n) for n in typed]
    if names == ["all"]:  # cross and dg: one training on the source, tested on all fourteen targets
        source = data.dataset_key(_default(source, book.defaults["source"]))
        names = book.paper_datasets if protocol in ("base2novel", "fewshot") else \
            [n for n in book.paper_datasets if n != source] + book.dg_targets
    return list(names)


def settings_from_flags(args: argparse.Namespace, book: RecipeBook) -> Dict[str, object]:
    """A new run: the flags + the trained dataset's recipe + the defaults -> every setting,
    explicit."""
    protocol = _default(args.protocol, book.defaults["protocol"])
    typed = typed_flags(args, protocol, args.source, book)
    names = typed["dataset"]
    # no paths in a folder name
    folder = [splitfiles.own_dataset_name(n) if splitfiles.is_own_data(n) else n
              for n in args.dataset]
    output = _default(args.output, os.path.join("runs", f"{protocol}-{'-'.join(folder)}"))
    own = [(splitfiles.own_dataset_name(n), os.path.abspath(n)) for n in args.dataset
           if splitfiles.is_own_data(n)]
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
    roles = settings["roles"]  # each an existing file or a choice (cli.early_checks)
    if sum(choice not in ROLE_ABLATIONS for choice in roles) > 1:
        raise TrainError(f"--roles {' '.join(roles)}: give at most one of 'analyse' or a roles "
                         "file (both make the DeAR row); add the ablations all-mixed / "
                         "all-generalization beside it")
    ablations = settings["ablations"]
    if ablations and "dear" not in settings["method"]:
        raise TrainError(f"--ablations {' '.join(ablations)}: each is a DeAR row; "
                         "add dear to --method")
    toy_only = [name for name in ablations if name in TOY_ONLY_ABLATIONS and not toy]
    if toy_only:
        raise TrainError(f"--ablations {toy_only[0]}: the toy world's only (its causal check "
                         "knows which heads carry an attribute); use it with --dataset toyworld")
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
    trained dataset's training images); its 20 picks are dear.default_picks(..., paper=True).
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
        return [f"head analysis: the project's, not the paper's (--analysis paper): --bank "
                f"{settings['bank']}, concepts {concepts}{encoder}, --analysis-pool "
                f"{settings['analysis_pool']}"]
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
    if (settings["text_tokens"] or 0) < 0:
        return  # validate_settings refuses it, in the flag's words
    try:
        dear.check(tokens=settings["tokens"], num_attributes=num_attributes,
                   num_text_tokens=settings["text_tokens"])
    except dear.DeARError as error:
        raise TrainError(f"--text-tokens {settings['text_tokens']}: {error}") from None
    if settings["text_tokens"] is None:
        settings["text_tokens"] = dear.default_text_tokens(settings["tokens"], num_attributes)


def register_own_data(dataset_paths: Dict[str, str], output: str) -> None:
    """Your own data (--dataset PATH): registered in data.py under its folder's name, every file
    checked; a split drawn for a read-only folder goes to <output>/<name>/."""
    for name, path in dataset_paths.items():
        splitfiles.own_dataset(path, split_fallback_dir=os.path.join(output, name))


def validate_settings(settings: dict) -> None:
    """Every number in range and finite, before anything is read or written (resumed calls too:
    they may change the run-control flags): cli.check_values, then the method's own ranges,
    dear.py's checks."""
    check_values(settings)
    for key, given in (("beta", ["beta"]), ("low_bits", ["low_bits"]), ("high_bits", ["high_bits"]),
                       ("low_bits", ["low_bits", "high_bits"])):
        try:
            dear.check(**{name: settings[name] for name in given})
        except dear.DeARError as error:  # dear.py's message, under the flag
            raise TrainError(f"--{key.replace('_', '-')} {settings[key]}: {error}") from None
    analysis_pool_of(settings["analysis_pool"])  # a malformed pool stops here
    pick_device(settings["device"])  # an unknown or absent device stops here


def settings_from_run_folder(args: argparse.Namespace, book: RecipeBook) -> Dict[str, object]:
    """--resume / --eval-only: the run folder's saved settings; a flag that would change what is
    computed is refused (it would silently mix two experiments in one folder). The flags' own
    checks came first (cli.early_checks)."""
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
