"""harness/cli.py -- train.py's command line: every flag, its choices and its help, the defaults
shown from train.py's one table of them (RecipeBook), and --recipes, which prints the recipes'
table. It imports no torch, so that `python train.py --help` answers in a moment; the few
values it shows from the method's modules are read from their source (project_constants).
config.py turns the parsed flags into a run's settings.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import math
import os
import sys
from dataclasses import fields
from typing import Callable, List, NamedTuple, Optional

from .errors import TrainError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)  # each module's source parsed once, however many names
def module_tree(module: str) -> ast.Module:
    with open(os.path.join(REPO, f"{module}.py"), encoding="utf-8") as f:
        return ast.parse(f.read())


def top_level_assignments(module: str) -> dict:
    return {target.id: node.value for node in module_tree(module).body
            if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


def project_constants(module: str, *names: str) -> tuple:
    """Top-level constants of one of the project's modules (dear, clip_model, ...), read from
    its source, not imported (each imports torch): the module keeps the one definition."""
    found = top_level_assignments(module)
    return tuple(ast.literal_eval(found[name]) for name in names)


TEXT_TOKENS, TOKEN_CONSTRUCTIONS, CONCEPT_SOURCES = project_constants(
    "dear", "TEXT_TOKENS", "TOKEN_CONSTRUCTIONS", "CONCEPT_SOURCES")
(OWN_TEMPLATE,) = project_constants("harness/splitfiles", "OWN_TEMPLATE")
(OPENAI_HEAD_WIDTH,) = project_constants("clip_model", "OPENAI_HEAD_WIDTH")


def registry_names() -> List[str]:
    """data.DATASETS' names, read from its rows' source: DatasetSpec("oxford_pets", ...)."""
    return [node.args[0].value for node in ast.walk(module_tree("data"))
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "DatasetSpec"
            and node.args and isinstance(node.args[0], ast.Constant)]


# What a call can ask for.
PROTOCOLS = ("base2novel", "fewshot", "cross", "dg")
METHODS = ("zeroshot", "linear-probe", "dear")
# DeAR gives two kinds of logits (fused, and the class branch alone), and its public material
# does not settle which its tables use (docs/METHOD.md Sec. 5), so every table shows the DeAR
# row under both rules by default:
#   fused-everywhere   the fused logits, weights learned on the training classes, on every test set
#   class-on-unseen    fused on the trained classes in the trained domain; the class branch alone
#                      on classes not trained (novel classes, other datasets, variants): MMRL's code
FUSION_MODES = ("fused-everywhere", "class-on-unseen")
OLD_FUSION_NAMES = {"everywhere": "fused-everywhere", "adaptive": "class-on-unseen"}
# --roles' fixed maps besides "analyse" and a roles file, each with the ablation it is: all-mixed
# is the no-role-mask ablation's map (dear.ablate makes it; one row, whichever asks for it),
# all-generalization a comparison of our own (every token blind).
ROLE_ROWS = {"all-mixed": "no-role-mask", "all-generalization": None}
ROLE_ABLATIONS = tuple(ROLE_ROWS)
# The paper's ablations and the lab's controls (--ablations), each the DeAR row with one change:
# dear.ABLATIONS names them and says what each changes, dear.ablate makes the change. true-heads
# needs the toy world's causal check: "all" leaves it out elsewhere.
(ABLATIONS,) = project_constants("dear", "ABLATIONS")
TOY_ONLY_ABLATIONS = ("true-heads",)
# The head analysis as a whole (--analysis): the project's (its labelled bank, checked on the toy
# world against ablation) or the paper's Sec. 3.2 (config.analysis_preset; docs/METHOD.md
# Sec. 3's table of departures).
ANALYSES = ("project", "paper")
# SBERT, the paper's sentence encoder (--sentence-encoder sbert): sentence-transformers'
# all-MiniLM-L6-v2 unless another model is named. An optional extra, imported only when chosen.
SBERT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
SBERT_INSTALL = "pip install -r requirements-sbert.txt"
TEST_BETAS = ("per-target", "trained")  # cross, dg: DeAR's beta on a target (dear.test_beta)
AMP_CHOICES = ("on", "off", "fp16", "bf16")  # on = fp16 (devices.choose_precision)
# The attention kernel (--attention). clip_model computes attention one of two ways: its own
# explicit per-head maths, or torch's fused scaled_dot_product_attention ("sdpa"), which picks a
# backend among those allowed: flash (on CUDA no arbitrary mask: never DeAR's there),
# memory-efficient, cuDNN, math. A fused kernel can be wrong on a given GPU and torch build (cuDNN's attention has given
# NaN gradients with a mask at some sequence lengths, pytorch/pytorch#196678), so under "auto" a
# kernel that benchmarks/device_check.py found wrong on this GPU is not allowed, and cuDNN's only
# once device_check passed it there (its verdicts: devices.attention_record).
ATTENTION_CHOICES = ("auto", "explicit", "sdpa", "efficient", "cudnn", "math")
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION", "math": "MATH"}  # torch's SDPBackend names


def ablation_roles(name: str) -> Optional[str]:
    """The --roles row an ablation is, where --roles makes its map (ROLE_ROWS); None: the DeAR row
    with the change."""
    return next((roles for roles, ablation in ROLE_ROWS.items() if ablation == name), None)


class RecipeBook(NamedTuple):
    """train.py's tables, handed to the harness (which never imports train.py)."""
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


class OneLineParser(argparse.ArgumentParser):
    """An error as one line, not the whole usage (--help has it); exit status 2, as argparse's.
    (data.py keeps a copy of its own: it stands alone.)"""

    def error(self, message: str):
        if "--root: expected one argument" in message:  # `--root $DATA` with $DATA unset
            message += "; is $DATA set? export DATA=/path/to/your/datasets"
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(book: RecipeBook) -> argparse.ArgumentParser:
    """Every flag, grouped. Every default is None, so an unset flag is told apart from a typed one
    (--resume refuses a typed change); "(default ...)" is added to each help from the book."""
    p = OneLineParser(
        prog="train.py", usage="python train.py --dataset NAME|all|toyworld|PATH [options]",
        description="DeAR on CLIP: train and evaluate on the paper's protocols. A flag left unset "
        "takes the trained dataset's recipe (python train.py --recipes), else the default shown.",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=30, width=100))
    g = p.add_argument_group("what to run").add_argument
    g("--dataset", nargs="+", metavar="NAME", help="data.py's name, 'all' (the protocol's), "
      "'toyworld' (no downloads), or PATH: your own class folders or CoOp split file")
    g("--protocol", choices=PROTOCOLS, metavar="NAME", help=" | ".join(PROTOCOLS))
    g("--method", nargs="+", choices=METHODS, metavar="NAME",
      help="table rows: " + ", ".join(METHODS))
    g("--roles", nargs="+", metavar="CHOICE", help="head roles, a row each: analyse (concept "
      "entropy, cached), a roles.json file, all-mixed, all-generalization")
    g("--ablations", nargs="+", choices=(*ABLATIONS, "all"), metavar="NAME",
      help="the paper's ablations and the lab's controls, a DeAR row each: "
      + ", ".join(ABLATIONS) + "; all (true-heads: toy world only)")
    g("--fusion", nargs="+", type=fusion_name, metavar="MODE", help="DeAR's scoring on unseen "
      "classes, a row each: fused-everywhere, class-on-unseen (MMRL's)")
    g("--seeds", nargs="+", type=int, metavar="N", help="seeds; the tables report the mean")
    g("--shots", nargs="+", type=int, metavar="K", help="training images per class")
    g("--source", metavar="NAME", help="what cross and dg train on")
    g("--template", metavar="PROMPT", help="class prompt with '{}' for the name (unset: the "
      f"dataset's CoOp template; your own data: {OWN_TEMPLATE!r})")
    g("--recipes", action="store_true", help="print every protocol's and dataset's recipe, then "
      "stop")
    g = p.add_argument_group("where things are").add_argument
    g("--root", metavar="DATA", help="the $DATA folder, in CoOp's layout")
    g("--weights", metavar="NAME|PATH", help="CLIP: ViT-B/32, ViT-B/16, ViT-L/14 or a file")
    g("--head-width", type=int, metavar="D", help="channels per head of --weights (unset: the "
      f"file's, else OpenAI's {OPENAI_HEAD_WIDTH})")
    g("--bpe", metavar="PATH", help="CLIP's BPE merges file (unset: $CLIP_BPE_PATH, the cache, "
      "or a download)")
    g("--output", metavar="FOLDER", help="the run folder (unset: runs/<protocol>-<datasets>)")
    g = p.add_argument_group("DeAR").add_argument
    g("--first-layer", type=int, metavar="J", help="first layer with learnable tokens, 1-based "
      "(unset: the first of the last four)")
    g("--beta", type=float, help="each layer's fresh tokens against the previous layer's, [0, 1]")
    g("--test-beta", choices=TEST_BETAS, metavar="RULE", help="cross and dg: beta on a target, "
      "per-target (MMRL++'s) or trained")
    g("--text-tokens", type=int, metavar="K", help=f"learnable text tokens (unset: {TEXT_TOKENS} "
      "under separate; A under shared, where no other value is accepted)")
    g("--tokens", choices=TOKEN_CONSTRUCTIONS, metavar="HOW", help="separate (each layer its own "
      "tokens) or shared (MMRL++'s: one set of latent tokens for both towers)")
    g("--lambda-reg", type=float, metavar="W", help="weight of the self-regularisation loss")
    g("--lambda-fusion", type=float, metavar="W", help="weight of the fusion-weight loss")
    g = p.add_argument_group("the head analysis").add_argument
    g("--analysis", choices=ANALYSES, metavar="WHOSE", help="project (labels as concepts) or "
      "paper (TextSpan's pool, SBERT clusters, 20 picks); a typed flag beside it wins")
    g("--analysis-pool", metavar="POOL", help="its images: train (the trained split) or "
      "DATASET:SPLIT, e.g. imagenet:test (TextSpan's)")
    g("--analysis-images", type=int, metavar="N", help="at most this many, evenly over classes")
    g("--bank", metavar="POOL", help="its descriptions: project, project-unlabelled, textspan, or "
      "a file (one per line, 'text<TAB>concept' labels one)")
    g("--concepts", choices=CONCEPT_SOURCES, metavar="FROM", help="clusters (the paper's) or labels "
      "(unset: labels where every line has one)")
    g("--sentence-encoder", type=sentence_encoder_name, metavar="clip|sbert[:NAME_OR_FOLDER]",
      help=f"what embeds the picks to cluster them; SBERT: {SBERT_INSTALL}")
    g("--min-cluster-size", type=int, metavar="N", help="HDBSCAN's smallest concept (unset: the "
      "picks per head)")
    g("--min-samples", type=int, metavar="N", help="HDBSCAN's core neighbours (unset: the above)")
    g("--cluster-names", metavar="JSON", help='{"3": "colour", ...} renaming clusters by their ids')
    g("--descriptions", type=int, metavar="N", help="TextSpan picks per head (unset: a labelled "
      "pool's fewest values of an attribute, else 20)")
    g("--low-bits", type=float, metavar="H", help="an attribute head's entropy at most (unset: "
      "a third of the most, at least 0.81)")
    g("--high-bits", type=float, metavar="H", help="a generalization head's at least (unset: two "
      "thirds of the most)")
    g("--analyse-only", action="store_true", help="the head analysis alone, then stop")
    g = p.add_argument_group("optimisation").add_argument
    g("--epochs", type=int, metavar="N", help="training epochs, the warm-up's included")
    g("--batch-size", type=int, metavar="B", help="images per step (per process under torchrun)")
    g("--lr", type=float, help="AdamW's learning rate after the warm-up (then cosine)")
    g("--warmup-epochs", type=int, metavar="N",
      help=f"epochs at a constant {book.warmup_lr:g} first")
    g("--augment", choices=("on", "off"), metavar="ON", help="random resized crop and flip")
    g("--image-cache", choices=("on", "off"), metavar="ON", help="decode the training images "
      "once, into memory (off: every epoch, CoOp's crop of the full photo)")
    g = p.add_argument_group("running").add_argument
    g("--device", metavar="DEVICE", help="auto (cuda, mps, cpu), cpu, cuda, cuda:N or mps")
    g("--amp", choices=AMP_CHOICES, metavar="HOW", help="CUDA's autocast: on = fp16 (with a loss "
      "scaler), bf16, off (fp32)")
    g("--attention", choices=ATTENTION_CHOICES, metavar="KERNEL", help="auto, explicit, sdpa, "
      "efficient, cudnn, math (docs/USAGE.md, 'Attention kernels')")
    g("--workers", type=int, metavar="N", help="loading processes (unset: one per core but one "
      "on a GPU, fitted to /dev/shm; none on the CPU)")
    g("--eval-batch-size", type=int, metavar="B", help="images per evaluation batch")
    g("--log-every", type=int, metavar="N", help="a progress line in log.txt every N steps")
    g("--resume", action="store_true", help="continue the runs in --output")
    g("--eval-only", action="store_true", help="evaluate the finished runs in --output again")
    g("--max-epochs-per-call", type=int, metavar="N", help="stop after N epochs (--resume goes on)")
    g("--toy-scale", choices=("full", "miniature"), metavar="SIZE", help="the toy world: full or "
      "miniature (the tests')")
    for action in p._actions:  # noqa: SLF001 -- argparse keeps no public list of its flags
        if action.help and action.dest != "help":
            action.help += default_help(action.dest, book)
    return p


def shown(value) -> str:
    """A default as the command line spells it: on/off, a list space-separated."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    return str(value)


def default_help(key: str, book: RecipeBook) -> str:
    """' (default ...)' for a flag's help, from the book: the one place defaults live. A recipe's
    field: its value for base2novel and where it varies, --recipes."""
    parts = [shown(book.defaults[key])] if key in book.defaults else []
    if key in book.toy_defaults:
        parts.append(f"toyworld: {shown(book.toy_defaults[key])}")
    if key in {f.name for f in fields(book.protocol_recipes["base2novel"])}:
        values = {getattr(r, key) for table in book.recipes.values() for r in table.values()}
        usual = shown(getattr(book.protocol_recipes["base2novel"], key))
        parts.append(f"{usual}; per dataset: --recipes" if len(values) > 1 else usual)
    if key == "shots":
        parts.append(f"fewshot: {shown(book.fewshot_shots)}")
    return f" (default {'; '.join(parts)})" if parts else ""


def recipes_table(book: RecipeBook) -> str:
    """--recipes: every protocol's recipe, a row per dataset (its own data takes the protocol's),
    a column per field (docs/METHOD.md Sec. 7 gives each value's source)."""
    keys = [f.name for f in fields(book.protocol_recipes["base2novel"])]
    lines = ["Recipes (train.py's RECIPES; a typed flag wins; sources: docs/METHOD.md Sec. 7)"]
    for protocol, table in book.recipes.items():
        if protocol == "dg":  # one ImageNet training serves cross and dg
            continue
        rows = {"(your own data)": book.protocol_recipes[protocol], **table}
        cells = {name: [shown(getattr(recipe, k)) for k in keys] for name, recipe in rows.items()}
        widths = [max(len(k), *(len(c[i]) for c in cells.values())) for i, k in enumerate(keys)]
        first = max(map(len, rows))
        lines += ["", f"{protocol}{' and dg' if protocol == 'cross' else ''}:",
                  f"  {'dataset':<{first}}  " + "  ".join(f"{k:>{w}}" for k, w in zip(keys, widths))]
        for name, row in cells.items():
            lines.append(f"  {name:<{first}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(row, widths)))
    lines += ["", f"warm-up lr {book.warmup_lr:g}, weight decay {book.weight_decay:g}, few-shot "
              f"shots {' '.join(map(str, book.fewshot_shots))}"]
    return "\n".join(lines)


def answer_at_once(argv: List[str], book: RecipeBook) -> None:
    """--help and --recipes: printed, then exit, before train.py imports torch."""
    if any(flag in argv for flag in ("-h", "--help")):
        build_parser(book).parse_args(["--help"])  # prints and exits
    if "--recipes" in argv:
        print(recipes_table(book))
        raise SystemExit(0)


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
    model, so that --resume compares like with like. Installed and there: sources.py checks."""
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


# ------------------------------------------------------------------------------------------
# The refusals that need no tensor: before train.py imports torch (a second, not ten and 800 MB)
# ------------------------------------------------------------------------------------------


def refuse_at_once(argv: List[str], book: RecipeBook) -> None:
    """train.py as a script: the flags parsed and early_checks run before torch is imported; a
    refusal is the one line train.main would print, exit status 2."""
    try:
        early_checks(build_parser(book).parse_args(argv), book)
    except TrainError as error:
        print(f"train.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def early_checks(args: argparse.Namespace, book: RecipeBook) -> None:
    """Every check of the typed flags that reads no file's contents: names, numbers, paths that do
    not exist, --resume's folder. config.resolve_settings checks the rest (run by train.run after
    this)."""
    if args.resume or args.eval_only:
        if args.resume and args.eval_only:
            raise TrainError("--resume and --eval-only: give one (--resume finishes the runs, "
                             "--eval-only evaluates the finished runs again)")
        if not args.output:
            raise TrainError("--resume and --eval-only need --output, the run folder to continue "
                             "(train.py printed it: 'output <folder>')")
        if args.analyse_only:
            raise TrainError("--analyse-only starts nothing to resume; drop --resume / --eval-only")
        if not os.path.isdir(args.output):
            raise TrainError(f"--output {args.output}: no such folder; --resume and --eval-only "
                             "continue a run folder made by train.py")
    elif not args.dataset:
        raise TrainError("--dataset is required (e.g. --dataset toyworld, --dataset oxford_pets "
                         "--root $DATA, --dataset all)")
    names = registry_names()
    for value in args.dataset or []:
        if registry_key(value) in (*names, "all") or os.path.exists(value):
            continue
        if "/" in value or os.sep in value or value.lower().endswith(".json"):  # a path, as data.py
            raise TrainError(f"--dataset {value}: not found; expected a folder of class folders "
                             "(PATH/<class>/<image>) or a split file in CoOp's format (.json)")
        raise TrainError(f"--dataset {value}: not a dataset name, nor a folder or split file of "
                         f"your own; {nearest(value, names)}")
    pool, colon, _ = (args.analysis_pool or "").partition(":")  # DATASET:SPLIT
    for flag, value in (("--source", args.source), ("--analysis-pool", colon and pool)):
        if value and registry_key(value) not in names:
            raise TrainError(f"{flag} {value}: not a dataset name; {nearest(value, names)}")
    real = [v for v in args.dataset or []
            if registry_key(v) in (*names, "all") and registry_key(v) != "toyworld"]
    fresh = not (args.resume or args.eval_only)  # (a resumed run keeps its saved --root)
    if real and fresh and not (args.root and os.path.isdir(args.root)):
        where = f"--root {args.root}: no such folder" if args.root else "--root is not given"
        raise TrainError(f"{where}; --dataset {real[0]} is read from it: set DATA to the folder "
                         "of CoOp's datasets (export DATA=/path/to/your/datasets) and give "
                         "--root $DATA")
    for choice in args.roles or []:
        if choice not in ("analyse", "analyze", *ROLE_ABLATIONS) and not os.path.isfile(choice):
            raise TrainError(f"--roles {choice}: no such file; give a roles JSON written by the "
                             "head analysis, 'analyse', "
                             f"{' or '.join(repr(r) for r in ROLE_ABLATIONS)}")
    check_values({key: value for key, value in vars(args).items() if value is not None})


def registry_key(name: str) -> str:
    """data.dataset_key's rule: case, spaces around and "-" vs "_" do not matter."""
    return str(name).strip().lower().replace("-", "_")


def nearest(value: str, names: List[str]) -> str:
    """'did you mean oxford_pets?', or the list where no name is near."""
    near = difflib.get_close_matches(registry_key(value), names, n=1)
    return f"did you mean {near[0]}?" if near else f"the names: {', '.join(names)}"


# numpy's range; the per-epoch seeds are derived from it (seed * 100003 + epoch)
MAX_SEED = 2**32 - 1


def check_values(values: dict) -> None:
    """Every number in range and finite, and the template well-formed, among `values` (the typed
    flags, then config.validate_settings' complete settings; a key absent is not checked). The
    method's own ranges are dear.py's checks (config.validate_settings)."""
    def refuse(key: str, expected: str):
        value = values[key]
        shown = " ".join(map(str, value)) if isinstance(value, list) else value
        raise TrainError(f"--{key.replace('_', '-')} {shown}: {expected}")

    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    # (key, least value, None or "auto" allowed): dear.check checks J's top once the
    # model is read
    for key, least, optional in (("epochs", 1, 0), ("batch_size", 1, 0), ("eval_batch_size", 1, 0),
                                 ("log_every", 1, 0), ("analysis_images", 1, 0),
                                 ("warmup_epochs", 0, 0),
                                 ("text_tokens", 0, 0), ("head_width", 1, 1), ("workers", 0, 1),
                                 ("max_epochs_per_call", 1, 1), ("descriptions", 1, 1),
                                 ("first_layer", 1, 1),
                                 ("min_cluster_size", 2, 1), ("min_samples", 1, 1)):
        if key in values and not (optional and values[key] in (None, "auto")
                                  or is_int(values[key]) and values[key] >= least):
            refuse(key, f"expected an integer >= {least}" if least != 1
                   else "expected a positive integer")
    if "seeds" in values and not (values["seeds"] and all(is_int(s) and 0 <= s <= MAX_SEED
                                                          for s in values["seeds"])):
        refuse("seeds", f"expected integers from 0 to {MAX_SEED}")
    if "shots" in values and not (values["shots"] and all(is_int(k) and k >= 1
                                                          for k in values["shots"])):
        refuse("shots", "expected positive integers")
    # an inf lr trains on NaN; a NaN weight is not even valid JSON
    weight = "expected a finite weight >= 0"
    for key, expected in (("lr", "expected a positive, finite learning rate"),
                          ("lambda_reg", weight),
                          ("lambda_fusion", weight)):
        value = values.get(key)
        finite = isinstance(value, (int, float)) and math.isfinite(value)
        if key in values and not (finite and (value > 0 if key == "lr" else value >= 0)):
            refuse(key, expected)
    template = values.get("template")
    try:
        well_formed = template is None or template.format("x") != template.format("y")
    # '{0}{1}', '{x}', '{', '{.x}', '{[a]}'
    except (IndexError, KeyError, ValueError, AttributeError, TypeError):
        well_formed = False
    if not well_formed:
        raise TrainError(f"--template {template!r}: expected a prompt with one '{{}}' for the "
                         f"class name, e.g. 'a photo of a {{}}, a kind of flower.'")
