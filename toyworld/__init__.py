"""
toyworld -- a small world of drawn shapes, a tiny CLIP pretrained on it from scratch on a CPU,
and a downstream task, so that the whole DeAR pipeline runs (and can be *measured*) offline.

Why (docs/METHOD.md Sec. 8): with real CLIP one cannot ask "does a head that concept entropy
calls 'colour' really carry colour?". Here one can: every image is drawn from known attribute
values, so each claim of the method has a ground truth (about this small world only).

    world.py     the attribute table, the renderer, captions, the description bank
    bpe.py       a byte-level BPE learned from the captions, in OpenAI's merges-file format
    pretrain.py  CLIP's contrastive pretraining of a tiny clip_model.CLIP; the cache; the
                 shipped model (assets/full/, checked by SHA-256)
    task.py      the downstream task in CoOp's layout (data.py's "toyworld" registry row)
    causal.py    mean-ablation of each head vs its concept-entropy role
    __main__.py  python -m toyworld: prepare and show what was made

Every output is in a real format, so the rest of the project runs on it unchanged:
    model, _ = clip_model.load(assets.weights, head_width=assets.head_width)
    tokenizer = clip_model.SimpleTokenizer(assets.bpe)
    splits = data.load_dataset("toyworld", assets.data_root, num_shots=16, seed=1, subsample="base")
    roles = dear.analyze_heads(model, batches, tokenizer, assets.bank, assets.attributes, num_layers=...)

Try it:  python -m toyworld --scale miniature      (~10 s)
         python -m toyworld                        (full: the shipped model; seconds)
         python -m toyworld --rebuild              (pretrain the full model again: ~11 minutes)
"""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Optional

__all__ = ["ToyAssets", "prepare", "SCALES", "THREADS"]

# The toy world computes on one CPU thread, whatever the machine (train.py sets it for a toy run,
# python -m toyworld for its checks; pretraining has its own count, pretrain.CONFIGS, also 1).
# Its matrices are small: a second thread gains little on a quiet machine and costs several
# times over beside one busy process, and with one thread the toy's numbers do not depend on
# the number of cores (docs/MEASURED.md, "The quick start, and why the toy runs on one thread").
THREADS = 1

# What each scale builds: a key of pretrain.CONFIGS and task.TaskConfig's fields. "full" is the
# lab (its model is shipped; building it again takes ~11 minutes on 2 cores); "miniature" is
# for the tests (16 px, 2 layers, seconds).
SCALES = {
    "full": {"pretrain": "full", "task": {"image_size": 48, "images_per_class": (32, 8, 30)}},
    "miniature": {"pretrain": "miniature", "task": {"image_size": 16, "images_per_class": (16, 4, 4)}},
}


@dataclass
class ToyAssets:
    """Everything train.py needs to run DeAR on the toy world."""

    weights: str  # CLIP state dict in OpenAI's key format: clip_model.load(weights, head_width=head_width)
    bpe: str  # merges file in OpenAI's format: clip_model.SimpleTokenizer(bpe)
    head_width: int  # channels per attention head (the toy CLIP's 128 = 8 heads x 16)
    data_root: str  # the $DATA folder that holds toyworld/ in CoOp's layout
    attributes: list[str]  # the core attributes, in attribute-token order
    bank: list[tuple[str, str, str]]  # (text, concept, value) triples: the toy description bank for the head analysis
    image_size: int  # pixels; the model's input resolution
    report: dict = field(default_factory=dict)  # pretraining figures (parameters, seconds, zero-shot)


def prepare(scale: str = "full", cache_dir: Optional[str] = None,
            log: Callable[[str], None] = print, rebuild: bool = False) -> ToyAssets:
    """Find (or make) the toy CLIP and its BPE file, and make (or reuse) the downstream task.

    The "full" model is the shipped one (toyworld/assets/full/, checked by SHA-256): every user
    gets the very model the README was measured on. Other scales, and everything with
    rebuild=True, are built in <cache_dir>/toyworld/<scale>/ (cache_dir: default
    clip_model.default_cache_dir()), where the task is written too. A cache that is missing,
    incomplete, corrupt or made with other settings is rebuilt, with a line saying why."""
    from harness import files
    from toyworld import world
    from toyworld.pretrain import CONFIGS, cache_folder, pretrained_clip
    from toyworld.task import TaskConfig, write_task

    if scale not in SCALES:
        raise ValueError(f"unknown toy world scale {scale!r}; expected one of {', '.join(SCALES)}")
    config, task_config = CONFIGS[SCALES[scale]["pretrain"]], TaskConfig(**SCALES[scale]["task"])
    assert task_config.image_size == config.image_size, "the task is drawn at the model's resolution"
    folder = cache_folder(config, cache_dir)
    data_root = os.path.join(folder, "data")
    # One builder at a time (two would build twice, or clean away each other's half-built
    # task); the others wait, then reuse.
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with files.lock(os.path.join(os.path.dirname(folder), ".lock"), f"toy world: another process "
                    f"is preparing {os.path.dirname(folder)}; waiting for it", log):
        # A task build killed half-way leaves its temporary folder; no one else is building now.
        for leftover in glob.glob(os.path.join(glob.escape(data_root), ".toyworld-building-*")):
            shutil.rmtree(leftover, ignore_errors=True)
        cached = pretrained_clip(config, cache_dir, log, rebuild=rebuild)
        write_task(data_root, task_config, log)
    return ToyAssets(weights=cached.weights, bpe=cached.bpe, head_width=cached.head_width,
                     data_root=data_root, attributes=list(world.ATTRIBUTES), bank=world.toy_bank(),
                     image_size=config.image_size, report=cached.report)
