"""
data.py -- the benchmark datasets of prompt learning, read from CoOp's on-disk layout.

The registry, the readers (CoOp's split files, ImageNet and its variants, FGVC-Aircraft), a
dataset read once (`read_listing`: ImageNet's 1.3M files in seconds) and what a run takes from it
(`splits_from`: few-shot sampling, the images Dassl draws; the base/novel split), `load_dataset`
(both at once), CLIP's transforms and a torch Dataset. $DATA as CoOp's DATASETS.md lays it out,
without Dassl; imports nothing from the project, so it copies out alone (docs/METHOD.md Sec. 6).
What train.py adds lives in the harness: your own folders' reader and the few-shot cache on disk
(harness/splitfiles.py), the decoded images (harness/imagecache.py).

    python data.py --root $DATA --dataset oxford_pets --shots 16
    python data.py            # prints the registry table
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms as T

COOP_DATASETS_MD = "https://github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md"

class DatasetError(Exception):
    """A bad dataset or argument, in one line: the path or flag at fault, what is wrong, what to
    do."""

    def __init__(self, message: str):
        message = str(message)
        # From a DataLoader worker torch re-raises DatasetError("Caught DatasetError in DataLoader
        # worker process 0.\nOriginal Traceback ...\ndata.DatasetError: <our line>"): keep our line.
        if message.startswith("Caught DatasetError") and "\nOriginal Traceback" in message:
            message = message.rstrip().rsplit("\n", 1)[-1].split("DatasetError: ", 1)[-1]
        # one line, whatever it quotes
        super().__init__(message.replace("\r", " ").replace("\n", " "))

class DatasetWarning(UserWarning):
    """Worth knowing, not worth stopping for (a rebuilt cache, a class with fewer than K images)."""

def _warn(message: str) -> None:
    # attributed to the caller of the function that warns
    warnings.warn(message, DatasetWarning, stacklevel=2)

@dataclass(frozen=True, slots=True)
class Item:
    path: str  # the image file's full path
    label: int  # 0..n_classes-1, the index into the class list
    classname: str  # cleaned (underscores -> spaces), as the prompt uses it

@dataclass
class DatasetSplits:  # what load_dataset and splits_from return; classnames[i] names label i
    name: str  # registry name, e.g. "oxford_pets"
    dataset_dir: str  # $DATA/<folder>: the split and the few-shot cache live here
    train: list[Item]
    val: list[Item]
    test: list[Item]
    classnames: list[str]
    template: str  # template.format(name) is a class's prompt

    # in label order
    prompts = property(lambda self: [self.template.format(name) for name in self.classnames])


# ---- The registry: one row per dataset -------------------------------------------------------

@dataclass(frozen=True)
class DatasetSpec:
    name: str  # what the user types: --dataset oxford_pets
    folder: str  # under $DATA (CoOp's DATASETS.md); for your own data its absolute path
    reader: str  # the reader that understands the layout (READERS)
    image_dir: str  # the folder, inside `folder`, that image paths are relative to
    # CoOp's split file inside `folder` (the other readers find their classes)
    split_file: str | None
    template: str  # CoOp's prompt (CUSTOM_TEMPLATES, trainers/coop.py); "{}" is the class name

    # your own data (harness/splitfiles.own_dataset): an absolute folder
    own = property(lambda self: os.path.isabs(self.folder))
    # test sets of domain generalization
    evaluation_only = property(lambda self: self.reader == "imagenet_variant")

# Rows 2-11: base-to-novel, few-shot, cross-dataset; ImageNet: the source of cross-dataset and
# domain generalization, whose targets are the variants.
DATASETS: dict[str, DatasetSpec] = {spec.name: spec for spec in [
    #           name               folder                  reader
    #           image_dir                                  split_file
    #           template
    DatasetSpec("imagenet",        "imagenet",             "imagenet",
                "images",                                  None,
                "a photo of a {}."),
    DatasetSpec("caltech101",      "caltech-101",          "split_json",
                "101_ObjectCategories",                    "split_zhou_Caltech101.json",
                "a photo of a {}."),
    DatasetSpec("oxford_pets",     "oxford_pets",          "split_json",
                "images",                                  "split_zhou_OxfordPets.json",
                "a photo of a {}, a type of pet."),
    DatasetSpec("stanford_cars",   "stanford_cars",        "split_json",
                "",                                        "split_zhou_StanfordCars.json",
                "a photo of a {}."),
    DatasetSpec("oxford_flowers",  "oxford_flowers",       "split_json",
                "jpg",                                     "split_zhou_OxfordFlowers.json",
                "a photo of a {}, a type of flower."),
    DatasetSpec("food101",         "food-101",             "split_json",
                "images",                                  "split_zhou_Food101.json",
                "a photo of {}, a type of food."),
    DatasetSpec("fgvc_aircraft",   "fgvc_aircraft",        "fgvc_aircraft",
                "images",                                  None,
                "a photo of a {}, a type of aircraft."),
    DatasetSpec("sun397",          "sun397",               "split_json",
                "SUN397",                                  "split_zhou_SUN397.json",
                "a photo of a {}."),
    DatasetSpec("dtd",             "dtd",                  "split_json",
                "images",                                  "split_zhou_DescribableTextures.json",
                "{} texture."),
    DatasetSpec("eurosat",         "eurosat",              "split_json",
                "2750",                                    "split_zhou_EuroSAT.json",
                "a centered satellite photo of {}."),
    DatasetSpec("ucf101",          "ucf101",               "split_json",
                "UCF-101-midframes",                       "split_zhou_UCF101.json",
                "a photo of a person doing {}."),
    DatasetSpec("imagenet_v2",     "imagenetv2",           "imagenet_variant",
                "imagenetv2-matched-frequency-format-val", None,
                "a photo of a {}."),
    DatasetSpec("imagenet_sketch", "imagenet-sketch",      "imagenet_variant",
                "images",                                  None,
                "a photo of a {}."),
    DatasetSpec("imagenet_a",      "imagenet-adversarial", "imagenet_variant",
                "imagenet-a",                              None,
                "a photo of a {}."),
    DatasetSpec("imagenet_r",      "imagenet-rendition",   "imagenet_variant",
                "imagenet-r",                              None,
                "a photo of a {}."),
    # The project's own toy world (toyworld/task.py writes it in this layout; not a CoOp dataset).
    DatasetSpec("toyworld",        "toyworld",             "split_json",
                "images",                                  "split_toyworld.json",
                "a photo of a {}."),
]}

SUBSAMPLE_CHOICES = ("all", "base", "new", "novel")  # CoOp says "new"; "novel" is the same
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")  # for the datasets listed by folder

def dataset_key(name: str) -> str:
    """A name as the registry spells it: case, spaces around it and "-" vs "_" do not matter."""
    return str(name).strip().lower().replace("-", "_")

def get_spec(name: str) -> DatasetSpec:
    """The registry row of `name`, or of your own data registered by own_dataset."""
    # own data: its folder's name, exactly
    spec = DATASETS.get(name) or DATASETS.get(dataset_key(name))
    if spec is None:
        raise DatasetError(f"unknown dataset {name!r}; expected one of: {', '.join(DATASETS)}, or "
                           "the path of your own data (a folder of class folders, or a split file)")
    return spec

def clean_classname(name: str) -> str:
    # CoOp's: "american_pit_bull_terrier" -> "american pit bull terrier"
    return name.replace("_", " ")


# ---- Checks and listings shared by the readers -----------------------------------------------

def _require(path: str, what: str, exists=os.path.isfile) -> None:
    if not exists(path):
        raise DatasetError(f"{path}: {what} not found; put it there as CoOp's DATASETS.md "
                           f"({COOP_DATASETS_MD}) describes")

def _image_path(image_root: str, relative_path: str, where: str) -> str:
    """image_root/relative_path, refused if it leaves image_root: a split names its own images."""
    path = os.path.join(image_root, relative_path)  # "../x.jpg" would reach files elsewhere on disk
    if not os.path.normpath(path).startswith(os.path.normpath(image_root) + os.sep):
        raise DatasetError(f"{where}: image path {relative_path!r} leaves the image folder "
                           f"{image_root}; expected a path relative to it, without '..'")
    return path

def _check_split(splits: dict[str, list[Item]], listed_in: str, on_disk: bool = True) -> None:
    """Each image once, and (on_disk) every image on disk (one isfile each is fast, a crash
    mid-epoch is not)."""
    # normalised path -> its split: a repeat is drawn twice, or leaks the test set
    seen: dict[str, str] = {}
    for split_name, item in ((name, item) for name, items in splits.items() for item in items):
        key = os.path.normpath(item.path)
        if key in seen:
            raise DatasetError(f"{listed_in}: {item.path} is listed twice (in '{seen[key]}' and "
                               f"'{split_name}'); expected each image once; remove the repeated "
                               "entry")
        seen[key] = split_name
    # all: the count says how bad
    missing = [path for path in seen if on_disk and not os.path.isfile(path)]
    if missing:
        raise DatasetError(f"{missing[0]}: image listed in {listed_in} not found ({len(missing)} "
                           f"of {len(seen)} listed images are missing); expected the images where "
                           "CoOp's DATASETS.md puts them")

def _classnames_from_items(items: list[Item], source: str) -> list[str]:
    """The class list a split's items define: one name per label, labels 0..n-1."""
    name_of: dict[int, str] = {}
    for item in items:
        if name_of.setdefault(item.label, item.classname) != item.classname:
            raise DatasetError(f"{source}: label {item.label} has two class names, "
                               f"{name_of[item.label]!r} and {item.classname!r}; expected one name "
                               "per label")
    # a skipped label would shift every class after it
    if sorted(name_of) != list(range(len(name_of))):
        raise DatasetError(f"{source}: labels {str(sorted(name_of))[:80]} are not "
                           f"0..{len(name_of) - 1}; expected consecutive labels")
    return [name_of[label] for label in range(len(name_of))]

def _subfolders(folder: str) -> list[str]:  # sorted; files beside them (README.txt) are ignored
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))

def _image_files(folder: str, prefix: str = "") -> tuple[list[str], int]:
    """(image files under `folder`, recursively, relative with "/" and sorted: a folder's files,
    then each subfolder's, as os.walk lists them; how many other files). os.scandir and string
    joins, no per-file os.path.relpath: ImageNet's 1.3M names in seconds, not tens of seconds."""
    images, subfolders, skipped = [], [], 0
    try:
        with os.scandir(folder) as entries:
            for entry in (e for e in entries if not e.name.startswith(".")):  # hidden ones skipped
                if entry.is_dir():  # recursive: your own class folders may nest
                    subfolders.append(entry)
                elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                    images.append(prefix + entry.name)
                else:
                    skipped += 1
    except OSError as e:
        raise DatasetError(f"{folder}: cannot list this folder ({e.strerror or e}); make it "
                           "readable") from None
    images.sort()
    for entry in sorted(subfolders, key=lambda e: e.name):
        if not entry.is_symlink():  # as os.walk: a linked folder is not entered
            found, skipped_there = _image_files(entry.path, f"{prefix}{entry.name}/")
            images += found
            skipped += skipped_there
    return images, skipped


# ---- Readers: (spec, dataset folder) -> (train, val, test, class names) ----------------------
# val is None when the dataset has none of its own (ImageNet: CoOp validates on the test set).

def read_split_json(spec: DatasetSpec, dataset_dir: str) -> tuple:
    """CoOp's split_zhou_*.json, `{"train"|"val"|"test": [[relative_path, label, classname]]}`."""
    split_path = os.path.join(dataset_dir, spec.split_file)
    # Stanford Cars: "" ("cars_train/..." paths)
    image_root = os.path.join(dataset_dir, spec.image_dir)
    if not os.path.isfile(split_path):  # CoOp's DATASETS.md links each split file
        raise DatasetError(f"{split_path}: split file not found; download {spec.split_file} from "
                           f"the link in CoOp's DATASETS.md ({COOP_DATASETS_MD}) and put it there")
    _require(image_root, "image folder", os.path.isdir)
    return _items_of_split(_read_json_split(split_path), image_root, split_path)

def _read_json_split(split_path: str) -> dict:
    # what to do, for both errors
    again = f"download it again from CoOp's DATASETS.md ({COOP_DATASETS_MD})"
    try:
        with open(split_path, encoding="utf-8") as f:
            raw = json.load(f)
    # ValueError: also a 5,000-digit number
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise DatasetError(f"{split_path}: not a valid JSON split file ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:100]}); {again}") from None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), list)
                                            for k in ("train", "val", "test")):
        raise DatasetError(f"{split_path}: expected a JSON object with lists 'train', 'val' and "
                           f"'test'; {again}")
    return raw

def _items_of_split(raw: dict, image_root: str, split_path: str) -> tuple:
    """A split's entries -> Items under image_root, every entry and image checked."""
    splits: dict[str, list[Item]] = {"train": [], "val": [], "test": []}
    for split_name, items in splits.items():
        for position, entry in enumerate(raw[split_name]):
            # what every error here names
            where = f"{split_path}: entry {position} of '{split_name}'"
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                    and not os.path.isabs(entry[0]) and type(entry[1]) is int
                    and isinstance(entry[2], str)):
                raise DatasetError(f"{where} is {repr(entry)[:100]}; expected "
                                   "[relative_image_path, label, classname]")
            items.append(Item(_image_path(image_root, entry[0], where), entry[1],
                              clean_classname(entry[2])))
    _check_split(splits, split_path)  # now, not when a DataLoader worker meets the file mid-epoch
    classnames = _classnames_from_items(splits["train"] + splits["val"] + splits["test"],
                                        split_path)
    return splits["train"], splits["val"], splits["test"], classnames

def _read_class_folders(image_root: str, label_of: dict[str, int], classnames: list[str],
                        what: str) -> list[Item]:
    """Items of image_root/<folder>/<image>, every folder a class of label_of."""
    _require(image_root, what, os.path.isdir)
    items = []
    for folder in _subfolders(image_root):
        if folder not in label_of:
            raise DatasetError(f"{os.path.join(image_root, folder)}: class folder not listed in "
                               "the dataset's classnames.txt; expected only the classes "
                               "classnames.txt names")
        label, class_folder = label_of[folder], os.path.join(image_root, folder)
        prefix, name = os.path.join(class_folder, ""), classnames[label]  # no join per image
        items += [Item(prefix + image, label, name) for image in _image_files(class_folder)[0]]
    return items

def read_imagenet(spec: DatasetSpec, dataset_dir: str) -> tuple:
    """ImageNet as CoOp reads it: classnames.txt ("<wnid> <name>" per line, in label order; CoOp's
    copy has CLIP's names), train from images/train/<wnid>/, test from images/val/<wnid>/, no
    validation split of its own. The variants (test sets only) hold a copy of classnames.txt and
    a folder per class: labelled as CoOp's imagenet_a.py / imagenet_r.py label them (below)."""
    # wnid -> cleaned name, in label order
    path, names = os.path.join(dataset_dir, "classnames.txt"), {}
    _require(path, "classnames.txt (ImageNet's class list, one '<wnid> <name>' per line, linked "
                   "from CoOp's DATASETS.md; the variants hold a copy of it)")
    with open(path, encoding="utf-8") as f:
        for line_number, (wnid, _, name) in enumerate((line.strip().partition(" ") for line in f),
                                                      start=1):
            if wnid and (not name.strip() or wnid in names):
                raise DatasetError(f"{path}: line {line_number} is {wnid + ' ' + name!r}; expected "
                                   f"'<wnid> <class name>' with each wnid once")
            if wnid:
                names[wnid] = clean_classname(name.strip())
    image_root = os.path.join(dataset_dir, spec.image_dir)
    if not spec.evaluation_only:
        label_of, classnames = {wnid: label
                                for label, wnid in enumerate(names)}, list(names.values())
        train = _read_class_folders(os.path.join(image_root, "train"), label_of, classnames,
                                    "training image folder")
        test = _read_class_folders(os.path.join(image_root, "val"), label_of, classnames,
                                   "validation image folder (the val images sorted into <wnid>/ "
                                   "folders)")
        for part, items in (("train", train), ("val", test)):  # a half-extracted archive shows here
            if absent := sorted(set(label_of.values()) - {item.label for item in items}):
                raise DatasetError(f"{os.path.join(image_root, part, list(names)[absent[0]])}: no "
                                   f"images for this class ({len(absent)} of {len(names)} have "
                                   "none); expected a folder per class")
        return train, None, test, classnames
    _require(image_root, "image folder", os.path.isdir)
    # -V2's folders are "0".."999": line i of classnames.txt
    wnids, v2 = list(names), spec.name == "imagenet_v2"
    # others: wnids
    wnid_of_folder = {f: wnids[int(f)] if v2 and f.isdigit() and int(f) < len(wnids) else f
                      # a folder of no class is named by _read_class_folders
                      for f in _subfolders(image_root)}
    present = set(wnid_of_folder.values())
    # The classes with a folder, in classnames.txt order, labelled 0..n-1: for -V2 and -Sketch (all
    # 1000) ImageNet's index space; -A and -R hold 200, so a model trained on ImageNet classifies
    # among those 200 names, as CoOp, CoCoOp, MaPLe and PromptSRC report it.
    kept = [wnid for wnid in wnids if wnid in present]
    label_of = {folder: kept.index(wnid) for folder, wnid in wnid_of_folder.items()
                if wnid in names}
    test = _read_class_folders(image_root, label_of, [names[wnid] for wnid in kept], "image folder")
    if not test:
        raise DatasetError(f"{image_root}: no images found; expected one folder of images per "
                           "class")
    return [], [], test, [names[wnid] for wnid in kept]

def read_fgvc_aircraft(spec: DatasetSpec, dataset_dir: str) -> tuple:
    """The archive's data/ folder: variants.txt (one per line, label order), and per split
    images_variant_<split>.txt ("<image id> <variant>": "1025794 Cessna 172") -> images/<id>.jpg."""
    variants_path, image_root = (os.path.join(dataset_dir, "variants.txt"),
                                 os.path.join(dataset_dir, spec.image_dir))
    _require(variants_path, "FGVC-Aircraft class list (variants.txt, from the archive's data/ "
                            "folder)")
    _require(image_root, "image folder", os.path.isdir)
    with open(variants_path, encoding="utf-8") as f:
        label_of = {variant: label
                    for label, variant in enumerate(line.strip() for line in f if line.strip())}
    splits: dict[str, list[Item]] = {"train": [], "val": [], "test": []}
    for split_name, items in splits.items():
        list_path = os.path.join(dataset_dir, f"images_variant_{split_name}.txt")
        _require(list_path, "FGVC-Aircraft image list (from the archive's data/ folder)")
        with open(list_path, encoding="utf-8") as f:
            for line_number, (image_id, _, variant) in enumerate((line.strip().partition(" ")
                                                                   for line in f), 1):
                if image_id and variant not in label_of:
                    raise DatasetError(f"{list_path}: line {line_number} is "
                                       f"{image_id + ' ' + variant!r}; expected '<image id> "
                                       f"<variant>' with a variant listed in {variants_path}")
                if image_id:
                    path = _image_path(image_root, image_id + ".jpg",
                                       f"{list_path}: line {line_number}")
                    items.append(Item(path, label_of[variant], clean_classname(variant)))
        _check_split({split_name: items}, list_path)  # the missing image named with its list
    # and no image in two lists
    _check_split(splits, f"the image lists in {dataset_dir}", on_disk=False)
    return splits["train"], splits["val"], splits["test"], [clean_classname(v) for v in label_of]


# The registry of readers: the harness adds your own folders' ("image_folder",
# harness/splitfiles.py).
READERS = {"split_json": read_split_json, "imagenet": read_imagenet,
           "imagenet_variant": read_imagenet, "fgvc_aircraft": read_fgvc_aircraft}


# ---- One reading of a dataset, shared by all that a call takes from it -----------------------

def _no_log(line: str) -> None:  # the default: a library call prints nothing
    pass

@dataclass
class Listing:
    """One dataset as its reader found it, every image listed and checked (read_listing): read
    once per call, then shared by every subset and few-shot draw of it (splits_from)."""
    spec: DatasetSpec
    dataset_dir: str  # $DATA/<folder>: the split lives here
    train: list[Item]
    val: list[Item] | None  # None: none of its own (ImageNet: CoOp validates on the test set)
    test: list[Item]
    classnames: list[str]
    # part -> label -> its items: made by the first few-shot draw, read by every other one
    by_label: dict[str, dict[int, list[Item]]] | None = None
    fingerprint: str | None = None  # of what the draws read: a cache's key (the harness's)
    short_said: set[int] = field(default_factory=set)  # the shot counts whose shortfall was said

def dataset_folder(name: str, root: str | None) -> str:
    """The folder of dataset `name` under `root` ($DATA; your own data: where own_dataset found
    it), or a DatasetError saying what is missing: a check that reads no listing, so a caller can
    make it before anything costly (a download, a model read)."""
    spec = get_spec(name)
    if spec.own:
        return spec.folder  # your own data lives where own_dataset found it, whatever the root
    root = os.path.abspath(os.path.expanduser(str(root))) if root else "(no root given)"
    if not os.path.isdir(root):
        raise DatasetError(f"{root}: data root (--root) not found; expected the $DATA "
                           f"folder of CoOp's DATASETS.md ({COOP_DATASETS_MD}) that holds "
                           f"{spec.folder}/")
    dataset_dir = os.path.join(root, spec.folder)
    _require(dataset_dir, "dataset folder", os.path.isdir)
    return dataset_dir


def read_listing(name: str, root: str | None, log: Callable[[str], None] = _no_log) -> Listing:
    """Dataset `name` from `root` ($DATA; your own data: from where own_dataset found it), every
    entry and image checked, with a line to `log` before (ImageNet: 1.3M files) and one after."""
    spec = get_spec(name)
    dataset_dir = dataset_folder(name, root)
    log(f"{spec.name}: reading {dataset_dir} (every image listed and checked)")
    started = time.perf_counter()
    train, val, test, classnames = READERS[spec.reader](spec, dataset_dir)
    counts = " + ".join(f"{len(items):,} {part}" for part, items in
                        (("train", train), ("val", val or []), ("test", test)) if items)
    log(f"{spec.name}: {counts or 'no'} images, {len(classnames):,} classes, read in "
        f"{time.perf_counter() - started:.1f} s")
    return Listing(spec, dataset_dir, train, val, test, classnames)


# ---- Few-shot sampling (Dassl's) ---------------------------------------------------------------

def _by_label(items: list[Item]) -> dict[int, list[Item]]:
    by_label: dict[int, list[Item]] = {}  # classes in the order they first appear (Cars: unsorted)
    for item in items:
        by_label.setdefault(item.label, []).append(item)
    return by_label

def few_shot_pools(listing: Listing) -> dict[str, dict[int, list[Item]]]:
    """What a draw reads: train, and val where the dataset has its own, by class; made once per
    listing, so that fifteen draws cost one pass over ImageNet."""
    if listing.by_label is None:
        parts = {"train": listing.train, **({} if listing.val is None else {"val": listing.val})}
        listing.by_label = {part: _by_label(items) for part, items in parts.items()}
    return listing.by_label

def _draw(by_label: dict[int, list[Item]], num_shots: int, rng: random.Random) -> list[Item]:
    return [item for pool in by_label.values() for item in  # fewer than K: K draws with repeats
            (rng.sample(pool, num_shots) if len(pool) >= num_shots
             else rng.choices(pool, k=num_shots))]

def _warn_short_classes(listing: Listing, shots: dict[str, int]) -> None:
    """One line per dataset and shot count in a call (the first draw at that count says it): the
    parts whose classes hold fewer images than the shots, which each draw repeats, as Dassl does."""
    if shots["train"] in listing.short_said:
        return
    listing.short_said.add(shots["train"])
    said = []
    for part, k in shots.items():
        by_label = listing.by_label[part]
        short = sorted((label, len(items)) for label, items in by_label.items() if len(items) < k)
        if len(short) == len(by_label) and len({n for _, n in short}) == 1:
            said.append(f"{part}: every class has fewer than {k} images ({short[0][1]} each)")
        elif short:
            listed = ", ".join(f"{by_label[label][0].classname!r} has {n}"
                               for label, n in short[:5])
            more = f", and {len(short) - 5} more" * (len(short) > 5)
            said.append(f"{part}: {len(short)} of {len(by_label)} classes have fewer than {k} "
                        f"images ({listed}{more})")
    if said:
        _warn(f"{listing.spec.name}: {'; '.join(said)}; each draw repeats some to make the "
              "shots, as Dassl does")

def draw_few_shot(listing: Listing, num_shots: int, seed: int) -> dict[str, list[Item]]:
    """K images per class for train, min(K, 4) for val, as Dassl's generate_fewshot_dataset draws
    them (Dassl.pytorch, dassl/data/datasets/base_dataset.py; CoOp, CoCoOp, MaPLe, PromptSRC and
    MMRL use it), so that a seed trains on the papers' images: one random.Random(seed) stream,
    train then val (Dassl's random.seed(seed)); a class with fewer than K gives K with repeats."""
    by_label = few_shot_pools(listing)
    shots = {part: num_shots if part == "train" else min(num_shots, 4) for part in by_label}
    _warn_short_classes(listing, shots)
    rng = random.Random(seed)
    return {part: _draw(by_label[part], k, rng) for part, k in shots.items()}


# ---- Base/novel split (CoOp's OxfordPets.subsample_classes) and the entry points ------------

def subsample_classes(classnames: list[str], splits: list[list[Item]], subsample: str) -> tuple:
    """Keep the base (first ceil(n/2) labels) or the novel ("new", the rest) classes in every list,
    relabelled from 0. After few-shot sampling (CoOp): a base class keeps its few-shot images."""
    if subsample == "all":
        return classnames, splits
    n_base = math.ceil(len(classnames) / 2)
    # labels are 0..n-1
    selected = range(n_base) if subsample == "base" else range(n_base, len(classnames))
    new_label = {old: new for new, old in enumerate(selected)}
    return [classnames[old] for old in selected], [
        [replace(item, label=new_label[item.label]) for item in items if item.label in new_label]
        for items in splits]

def _check_selection(spec: DatasetSpec, num_shots: int | None, seed: int, subsample: str) -> None:
    if subsample not in SUBSAMPLE_CHOICES:
        raise DatasetError(f"subsample={subsample!r}: expected one of "
                           f"{', '.join(SUBSAMPLE_CHOICES)}")
    if num_shots is not None and (type(num_shots) is not int or num_shots < 1):
        raise DatasetError(f"num_shots={num_shots!r}: expected None (all training images) or an "
                           "integer >= 1")
    if type(seed) is not int:
        raise DatasetError(f"seed={seed!r}: expected an integer")
    if spec.evaluation_only and (num_shots is not None or subsample != "all"):
        raise DatasetError(f"{spec.name}: a test set only (domain generalization); load it with "
                           f"num_shots=None and subsample='all'")

def splits_from(listing: Listing, num_shots: int | None = None, seed: int = 1,
                subsample: str = "all", draw: Callable = draw_few_shot) -> DatasetSplits:
    """The splits of a listing. num_shots: None (every training image) or K >= 1 per class (val:
    min(K, 4)), drawn with `seed` by draw(listing, num_shots, seed) (draw_few_shot; the harness
    passes one that caches); subsample: "all", "base", "new"/"novel". The variants are test sets
    only (num_shots=None, subsample="all"). One-line DatasetError."""
    subsample = str(subsample).lower()
    _check_selection(listing.spec, num_shots, seed, subsample)
    train, val, test = listing.train, listing.val, listing.test
    if num_shots is not None:
        sampled = draw(listing, num_shots, seed)
        train, val = sampled["train"], sampled.get("val")
    val = test if val is None else val  # ImageNet: CoOp validates on the test set
    classnames, (train, val, test) = subsample_classes(listing.classnames, [train, val, test],
                                                       "new" if subsample == "novel" else subsample)
    name, template = listing.spec.name, listing.spec.template
    return DatasetSplits(name, listing.dataset_dir, train, val, test, classnames, template)

def load_dataset(name: str, root: str, num_shots: int | None = None, seed: int = 1,
                 subsample: str = "all", log: Callable[[str], None] = _no_log) -> DatasetSplits:
    """Dataset `name` from `root` ($DATA): read_listing, then splits_from (see both). A caller
    taking several subsets or draws of one dataset reads it once and calls splits_from."""
    _check_selection(get_spec(name), num_shots, seed, str(subsample).lower())  # before the reading
    return splits_from(read_listing(name, root, log), num_shots, seed, subsample)


# ---- Transforms and the torch Dataset -------------------------------------------------------

# CLIP's statistics and test transform: data.py stands alone, so it keeps its own copy (as
# clip_model.py).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

def train_transform(size: int = 224) -> T.Compose:
    """CoOp's / MMRL's augmentation: random resized crop (scale 0.5-1, bicubic), flip, CLIP's
    normalisation."""
    return T.Compose([T.RandomResizedCrop(size, scale=(0.5, 1.0),
                                          interpolation=T.InterpolationMode.BICUBIC),
                      T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(CLIP_MEAN, CLIP_STD)])

def test_transform(size: int = 224) -> T.Compose:
    """CLIP's preprocessing: shorter side to `size` (bicubic), centre crop, normalise."""
    return T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size),
                      T.ToTensor(), T.Normalize(CLIP_MEAN, CLIP_STD)])

test_transform.__test__ = False  # a transform, not a pytest test, when a test file imports it

def load_image(path: str) -> Image.Image:
    """An image as RGB, or one line naming the file."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")  # convert() decodes the whole file: truncation shows here
    except FileNotFoundError as e:
        raise DatasetError(f"{path}: image not found; expected the file the split lists") from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DatasetError(f"{path}: cannot read image ({type(e).__name__}: {e}); the file is "
                           f"corrupt or not an image, replace it with the original") from e

def augmentation_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one image's augmentation in one epoch: 64 bits of SHA-256 of (seed, epoch,
    index), so that nearby triples draw unrelated crops."""
    digest = hashlib.sha256(f"{seed},{epoch},{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")

class ImageDataset(Dataset):
    """Items as a torch Dataset of (image tensor (3, size, size), label). With a `seed`, each
    image's random transform (train_transform's crop and flip) draws from a generator of its own,
    seeded by (seed, epoch, index), where the index asked for is an image's number (epoch 0) or
    an (epoch, number) pair, as a sampler that knows the epoch gives it: the same augmentation
    whichever DataLoader worker, or the main process, loads the image, so the stream depends
    neither on the number of workers nor on how long they live. torchvision's transforms draw
    from torch's global generator: it is forked around each image and left as it was. Without a
    seed: the global generator, as is."""

    def __init__(self, items: list[Item], transform=None, seed: int | None = None):
        self.items = list(items)
        self.transform = transform if transform is not None else test_transform()
        self.seed = seed

    def __len__(self) -> int:
        return len(self.items)

    def image(self, index: int):
        """The index-th image, before the transform: opened here, in the loading process, so that a
        bad file fails on its own line."""
        return load_image(self.items[index].path)

    def __getitem__(self, index: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = index if isinstance(index, tuple) else (0, index)
        image, label = self.image(index), self.items[index].label
        if self.seed is None:
            return self.transform(image), label
        with torch.random.fork_rng(devices=[]):  # the CPU generator alone, restored after
            torch.default_generator.manual_seed(augmentation_seed(self.seed, epoch, index))
            return self.transform(image), label


# ---- Command line: a summary of one dataset, or the registry --------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="data.py", description="Summarise a dataset (no "
                                     "--dataset: print the registry).")
    # an error as one line, not the whole usage (--help has it); exit status 2, as argparse's
    parser.error = lambda message: parser.exit(2, f"data.py: error: {message} (see --help)\n")
    parser.add_argument("--root", help="the $DATA folder of CoOp's DATASETS.md")
    parser.add_argument("--dataset", help=f"one of: {', '.join(DATASETS)}")
    parser.add_argument("--shots", type=int, default=None, help="K images per class (default: all)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the few-shot draw")
    parser.add_argument("--subsample", default="all", choices=SUBSAMPLE_CHOICES,
                        help="which classes to keep")
    args = parser.parse_args(argv)
    # data.py's own warning format, on purpose (it stands alone): one line each, no source line.
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    if args.dataset is None:
        print(f"{'name':<16} {'folder under $DATA':<22} {'reader':<17} template")
        for spec in DATASETS.values():
            print(f"{spec.name:<16} {spec.folder + '/':<22} {spec.reader:<17} {spec.template!r}")
        return 0
    if args.root is None:
        parser.error("--root is required with --dataset")
    try:
        d = load_dataset(args.dataset, args.root, args.shots, args.seed, args.subsample, log=print)
    except DatasetError as e:
        print(f"data.py: error: {e}", file=sys.stderr)
        return 2
    shots = "all images" if args.shots is None else f"{args.shots} shots, seed {args.seed}"
    print(f"{d.name}  ({d.dataset_dir})  {shots}, subsample={args.subsample}")
    print(f"  classes   {len(d.classnames)}: "
          f"{', '.join(d.classnames[:5])}{', ...' * (len(d.classnames) > 5)}")
    for split_name in ("train", "val", "test"):
        counts = Counter(item.label for item in getattr(d, split_name)).values()
        per_class = f"{min(counts)}-{max(counts)} per class" if counts else "empty"
        print(f"  {split_name:<9} {len(getattr(d, split_name)):>6} images ({per_class})")
    print(f"  template  {d.template!r}" + (f"\n  prompt    {d.prompts[0]!r}" if d.classnames
                                           else ""))
    return 0

if __name__ == "__main__":
    sys.exit(main())
