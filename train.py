"""
train.py -- DeAR (and zero-shot CLIP, a linear probe) on the paper's four protocols.

    python train.py --dataset toyworld                       # the toy world: no downloads, CPU, minutes
    python train.py --dataset oxford_pets --root $DATA       # base-to-novel, seeds 1 2 3, ViT-B/16
    python train.py --dataset all --root $DATA --protocol fewshot --seeds 1
    python train.py --output runs/base2novel-oxford_pets --resume       # continue a stopped run
    python train.py --output runs/base2novel-oxford_pets --eval-only    # evaluate it again
    python train.py --dataset dtd --root $DATA --analyse-only     # the head roles alone, then stop
    torchrun --nproc_per_node=4 train.py --dataset all --root $DATA --protocol cross

Protocols: base2novel (train on the base half of the classes; Base, Novel, HM), fewshot (1 to 16
shots of every class), cross and dg (one training on ImageNet, tested on the ten other datasets
and on ImageNet-V2, -Sketch, -A, -R). How it fits: clip_model.py is CLIP, data.py reads CoOp's
layout, dear.py is the method; this file reads top to bottom like nanoGPT's train.py: 1. the
recipes, 2. data, 3. the model, 4. the training loop, 5. evaluation, 6. what the loop calls (the
class prompts, the loader, several processes, the per-epoch seeds), 7. one run end to end, and
main. What surrounds them is the harness/ package, which this file calls and which never imports
it: the flags and settings (cli, config), devices and precision (devices), the runs of a call
(plan), the input files (sources, bank), the head analysis and its cache (analysis), the linear
probe and the retrieval check (probes), watching a run (monitor), the run folder (runfolder, files),
tables and pictures (reports, pictures). A run folder holds per dataset / row / seed a
checkpoint.pt and results.json (a run is complete once it exists), per trained dataset the head
roles it used (<dataset>/roles/), and at the top settings.json, summary.json and summary.md.
Layers count from 1, as in the paper (J = 9).

Shapes, the project's letters (as in clip_model.py and dear.py): B images in a batch; C classes;
E the joint embedding's width; A attribute tokens; n images of a list (features of a whole split);
M the retrieval gallery's images and k the neighbours ranked per image (dear.rank_gallery's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
import types
import warnings
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional

from harness import cli, errors  # the command line: argparse alone (no torch), for --help's sake

# ---- 1. The recipes: every default, written once, with its source (docs/METHOD.md Sec. 7) --------
# Where the paper is silent: MMRL++ (yunncheng/MMRL), DeAR's nearest relative;
# harness/cli.py makes flags of these.


@dataclass(frozen=True)
class Recipe:
    """How one protocol trains one dataset. Each field is the default of the flag of the same
    name; the defaults are MMRL++'s base-to-novel yaml (configs/trainers/MMRLpp/vit_b16.yaml)
    but for those whose comment names another source (K, --text-tokens, is ours and no field:
    config.resolve_text_tokens)."""
    epochs: int = 10  # training epochs, the warm-up epochs included
    batch_size: int = 4  # images per step (per process under torchrun)
    lr: float = 1e-3  # AdamW's learning rate after the warm-up, then cosine decay
    warmup_epochs: int = 1  # epochs at the constant WARMUP_LR before the cosine (Dassl's recount)
    shots: int = 16  # training images per class, but fewshot's sweep: MMRL++'s scripts, no yaml
    lambda_reg: float = 1.0  # weight of the self-regularisation loss (docs/METHOD.md Sec. 5)
    lambda_fusion: float = 0.1  # weight of the fusion-weight regularisation loss: our choice
    beta: float = 0.9  # each layer's fresh tokens against the previous layer's output tokens
    # J, 1-based: the paper's (MMRL++ starts at layer 6); auto = first of the last four layers
    first_layer: str = "auto"
    augment: bool = True  # random resized crop + flip (CoOp's)


# The paper's eleven datasets, in its tables' order, and ImageNet's four variants (dg).
PAPER_DATASETS = ["imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers",
                  "food101", "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101"]
DG_TARGETS = ["imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r"]
# Each protocol's recipe, from MMRL++'s configs/trainers/MMRLpp/: vit_b16.yaml,
# vit_b16_few_shot.yaml, vit_b16_cross_datasets.yaml (cross and dg share one ImageNet training);
# ImageNet: vit_b16_imagenet.yaml.
PROTOCOL_RECIPES = {"base2novel": Recipe(),
                    "fewshot": Recipe(epochs=100, batch_size=32, lr=2e-3),
                    "cross": Recipe(epochs=1, batch_size=32, warmup_epochs=0)}
PROTOCOL_RECIPES["dg"] = PROTOCOL_RECIPES["cross"]
# (beta, lambda_reg) per dataset: MMRL++'s trainers/config.py, which MMRL's train.py merges
# after the yaml (so it wins); B2N and FS share one table, CD sets ImageNet's training.
MMRLPP_B2N_FS = {"imagenet": (0.9, 0.2), "fgvc_aircraft": (0.9, 2.0), "ucf101": (0.9, 3.0),
                 "dtd": (0.9, 7.0), "oxford_pets": (0.7, 0.01), "stanford_cars": (0.7, 6.0),
                 "caltech101": (0.6, 3.0), "sun397": (0.5, 3.0), "oxford_flowers": (0.4, 7.0),
                 "eurosat": (0.2, 0.01), "food101": (0.1, 1.0)}
MMRLPP_CD = {"imagenet": (0.9, 0.1)}
WARMUP_LR = 1e-5  # MMRL++'s WARMUP_CONS_LR
WEIGHT_DECAY = 5e-4  # Dassl's OPTIM.WEIGHT_DECAY
FEWSHOT_SHOTS = [1, 2, 4, 8, 16]  # the few-shot protocol's sweep (CoOp)


def _recipes() -> Dict[str, Dict[str, Recipe]]:
    """{protocol: {dataset: Recipe}}: the protocol's recipe with each dataset's exceptions."""
    recipes: Dict[str, Dict[str, Recipe]] = {}
    for protocol in ("base2novel", "fewshot", "cross"):
        recipes[protocol] = {}
        table = MMRLPP_CD if protocol == "cross" else MMRLPP_B2N_FS
        for name in PAPER_DATASETS:
            recipe = PROTOCOL_RECIPES[protocol]
            # ImageNet's own yaml: vit_b16_imagenet.yaml
            if name == "imagenet" and protocol in ("base2novel", "fewshot"):
                recipe = dataclasses.replace(recipe, epochs=5, batch_size=32, lr=1e-3)
            if name in table:
                recipe = dataclasses.replace(recipe, beta=table[name][0], lambda_reg=table[name][1])
            recipes[protocol][name] = recipe
        # The toy world's tiny CLIP learns from few, small images: more epochs at a larger lr (our
        # choice); no crop or flip, which would move the object and so change its position, one of
        # the attributes; beta 0.5 (our choice: no MMRL++ value exists for it). No cross protocol.
        if protocol != "cross":
            recipes[protocol]["toyworld"] = Recipe(epochs=20, batch_size=8, lr=5e-3, beta=0.5,
                                                   augment=False)
    recipes["dg"] = recipes["cross"]  # one ImageNet training serves both
    return recipes


RECIPES = _recipes()
# The defaults of the flags outside a recipe; a flag in neither says in its help what unset means.
DEFAULTS = dict(
    protocol="base2novel",  # the paper's main table
    method=["zeroshot", "dear"],  # CLIP as it is, and DeAR
    roles=["analyse"],  # DeAR's own head analysis: one role map per model and image pool, cached
    ablations=[],  # the paper's ablations (cli.ABLATIONS), a row each: none unless asked
    test_beta="per-target",  # cross and dg: each target at MMRL++'s beta (dear.test_beta)
    fusion=list(cli.FUSION_MODES),  # both rules of scoring DeAR, one table row each
    tokens="separate",  # each layer's own tokens (ours); shared = MMRL++'s (docs/METHOD.md Sec. 4)
    seeds=[1, 2, 3],  # CoOp's three seeds; the tables report the mean
    source="imagenet",  # what cross and dg train on (the paper's protocol)
    weights="ViT-B/16",  # the paper's backbone
    analysis_pool="train",  # the trained dataset's whole training split (base2novel: base classes)
    analysis="project",  # the project's head analysis, not the paper's (config.analysis_preset)
    analysis_images=2000,  # at most this many images of the pool for the head analysis
    bank="project",  # the analysis' descriptions: the project's labelled bank (toyworld: its own)
    sentence_encoder="clip",  # what embeds the picks to cluster them: CLIP's own text tower
    device="auto",  # cuda, then mps, then cpu
    amp="on",  # autocast on CUDA: fp16 with a loss scaler (devices.choose_precision; CPU: fp32)
    image_cache=True,  # the few-shot training images decoded once (imagecache.DecodedImages): ours
    attention="auto",  # torch's fused kernel, less any device_check found wrong (devices.py)
    eval_batch_size=64,  # images per evaluation batch
    log_every=20,  # steps between progress lines
    toy_scale="full",  # the toy world the README's table comes from
)
# The toy world shows more rows: the linear probe (how far the frozen features separate the classes)
# and the two role ablations beside DeAR. It brings its own model (--weights refused).
TOY_DEFAULTS = dict(method=list(cli.METHODS), roles=["all-mixed", "all-generalization", "analyse"])


def attribute_tokens(toy: bool) -> List[str]:
    """One attribute token each: the paper's five core attributes, or the toy world's four."""
    if toy:
        from toyworld import world  # only the word lists: cheap, builds nothing

        return list(world.ATTRIBUTES)
    return list(dear.CORE_ATTRIBUTES)


# K (--text-tokens) is in no table: unset, dear.default_text_tokens (config.resolve_text_tokens).
BOOK = cli.RecipeBook(RECIPES, PROTOCOL_RECIPES, DEFAULTS, TOY_DEFAULTS, PAPER_DATASETS,
                       DG_TARGETS, FEWSHOT_SHOTS, WARMUP_LR, WEIGHT_DECAY, attribute_tokens)

# --help and --recipes are answered here, before torch and the method are imported: in a moment,
# not the seconds torch takes to load; so is every refusal that needs no tensor (cli.early_checks).
if __name__ == "__main__":
    cli.answer_at_once(sys.argv[1:], BOOK)
    cli.refuse_at_once(sys.argv[1:], BOOK)

import torch  # noqa: E402 -- below --help's answer, on purpose
from torch.utils.data import DataLoader  # noqa: E402

errors.matching_torchvision()  # data.py's torchvision, built for this torch: else one line
import data  # noqa: E402
import dear  # noqa: E402
from harness import (analysis, config, devices, files, imagecache, monitor,  # noqa: E402
                     plan, probes, reports, runfolder, sources, splitfiles)
from harness.errors import TrainError  # noqa: E402

# ---- 2. Data: what each protocol trains on and tests on (docs/METHOD.md Sec. 6) ------------------
@dataclass
class EvalSet:
    name: str  # column of the table: "base", "novel", "all", or a dataset name
    items: List[data.Item]
    classnames: List[str]
    template: str
    trained: bool  # its classes are the trained classes, in the trained domain (fused logits)


class Datasets:
    """Each dataset read once per call, every image listed and checked (ImageNet: 1.3M files),
    then shared by its test sets, the head analysis's pool and every few-shot draw."""

    def __init__(self, root: Optional[str], log):
        self.root = root
        self.log = log
        self.listings = {}

    def splits(self, name: str, **selection) -> data.DatasetSplits:  # num_shots, seed, subsample
        if name not in self.listings:
            self.listings[name] = splitfiles.read_listing(name, self.root, self.log)
        draw = functools.partial(splitfiles.cached_draw, log=self.log)  # the few-shot cache's
        return data.splits_from(self.listings[name], draw=draw, **selection)


def training_split(settings, datasets: Datasets, dataset: str, seed: int,
                   shots: int) -> data.DatasetSplits:
    """One run's few-shot draw (base2novel: of the base classes)."""
    subsample = "base" if settings["protocol"] == "base2novel" else "all"
    split = datasets.splits(dataset, num_shots=shots, seed=seed, subsample=subsample)
    # --template overrides the dataset's own
    split.template = settings["template"] or split.template
    if not split.train:  # training on nothing would still write a row of the table
        which = " of the base classes" if subsample == "base" else ""
        raise TrainError(f"{split.dataset_dir}: no training images{which}; "
                         "the split's 'train' list must name some")
    return split


def evaluation_sets(settings, datasets: Datasets, dataset: str) -> List[EvalSet]:
    """The test sets of a protocol, each with its own class list."""
    def full(name: str, column: str, trained: bool, subsample: str = "all") -> EvalSet:
        d = datasets.splits(name, subsample=subsample)
        if not d.test:  # an accuracy over no images would print as 0.00
            which = {"base": " of the base classes",
                     "new": " of the novel classes"}.get(subsample, "")
            raise TrainError(f"{d.dataset_dir}: no test images{which} "
                             f"({len(d.classnames)} classes); the {column} column needs some: "
                             "the split's 'test' list must name them")
        return EvalSet(column, d.test, d.classnames, settings["template"] or d.template, trained)

    if settings["protocol"] == "base2novel":
        return [full(dataset, "base", True, "base"), full(dataset, "novel", False, "new")]
    if settings["protocol"] == "fewshot":
        return [full(dataset, "all", True)]
    return ([full(dataset, dataset, True)]
            + [full(target, target, False) for target in settings["dataset"]])


class RunData(NamedTuple):
    """Every list of a call, read (and every listed image checked) before anything is written."""
    train: Dict[tuple, data.DatasetSplits]  # (dataset, seed, shots) -> that run's few-shot draw
    test: Dict[str, List[EvalSet]]  # trained dataset -> its protocol's test sets


def check_datasets(settings, jobs: List[plan.Job]) -> None:
    """Each dataset the call will read is under --root: a folder's presence costs nothing, so it is
    checked before anything is downloaded (CLIP's weights, TextSpan's pool, an SBERT model) or read.
    The toy world is made later, in the cache."""
    if settings["dataset"] == ["toyworld"]:
        return
    names = [job.dataset for job in jobs]  # the trained datasets (and their test sets)
    if not settings["analyse_only"]:
        names += settings["dataset"]  # cross, dg: the targets
    pool, _ = config.analysis_pool_of(settings["analysis_pool"])
    fresh = not (settings["resume"] or settings["eval_only"])
    if pool is not None and sources.analysing(settings) and fresh:
        names.append(pool)
    for name in dict.fromkeys(names):
        data.dataset_folder(name, settings["root"])


def read_data(settings, jobs: List[plan.Job], datasets: Datasets) -> RunData:
    # Each training split is drawn once per (dataset, seed, shots): rows that differ only in
    # --roles share it.
    trained = sorted({job.dataset for job in jobs})
    test = {dataset: evaluation_sets(settings, datasets, dataset) for dataset in trained}
    train: Dict[tuple, data.DatasetSplits] = {}
    for key in [(job.dataset, job.seed, job.shots) for job in jobs if job.seed is not None]:
        if key not in train:
            train[key] = training_split(settings, datasets, *key)
    return RunData(train, test)


# ---- 3. Model: the frozen CLIP (or the toy world's), read once per call; DeAR on top, per run ----
def build_dear(settings, inputs: sources.Inputs, change: dear.Ablated) -> dear.DeAR:
    """DeAR on the frozen CLIP: the one place it is built (to train, and for --eval-only), at the
    recipe's beta, from a run's dear.ablate record (its role map and attribute tokens, an
    ablation's change made). Its learnable tokens come from torch's global generator: the caller
    seeds it."""
    # the header already said so (blind tokens by construction, or the fallback): not per run
    said = change.role_map.source == "all-generalization" or (
        change.class_branch_fallback and dear.falls_back_to_class_branch(change.role_map))
    with warnings.catch_warnings():
        if said:
            warnings.simplefilter("ignore", dear.LeftOutWarning)
        return dear.DeAR(inputs.clip, change.role_map, change.attributes,
                         first_layer=sources.first_layer(settings, inputs.clip),
                         beta=settings["beta"], num_text_tokens=settings["text_tokens"],
                         tokens=settings["tokens"],
                         class_branch_fallback=change.class_branch_fallback,
                         fuse=change.fuse, fixed_alpha=change.fixed_alpha)


# ---- 4. The loop: AdamW on the tokens, the attribute projection and the fusion weights ----------
def learning_rate(settings, epoch: int) -> float:
    """Dassl's schedule for epoch `epoch` (0-based), set once per epoch: the constant warm-up lr
    for warmup_epochs, then cosine annealing over `epochs` whose count restarts after the warm-up
    (WARMUP_RECOUNT = True, Dassl's default: dassl/optim/lr_scheduler.py hands over to a
    CosineAnnealingLR(T_max = epochs) never stepped). Epoch e runs at
    lr (1 + cos(pi (e - W) / T)) / 2."""
    warmup = settings["warmup_epochs"]
    if epoch < warmup:
        return settings["warmup_lr"]
    return 0.5 * settings["lr"] * (1 + math.cos(math.pi * (epoch - warmup) / settings["epochs"]))


def train_job(job: plan.Job, settings, inputs: sources.Inputs, change: dear.Ablated,
              split: data.DatasetSplits, runtime: devices.Runtime) -> Optional[dear.DeAR]:
    """Train one DeAR run, built and its loss set from its dear.ablate record, a checkpoint at
    every epoch end -> the model (None if --max-epochs-per-call stopped it first). The loop is
    the paper's Sec. 3.4; several processes and the per-epoch seeds are the helpers of section 6
    below; resuming and checkpoints, harness/runfolder.py's."""
    torch.manual_seed(job.seed)  # the learnable tokens' initialisation
    model = build_dear(settings, inputs, change).to(runtime.device)
    # the tokens, the attribute projection and the fusion weights: DeAR's learnable tensors;
    # fused where a step must not wait for the host
    optimizer = torch.optim.AdamW(model.learnable_parameters(), lr=settings["lr"],
                                  weight_decay=settings["weight_decay"],
                                  fused=devices.fused_optimizer(runtime))
    # the loss scaler: fp16 only; bf16 needs none
    scaler = devices.grad_scaler(runtime.device, enabled=runtime.amp_dtype == torch.float16)
    # --resume: from the run's last checkpoint; the epochs [start, stop) of this call
    start = (runfolder.resume_checkpoint(job, settings, model, optimizer, scaler, runtime)
             if settings["resume"] else 0)
    stop = min(settings["epochs"], start + (settings["max_epochs_per_call"] or settings["epochs"]))
    monitor.describe(job, model, split, runtime)  # the run in two lines
    if start >= settings["epochs"]:
        return model
    classes = class_prompts(model, inputs, split, runtime)  # the frozen text side up to J, once
    loader = training_loader(job, settings, split, inputs.clip, runtime)
    network = distributed(model, settings, runtime)  # DDP under torchrun, else the model itself
    lambda_reg, lambda_fusion, branch_ce = change.lambda_reg, change.lambda_fusion, change.branch_ce
    # the sums, the wait for data and the non-finite guard, read every --log-every steps
    progress = monitor.Progress(job, settings, runtime, model, scaler,
                             steps=(stop - start) * len(loader), steps_per_epoch=len(loader),
                             kept=start)
    model.train()
    for epoch in range(start, stop):
        lr = start_epoch(epoch, job, settings, loader, optimizer)  # lr, order, seeds: epoch alone
        for step, (images, labels) in progress.epoch(epoch, loader):
            images = images.to(runtime.device, non_blocking=True)
            labels = labels.to(runtime.device, non_blocking=True)
            with devices.autocast(runtime):
                output = network(images, classes, with_frozen=True)  # also frozen CLIP's, for L_reg
                losses = dear.dear_loss(output, labels, lambda_reg, lambda_fusion, branch_ce)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(losses["total"]).backward()
            scaler.unscale_(optimizer)  # the true gradients, for the guard's norm
            scaler.step(optimizer)  # fp16: skipped where a gradient overflowed (fused: no sync)
            scaler.update()
            progress.step(step, lr, losses, output.logits, labels)  # a non-finite step: Diverged
        runfolder.end_epoch(job, settings, model, optimizer, scaler, progress, runtime)  # checkpoint
    return runfolder.finish_job(job, settings, model, stop, runtime)  # None: stopped early


# ---- 5. Evaluation: top-1 accuracy under each fusion rule ----------------------------------------
# DeAR gives two kinds of logits in one pass (fused, and the class branch alone); the fusion
# mode (cli.FUSION_MODES) decides per test set which one is reported (dear.scoring_logits). Each
# test set is scored at its own beta (dear.test_beta): MMRL++ tests each cross/dg target at its own.


def zero_shot_logits(clip, image_features: torch.Tensor, text_features: torch.Tensor):
    """CLIP's zero-shot logits, s * cos: (B, E), (C, E) -> (B, C), in fp32 under any autocast."""
    return dear.cosine_logits(image_features, text_features, clip.logit_scale.exp())


@torch.no_grad()
def evaluate(model, clip, tokenizer, eval_set: EvalSet, settings, runtime: devices.Runtime,
             beta: Optional[float] = None) -> Dict[str, float]:
    """Top-1 accuracy (%) -> {"clip": acc} for zero-shot CLIP (model=None), or {"fused": acc,
    "class": acc} for DeAR (the class branch alone: s * cos(f_cls, t_c)), from one pass over the
    images, DeAR's tokens mixed at `beta` (dear.test_beta; None: the beta it was built with).
    Under torchrun each process takes every world-th image and the counts are summed."""
    prompts = [eval_set.template.format(name) for name in eval_set.classnames]
    ids = tokenizer.tokenize(prompts, clip.context_length, truncate=True).to(runtime.device)
    with devices.autocast(runtime):  # the class prompts, once per test set
        if model is None:
            text = clip.encode_text(ids)  # (C, E)
        else:
            text = model.encode_text(model.prepare_classes(ids), beta)  # (C, E), the text tokens
    items = eval_set.items[runtime.rank::runtime.world]
    kinds = ["clip"] if model is None else ["fused", "class"]
    # per kind of logits its correct predictions, then images with a non-finite logit
    counts = torch.zeros(len(kinds) + 1, dtype=torch.long, device=runtime.device)
    for images, labels in devices.loader_of(items, settings, clip.visual.input_resolution, runtime):
        images, labels = images.to(runtime.device), labels.to(runtime.device)
        # The encoders under autocast; every score in fp32 (dear.cosine_logits, fused_logits).
        with devices.autocast(runtime):
            if model is None:
                scores = [zero_shot_logits(clip, clip.encode_image(images), text)]  # (B, C)
            else:
                f_cls, f_attr, _ = model.encode_image(images, beta=beta)  # (B, E), (B, A, E)
                features = torch.cat([f_cls[:, None], f_attr], dim=1)  # (B, 1 + A, E)
                fused, branches = model.fused_logits(features, text)  # (B, C), (B, 1 + A, C)
                scores = [fused, branches[:, 0]]  # (B, C) each
        counts += torch.stack([(logits.argmax(dim=-1) == labels).sum() for logits in scores]
                              + [(~torch.isfinite(torch.stack(scores))).any(0).any(-1).sum()])
    *correct, non_finite, total = devices.sum_over_processes(counts.tolist() + [len(items)], runtime)
    if non_finite:  # an argmax over NaN is no prediction
        raise monitor.Diverged(f"test {eval_set.name}: {int(non_finite)} of {int(total)} images "
                               f"got non-finite logits ({devices.precision_name(runtime.amp_dtype)}"
                               f", attention {runtime.attention}); try --attention explicit "
                               "or another --amp with --eval-only")
    return {kind: 100.0 * c / max(total, 1) for kind, c in zip(kinds, correct)}


# ---- 6. What the loop calls: the class prompts, the loader, several processes, the per-epoch seeds
def class_prompts(model: dear.DeAR, inputs: sources.Inputs, split: data.DatasetSplits,
                  runtime: devices.Runtime):
    """The class prompts' frozen text side, once per run (the text tokens enter at layer J)."""
    ids = inputs.tokenizer.tokenize(split.prompts, inputs.clip.context_length, truncate=True)
    with devices.autocast(runtime):
        return model.prepare_classes(ids.to(runtime.device))


def training_loader(job: plan.Job, settings, split: data.DatasetSplits, clip,
                    runtime: devices.Runtime):
    """The few-shot images, augmented unless --augment off, in EpochSampler's order: a pure
    function of (seed, epoch), and each image's augmentation is drawn from its own generator
    seeded by (seed, epoch, image), whatever --workers: what makes --resume land on the same
    result as an unbroken run. Under torchrun each process reads (and decodes) its own shard."""
    size, workers = clip.visual.input_resolution, runtime.loaders["train"][0]
    sampler = imagecache.EpochSampler(len(split.train), runtime.world, runtime.rank, job.seed)
    if settings["image_cache"]:  # decoded once (imagecache), by the loader's processes
        dataset = imagecache.DecodedImages(split.train, size, settings["augment"], job.seed,
                                           workers, only=sampler.shard)
    else:  # decoded (and resampled) again each epoch
        transform = data.train_transform if settings["augment"] else data.test_transform
        dataset = data.ImageDataset(split.train, transform(size), seed=job.seed)
    # Dassl's rule (dassl/data/data_manager.py, build_data_loader): a short last batch is dropped,
    # unless it is the only one; per process (len(sampler)), so that no process has no step.
    drop_last = len(sampler) >= settings["batch_size"]
    return devices.loader(dataset, settings["batch_size"], runtime, "train", sampler=sampler,
                          drop_last=drop_last)


def distributed(model: dear.DeAR, settings, runtime: devices.Runtime):
    """Under torchrun, the learnable tensors' gradients averaged over the processes (DDP)."""
    if runtime.world == 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
        # every learnable tensor gets a gradient in every configuration (tests/test_devices.py):
        # none for DDP to look for (find_unused_parameters would cost a graph walk per step)
        broadcast_buffers=False, find_unused_parameters=False)


def start_epoch(epoch: int, job: plan.Job, settings, loader: DataLoader, optimizer) -> float:
    """Epoch `epoch`'s learning rate, set; its order, augmentation and randomness seeded by
    (seed, epoch) alone, so that an epoch replays identically after --resume -> the lr."""
    loader.sampler.set_epoch(epoch)  # the sampler hands each image's number on with the epoch
    # torch's global generator, which e.g. the loader draws its workers' base seed from: seeded
    # by (seed, epoch) alone, so a resumed epoch draws what it drew unbroken; any epoch < 100,003
    # (a prime), so no two (seed, epoch) pairs share a seed
    torch.manual_seed(job.seed * 100_003 + epoch)
    lr = learning_rate(settings, epoch)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


# ---- 7. One run end to end: DeAR trained (or loaded), each test set scored, the retrieval check --
def run_job(job: plan.Job, settings, inputs: sources.Inputs, role_maps: dict, lists: RunData,
            runtime: devices.Runtime) -> Optional[dict]:
    """Train (or load) and evaluate one job, then write its results.json -> its results, or None
    if --max-epochs-per-call stopped it."""
    results_path = os.path.join(job.folder, "results.json")
    if runfolder.finished(job, settings):
        with open(results_path, encoding="utf-8") as f:
            return json.load(f)  # finished in an earlier call (checked by runfolder.check_run_folder)
    model = None
    if job.row == "linear-probe":
        split = lists.train[job.dataset, job.seed, job.shots]
        metrics = probes.linear_probe(inputs.clip, split, lists.test[job.dataset], settings, runtime)
        result = dict(job=dataclasses.asdict(job), metrics=metrics,
                      settings=plan.job_settings(settings, job))
    else:
        if job.row != "zeroshot":  # the run's role map and tokens, an ablation's change made
            role_map = role_maps[job.dataset, job.roles]  # true_map: None but for true-heads
            change = dear.ablate(job.ablation, role_map, inputs.attributes,
                                 settings["lambda_fusion"], settings["lambda_reg"], job.seed,
                                 runfolder.true_role_map(settings, job, role_map))
        if job.row != "zeroshot" and settings["eval_only"]:
            checkpoint = runfolder.finished_checkpoint(job, settings)
            model = build_dear(settings, inputs, change).to(runtime.device)
            model.load_learnable_state_dict(checkpoint["learnable"])
        elif job.row != "zeroshot":
            model = train_job(job, settings, inputs, change,
                              lists.train[job.dataset, job.seed, job.shots], runtime)
            if model is None:
                return None
        model = model.eval() if model is not None else None
        # One pass per test set gives every kind of logits; each fusion mode then picks per set.
        accuracy = {}  # {set: {kind of logits: top-1 %}}
        logits = {mode: {} for mode in settings["fusion"]}  # {mode: {set: kind that scores it}}
        betas = {}  # {set: DeAR's beta on it}
        for eval_set in lists.test[job.dataset]:
            beta = None
            if model is not None:  # MMRL++'s recipe: each cross/dg target at its own beta
                beta = betas[eval_set.name] = dear.test_beta(
                    eval_set.name, eval_set.trained, settings["beta"],
                    per_target=settings["test_beta"] == "per-target")
            try:
                accuracy[eval_set.name] = evaluate(model, inputs.clip, inputs.tokenizer, eval_set,
                                                   settings, runtime, beta)
            except monitor.Diverged as error:  # said with the run's name
                raise monitor.Diverged(f"[{job.label}] {error}") from None
            for mode in settings["fusion"]:
                used = "clip" if model is None else dear.scoring_logits(mode, eval_set.trained)
                logits[mode][eval_set.name] = used
            scores = ", ".join(f"{v:.2f}% ({kind} logits)"
                               for kind, v in accuracy[eval_set.name].items())
            at = f", beta {beta:g}" if beta is not None else ""
            runtime.detail(f"[{job.label}] test {eval_set.name}: {scores} ({len(eval_set.items)}"
                           f" images, {len(eval_set.classnames)} classes{at})")
        runtime.log(f"[{job.label}] test: " + "; ".join(  # one line: every set, every kind
            f"{name} " + " / ".join(f"{v:.2f}% {kind}" for kind, v in kinds.items())
            for name, kinds in accuracy.items()))
        result = reports.evaluation_record(job, settings, model, accuracy, logits, betas)
    if runtime.main:
        # pictures in the run folder; the toy world's precision@10 in the result
        if model is not None:
            result["retrieval"] = probes.retrieval_check(model, job, settings, inputs, lists, runtime)
        if model is not None and (fp16 := runfolder.fp16_record(job)):  # its skipped steps
            result["fp16"] = fp16
        table = reports.job_table(job.label, result["metrics"])
        files.write_text(os.path.join(job.folder, "results.md"), table)
        files.write_json(results_path, result)  # last: its presence marks the run complete
    # the other processes wait for rank 0's retrieval check on the CPU-side group, never in the
    # next run's DDP constructor (a collective whose timeout the check may outlast)
    devices.wait_for_main(runtime, "retrieval check")
    return result


# ---- main: every check first, then the run folder, the runs in order, the tables -----------------
def main(argv: Optional[List[str]] = None) -> int:
    cli.answer_at_once(sys.argv[1:] if argv is None else argv, BOOK)  # --help, --recipes
    args = cli.build_parser(BOOK).parse_args(argv)
    return errors.one_line_errors(lambda: run(args))  # a known error: one line, exit status 2


def run(args) -> int:
    cli.early_checks(args, BOOK)  # names, numbers, paths (as a script: before torch, too)
    settings = config.resolve_settings(args, BOOK)  # flags (or the saved run) -> settings, checked
    jobs = plan.plan_jobs(settings)
    fresh = not (settings["resume"] or settings["eval_only"])
    with contextlib.ExitStack() as stack:  # holds the run folder's lock until the call ends
        # fresh: usable; resumed: locked, every file checked
        runfolder.check_run_folder(settings, jobs, stack)
        check_datasets(settings, jobs)  # each dataset's folder is there, before any download
        toy = settings["dataset"] == ["toyworld"]
        attributes = attribute_tokens(toy)
        pool = sources.read_pool(settings, attributes)  # checked before any model is read
        runtime = devices.setup_runtime(settings)  # the device (and processes, under torchrun)
        stack.callback(devices.end_runtime, runtime)  # the processes' group left on every way out
        stack.enter_context(devices.sdpa_backends(runtime.backends))  # --attention's fused kernels
        # the toy world on one CPU thread (its numbers the same on every machine); else torch's
        threads = stack.enter_context(devices.cpu_threads(toy))
        for line in pool[1]["header"] if pool else []:  # which head analysis, and how it departs
            runtime.log(line)
        # CLIP, tokenizer, the toy world, checked
        inputs = sources.open_inputs(settings, runtime, pool, attributes)
        # the loaders' processes and batches in flight: what the CPUs and /dev/shm allow
        runtime.loaders = devices.loader_plan(settings, runtime, inputs.clip.visual.input_resolution)
        # the files' places and SHA-256 complete the settings
        settings = dict(settings, **inputs.files)
        datasets = Datasets(settings["root"], runtime.log)  # each read once, when first asked for
        lists = read_data(settings, jobs, datasets) if not settings["analyse_only"] else None
        # The head analysis (paper Sec. 3.2): a role map belongs to the model and the images it was
        # measured on, not to a run: once per (weights, pool, bank, analysis settings), cached,
        # reused by every run asking the same; each run folder keeps a copy (<dataset>/roles/).
        analysed, records = analysis.analysed_role_maps(settings, inputs, datasets, runtime)
        del datasets  # the whole lists (ImageNet: 1.3M Items, 250 MB) are not needed past here
        if fresh:
            settings["role_maps"] = records or None
        settings = types.MappingProxyType(settings)  # read-only from here on
        if settings["analyse_only"]:  # the role maps' copies in a fresh --output, no run
            return runfolder.analyse_only(settings, inputs.clip, records, runtime, stack)
        if runtime.main and fresh:  # from here on the run folder exists
            runfolder.start_run_folder(settings, inputs.clip, runtime.world, stack)
        runfolder.open_call_log(runtime, settings["output"], stack)  # <output>/log.txt, appended
        stack.enter_context(runfolder.said_on_interrupt(runtime, settings))  # Ctrl-C: what next
        for line in plan.call_header(settings, jobs, runtime, threads):  # what runs where, rows
            runtime.log(line)
        role_maps = sources.role_maps_for(jobs, inputs, analysed)  # per (dataset, --roles) asked
        started, results, diverged = time.time(), [], []
        for index, job in enumerate(jobs, 1):  # a run is done once its results.json is written
            when = ("already finished" if runfolder.finished(job, settings) else
                    f"elapsed {devices.format_time(time.time() - started)}")
            runtime.log(f"== run {index}/{len(jobs)}: {job.label} ({when}) ==")
            runtime.runs_after = sum(runfolder.trains(later, settings) for later in jobs[index:])
            with runfolder.run_log(runtime, job.folder):  # its lines also in its folder's log.txt
                try:
                    result = run_job(job, settings, inputs, role_maps, lists, runtime)
                except monitor.Diverged as stop:  # that run stops at its last finite checkpoint
                    runtime.log(f"train.py: {stop}")
                    runfolder.mark_diverged(job, str(stop), runtime)  # --resume: a fresh scaler
                    diverged.append(dict(job=dataclasses.asdict(job), diverged=str(stop)))
                    continue
            if result is None:
                return 0  # stopped by --max-epochs-per-call; resumable
            results.append(result)
        # the call's tables: after them the call is done
        notes = reports.small_data_notes(lists)  # a column near a given, shots repeated
        reports.write_summaries(settings, results, diverged, notes, inputs.attributes,
                                probes.RETRIEVAL_K, runtime)
        runtime.log(f"train.py: done in {devices.format_time(time.time() - started)}; tables in "
                    f"{os.path.join(settings['output'], 'summary.md')}")
    if diverged:  # the others finished; these continue from their last finite checkpoint
        if runtime.main:  # as the line above it: once
            print(f"train.py: {len(diverged)} of {len(jobs)} runs diverged (above); the others' "
                  "numbers are in the tables; --resume as it was would diverge again: continue "
                  f"with another --attention or --amp (python train.py --output "
                  f"{settings['output']} --resume --attention explicit), or start again with a "
                  "smaller --lr and another --output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
