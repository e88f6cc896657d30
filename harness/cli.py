"""harness/cli.py -- train.py's command line: every flag, its choices and its help, the
defaults shown from train.py's one table of them (RecipeBook), and --recipes. Imports no torch, so
that --help answers in a moment; config.py turns the parsed flags into a run's settings.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from typing import Callable, List, NamedTuple, Optional

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


AMP_CHOICES = ("on", "off", "fp16", "bf16")  # on = fp16 (choose_precision)


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


# The paper's ablation study ("Ablation Study"), each the DeAR row with one change, a row of its
# own (docs/METHOD.md Sec. 5); branch-ce is ours, for the retrieval diagnosis (docs/TOYWORLD.md).
# Name -> what --ablations' help says; ablate below applies each.
ABLATIONS = {
    "no-role-mask": "every head mixed: the tokens reach every head (the row of --roles all-mixed)",
    "no-attribute-tokens": "no attribute token: the class branch and the text tokens alone",
    "no-fusion-reg": "lambda_fusion = 0: nothing holds the fusion to the class branch",
    "mask-generalization-only": "the analysed map with its attribute heads made mixed",
    "branch-ce": "NOT the paper's loss: + MMRL's 0.7 CE(class) + 0.3 CE(attribute branches)",
}


def ablation_roles(name: str) -> Optional[str]:
    """The --roles row an ablation is, where its one change is the role map alone and --roles
    makes that map (made once, whichever asks); None: the DeAR row with the change."""
    return "all-mixed" if name == "no-role-mask" else None


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
