"""
toyworld/task.py -- the downstream task: a few-shot classification dataset written to disk in
CoOp's layout, so data.py reads it like any of the benchmark datasets.

What this file holds:

    1. the classes ...... colour x shape combinations ("red circle"), ordered so that data.py's
                          base/novel rule (first ceil(n/2) labels are base) makes the novel
                          classes *unseen combinations* of colours and shapes that the base
                          classes do use -- the toy version of base-to-novel generalisation
    2. writing it ....... <data_root>/toyworld/images/<class>/<split>_<n>.png and
                          <data_root>/toyworld/split_toyworld.json, {"train"|"val"|"test":
                          [[path relative to images/, label, class name], ...]}, built in a
                          temporary folder and renamed into place; reused when complete

Why it is not trivial for the toy CLIP: its images are drawn in the *shifted* style (tinted,
blotchy, noisier backgrounds and outlined shapes; world.STYLES), which pretraining never saw,
and every image also varies in texture, position, size and background, which the class name
does not mention. Zero-shot accuracy is therefore well below 100% (measured figures in the
README), leaving room for prompt learning to help.

How it fits: toyworld/__init__.py's `prepare` calls `write_task`; train.py then calls
`data.load_dataset("toyworld", data_root, num_shots=16, seed=..., subsample="base")` through
the registry row in data.py, exactly as for oxford_pets.

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
from toyworld._files import atomic_write_json

FOLDER, IMAGE_DIR, SPLIT_FILE = "toyworld", "images", "split_toyworld.json"  # data.py's registry row
RECORD_FILE = "toyworld_task.json"  # what was written, with which settings: the completeness check

# ------------------------------------------------------------------------------------------
# 1. The classes
# ------------------------------------------------------------------------------------------


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
    base = [cell for cell in cells if cell[2]]
    novel = [cell for cell in cells if not cell[2]]
    assert len(base) == math.ceil(len(cells) / 2), (
        f"{len(base)} base cells of {len(cells)}; use an even number of shapes or colours so the "
        "chess board splits in half")
    return base + novel


def class_name(colour: str, shape: str) -> str:
    return f"{colour} {shape}"


# ------------------------------------------------------------------------------------------
# 2. Writing it
# ------------------------------------------------------------------------------------------


def _is_split(value) -> bool:
    """The split file's shape: {"train"|"val"|"test": [[relative_path, label, classname], ...]}."""
    return isinstance(value, dict) and all(
        isinstance(entries, list) and all(isinstance(e, list) and e and isinstance(e[0], str) for e in entries)
        for entries in value.values())


def task_is_complete(data_root: str, config: TaskConfig) -> bool:
    """True if <data_root>/toyworld holds this config's task in full: its record matches and
    every image the split lists exists."""
    folder = os.path.join(data_root, FOLDER)
    try:
        with open(os.path.join(folder, RECORD_FILE), encoding="utf-8") as f:
            record = json.load(f)
        with open(os.path.join(folder, SPLIT_FILE), encoding="utf-8") as f:
            split = json.load(f)
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(record, dict) or not _is_split(split):  # valid JSON of the wrong shape
        return False
    if record.get("config") != json.loads(json.dumps(asdict(config))):  # tuples -> lists, as stored
        return False
    if record.get("world") != world.fingerprint():  # drawn from another version of world.py
        return False
    return all(os.path.isfile(os.path.join(folder, IMAGE_DIR, entry[0]))
               for entries in split.values() for entry in entries)


def _scenes(config: TaskConfig, label: int, split_index: int, count: int) -> list:
    """The scenes of one class's images in one split (0 train, 1 val, 2 test), from their own seed."""
    colour, shape, _ = class_table(config)[label]
    scene_rng = random.Random(f"{config.seed}-{label}-{split_index}")
    return [world.sample_scene(scene_rng, colour=colour, shape=shape) for _ in range(count)]


def split_scenes(data_root: str, split_name: str = "test") -> dict:
    """{image path relative to images/: its world.Scene} for one split of the task written
    under data_root: the split file names only the class, so the other attributes (texture,
    position, ...) are re-drawn from the seeds write_task used, with the config it recorded."""
    folder = os.path.join(data_root, FOLDER)
    with open(os.path.join(folder, RECORD_FILE), encoding="utf-8") as f:
        recorded = json.load(f)["config"]
    config = TaskConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items()})
    split_index = ("train", "val", "test").index(split_name)
    count = config.images_per_class[split_index]
    scenes = {}
    for label, (colour, shape, _) in enumerate(class_table(config)):
        for index, scene in enumerate(_scenes(config, label, split_index, count)):
            scenes[f"{class_name(colour, shape).replace(' ', '_')}/{split_name}_{index:03d}.png"] = scene
    return scenes


def write_task(data_root: str, config: TaskConfig = TaskConfig(),
               log: Callable[[str], None] = print) -> str:
    """Write the task under `data_root` unless it is already there and complete; return
    <data_root>/toyworld.

    Everything is written into a temporary folder next to the target and renamed into place
    at the end, so an interrupted run never leaves a half task that looks complete. An
    incomplete or differently configured folder is removed and rebuilt.
    """
    target = os.path.join(data_root, FOLDER)
    if task_is_complete(data_root, config):
        log(f"toy task: reusing {target}")
        return target
    os.makedirs(data_root, exist_ok=True)
    building = tempfile.mkdtemp(dir=data_root, prefix=".toyworld-building-")
    try:
        split: dict[str, list] = {"train": [], "val": [], "test": []}
        table = class_table(config)
        for label, (colour, shape, _) in enumerate(table):
            name = class_name(colour, shape)
            folder_name = name.replace(" ", "_")  # class folders without spaces, as CoOp's
            os.makedirs(os.path.join(building, IMAGE_DIR, folder_name))
            for split_index, (split_name, count) in enumerate(zip(split, config.images_per_class)):
                # One generator per (class, split): any one of them can be re-drawn alone.
                rng = np.random.default_rng([config.seed, label, split_index])
                scenes = _scenes(config, label, split_index, count)
                images = world.render_batch(scenes, rng, config.image_size, config.style)
                for index, pixels in enumerate(images):
                    relative = f"{folder_name}/{split_name}_{index:03d}.png"
                    Image.fromarray(pixels).save(os.path.join(building, IMAGE_DIR, relative))
                    split[split_name].append([relative, label, name])
        with open(os.path.join(building, SPLIT_FILE), "w", encoding="utf-8") as f:
            json.dump(split, f)
        n_base = math.ceil(len(table) / 2)
        atomic_write_json(os.path.join(building, RECORD_FILE), {
            "what": "the toy world's downstream task (toyworld/task.py); labels 0..n_base-1 are base",
            "config": asdict(config),
            "world": world.fingerprint(),
            "base_classes": [class_name(c, s) for c, s, _ in table[:n_base]],
            "novel_classes": [class_name(c, s) for c, s, _ in table[n_base:]],
        })
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
    correct = total = 0
    for images, labels in loader:
        image_features = torch.nn.functional.normalize(model.encode_image(images), dim=-1)
        correct += ((image_features @ text.T).argmax(dim=-1) == labels).sum().item()
        total += len(labels)
    return correct / total


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "toy_data"
    write_task(root)
    for label, (colour, shape, is_base) in enumerate(class_table(TaskConfig())):
        print(f"{label:>3}  {class_name(colour, shape):<16} {'base' if is_base else 'novel'}")
