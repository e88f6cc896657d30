"""harness/splitfiles.py -- the splits train.py keeps on disk around data.py's: your own folder's
split (the "image_folder" reader, registered into data.READERS) and the few-shot cache; and the
listings read with the garbage collector paused.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import random
import time
from typing import Callable

from PIL import Image

import clip_model
import data
from data import (IMAGE_EXTENSIONS, DatasetError, DatasetSpec, Item, Listing,
                  _image_files, _image_path, _items_of_split, _read_json_split, _subfolders,
                  _warn, clean_classname, dataset_key)


# ---- Your own data: a folder of class folders, or a split file in CoOp's format --------------
#   PATH/<class>/<image>  torchvision's ImageFolder layout (labels: the sorted folders), split once
#                         50/20/30 per class and written as PATH/split_<name>.json, from then on the
#                         split (edit it, or delete it to draw again); into split_fallback_dir if
#                         PATH is read-only. Nothing else is written into PATH.
#   PATH/<any>.json       a split in CoOp's format, paths relative to the file's folder.
# The name (tables, run folders) is the folder's; the few-shot cache is in the project's cache
# (fewshot_cache_path).

OWN_TEMPLATE = "a photo of a {}."  # CoOp's generic template
# train, val per class; test gets the rest (CoOp's read_and_split_data)
OWN_SPLIT_FRACTIONS = (0.5, 0.2)
OWN_SPLIT_SEED = 1  # our choice: one fixed seed, so the same folder always gives the same split
# folder -> its drawn split, so that checking and reading draw once; -> where its split goes if
# the folder is read-only
_DRAWN_SPLITS: dict[str, dict] = {}
_FALLBACK_DIRS: dict[str, str | None] = {}


def own_dataset_name(path: str) -> str:  # the folder's name (a split file's: that of its folder)
    path = os.path.abspath(os.path.expanduser(str(path)))
    return os.path.basename(os.path.dirname(path) if path.lower().endswith(".json") else path)


def is_own_data(value: str) -> bool:
    """Whether a --dataset value is a path (not a registry name, nor train.py's "all")."""
    value, names = str(value), (*data.DATASETS, "all")
    return value not in names and dataset_key(value) not in names and (
        "/" in value or os.sep in value or value.lower().endswith(".json") or os.path.exists(value))


def own_dataset(path: str, split_fallback_dir: str | None = None) -> DatasetSpec:
    """Register your own data at PATH and return its row. Everything is checked now, before any
    work; a folder's split is drawn (in memory) but written only when load_dataset first reads
    it."""
    path, name = os.path.abspath(os.path.expanduser(str(path))), own_dataset_name(path)
    if path.lower().endswith(".json"):
        if not os.path.isfile(path):
            raise DatasetError(f"{path}: split file not found; expected a JSON file in CoOp's "
                               "format, "
                               f'{{"train"|"val"|"test": [[path, label, classname], ...]}}')
        spec = DatasetSpec(name, os.path.dirname(path), "split_json", "", os.path.basename(path),
                           OWN_TEMPLATE)
    elif os.path.isdir(path):
        spec = DatasetSpec(name, path, "image_folder", "", f"split_{name}.json", OWN_TEMPLATE)
        _FALLBACK_DIRS[path] = split_fallback_dir and os.path.abspath(split_fallback_dir)
    else:
        raise DatasetError(f"{path}: not found; expected a folder of class folders "
                           "(PATH/<class>/<image>) or a split file in CoOp's format (.json)")
    # a benchmark's name would shadow it
    known = data.DATASETS.get(name) or data.DATASETS.get(dataset_key(name))
    if (known is not None and not known.own) or dataset_key(name) == "all":
        raise DatasetError(f"{path}: its name {name!r} is that of a benchmark; rename the folder "
                           "(the name is used in tables and run folders)")
    if spec.reader == "image_folder" and _find_own_split(spec) is None:
        # every class and image checked as drawn
        _DRAWN_SPLITS[spec.folder] = draw_image_folder_split(spec.folder)
    else:
        data.READERS[spec.reader](spec, spec.folder)
    data.DATASETS[name] = spec  # from now on get_spec / load_dataset know it by name
    return spec


def draw_image_folder_split(folder: str) -> dict:
    """PATH/<class>/<image> -> {"train"|"val"|"test": [[path, label, class folder], ...]}, drawn as
    CoOp's read_and_split_data (datasets/dtd.py) draws it; each part must get an image."""
    classes = [c for c in _subfolders(folder) if c != "split_fewshot"]  # an older cache is no class
    if len(classes) < 2:
        raise DatasetError(f"{folder}: {len(classes)} class folder{'s' * (len(classes) != 1)}; "
                           "expected at least two, as PATH/<class name>/<image> (torchvision's "
                           "ImageFolder layout)")
    folder_of_name: dict[str, str] = {}
    for class_folder in classes:
        if (other := folder_of_name.setdefault(clean_classname(class_folder),
                                               class_folder)) != class_folder:
            raise DatasetError(f"{folder}: class folders {other!r} and {class_folder!r} both give "
                               f"the class name {clean_classname(class_folder)!r} (underscores "
                               "become spaces); rename one")
    rng, skipped, split = random.Random(OWN_SPLIT_SEED), 0, {"train": [], "val": [], "test": []}
    for label, class_folder in enumerate(classes):
        images, skipped_here = _image_files(os.path.join(folder, class_folder))
        skipped += skipped_here
        for path in (os.path.join(folder, class_folder, relative) for relative in images):
            try:  # opening the header finds a file that only looks like an image
                Image.open(path).close()
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
                raise DatasetError(f"{path}: cannot be read as an image ({type(e).__name__}); "
                                   f"replace it or move it out of the data folder") from None
        n = len(images)  # per class, so that every class is in every part
        n_train, n_val = round(n * OWN_SPLIT_FRACTIONS[0]), round(n * OWN_SPLIT_FRACTIONS[1])
        if min(n_train, n_val, n - n_train - n_val) < 1:
            raise DatasetError(f"{os.path.join(folder, class_folder)}: class "
                               f"{clean_classname(class_folder)!r} has {n} image{'s' * (n != 1)}; "
                               "the 50/20/30 train/val/test split needs at least 4 per class; add "
                               "images or remove the folder")
        rng.shuffle(images)  # then round(50%) train, round(20%) val, the rest test
        entries = [[f"{class_folder}/{relative}", label, class_folder] for relative in images]
        for part, (start, stop) in zip(split, ((0, n_train), (n_train, n_train + n_val),
                                               (n_train + n_val, n))):
            split[part] += entries[start:stop]
    if skipped:  # said once for the whole folder, not once per file
        _warn(f"{folder}: skipped {skipped} non-image file{'s' * (skipped != 1)} (only "
              f"{', '.join(IMAGE_EXTENSIONS)} are read)")
    return split


def _find_own_split(spec: DatasetSpec) -> str | None:  # in the data folder, else in the fallback
    found = [os.path.join(f, spec.split_file)
             for f in (spec.folder, _FALLBACK_DIRS.get(spec.folder)) if f]
    return next((path for path in found if os.path.isfile(path)), None)


def read_image_folder(spec: DatasetSpec, dataset_dir: str) -> tuple:
    """A folder of class folders: its split file if there is one, else the split drawn now and
    written (to the folder, else the fallback; if neither is writable, drawn again next time)."""
    if (split_path := _find_own_split(spec)) is not None:
        return _items_of_split(_read_json_split(split_path), dataset_dir, split_path)
    # the same fixed-seed draw
    raw = _DRAWN_SPLITS.get(dataset_dir) or draw_image_folder_split(dataset_dir)
    wanted = os.path.join(dataset_dir, spec.split_file)
    for folder in filter(None, (dataset_dir, _FALLBACK_DIRS.get(dataset_dir))):
        split_path = os.path.join(folder, spec.split_file)
        try:
            _write_json_atomically(split_path, {}, raw)
        except OSError as e:
            reason = e.strerror or str(e)
            continue
        if split_path != wanted:
            _warn(f"{wanted}: cannot write the split file ({reason}); wrote it to {split_path}")
        return _items_of_split(raw, dataset_dir, split_path)
    _warn(f"{wanted}: cannot write the split file ({reason}); the same split is drawn again on "
          "each call")
    return _items_of_split(raw, dataset_dir, wanted)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a million small objects are made: they form
    no cycles, and each automatic collection would walk them all again (twice the time, measured
    on 10% of ImageNet)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_listing(name: str, root: str | None, log: Callable[[str], None]) -> Listing:
    """data.read_listing with the collector paused (ImageNet: 1.3M Items)."""
    with collector_paused():
        return data.read_listing(name, root, log)


# ---- The few-shot cache -----------------------------------------------------------------------
# shot_{K}-seed_{seed}.json: as CoOp's pickle, every run of one (K, seed) trains on the same images.
# JSON (readable; loading runs no code) with SHA-256s of the split it was drawn from and of its own
# lists: another format, another split or an edit is redrawn, never trusted.
# 3: Dassl's draw (2 drew otherwise)
FEWSHOT_CACHE_FORMAT = "dear-from-scratch few-shot split, version 3"


def fewshot_cache_path(dataset_dir: str, num_shots: int, seed: int, own: bool = False) -> str:
    """$DATA/<folder>/split_fewshot/ (CoOp's place); your own data's in the project's cache
    (clip_model.default_cache_dir), by the folder's name and path: its folder holds only the
    split file."""
    folder = os.path.join(dataset_dir, "split_fewshot")
    if own:
        key = hashlib.sha256(dataset_dir.encode()).hexdigest()[:12]
        folder = os.path.join(clip_model.default_cache_dir(), "fewshot",
                              f"{os.path.basename(dataset_dir)}-{key}")
    return os.path.join(folder, f"shot_{num_shots}-seed_{seed}.json")


def _fingerprint(lists: dict) -> str:
    return hashlib.sha256(json.dumps(lists, sort_keys=True).encode()).hexdigest()


def _relative(path: str, dataset_dir: str, prefix: str) -> str:
    """os.path.relpath(path, dataset_dir) with "/": the readers join every path onto the folder,
    so the prefix is cut off (relpath itself costs seconds over ImageNet's 1.28M paths)."""
    relative = path[len(prefix):] if path.startswith(prefix) else os.path.relpath(path, dataset_dir)
    return relative.replace(os.sep, "/")


def _entries(items: list[Item], dataset_dir: str) -> list[list]:
    """[path under the dataset folder (which may move), label, class name] per item: the cache's."""
    prefix = os.path.join(dataset_dir, "")  # the folder and a separator
    return [[_relative(i.path, dataset_dir, prefix), i.label, i.classname] for i in items]


def _fingerprint_of_items(parts: dict[str, list[Item]], dataset_dir: str,
                          chunk: int = 10_000) -> str:
    """_fingerprint({part: _entries(items)}), byte for byte, without all the entries at once: the
    JSON text is hashed `chunk` entries at a time (ImageNet's 1.28M as lists: about 300 MB)."""
    digest = hashlib.sha256(b"{")
    for i, (part, items) in enumerate(sorted(parts.items())):  # json.dumps(sort_keys=True)'s order
        digest.update(f"{', ' * (i > 0)}{json.dumps(part)}: [".encode())
        for start in range(0, len(items), chunk):
            text = json.dumps(_entries(items[start:start + chunk], dataset_dir))[1:-1]  # no [ ]
            digest.update(f"{', ' * (start > 0)}{text}".encode())
        digest.update(b"]")
    digest.update(b"}")
    return digest.hexdigest()


def _read_fewshot_cache(cache_path: str, fingerprint: str, parts: list[str]) -> dict | None:
    """The cache's content, or None (with a warning saying why) when it cannot be trusted."""
    try:
        with open(cache_path, encoding="utf-8") as f:
            cached = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = f"cannot be read as JSON ({type(e).__name__})"
    else:
        found = cached.get("format") if isinstance(cached, dict) else None
        if found != FEWSHOT_CACHE_FORMAT:  # e.g. version 2, whose draw was not Dassl's
            reason = f"is of another format ({found!r}), not {FEWSHOT_CACHE_FORMAT!r}"
        elif cached.get("fingerprint") != fingerprint:
            reason = "was drawn from a different split (fingerprint mismatch)"
        elif cached.get("content") != _fingerprint({part: cached.get(part) for part in parts}):
            reason = ("was edited after it was written (its lists do not match its content "
                      "fingerprint)")
        else:
            return cached
    _warn(f"{cache_path}: few-shot cache {reason}; rebuilding it")
    return None


def _write_json_atomically(path: str, header: dict, lists: dict[str, list[list]]) -> None:
    """{**header, **lists} as JSON, one entry per line, through a temporary file and os.replace:
    the entries one a line (clip_model.atomic_write writes what a callback writes)."""
    fields = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in header.items()]
    fields += [f"  {json.dumps(key)}: [\n" + ",\n".join(f"    {json.dumps(e)}"
                                                        for e in entries) + "\n  ]"
               for key, entries in lists.items()]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"  # in the same folder, so that the rename is atomic
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write("{\n" + ",\n".join(fields) + "\n}\n")
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _listing_fingerprint(listing: Listing, log: Callable[[str], None]) -> str:
    """The fingerprint of what the draws read (data.few_shot_pools), made with the pools, once
    per listing: fifteen draws cost one pass over ImageNet."""
    if listing.fingerprint is None:
        started = time.perf_counter()
        with collector_paused():
            data.few_shot_pools(listing)
            own_val = {} if listing.val is None else {"val": listing.val}  # as the pools'
            parts = {"train": listing.train, **own_val}
            listing.fingerprint = _fingerprint_of_items(parts, listing.dataset_dir)
        log(f"{listing.spec.name}: {sum(map(len, parts.values())):,} {' + '.join(parts)} images "
            f"grouped by class and fingerprinted for the few-shot cache in "
            f"{time.perf_counter() - started:.1f} s")
    return listing.fingerprint


def cached_draw(listing: Listing, num_shots: int, seed: int,
                log: Callable[[str], None] = lambda line: None) -> dict[str, list[Item]]:
    """data.draw_few_shot kept on disk (train.py's draw, for data.splits_from): the cache's lists
    where it holds a valid one for this split, else the draw, written there."""
    dataset_dir, fingerprint = listing.dataset_dir, _listing_fingerprint(listing, log)
    drawn = data.draw_few_shot(listing, num_shots, seed)  # milliseconds; it warns of shortfalls
    cache_path = fewshot_cache_path(dataset_dir, num_shots, seed, listing.spec.own)
    lists = _read_fewshot_cache(cache_path, fingerprint, list(drawn))
    if lists is None:
        lists = {part: _entries(items, dataset_dir) for part, items in drawn.items()}
        header = {"format": FEWSHOT_CACHE_FORMAT, "dataset": listing.spec.name,
                  "num_shots": num_shots, "seed": seed, "fingerprint": fingerprint,
                  "content": _fingerprint(lists)}
        try:
            _write_json_atomically(cache_path, header, lists)
        except OSError as e:
            _warn(f"{cache_path}: cannot write the few-shot cache ({e.strerror or e}); continuing "
                  "without it")
    # Items made anew from the entries, drawn or read alike: none of the listing's (ImageNet: 1.3M,
    # 250 MB) stays alive with the draws, which the run keeps to its end.
    return {part: [Item(_image_path(dataset_dir, path, cache_path), label, name)
                   for path, label, name in lists[part]] for part in drawn}


data.READERS["image_folder"] = read_image_folder  # your own folders, from now on
