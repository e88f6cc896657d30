"""
toyworld/task.py -- the downstream task: a few-shot classification dataset written to disk in
CoOp's layout, so data.py reads it (registry row "toyworld") like any benchmark dataset.

    1. the classes ...... colour x shape combinations ("red circle"); the novel classes are
                          *unseen combinations* of the base classes' colours and shapes
    2. writing it ....... <data_root>/toyworld/images/<class>/<split>_<n>.png and
                          split_toyworld.json, built in a temporary folder and renamed into
                          place; reused when complete

Why it is not trivial for the toy CLIP: the images are drawn in the *shifted* style that
pretraining never saw (world.STYLES), and vary in texture, position, size and background,
which the class name does not mention: zero-shot accuracy is well below 100% (docs/MEASURED.md).

Try it:  python -m toyworld.task /tmp/toydata && python data.py --root /tmp/toydata --dataset toyworld --shots 16
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
from PIL import Image

from toyworld import world

FOLDER, IMAGE_DIR, SPLIT_FILE = "toyworld", "images", "split_toyworld.json"  # data.py's registry row
RECORD_FILE = "toyworld_task.json"  # what was written, with which settings: the completeness check
SPLITS = ("train", "val", "test")  # the order of TaskConfig.images_per_class


# ---- 1. The classes ----------------------------------------------------------------------
@dataclass(frozen=True)
class TaskConfig:
    colours: tuple[str, ...] = ("red", "yellow", "green", "blue")
    shapes: tuple[str, ...] = world.ATTRIBUTES["shape"]  # all six
    images_per_class: tuple[int, int, int] = (32, 8, 30)  # train, val, test: enough for 16 shots
    image_size: int = 32
    style: str = "shifted"
    seed: int = 0


def class_table(config: TaskConfig) -> list[tuple[str, str, bool]]:
    """(colour, shape, is_base) for every class, in label order: base classes first.

    Lay the classes out as a colours x shapes grid and colour it like a chess board: a cell
    is base when (colour index + shape index) is even. Each colour then has base *and* novel
    shapes, and each shape base *and* novel colours, so a novel class such as "red square"
    combines a colour and a shape that training saw -- just never together. With an even
    number of shapes the board has exactly half its cells of each kind, so data.py's rule
    "the first ceil(n/2) labels are base" picks out exactly the chess board's base cells.
    """
    cells = [(colour, shape, (ci + si) % 2 == 0)
             for ci, colour in enumerate(config.colours) for si, shape in enumerate(config.shapes)]
    n_base = sum(cell[2] for cell in cells)
    assert n_base == math.ceil(len(cells) / 2), (
        f"{n_base} base cells of {len(cells)}; use an even number of shapes or colours so the chess board splits in half")
    return sorted(cells, key=lambda cell: not cell[2])  # stable: base cells first, each in grid order


def class_name(colour: str, shape: str) -> str:
    return f"{colour} {shape}"


# ---- 2. Writing it -----------------------------------------------------------------------
def task_is_complete(data_root: str, config: TaskConfig) -> bool:
    """True if <data_root>/toyworld holds this config's task in full: its record matches and
    every image the split lists exists. Files that are missing, not JSON, or JSON of another
    shape (the lookups below fail) mean False: the task is rebuilt."""
    folder = os.path.join(data_root, FOLDER)
    try:
        with open(os.path.join(folder, RECORD_FILE), encoding="utf-8") as f:
            record = json.load(f)
        with open(os.path.join(folder, SPLIT_FILE), encoding="utf-8") as f:
            split = json.load(f)  # {"train"|"val"|"test": [[relative_path, label, classname], ...]}
        return (record["config"] == json.loads(json.dumps(asdict(config)))  # tuples -> lists, as stored
                and record["world"] == world.fingerprint()  # not drawn from another version of world.py
                and all(os.path.isfile(os.path.join(folder, IMAGE_DIR, entry[0]))
                        for entries in split.values() for entry in entries))
    except (OSError, ValueError, RecursionError, TypeError, KeyError, IndexError, AttributeError):
        return False


def _drawn(config: TaskConfig, label: int, split_index: int) -> list[tuple[str, world.Scene]]:
    """[(image path relative to images/, its scene)] of one class in one split (0 train, 1 val,
    2 test), from their own seed. Class folders have no spaces, as CoOp's."""
    colour, shape, _ = class_table(config)[label]
    scene_rng = random.Random(f"{config.seed}-{label}-{split_index}")
    prefix = f"{class_name(colour, shape).replace(' ', '_')}/{SPLITS[split_index]}"
    return [(f"{prefix}_{index:03d}.png", world.sample_scene(scene_rng, colour=colour, shape=shape))
            for index in range(config.images_per_class[split_index])]


def split_scenes(data_root: str, split_name: str = "test") -> dict:
    """{image path relative to images/: its world.Scene} for one split of the task written
    under data_root: the split file names only the class, so the other attributes (texture,
    position, ...) are re-drawn from the seeds write_task used, with the config it recorded."""
    folder = os.path.join(data_root, FOLDER)
    with open(os.path.join(folder, RECORD_FILE), encoding="utf-8") as f:
        recorded = json.load(f)["config"]
    config = TaskConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()})
    return {path: scene for label in range(len(class_table(config)))
            for path, scene in _drawn(config, label, SPLITS.index(split_name))}


def write_task(data_root: str, config: TaskConfig = TaskConfig(),
               log: Callable[[str], None] = print) -> str:
    """Write the task under `data_root` unless it is already there and complete; return
    <data_root>/toyworld. It is written into a temporary folder renamed into place at the end,
    so an interrupted run never leaves a half task that looks complete."""
    target = os.path.join(data_root, FOLDER)
    if task_is_complete(data_root, config):
        log(f"toy task: reusing {target}")
        return target
    os.makedirs(data_root, exist_ok=True)
    building = tempfile.mkdtemp(dir=data_root, prefix=".toyworld-building-")
    try:
        split: dict[str, list] = {name: [] for name in SPLITS}
        table = class_table(config)
        for label, (colour, shape, _) in enumerate(table):
            name = class_name(colour, shape)
            os.makedirs(os.path.join(building, IMAGE_DIR, name.replace(" ", "_")))
            for split_index, split_name in enumerate(SPLITS):
                drawn = _drawn(config, label, split_index)
                # One generator per (class, split): any one of them can be re-drawn alone.
                rng = np.random.default_rng([config.seed, label, split_index])
                images = world.render_batch([scene for _, scene in drawn], rng, config.image_size, config.style)
                for (relative, _), pixels in zip(drawn, images):
                    Image.fromarray(pixels).save(os.path.join(building, IMAGE_DIR, relative))
                    split[split_name].append([relative, label, name])
        n_base = math.ceil(len(table) / 2)
        record = {"what": "the toy world's downstream task (toyworld/task.py); labels 0..n_base-1 are base",
                  "config": asdict(config), "world": world.fingerprint(),
                  "base_classes": [class_name(c, s) for c, s, _ in table[:n_base]],
                  "novel_classes": [class_name(c, s) for c, s, _ in table[n_base:]]}
        # Plain writes: the whole folder is renamed into place only once both are complete.
        with open(os.path.join(building, SPLIT_FILE), "w", encoding="utf-8") as f:
            json.dump(split, f)
        with open(os.path.join(building, RECORD_FILE), "w", encoding="utf-8") as f:
            f.write(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
        if os.path.exists(target):
            shutil.rmtree(target)  # an incomplete or outdated task: replaced, not trusted
        os.replace(building, target)
    finally:
        if os.path.exists(building):
            shutil.rmtree(building)
    counts = "/".join(map(str, config.images_per_class))
    log(f"toy task: wrote {len(table)} classes x {counts} train/val/test images ({config.style} style) to {target}")
    return target


@torch.no_grad()
def zero_shot_on_task(model, tokenizer, data_root: str, subsample: str = "all") -> float:
    """Zero-shot test accuracy of a CLIP on the task, read back through data.py exactly as
    train.py reads it (registry row, split file, test transform, the row's template)."""
    import data  # the project's reader; imported here so writing the task needs only the world

    splits = data.load_dataset(FOLDER, data_root, subsample=subsample)
    prompts = tokenizer.tokenize(splits.prompts, model.context_length)
    text = torch.nn.functional.normalize(model.encode_text(prompts), dim=-1)  # (classes, E)
    loader = torch.utils.data.DataLoader(
        data.ImageDataset(splits.test, data.test_transform(model.visual.input_resolution)), batch_size=256)
    correct = 0
    for images, labels in loader:
        image_features = torch.nn.functional.normalize(model.encode_image(images), dim=-1)
        correct += ((image_features @ text.T).argmax(dim=-1) == labels).sum().item()
    return correct / len(splits.test)


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "toy_data"
    write_task(root)
    for label, (colour, shape, is_base) in enumerate(class_table(TaskConfig())):
        print(f"{label:>3}  {class_name(colour, shape):<16} {'base' if is_base else 'novel'}")
