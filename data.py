"""
The fifteen benchmark datasets of prompt learning, read from CoOp's on-disk layout.

What this file holds, top to bottom:
  - the registry: one table row (a `DatasetSpec`) per dataset, saying its folder under
    $DATA, where its split comes from, how its class names are found and its prompt template;
  - readers for the four kinds of layout: CoOp's `split_zhou_*.json` files, ImageNet's
    `classnames.txt` + class folders, FGVC-Aircraft's text lists, and the ImageNet variants;
  - few-shot sampling (K images per class with the run's seed, the very images Dassl draws)
    and its JSON cache;
  - your own data, with no code to write: a folder of class folders (split 50/20/30 once and
    written as a CoOp split file) or a split file in CoOp's format (`own_dataset`);
  - the base/novel class split of the base-to-novel protocol;
  - the CLIP image transforms and a torch `Dataset` that yields (image tensor, label);
  - `load_dataset(name, root, num_shots, seed, subsample)`, the one public entry point.

How it fits the other files: clip_model.py is the CLIP model, dear.py is the method,
train.py is the command line that calls `load_dataset` and wraps its items in
`ImageDataset`. This file imports nothing from them (only the standard library, torch,
torchvision and PIL), so it can be copied out and used on its own.

It implements docs/METHOD.md Sec. 6 ("Protocols and data"). Users of CoOp, CoCoOp, MaPLe,
PromptSRC or MMRL already have a `$DATA` folder laid out as CoOp's DATASETS.md describes
(https://github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md); this file reads that folder as
it is, with no Dassl. Where we differ from CoOp, the comment says so:
  - the few-shot cache is JSON (`split_fewshot/shot_16-seed_1.json`), not pickle, and it
    records a fingerprint of the split it was drawn from, so a changed split is re-sampled;
  - the sampling uses its own `random.Random(seed)` rather than the global `random` that
    Dassl seeds; the stream is the same, so the same seed draws the same images as CoOp.

Try it:
    python data.py --root $DATA --dataset oxford_pets --shots 16
    python data.py --dataset path/to/my_photos   # your own data: PATH/<class>/<image>
    python data.py --root $DATA --dataset imagenet_a
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
import tempfile
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, replace

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode

COOP_DATASETS_MD = "https://github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md"

# -----------------------------------------------------------------------------
# Errors and warnings


class DatasetError(Exception):
    """Anything wrong with a dataset on disk or with the arguments of `load_dataset`.

    The message is always one line: the path (or flag) at fault, what is wrong, and what to
    do. A command line can print it as is, with no traceback.
    """

    def __init__(self, message: str):
        message = str(message)
        # Raised in a DataLoader worker, torch rebuilds the error in the main process as
        # DatasetError("Caught DatasetError in DataLoader worker process 0.\nOriginal Traceback
        # ...\ndata.DatasetError: <our line>"): keep only our line, the one the main process
        # would have printed without workers.
        if message.startswith("Caught DatasetError") and "\nOriginal Traceback" in message:
            message = message.rstrip().rsplit("\n", 1)[-1].split("DatasetError: ", 1)[-1]
        super().__init__(message.replace("\r", " ").replace("\n", " "))


class DatasetWarning(UserWarning):
    """Something the user should know but that does not stop the run (a rebuilt cache, a
    class with fewer than K images)."""


def _warn(message: str) -> None:
    warnings.warn(message, DatasetWarning, stacklevel=2)


# -----------------------------------------------------------------------------
# Items and what load_dataset returns


@dataclass(frozen=True, slots=True)
class Item:
    """One image of a dataset."""

    path: str  # full path of the image file ($DATA/<folder>/<image folder>/<relative path>)
    label: int  # class index, 0..n_classes-1 in the returned class list
    classname: str  # cleaned class name (underscores -> spaces), as the prompt uses it


@dataclass
class DatasetSplits:
    """What `load_dataset` returns: the three item lists, the class names and the template.

    `classnames[i]` is the name of label i in every list; `template.format(name)` is the
    class's prompt ("a photo of a {}, a type of pet." -> "a photo of a abyssinian, ...").
    """

    name: str  # registry name, e.g. "oxford_pets"
    dataset_dir: str  # $DATA/<folder>, where the split and the few-shot cache live
    train: list[Item]
    val: list[Item]
    test: list[Item]
    classnames: list[str]
    template: str

    @property
    def prompts(self) -> list[str]:
        """One prompt per class, in label order."""
        return [self.template.format(name) for name in self.classnames]


# -----------------------------------------------------------------------------
# The registry: one row per dataset
#
# Readers (the `reader` column):
#   "split_json"        CoOp's split_zhou_*.json: {"train"|"val"|"test": [[path, label, name]]}
#   "imagenet"          classnames.txt ("<wnid> <name>" per line, the label order) and
#                       images/train/<wnid>/, images/val/<wnid>/ class folders
#   "fgvc_aircraft"     variants.txt (label order) and images_variant_{train,val,test}.txt
#   "imagenet_variant"  classnames.txt (a copy of ImageNet's) and one folder per class
#
# Templates are CoOp's CUSTOM_TEMPLATES (CoOp, trainers/coop.py).


@dataclass(frozen=True)
class DatasetSpec:
    name: str  # what the user types: load_dataset("oxford_pets", ...), --dataset oxford_pets
    folder: str  # folder under $DATA (CoOp's DATASETS.md)
    reader: str  # which reader below understands the layout
    image_dir: str  # folder, inside `folder`, that image paths are relative to ("" = `folder`)
    split_file: str | None  # CoOp's split file inside `folder`, for reader "split_json";
    #                         the other readers find the class names themselves (ImageNet's
    #                         classnames.txt, "<wnid> <name>" per line; FGVC's variants.txt)
    template: str  # CoOp's prompt template; "{}" is replaced by the class name
    split_fallback_dir: str | None = None  # your own data: where the drawn split goes if `folder` is read-only

    @property
    def own(self) -> bool:
        """Your own data (own_dataset): `folder` is its absolute path, not a folder under $DATA."""
        return os.path.isabs(self.folder)

    @property
    def evaluation_only(self) -> bool:
        # The four ImageNet variants are test sets only (domain generalization): a model
        # trained on ImageNet is evaluated on them, nothing is trained or sampled on them.
        return self.reader == "imagenet_variant"


# The protocols (docs/METHOD.md Sec. 6): the first eleven rows take part in base-to-novel,
# few-shot and cross-dataset evaluation; ImageNet is the source of cross-dataset and domain
# generalization, and the four variants are test sets of domain generalization only.

# fmt: off
DATASETS: dict[str, DatasetSpec] = {spec.name: spec for spec in [
    #           name               folder                  reader              image_dir                                  split_file                              template
    DatasetSpec("imagenet",        "imagenet",             "imagenet",         "images",                                  None,                                   "a photo of a {}."),
    DatasetSpec("caltech101",      "caltech-101",          "split_json",       "101_ObjectCategories",                    "split_zhou_Caltech101.json",           "a photo of a {}."),
    DatasetSpec("oxford_pets",     "oxford_pets",          "split_json",       "images",                                  "split_zhou_OxfordPets.json",           "a photo of a {}, a type of pet."),
    DatasetSpec("stanford_cars",   "stanford_cars",        "split_json",       "",                                        "split_zhou_StanfordCars.json",         "a photo of a {}."),
    DatasetSpec("oxford_flowers",  "oxford_flowers",       "split_json",       "jpg",                                     "split_zhou_OxfordFlowers.json",        "a photo of a {}, a type of flower."),
    DatasetSpec("food101",         "food-101",             "split_json",       "images",                                  "split_zhou_Food101.json",              "a photo of {}, a type of food."),
    DatasetSpec("fgvc_aircraft",   "fgvc_aircraft",        "fgvc_aircraft",    "images",                                  None,                                   "a photo of a {}, a type of aircraft."),
    DatasetSpec("sun397",          "sun397",               "split_json",       "SUN397",                                  "split_zhou_SUN397.json",               "a photo of a {}."),
    DatasetSpec("dtd",             "dtd",                  "split_json",       "images",                                  "split_zhou_DescribableTextures.json",  "{} texture."),
    DatasetSpec("eurosat",         "eurosat",              "split_json",       "2750",                                    "split_zhou_EuroSAT.json",              "a centered satellite photo of {}."),
    DatasetSpec("ucf101",          "ucf101",               "split_json",       "UCF-101-midframes",                       "split_zhou_UCF101.json",               "a photo of a person doing {}."),
    DatasetSpec("imagenet_v2",     "imagenetv2",           "imagenet_variant", "imagenetv2-matched-frequency-format-val", None,                                   "a photo of a {}."),
    DatasetSpec("imagenet_sketch", "imagenet-sketch",      "imagenet_variant", "images",                                  None,                                   "a photo of a {}."),
    DatasetSpec("imagenet_a",      "imagenet-adversarial", "imagenet_variant", "imagenet-a",                              None,                                   "a photo of a {}."),
    DatasetSpec("imagenet_r",      "imagenet-rendition",   "imagenet_variant", "imagenet-r",                              None,                                   "a photo of a {}."),
    # The project's own toy world (toyworld/task.py writes it in this layout; not a CoOp dataset).
    DatasetSpec("toyworld",        "toyworld",             "split_json",       "images",                                  "split_toyworld.json",                  "a photo of a {}."),
]}
# fmt: on

SUBSAMPLE_CHOICES = ("all", "base", "new", "novel")  # CoOp says "new"; "novel" is the same
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")  # for folder-listed datasets


def dataset_key(name: str) -> str:
    """A dataset name as the registry spells it: case, spaces around it and "-" vs "_" do not
    matter ("Oxford-Pets" -> "oxford_pets"). The one place that rule is written."""
    return str(name).strip().lower().replace("-", "_")


def get_spec(name: str) -> DatasetSpec:
    """The registry row for `name` ("oxford_pets"; case and "-" vs "_" do not matter), or
    that of your own data registered by own_dataset (its folder's name, exactly)."""
    if name in DATASETS:
        return DATASETS[name]
    key = dataset_key(name)
    if key not in DATASETS:
        known = ", ".join(DATASETS)
        raise DatasetError(f"unknown dataset {name!r}; expected one of: {known}, or the path of your own data "
                           f"(a folder of class folders, or a split file)")
    return DATASETS[key]


def clean_classname(name: str) -> str:
    """CoOp's cleaning of a class name for the prompt: underscores become spaces
    ("american_pit_bull_terrier" -> "american pit bull terrier")."""
    return name.replace("_", " ")


# -----------------------------------------------------------------------------
# Small helpers shared by the readers


def _require_file(path: str, what: str) -> None:
    """Stop with a one-line error if a file the layout needs is not there."""
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: {what} not found; put it there as CoOp's DATASETS.md "
                           f"({COOP_DATASETS_MD}) describes")


def _require_dir(path: str, what: str) -> None:
    if not os.path.isdir(path):
        raise DatasetError(f"{path}: {what} not found; put it there as CoOp's DATASETS.md "
                           f"({COOP_DATASETS_MD}) describes")


def _check_images_exist(items: list[Item], listed_in: str) -> None:
    """Every image a list names must exist. One os.path.isfile per image is fast (tens of
    thousands per second), and finding a missing file now beats a crash mid-epoch."""
    missing = [item.path for item in items if not os.path.isfile(item.path)]
    if missing:
        raise DatasetError(
            f"{missing[0]}: image listed in {listed_in} not found "
            f"({len(missing)} of {len(items)} listed images are missing); "
            f"expected the images where CoOp's DATASETS.md puts them ({COOP_DATASETS_MD})")


def _image_path(image_root: str, relative_path: str, where: str) -> str:
    """image_root/relative_path, refused if it leaves image_root ("../../x.jpg", an absolute
    path): a split file names images of its own dataset, never files elsewhere on disk."""
    path = os.path.join(image_root, relative_path)
    if os.path.isabs(relative_path) or not os.path.normpath(path).startswith(os.path.normpath(image_root) + os.sep):
        raise DatasetError(f"{where}: image path {relative_path!r} leaves the image folder {image_root}; "
                           f"expected a path relative to it, without '..'")
    return path


def _check_no_duplicates(splits: dict[str, list[Item]], listed_in: str) -> None:
    """Each image once in a dataset's split: a repeated entry would be drawn twice by the
    few-shot sampler, and an image in both train and test would leak the test set."""
    seen: dict[str, str] = {}
    for split_name, items in splits.items():
        for item in items:
            key = os.path.normpath(item.path)
            if key in seen:
                raise DatasetError(f"{listed_in}: {item.path} is listed twice (in '{seen[key]}' and "
                                   f"'{split_name}'); expected each image once; remove the repeated entry")
            seen[key] = split_name


def _classnames_from_items(items: list[Item], source: str) -> list[str]:
    """The class list (index = label) that a split's items define. Each label must carry one
    name, and the labels must be 0..n-1 with none skipped."""
    name_of: dict[int, str] = {}
    for item in items:
        known = name_of.setdefault(item.label, item.classname)
        if known != item.classname:
            raise DatasetError(f"{source}: label {item.label} has two class names, {known!r} "
                               f"and {item.classname!r}; expected one name per label")
    n_classes = len(name_of)
    if sorted(name_of) != list(range(n_classes)):
        raise DatasetError(f"{source}: labels are {str(sorted(name_of)[:3])[:60]}...{str(sorted(name_of)[-3:])[:60]} "
                           f"for {n_classes} classes; expected consecutive labels 0..{n_classes - 1}")
    return [name_of[label] for label in range(n_classes)]


def _list_images(folder: str) -> list[str]:
    """Image files directly inside `folder`, sorted by name (hidden files and other
    extensions skipped)."""
    return sorted(entry.name for entry in os.scandir(folder)
                  if entry.is_file() and not entry.name.startswith(".")
                  and entry.name.lower().endswith(IMAGE_EXTENSIONS))


def _list_subfolders(folder: str) -> list[str]:
    """Subfolders of `folder`, sorted; files such as README.txt are ignored."""
    return sorted(entry.name for entry in os.scandir(folder)
                  if entry.is_dir() and not entry.name.startswith("."))


# A reader returns (train, val, test) with the class list. `val` is None when the dataset has
# no validation split of its own (ImageNet: CoOp validates on the test set); load_dataset then
# uses the test list. Class names are already cleaned.
ReaderResult = tuple[list[Item], list[Item] | None, list[Item], list[str]]

# -----------------------------------------------------------------------------
# Reader: CoOp's split_zhou_*.json (caltech101, oxford_pets, stanford_cars, oxford_flowers,
# food101, sun397, dtd, eurosat, ucf101)


def read_split_json(spec: DatasetSpec, dataset_dir: str) -> ReaderResult:
    """Read `{"train"|"val"|"test": [[relative_path, label, classname], ...]}`.

    Paths are relative to `dataset_dir/spec.image_dir` (for Stanford Cars, whose paths start
    with "cars_train/" or "cars_test/", that is the dataset folder itself; for your own split
    file, the folder the file sits in).
    """
    split_path = os.path.join(dataset_dir, spec.split_file)
    if not os.path.isfile(split_path):
        raise DatasetError(
            f"{split_path}: split file not found; download {spec.split_file} from the link in "
            f"CoOp's DATASETS.md ({COOP_DATASETS_MD}) and put it there")
    image_root = os.path.join(dataset_dir, spec.image_dir)
    _require_dir(image_root, "image folder")
    return _items_of_split(_read_json_split(split_path), image_root, split_path)


def _read_json_split(split_path: str) -> dict:
    try:
        with open(split_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # ValueError: also a 5,000-digit number
        raise DatasetError(f"{split_path}: not a valid JSON split file ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:100]}); download it again from CoOp's DATASETS.md "
                           f"({COOP_DATASETS_MD})") from None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), list) for k in ("train", "val", "test")):
        raise DatasetError(f"{split_path}: expected a JSON object with lists 'train', 'val' and "
                           f"'test'; download it again from CoOp's DATASETS.md ({COOP_DATASETS_MD})")
    return raw


def _items_of_split(raw: dict, image_root: str, split_path: str) -> ReaderResult:
    """A split's entries -> Items under image_root, every entry and image checked."""
    splits = {}
    for split_name in ("train", "val", "test"):
        items = []
        for position, entry in enumerate(raw[split_name]):
            ok = (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                  and not os.path.isabs(entry[0]) and isinstance(entry[1], int)
                  and not isinstance(entry[1], bool) and isinstance(entry[2], str))
            if not ok:
                raise DatasetError(f"{split_path}: entry {position} of '{split_name}' is {repr(entry)[:100]}; "
                                   f"expected [relative_image_path, label, classname]")
            relative_path, label, classname = entry
            path = _image_path(image_root, relative_path, f"{split_path}: entry {position} of '{split_name}'")
            items.append(Item(path, label, clean_classname(classname)))
        splits[split_name] = items
    _check_no_duplicates(splits, split_path)

    every_item = splits["train"] + splits["val"] + splits["test"]
    classnames = _classnames_from_items(every_item, split_path)
    _check_images_exist(every_item, split_path)
    return splits["train"], splits["val"], splits["test"], classnames


# -----------------------------------------------------------------------------
# Reader: ImageNet (classnames.txt + class folders) and the four ImageNet variants


def _read_imagenet_classnames(dataset_dir: str) -> dict[str, str]:
    """classnames.txt: one "<wnid> <class name>" per line, in label order. CoOp's copy uses
    CLIP's class names (e.g. "n01514668 rooster"). Returns wnid -> cleaned name, in order."""
    path = os.path.join(dataset_dir, "classnames.txt")
    if not os.path.isfile(path):
        raise DatasetError(
            f"{path}: classnames.txt not found; it is ImageNet's class list, one '<wnid> <name>' "
            f"per line; download it from the link in CoOp's DATASETS.md ({COOP_DATASETS_MD}) "
            f"(the ImageNet variants hold a copy of the same file)")
    names: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            wnid, _, name = line.strip().partition(" ")
            if not name.strip() or wnid in names:
                raise DatasetError(f"{path}: line {line_number} is {line.strip()!r}; expected "
                                   f"'<wnid> <class name>' with each wnid once")
            names[wnid] = clean_classname(name.strip())
    return names


def _read_class_folders(image_root: str, label_of: dict[str, int], classnames: list[str],
                        what: str) -> list[Item]:
    """Items from `image_root/<folder>/<image>`, the folder naming the class. Every folder
    must be a known class; files beside the folders (README.txt) are ignored."""
    _require_dir(image_root, what)
    items = []
    for folder in _list_subfolders(image_root):
        if folder not in label_of:
            raise DatasetError(f"{os.path.join(image_root, folder)}: class folder not listed in the "
                               f"dataset's classnames.txt; expected only the classes classnames.txt names")
        label = label_of[folder]
        for filename in _list_images(os.path.join(image_root, folder)):
            items.append(Item(os.path.join(image_root, folder, filename), label, classnames[label]))
    return items


def read_imagenet(spec: DatasetSpec, dataset_dir: str) -> ReaderResult:
    """ImageNet as CoOp reads it: train from images/train/<wnid>/, test from images/val/<wnid>/
    (the 50,000 validation images), and no validation split of its own (CoOp validates on
    the test set). Labels follow the line order of classnames.txt (sorted wnids in CoOp's copy,
    which is also the order of CoOp's sorted folders)."""
    name_of_wnid = _read_imagenet_classnames(dataset_dir)
    label_of = {wnid: label for label, wnid in enumerate(name_of_wnid)}
    classnames = list(name_of_wnid.values())
    image_root = os.path.join(dataset_dir, spec.image_dir)
    train = _read_class_folders(os.path.join(image_root, "train"), label_of, classnames, "training image folder")
    test = _read_class_folders(os.path.join(image_root, "val"), label_of, classnames,
                               "validation image folder (the val images sorted into <wnid>/ folders)")
    for split_name, items in (("train", train), ("val", test)):
        labels_present = {item.label for item in items}
        absent = [wnid for wnid, label in label_of.items() if label not in labels_present]
        if absent:
            raise DatasetError(f"{os.path.join(image_root, split_name, absent[0])}: no images for this "
                               f"class ({len(absent)} of {len(label_of)} classes of classnames.txt have none); "
                               f"expected one folder of images per line of classnames.txt")
    return train, None, test, classnames


def read_imagenet_variant(spec: DatasetSpec, dataset_dir: str) -> ReaderResult:
    """ImageNet-V2, -Sketch, -A and -R: test sets only.

    Labelling (CoOp's, documented here because ImageNet-A and -R hold only 200 of the 1000
    classes): the classes are those that have a folder, taken in the order of classnames.txt
    and labelled 0..n-1; the returned class names are those n names. For -V2 and -Sketch
    (all 1000 classes) this is exactly ImageNet's index space. For -A and -R it is a 200-way
    problem: label i is the i-th present wnid in classnames.txt order (= sorted wnid order,
    as CoOp's imagenet_a.py/imagenet_r.py label them), and `classnames[i]` its name, so a
    model trained on ImageNet classifies among these 200 names, as CoOp, CoCoOp, MaPLe and
    PromptSRC report it. ImageNet's index of label i is the line of `classnames[i]`'s wnid in
    classnames.txt.

    Folders: -V2 names them "0".."999" (folder i is line i of classnames.txt); the others
    name them by wnid. Non-folder entries such as README.txt are ignored.
    """
    name_of_wnid = _read_imagenet_classnames(dataset_dir)
    wnids_in_order = list(name_of_wnid)
    image_root = os.path.join(dataset_dir, spec.image_dir)
    _require_dir(image_root, "image folder")
    folders = _list_subfolders(image_root)

    # Map each folder to its wnid.
    if spec.name == "imagenet_v2":
        wnid_of_folder = {}
        for folder in folders:
            if not (folder.isdigit() and int(folder) < len(wnids_in_order)):
                raise DatasetError(f"{os.path.join(image_root, folder)}: unexpected folder; expected folders "
                                   f"named 0..{len(wnids_in_order) - 1}, folder i holding class i of classnames.txt")
            wnid_of_folder[folder] = wnids_in_order[int(folder)]
    else:
        wnid_of_folder = {folder: folder for folder in folders}

    # Present classes in classnames.txt order, labelled 0..n-1. A folder whose wnid is not in
    # classnames.txt gets no label, and _read_class_folders names it in its error.
    present_wnids = set(wnid_of_folder.values())
    kept_wnids = [wnid for wnid in wnids_in_order if wnid in present_wnids]
    label_of_wnid = {wnid: label for label, wnid in enumerate(kept_wnids)}
    classnames = [name_of_wnid[wnid] for wnid in kept_wnids]
    label_of_folder = {folder: label_of_wnid[wnid] for folder, wnid in wnid_of_folder.items()
                       if wnid in label_of_wnid}

    test = _read_class_folders(image_root, label_of_folder, classnames, "image folder")
    if not test:
        raise DatasetError(f"{image_root}: no images found; expected one folder of images per class")
    return [], [], test, classnames


# -----------------------------------------------------------------------------
# Reader: FGVC-Aircraft's text lists


def read_fgvc_aircraft(spec: DatasetSpec, dataset_dir: str) -> ReaderResult:
    """FGVC-Aircraft (the archive's data/ folder, renamed fgvc_aircraft): variants.txt holds
    one variant per line (line order = label order); images_variant_{train,val,test}.txt hold
    "<image id> <variant name>" per line, where the name may contain spaces ("1025794 Cessna
    172"); the image is images/<image id>.jpg."""
    variants_path = os.path.join(dataset_dir, "variants.txt")
    _require_file(variants_path, "FGVC-Aircraft class list (variants.txt, from the archive's data/ folder)")
    with open(variants_path, encoding="utf-8") as f:
        variants = [line.strip() for line in f if line.strip()]
    label_of = {variant: label for label, variant in enumerate(variants)}
    classnames = [clean_classname(variant) for variant in variants]
    image_root = os.path.join(dataset_dir, spec.image_dir)
    _require_dir(image_root, "image folder")

    splits = {}
    for split_name in ("train", "val", "test"):
        list_path = os.path.join(dataset_dir, f"images_variant_{split_name}.txt")
        _require_file(list_path, "FGVC-Aircraft image list (from the archive's data/ folder)")
        items = []
        with open(list_path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                image_id, _, variant = line.strip().partition(" ")
                if variant not in label_of:
                    raise DatasetError(f"{list_path}: line {line_number} is {line.strip()!r}; expected "
                                       f"'<image id> <variant>' with a variant listed in {variants_path}")
                label = label_of[variant]
                path = _image_path(image_root, image_id + ".jpg", f"{list_path}: line {line_number}")
                items.append(Item(path, label, classnames[label]))
        _check_images_exist(items, list_path)
        splits[split_name] = items
    _check_no_duplicates(splits, f"the image lists in {dataset_dir}")
    return splits["train"], splits["val"], splits["test"], classnames


# -----------------------------------------------------------------------------
# Your own data: a folder of class folders, or a split file in CoOp's format
#
#   PATH/<class name>/<image>        torchvision's ImageFolder layout. Class names are the
#                                    folder names (underscores -> spaces), labels their sorted
#                                    order. The train/val/test split is drawn once, per class,
#                                    50 / 20 / 30 (CoOp's read_and_split_data in its
#                                    datasets/dtd.py) with a fixed seed, and written as
#                                    PATH/split_<name>.json in CoOp's format: from then on that
#                                    file is the split (edit it, or delete it to draw again).
#                                    If PATH is read-only, it goes to `split_fallback_dir`.
#   PATH/<anything>.json             a split file in CoOp's format; its image paths are
#                                    relative to the folder the file sits in.
#
# The dataset's name (tables, run folders, caches) is its folder's name. The few-shot cache
# lives in PATH/split_fewshot/, as for the benchmarks.

OWN_TEMPLATE = "a photo of a {}."  # CoOp's generic template
OWN_SPLIT_FRACTIONS = (0.5, 0.2)  # train, val per class; test gets the rest (CoOp's read_and_split_data)
OWN_SPLIT_SEED = 1  # our choice: one fixed seed, so the same folder always gives the same split
_DRAWN_SPLITS: dict[str, dict] = {}  # folder -> its drawn split, so checking and reading draw once


def own_dataset_name(path: str) -> str:
    """The name of your own data at PATH: the folder's name (for a split file, the name of the
    folder the file sits in)."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    return os.path.basename(os.path.dirname(path) if path.lower().endswith(".json") else path)


def is_own_data(value: str) -> bool:
    """Whether a --dataset value is a path to your own data rather than a benchmark's name:
    not a registry name, and a path (a separator, a .json file, or something on disk)."""
    value = str(value)
    if value in DATASETS or dataset_key(value) in (*DATASETS, "all"):
        return False
    return "/" in value or os.sep in value or value.lower().endswith(".json") or os.path.exists(value)


def own_dataset(path: str, split_fallback_dir: str | None = None) -> DatasetSpec:
    """Register your own data at PATH (see above) and return its registry row. Everything is
    checked here, before any work; a folder's split is drawn (in memory) but written only when
    load_dataset first reads it. Raises DatasetError (one line) on any bad input."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    name = own_dataset_name(path)
    if path.lower().endswith(".json"):
        if not os.path.isfile(path):
            raise DatasetError(f"{path}: split file not found; expected a JSON file in CoOp's format, "
                               f'{{"train"|"val"|"test": [[path, label, classname], ...]}}')
        spec = DatasetSpec(name, os.path.dirname(path), "split_json", "", os.path.basename(path), OWN_TEMPLATE)
    elif os.path.isdir(path):
        spec = DatasetSpec(name, path, "image_folder", "", f"split_{name}.json", OWN_TEMPLATE,
                           split_fallback_dir and os.path.abspath(split_fallback_dir))
    else:
        raise DatasetError(f"{path}: not found; expected a folder of class folders (PATH/<class>/<image>) "
                           f"or a split file in CoOp's format (.json)")
    key = dataset_key(name)
    known = DATASETS.get(name) or DATASETS.get(key)
    if (known is not None and not known.own) or key == "all":
        raise DatasetError(f"{path}: its name {name!r} is that of a benchmark; rename the folder (the name "
                           f"is used in tables and run folders)")
    # Every entry and image checked now, not after the model has loaded.
    if spec.reader == "image_folder" and _find_own_split(spec) is None:
        raw = _DRAWN_SPLITS[spec.folder] = draw_image_folder_split(spec.folder)
        _items_of_split(raw, spec.folder, os.path.join(spec.folder, spec.split_file))
    else:
        READERS[spec.reader](spec, spec.folder)
    DATASETS[name] = spec
    return spec


def _image_files(folder: str) -> tuple[list[str], int]:
    """(image files under `folder`, recursively, relative to it and sorted; the number of
    other files skipped). Hidden files and folders are left out."""
    images, skipped = [], 0
    for parent, subfolders, files in os.walk(folder):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        for filename in sorted(files):
            if filename.startswith("."):
                continue
            if filename.lower().endswith(IMAGE_EXTENSIONS):
                images.append(os.path.relpath(os.path.join(parent, filename), folder).replace(os.sep, "/"))
            else:
                skipped += 1
    return images, skipped


def draw_image_folder_split(folder: str) -> dict:
    """PATH/<class>/<image> -> {"train"|"val"|"test": [[path, label, class folder], ...]},
    50 / 20 / 30 per class as CoOp's read_and_split_data draws it (round() for train and val,
    the rest test; each part must get an image), with random.Random(OWN_SPLIT_SEED)."""
    classes = [c for c in _list_subfolders(folder) if c != "split_fewshot"]  # our own cache is no class
    if len(classes) < 2:
        raise DatasetError(f"{folder}: {len(classes)} class folder{'s' * (len(classes) != 1)}; expected at least "
                           f"two, as PATH/<class name>/<image> (torchvision's ImageFolder layout)")
    folder_of_name: dict[str, str] = {}
    for class_folder in classes:
        other = folder_of_name.setdefault(clean_classname(class_folder), class_folder)
        if other != class_folder:
            raise DatasetError(f"{folder}: class folders {other!r} and {class_folder!r} both give the class name "
                               f"{clean_classname(class_folder)!r} (underscores become spaces); rename one")
    rng = random.Random(OWN_SPLIT_SEED)
    split: dict[str, list] = {"train": [], "val": [], "test": []}
    skipped = 0
    for label, class_folder in enumerate(classes):
        images, skipped_here = _image_files(os.path.join(folder, class_folder))
        skipped += skipped_here
        for relative in images:  # opening the header finds a file that only looks like an image
            path = os.path.join(folder, class_folder, relative)
            try:
                with Image.open(path):  # reads the header only
                    pass
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
                raise DatasetError(f"{path}: cannot be read as an image ({type(e).__name__}); "
                                   f"replace it or move it out of the data folder") from None
        n = len(images)
        n_train, n_val = round(n * OWN_SPLIT_FRACTIONS[0]), round(n * OWN_SPLIT_FRACTIONS[1])
        if min(n_train, n_val, n - n_train - n_val) < 1:
            raise DatasetError(f"{os.path.join(folder, class_folder)}: class {clean_classname(class_folder)!r} has "
                               f"{n} image{'s' * (n != 1)}; the 50/20/30 train/val/test split needs at least 4 "
                               f"per class; add images or remove the folder")
        rng.shuffle(images)
        entries = [[f"{class_folder}/{relative}", label, class_folder] for relative in images]
        split["train"] += entries[:n_train]
        split["val"] += entries[n_train:n_train + n_val]
        split["test"] += entries[n_train + n_val:]
    if skipped:
        _warn(f"{folder}: skipped {skipped} non-image file{'s' * (skipped != 1)} (only "
              f"{', '.join(IMAGE_EXTENSIONS)} are read)")
    return split


def _find_own_split(spec: DatasetSpec) -> str | None:
    """The split file of a folder of class folders: in the folder, else in the fallback."""
    for folder in (spec.folder, spec.split_fallback_dir):
        if folder and os.path.isfile(os.path.join(folder, spec.split_file)):
            return os.path.join(folder, spec.split_file)
    return None


def read_image_folder(spec: DatasetSpec, dataset_dir: str) -> ReaderResult:
    """Your own folder of class folders: its split file if there is one, else the split drawn
    now and written (to the folder, else to the fallback folder; if neither can be written,
    the next call draws the same split again). Paths are relative to the data folder."""
    split_path = _find_own_split(spec)
    if split_path is not None:
        return _items_of_split(_read_json_split(split_path), dataset_dir, split_path)
    raw = _DRAWN_SPLITS.get(dataset_dir) or draw_image_folder_split(dataset_dir)
    wanted = split_path = os.path.join(dataset_dir, spec.split_file)
    for folder in filter(None, (dataset_dir, spec.split_fallback_dir)):
        split_path = os.path.join(folder, spec.split_file)
        try:
            _write_json_atomically(split_path, {}, raw)
        except OSError as e:
            reason = e.strerror or str(e)
            continue
        if split_path != wanted:
            _warn(f"{wanted}: cannot write the split file ({reason}); wrote it to {split_path}")
        break
    else:
        _warn(f"{wanted}: cannot write the split file ({reason}); the same split is drawn again on each call")
    return _items_of_split(raw, dataset_dir, split_path)


READERS = {
    "split_json": read_split_json,
    "imagenet": read_imagenet,
    "fgvc_aircraft": read_fgvc_aircraft,
    "imagenet_variant": read_imagenet_variant,
    "image_folder": read_image_folder,
}

# -----------------------------------------------------------------------------
# Few-shot sampling


def sample_few_shot(items: list[Item], num_shots: int, rng: random.Random) -> list[Item]:
    """K images per class, drawn exactly as Dassl's generate_fewshot_dataset draws them
    (Dassl.pytorch, dassl/data/datasets/base_dataset.py), which CoOp, CoCoOp, MaPLe, PromptSRC
    and MMRL all use, so that a seed trains on the images the papers report on:

      - the classes are visited in the order their labels first appear in `items` (the split
        file's order, which is not sorted for Stanford Cars or Oxford Flowers);
      - a class with at least K images gives rng.sample(its images, K): K distinct images;
      - a class with fewer than K images gives rng.choices(its images, k=K): K draws with
        repetition (Dassl's `repeat=True`, the default CoOp keeps), so every class has K.

    With rng = random.Random(seed) this is the stream Dassl draws from after
    random.seed(seed). The output is grouped by class, in that visiting order."""
    by_label: dict[int, list[Item]] = defaultdict(list)  # insertion order = first appearance
    for item in items:
        by_label[item.label].append(item)
    sampled = []
    for pool in by_label.values():
        sampled.extend(rng.sample(pool, num_shots) if len(pool) >= num_shots else rng.choices(pool, k=num_shots))
    return sampled


def _warn_short_classes(items: list[Item], num_shots: int, where: str) -> None:
    """Say which classes have fewer than K images (their K draws repeat images)."""
    counts = Counter(item.label for item in items)
    short = sorted((label, count) for label, count in counts.items() if count < num_shots)
    if short:
        names = {item.label: item.classname for item in items}
        listed = ", ".join(f"{names[label]!r} has {count}" for label, count in short[:5])
        more = f", and {len(short) - 5} more" if len(short) > 5 else ""
        _warn(f"{where}: {len(short)} of {len(counts)} classes have fewer than {num_shots} images "
              f"and repeat some to make {num_shots}, as Dassl does ({listed}{more})")


# -----------------------------------------------------------------------------
# The few-shot cache: $DATA/<folder>/split_fewshot/shot_{K}-seed_{seed}.json
#
# CoOp pickles the sampled items to split_fewshot/shot_{K}-seed_{seed}.pkl so that every run
# with the same (K, seed) trains on the same images. We write JSON instead (readable, and
# loading it runs no code), atomically (temp file + os.replace, so an interrupted run never
# leaves half a file), with a fingerprint of the full split it was drawn from. A cache that
# does not parse, does not match, or names images the split does not have is rebuilt with a
# warning, never trusted. Like CoOp's pickle it is drawn once: the draw happens before the
# base/novel subsample, so base and novel runs of one (K, seed) share it.

# Version 3: Dassl's draw (classes in order of first appearance, short classes repeated).
# Caches of version 2 hold the older draw (sorted classes, short classes kept as they are)
# and are redrawn, with a warning, never reused.
FEWSHOT_CACHE_NAME = "dear-from-scratch few-shot split"
FEWSHOT_CACHE_FORMAT = f"{FEWSHOT_CACHE_NAME}, version 3"


def fewshot_cache_path(dataset_dir: str, num_shots: int, seed: int) -> str:
    return os.path.join(dataset_dir, "split_fewshot", f"shot_{num_shots}-seed_{seed}.json")


def _relative(path: str, dataset_dir: str) -> str:
    """An item's path relative to the dataset folder, as the cache stores it (so the cache
    stays valid when $DATA moves). Readers build every path under dataset_dir."""
    assert path.startswith(dataset_dir + os.sep), f"{path} is not inside {dataset_dir}"
    return path[len(dataset_dir) + 1:].replace(os.sep, "/")


def _entries(items: list[Item], dataset_dir: str) -> list[list]:
    """Items as the cache (and the split files) write them: [relative path, label, name]."""
    return [[_relative(item.path, dataset_dir), item.label, item.classname] for item in items]


def _fingerprint(full_entries: dict[str, list[list]]) -> str:
    """SHA-256 of the full (unsampled) splits a cache is drawn from ("fingerprint"), and of
    the sampled lists the cache holds ("content")."""
    return hashlib.sha256(json.dumps(full_entries, sort_keys=True).encode()).hexdigest()


def _read_fewshot_cache(cache_path: str, full: dict[str, list[Item]], full_entries: dict[str, list[list]],
                        shots: dict[str, int], fingerprint: str) -> dict[str, list[Item]] | None:
    """The cached few-shot lists, or None (with a warning saying why) if the cache cannot be
    trusted. `shots` gives K per split name ({"train": 16, "val": 4})."""
    if not os.path.exists(cache_path):
        return None

    def reject(reason: str) -> None:
        _warn(f"{cache_path}: few-shot cache {reason}; rebuilding it")

    try:
        with open(cache_path, encoding="utf-8") as f:
            cached = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return reject(f"cannot be read as JSON ({type(e).__name__})")
    found_format = cached.get("format") if isinstance(cached, dict) else None
    if found_format != FEWSHOT_CACHE_FORMAT:
        if isinstance(found_format, str) and found_format.startswith(FEWSHOT_CACHE_NAME):
            return reject(f"was drawn by an older rule ({found_format!r}), not Dassl's")
        return reject("is not in this file's format")
    if cached.get("fingerprint") != fingerprint:
        return reject("was drawn from a different split (fingerprint mismatch)")

    result = {}
    for split_name, num_shots in shots.items():
        item_of = {tuple(entry): item for entry, item in zip(full_entries[split_name], full[split_name])}
        entries = cached.get(split_name)
        if not isinstance(entries, list):
            return reject(f"has no '{split_name}' list")
        items = []
        for entry in entries:
            well_formed = isinstance(entry, list) and all(isinstance(field, (str, int)) for field in entry)
            key = tuple(entry) if well_formed else None
            if key not in item_of:
                return reject(f"lists {entry!r} in '{split_name}', which the split does not have")
            items.append(item_of[key])
        # Each class must hold K images, as the sampler draws them: distinct when the class has
        # at least K, repeats allowed (and then unavoidable) when it has fewer.
        available = Counter(item.label for item in full[split_name])
        drawn = Counter(item.label for item in items)
        distinct = Counter(item.label for item in set(items))
        if drawn != {label: num_shots for label in available} or any(
                distinct[label] != num_shots for label, count in available.items() if count >= num_shots):
            return reject(f"does not hold {num_shots} images per class (distinct where the class has "
                          f"{num_shots}) in '{split_name}'")
        result[split_name] = items
    # Last, for an edit that every check above lets through (one image swapped for another
    # of the same class): the lists must be those the cache was written with.
    if cached.get("content") != _fingerprint({split_name: cached[split_name] for split_name in shots}):
        return reject("was edited after it was written (its lists do not match its content fingerprint)")
    return result


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read the process's umask (the only way is to set it and set it back)


def _write_json_atomically(path: str, header: dict, lists: dict[str, list[list]]) -> None:
    """Write {**header, **lists} as JSON, one list entry per line, through a temp file in the
    same folder and os.replace (atomic on POSIX and Windows).

    A second copy of clip_model.atomic_write's idea, on purpose: data.py stands alone and
    imports nothing from the project."""
    fields = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in header.items()]
    for key, entries in lists.items():
        rows = ",\n".join(f"    {json.dumps(entry)}" for entry in entries)
        fields.append(f"  {json.dumps(key)}: [\n{rows}\n  ]")
    text = "{\n" + ",\n".join(fields) + "\n}\n"
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, temp_path = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp_path, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the usual rw-r--r--
        os.replace(temp_path, path)
    except BaseException:
        if os.path.exists(temp_path):
            os.remove(temp_path)
        raise


def few_shot_splits(spec: DatasetSpec, dataset_dir: str, full: dict[str, list[Item]],
                    num_shots: int, seed: int) -> dict[str, list[Item]]:
    """K per class for train and min(K, 4) for val (CoOp), read from the cache when it is
    valid, otherwise sampled with `random.Random(seed)` and cached. One stream draws train,
    then val, as CoOp's datasets do after Dassl's random.seed(seed)."""
    shots = {split_name: (num_shots if split_name == "train" else min(num_shots, 4)) for split_name in full}
    for split_name, k in shots.items():
        _warn_short_classes(full[split_name], k, f"{spec.name} {split_name}")

    cache_path = fewshot_cache_path(dataset_dir, num_shots, seed)
    full_entries = {split_name: _entries(items, dataset_dir) for split_name, items in full.items()}
    fingerprint = _fingerprint(full_entries)
    cached = _read_fewshot_cache(cache_path, full, full_entries, shots, fingerprint)
    if cached is not None:
        return cached

    rng = random.Random(seed)  # train first, then val, from one stream
    sampled = {split_name: sample_few_shot(full[split_name], shots[split_name], rng) for split_name in full}
    lists = {split_name: _entries(items, dataset_dir) for split_name, items in sampled.items()}
    header = {"format": FEWSHOT_CACHE_FORMAT, "dataset": spec.name, "num_shots": num_shots,
              "seed": seed, "fingerprint": fingerprint, "content": _fingerprint(lists)}
    try:
        _write_json_atomically(cache_path, header, lists)
    except OSError as e:
        _warn(f"{cache_path}: cannot write the few-shot cache ({e.strerror or e}); continuing without it")
    return sampled


# -----------------------------------------------------------------------------
# Base/novel split (docs/METHOD.md Sec. 6; CoOp's OxfordPets.subsample_classes)


def subsample_classes(classnames: list[str], splits: list[list[Item]],
                      subsample: str) -> tuple[list[str], list[list[Item]]]:
    """Keep the base or the novel half of the classes in every list and relabel from 0.

    Sort the labels; the first ceil(n/2) are base, the remaining floor(n/2) novel ("new").
    The same selection and relabelling applies to train, val and test, and the class names
    keep their order. CoOp calls this after few-shot sampling, so the few-shot images of a
    base class are the same whether or not the run subsamples.
    """
    if subsample == "all":
        return classnames, splits
    labels = list(range(len(classnames)))  # the labels, sorted: 0..n-1 (checked by the readers)
    n_base = math.ceil(len(labels) / 2)
    selected = labels[:n_base] if subsample == "base" else labels[n_base:]
    new_label = {old: new for new, old in enumerate(selected)}
    kept_names = [classnames[old] for old in selected]
    kept_splits = [[replace(item, label=new_label[item.label]) for item in items if item.label in new_label]
                   for items in splits]
    return kept_names, kept_splits


# -----------------------------------------------------------------------------
# The entry point


def _benchmark_folder(spec: DatasetSpec, root) -> str:
    """$DATA/<folder> of a benchmark, checked."""
    if not root:
        raise DatasetError(f"root={root!r}: no data root (--root) given; expected the $DATA folder "
                           f"of CoOp's DATASETS.md ({COOP_DATASETS_MD})")
    root = os.path.abspath(os.path.expanduser(str(root)))
    if not os.path.isdir(root):
        raise DatasetError(f"{root}: data root (--root) not found; expected the $DATA folder of "
                           f"CoOp's DATASETS.md ({COOP_DATASETS_MD}) that holds {spec.folder}/")
    dataset_dir = os.path.join(root, spec.folder)
    if not os.path.isdir(dataset_dir):
        raise DatasetError(f"{dataset_dir}: dataset folder not found; expected {spec.name} in "
                           f"{spec.folder}/ as CoOp's DATASETS.md lays it out ({COOP_DATASETS_MD})")
    return dataset_dir


def load_dataset(name: str, root: str, num_shots: int | None = None, seed: int = 1,
                 subsample: str = "all") -> DatasetSplits:
    """Read dataset `name` from `root` ($DATA, laid out as CoOp's DATASETS.md describes).

    num_shots: None for every training image, or K >= 1 for K images per class (validation:
                min(K, 4)), drawn with `seed` and cached in split_fewshot/shot_{K}-seed_{seed}.json.
    subsample: "all", "base" (first ceil(n/2) classes) or "new"/"novel" (the rest), relabelled
               from 0; applied after few-shot sampling, as in CoOp.

    ImageNet has no validation split of its own: `val` is the test list (CoOp). The ImageNet
    variants are test sets only: `train` and `val` are empty, and num_shots and subsample
    must be left at None and "all". Raises DatasetError (one line) on any bad input.
    """
    spec = get_spec(name)
    subsample = str(subsample).lower()
    if subsample not in SUBSAMPLE_CHOICES:
        raise DatasetError(f"subsample={subsample!r}: expected one of {', '.join(SUBSAMPLE_CHOICES)}")
    subsample = "new" if subsample == "novel" else subsample
    if num_shots is not None and (isinstance(num_shots, bool) or not isinstance(num_shots, int) or num_shots < 1):
        raise DatasetError(f"num_shots={num_shots!r}: expected None (all training images) or an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DatasetError(f"seed={seed!r}: expected an integer")
    if spec.evaluation_only and (num_shots is not None or subsample != "all"):
        raise DatasetError(f"{spec.name}: a test set only (domain generalization); load it with "
                           f"num_shots=None and subsample='all'")

    if spec.own:  # your own data: its folder is where own_dataset found it, whatever the root
        dataset_dir = spec.folder
    else:
        dataset_dir = _benchmark_folder(spec, root)

    train, val, test, classnames = READERS[spec.reader](spec, dataset_dir)

    if num_shots is not None:
        full = {"train": train} if val is None else {"train": train, "val": val}
        sampled = few_shot_splits(spec, dataset_dir, full, num_shots, seed)
        train, val = sampled["train"], sampled.get("val")
    if val is None:
        val = test  # ImageNet: CoOp validates on the test set

    classnames, (train, val, test) = subsample_classes(classnames, [train, val, test], subsample)
    return DatasetSplits(spec.name, dataset_dir, train, val, test, classnames, spec.template)


# -----------------------------------------------------------------------------
# Transforms and the torch Dataset

# OpenAI CLIP's preprocessing. clip_model.py holds the same two constants and test transform
# (clip_model.image_transform); data.py stands alone, imports nothing from the project, and so
# keeps its own copy: change both together.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def train_transform(size: int = 224) -> T.Compose:
    """Training augmentation of CoOp/MMRL: random resized crop (scale 0.5-1, bicubic),
    horizontal flip, CLIP normalisation."""
    return T.Compose([
        T.RandomResizedCrop(size, scale=(0.5, 1.0), interpolation=InterpolationMode.BICUBIC),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(CLIP_MEAN, CLIP_STD),
    ])


def test_transform(size: int = 224) -> T.Compose:
    """CLIP's own preprocessing: shorter side to `size` (bicubic), centre crop, normalise."""
    return T.Compose([
        T.Resize(size, interpolation=InterpolationMode.BICUBIC),
        T.CenterCrop(size),
        T.ToTensor(),
        T.Normalize(CLIP_MEAN, CLIP_STD),
    ])


test_transform.__test__ = False  # a transform, not a pytest test, when a test file imports it


def load_image(path: str) -> Image.Image:
    """Open an image as RGB, or stop with one line naming the file."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")  # convert() decodes the whole file: truncation shows here
    except FileNotFoundError as e:
        raise DatasetError(f"{path}: image not found; expected the file the split lists") from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DatasetError(f"{path}: cannot read image ({type(e).__name__}: {e}); the file is "
                           f"corrupt or not an image, replace it with the original") from e


class ImageDataset(Dataset):
    """A list of Items as a torch Dataset yielding (image tensor (3, size, size), label)."""

    def __init__(self, items: list[Item], transform=None):
        self.items = list(items)
        self.transform = transform if transform is not None else test_transform()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        item = self.items[index]
        return self.transform(load_image(item.path)), item.label


# -----------------------------------------------------------------------------
# Command line: a summary of one dataset, or the registry


def _print_registry() -> None:
    print(f"{'name':<16} {'folder under $DATA':<22} {'reader':<17} template")
    for spec in DATASETS.values():
        print(f"{spec.name:<16} {spec.folder + '/':<22} {spec.reader:<17} {spec.template!r}")


def _print_summary(data: DatasetSplits, num_shots: int | None, seed: int, subsample: str) -> None:
    def per_class(items: list[Item]) -> str:
        counts = Counter(item.label for item in items).values()
        return f"{min(counts)}-{max(counts)} per class" if counts else "empty"

    shots = "all images" if num_shots is None else f"{num_shots} shots, seed {seed}"
    print(f"{data.name}  ({data.dataset_dir})  {shots}, subsample={subsample}")
    print(f"  classes   {len(data.classnames)}: {', '.join(data.classnames[:5])}"
          f"{', ...' if len(data.classnames) > 5 else ''}")
    for split_name in ("train", "val", "test"):
        items = getattr(data, split_name)
        print(f"  {split_name:<9} {len(items):>6} images ({per_class(items)})")
    print(f"  template  {data.template!r}")
    if data.classnames:
        print(f"  prompt    {data.prompts[0]!r}")


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage before an error; a user wants the one line that says
    what is wrong (and `--help` for the rest). Exit status 2, as argparse's own. train.py and
    `python -m toyworld` use this one too (they import data.py anyway)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="data.py", description="Summarise a dataset read from CoOp's layout "
                                                 "(no --dataset: print the registry).")
    parser.add_argument("--root", help="the $DATA folder of CoOp's DATASETS.md")
    parser.add_argument("--dataset", help=f"one of: {', '.join(DATASETS)}; or the path of your own data: a folder "
                        "of class folders (PATH/<class>/<image>) or a split file in CoOp's format")
    parser.add_argument("--shots", type=int, default=None, help="K images per class (default: all)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the few-shot draw")
    parser.add_argument("--subsample", default="all", choices=SUBSAMPLE_CHOICES, help="which classes to keep")
    args = parser.parse_args(argv)
    # Warnings (a rebuilt cache, a short class) as one line each, without the source line.
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    if args.dataset is None:
        _print_registry()
        return 0
    own = is_own_data(args.dataset)
    if args.root is None and not own:
        parser.error("--root is required with --dataset (unless it is the path of your own data)")
    try:
        name = own_dataset(args.dataset).name if own else args.dataset
        data = load_dataset(name, args.root, num_shots=args.shots, seed=args.seed, subsample=args.subsample)
    except DatasetError as e:
        print(f"data.py: error: {e}", file=sys.stderr)
        return 2
    _print_summary(data, args.shots, args.seed, args.subsample)
    return 0


if __name__ == "__main__":
    sys.exit(main())
