"""
Tests for data.py: every reader on a tiny dataset written in CoOp's layout, the base/novel
split, few-shot sampling and its cache, the transforms, the one-line errors, and the real
CoOp split files of tests/data/coop_splits read through load_dataset.

Run:  python -m pytest -q tests/test_data.py

No dataset is downloaded: fixtures write a few classes of 8x8 images (and, for the real split
files, a 1x1 placeholder at every listed path) under pytest's tmp_path.
"""

import gzip
import hashlib
import io
import json
import functools
import os
import pickle
import random
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import data  # noqa: E402
from data import DatasetError, DatasetWarning, ImageDataset, load_dataset  # noqa: E402
from harness import imagecache, splitfiles  # noqa: E402

@pytest.fixture(autouse=True)
def registry_as_shipped(monkeypatch):
    """Your own data registers itself in data.DATASETS: each test starts from the shipped registry."""
    monkeypatch.setattr(data, "DATASETS", dict(data.DATASETS))


def cached_load(name, root, num_shots=None, seed=1, subsample="all") -> data.DatasetSplits:
    """A dataset as train.py reads it: the listing, then the few-shot draw through the cache."""
    listing = splitfiles.read_listing(name, root and str(root), lambda line: None)
    return data.splits_from(listing, num_shots, seed, subsample, draw=splitfiles.cached_draw)


# -----------------------------------------------------------------------------
# Writing tiny datasets in CoOp's layout


def write_image(path: Path, color=(128, 64, 32), size=(8, 8)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)  # format from the suffix (.jpg, .JPEG, .png)


# How each split-json dataset names its files (relative to its image folder), modelled on
# the real split files: flat for pets and flowers, class folders for the others, and
# cars_train/ + cars_test/ for Stanford Cars (relative to the dataset folder itself).
RELATIVE_PATH = {
    "oxford_pets": lambda cls, split, i: f"{cls.title()}_{split}{i}.jpg",
    "oxford_flowers": lambda cls, split, i: f"image_{cls[:3]}{split}{i}.jpg",
    "stanford_cars": lambda cls, split, i: f"cars_{'test' if split == 'test' else 'train'}/{split}{i}.jpg",
    "caltech101": lambda cls, split, i: f"{cls}/image_{split}{i}.jpg",
    "food101": lambda cls, split, i: f"{cls}/{split}{i}.jpg",
    "sun397": lambda cls, split, i: f"a/{cls}/sun_{split}{i}.jpg",
    "dtd": lambda cls, split, i: f"{cls}/{cls}_{split}{i}.jpg",
    "eurosat": lambda cls, split, i: f"{EUROSAT_FOLDER[cls]}/{EUROSAT_FOLDER[cls]}_{split}{i}.jpg",
    "ucf101": lambda cls, split, i: f"{cls}/v_{cls}_{split}{i}.jpg",
}
EUROSAT_FOLDER = {"Annual Crop Land": "AnnualCrop", "Forest": "Forest",
                  "Herbaceous Vegetation Land": "HerbaceousVegetation"}  # CoOp renames the classes
CLASSES = {
    "oxford_pets": ["abyssinian", "american_bulldog", "basset_hound", "beagle", "bengal"],
    "oxford_flowers": ["pink primrose", "globe thistle", "blanket flower"],
    "stanford_cars": ["2012 Audi TTS Coupe", "2007 Suzuki Aerio Sedan", "2012 Ferrari 458 Italia Convertible"],
    "caltech101": ["face", "leopard", "car_side"],
    "food101": ["apple_pie", "baby_back_ribs", "baklava"],
    "sun397": ["abbey", "airplane_cabin", "alley"],
    "dtd": ["banded", "blotchy", "braided", "bubbly"],
    "eurosat": ["Annual Crop Land", "Forest", "Herbaceous Vegetation Land"],
    "ucf101": ["Apply_Eye_Makeup", "Archery", "Baby_Crawling"],
}


def write_split_dataset(root: Path, name: str, counts=(8, 6, 2), train_counts=None) -> dict:
    """Write images and split_zhou_*.json for `name`; `counts` = images per class in
    (train, val, test), `train_counts` overrides train per class. Returns the split."""
    spec = data.DATASETS[name]
    image_root = root / spec.folder / spec.image_dir
    split = {"train": [], "val": [], "test": []}
    for label, classname in enumerate(CLASSES[name]):
        n_train = train_counts[label] if train_counts else counts[0]
        for split_name, n in zip(("train", "val", "test"), (n_train, counts[1], counts[2])):
            for i in range(n):
                relative = RELATIVE_PATH[name](classname, split_name, f"{label}_{i}")
                write_image(image_root / relative, color=(label * 40, i * 20, 100))
                split[split_name].append([relative, label, classname])
    (root / spec.folder / spec.split_file).write_text(json.dumps(split, indent=4))
    return split


@pytest.fixture
def pets_root(tmp_path) -> Path:
    """oxford_pets: 5 classes (underscores in names), 8 train / 6 val / 2 test each."""
    write_split_dataset(tmp_path, "oxford_pets")
    return tmp_path


IMAGENET_CLASSES = [  # CLIP's names, as in CoOp's classnames.txt (sorted by wnid)
    ("n01440764", "tench"), ("n01443537", "goldfish"), ("n01484850", "great white shark"),
    ("n01491361", "tiger shark"), ("n01494475", "hammerhead shark"),
]


def write_classnames_txt(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "classnames.txt").write_text("".join(f"{wnid} {name}\n" for wnid, name in IMAGENET_CLASSES))


@pytest.fixture
def imagenet_root(tmp_path) -> Path:
    """imagenet: classnames.txt, images/train/<wnid>/ (6 each), images/val/<wnid>/ (2 each)."""
    write_classnames_txt(tmp_path / "imagenet")
    for label, (wnid, _) in enumerate(IMAGENET_CLASSES):
        for i in range(6):
            write_image(tmp_path / "imagenet" / "images" / "train" / wnid / f"{wnid}_{i}.JPEG", (label * 40, i, 0))
        for i in range(2):
            write_image(tmp_path / "imagenet" / "images" / "val" / wnid / f"ILSVRC2012_val_{label}{i}.JPEG")
    return tmp_path


@pytest.fixture
def fgvc_root(tmp_path) -> Path:
    """fgvc_aircraft: variants.txt, images_variant_{train,val,test}.txt, images/<id>.jpg."""
    folder = tmp_path / "fgvc_aircraft"
    folder.mkdir()
    variants = ["707-320", "A300B4", "Cessna 172", "F-16A/B"]
    (folder / "variants.txt").write_text("\n".join(variants) + "\n")
    image_id = 1000000
    for split_name, n in (("train", 5), ("val", 3), ("test", 2)):
        lines = []
        for variant in variants:
            for _ in range(n):
                image_id += 1
                write_image(folder / "images" / f"{image_id}.jpg")
                lines.append(f"{image_id} {variant}")
        (folder / f"images_variant_{split_name}.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


def labels_of(items) -> Counter:
    return Counter(item.label for item in items)


def assert_one_line_naming(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message, f"error spans several lines: {message!r}"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in error: {message!r}"


# -----------------------------------------------------------------------------
# The registry


def test_registry_holds_the_fifteen_datasets_and_the_toy_world_with_coop_templates():
    assert list(data.DATASETS) == [
        "imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers", "food101",
        "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101",
        "imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r", "toyworld"]
    templates = {name: spec.template for name, spec in data.DATASETS.items()}
    assert templates["oxford_pets"] == "a photo of a {}, a type of pet."
    assert templates["oxford_flowers"] == "a photo of a {}, a type of flower."
    assert templates["fgvc_aircraft"] == "a photo of a {}, a type of aircraft."
    assert templates["dtd"] == "{} texture."
    assert templates["eurosat"] == "a centered satellite photo of {}."
    assert templates["food101"] == "a photo of {}, a type of food."
    assert templates["ucf101"] == "a photo of a person doing {}."
    for name in ("imagenet", "caltech101", "stanford_cars", "sun397", "imagenet_v2",
                 "imagenet_sketch", "imagenet_a", "imagenet_r"):
        assert templates[name] == "a photo of a {}."
    assert {spec.name for spec in data.DATASETS.values() if spec.evaluation_only} == {
        "imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r"}


# -----------------------------------------------------------------------------
# Readers, each on its own layout


@pytest.mark.parametrize("name", sorted(RELATIVE_PATH))
def test_split_json_reader_joins_paths_to_the_image_folder_and_cleans_names(tmp_path, name):
    split = write_split_dataset(tmp_path, name)
    spec = data.DATASETS[name]
    result = load_dataset(name, tmp_path)
    image_root = os.path.join(str(tmp_path), spec.folder, spec.image_dir)
    for split_name in ("train", "val", "test"):
        items = getattr(result, split_name)
        assert [os.path.relpath(item.path, image_root) for item in items] == [e[0] for e in split[split_name]]
        assert [item.label for item in items] == [e[1] for e in split[split_name]]
        assert all(os.path.isfile(item.path) for item in items)
    assert result.classnames == [name.replace("_", " ") for name in CLASSES[name]]
    assert result.template == spec.template
    assert result.prompts[0] == spec.template.format(result.classnames[0])


def test_oxford_pets_reader_reads_its_split_with_clean_names(pets_root):
    result = load_dataset("oxford_pets", pets_root)
    assert result.classnames == ["abyssinian", "american bulldog", "basset hound", "beagle", "bengal"]
    assert (len(result.train), len(result.val), len(result.test)) == (40, 30, 10)
    assert result.train[0].path == str(pets_root / "oxford_pets" / "images" / "Abyssinian_train0_0.jpg")
    assert {item.classname for item in result.train if item.label == 1} == {"american bulldog"}
    assert result.prompts[1] == "a photo of a american bulldog, a type of pet."


def test_dtd_reader_uses_class_folders_under_images_and_texture_template(tmp_path):
    write_split_dataset(tmp_path, "dtd")
    result = load_dataset("dtd", tmp_path)
    assert result.classnames == ["banded", "blotchy", "braided", "bubbly"]
    assert result.train[0].path == str(tmp_path / "dtd" / "images" / "banded" / "banded_train0_0.jpg")
    assert result.prompts == ["banded texture.", "blotchy texture.", "braided texture.", "bubbly texture."]


def test_eurosat_reader_keeps_coop_class_names_under_2750(tmp_path):
    write_split_dataset(tmp_path, "eurosat")
    result = load_dataset("eurosat", tmp_path)
    assert result.classnames == ["Annual Crop Land", "Forest", "Herbaceous Vegetation Land"]
    assert result.test[0].path.startswith(str(tmp_path / "eurosat" / "2750" / "AnnualCrop") + os.sep)
    assert result.prompts[1] == "a centered satellite photo of Forest."


def test_stanford_cars_paths_are_relative_to_the_dataset_folder(tmp_path):
    write_split_dataset(tmp_path, "stanford_cars")
    result = load_dataset("stanford_cars", tmp_path)
    cars = tmp_path / "stanford_cars"
    assert all(Path(item.path).parent == cars / "cars_train" for item in result.train + result.val)
    assert all(Path(item.path).parent == cars / "cars_test" for item in result.test)
    assert result.classnames[2] == "2012 Ferrari 458 Italia Convertible"


def test_fgvc_aircraft_reads_variant_lists_with_spaces_in_names(fgvc_root):
    result = load_dataset("fgvc_aircraft", fgvc_root)
    assert result.classnames == ["707-320", "A300B4", "Cessna 172", "F-16A/B"]  # variants.txt order
    assert labels_of(result.train) == {0: 5, 1: 5, 2: 5, 3: 5}
    assert (len(result.val), len(result.test)) == (12, 8)
    cessna = [item for item in result.train if item.label == 2]
    assert all(item.classname == "Cessna 172" for item in cessna)
    assert Path(cessna[0].path).parent == fgvc_root / "fgvc_aircraft" / "images"
    assert result.prompts[3] == "a photo of a F-16A/B, a type of aircraft."


def test_imagenet_labels_follow_classnames_txt_and_val_is_the_test_set(imagenet_root):
    result = load_dataset("imagenet", imagenet_root)
    assert result.classnames == [name for _, name in IMAGENET_CLASSES]
    assert labels_of(result.train) == {label: 6 for label in range(5)}
    assert labels_of(result.test) == {label: 2 for label in range(5)}
    assert result.val == result.test  # CoOp validates ImageNet on its 50k val (= test) set
    for item in result.train + result.test:
        wnid = IMAGENET_CLASSES[item.label][0]
        assert Path(item.path).parent.name == wnid


@pytest.mark.parametrize("name,folder,image_dir", [
    ("imagenet_a", "imagenet-adversarial", "imagenet-a"),
    ("imagenet_r", "imagenet-rendition", "imagenet-r"),
])
def test_imagenet_a_and_r_label_their_own_classes_in_classnames_order(tmp_path, name, folder, image_dir):
    # Two of the five classes present (as A and R hold 200 of 1000), listed out of order on
    # disk, plus a README.txt beside the folders that must be ignored.
    write_classnames_txt(tmp_path / folder)
    for wnid in ("n01491361", "n01443537"):
        for i in range(3):
            write_image(tmp_path / folder / image_dir / wnid / f"{i}.jpg")
    (tmp_path / folder / image_dir / "README.txt").write_text("not a class")
    result = load_dataset(name, tmp_path)
    assert result.classnames == ["goldfish", "tiger shark"]  # classnames.txt order, present only
    assert (result.train, result.val) == ([], [])
    assert labels_of(result.test) == {0: 3, 1: 3}
    for item in result.test:
        assert Path(item.path).parent.name == ["n01443537", "n01491361"][item.label]
        assert item.classname == result.classnames[item.label]


def test_imagenet_sketch_with_every_class_uses_imagenet_indices(tmp_path):
    write_classnames_txt(tmp_path / "imagenet-sketch")
    for wnid, _ in reversed(IMAGENET_CLASSES):
        write_image(tmp_path / "imagenet-sketch" / "images" / wnid / "sketch_1.JPEG")
    result = load_dataset("imagenet_sketch", tmp_path)
    assert result.classnames == [name for _, name in IMAGENET_CLASSES]
    assert sorted((item.label, Path(item.path).parent.name) for item in result.test) == [
        (label, wnid) for label, (wnid, _) in enumerate(IMAGENET_CLASSES)]


def test_imagenet_v2_folder_number_is_the_line_of_classnames_txt(tmp_path):
    write_classnames_txt(tmp_path / "imagenetv2")
    image_root = tmp_path / "imagenetv2" / "imagenetv2-matched-frequency-format-val"
    for index in range(5):
        write_image(image_root / str(index) / f"img{index}.jpeg")
    result = load_dataset("imagenet_v2", tmp_path)
    assert result.classnames == [name for _, name in IMAGENET_CLASSES]
    assert sorted((item.label, Path(item.path).parent.name) for item in result.test) == [
        (index, str(index)) for index in range(5)]


# -----------------------------------------------------------------------------
# Base/novel split


@pytest.mark.parametrize("name,n_base,n_novel", [("oxford_pets", 3, 2), ("dtd", 2, 2)])
def test_base_novel_split_has_ceil_and_floor_classes_relabelled_from_zero(tmp_path, name, n_base, n_novel):
    write_split_dataset(tmp_path, name)
    every = load_dataset(name, tmp_path)
    base = load_dataset(name, tmp_path, subsample="base")
    novel = load_dataset(name, tmp_path, subsample="new")
    assert base.classnames == every.classnames[:n_base]
    assert novel.classnames == every.classnames[n_base:]
    assert len(novel.classnames) == n_novel
    for split_name in ("train", "val", "test"):
        all_items = getattr(every, split_name)
        assert sorted(labels_of(getattr(base, split_name))) == list(range(n_base))
        assert sorted(labels_of(getattr(novel, split_name))) == list(range(n_novel))
        # Same images, labels shifted by n_base for the novel half, names unchanged.
        assert [(i.path, i.label, i.classname) for i in getattr(base, split_name)] == [
            (i.path, i.label, i.classname) for i in all_items if i.label < n_base]
        assert [(i.path, i.label + n_base, i.classname) for i in getattr(novel, split_name)] == [
            (i.path, i.label, i.classname) for i in all_items if i.label >= n_base]
    for result in (base, novel):
        assert all(item.classname == result.classnames[item.label] for item in result.train + result.test)


def test_novel_is_accepted_as_coops_new(pets_root):
    assert load_dataset("oxford_pets", pets_root, subsample="novel") == load_dataset(
        "oxford_pets", pets_root, subsample="new")


def test_base_subsample_comes_after_few_shot_as_in_coop(pets_root):
    every = load_dataset("oxford_pets", pets_root, num_shots=2, seed=3)
    base = load_dataset("oxford_pets", pets_root, num_shots=2, seed=3, subsample="base")
    assert [item.path for item in base.train] == [item.path for item in every.train if item.label < 3]
    assert labels_of(base.train) == {0: 2, 1: 2, 2: 2}


# -----------------------------------------------------------------------------
# Few-shot sampling and its cache


@pytest.mark.parametrize("shots,val_per_class", [(1, 1), (2, 2), (5, 4), (8, 4)])
def test_few_shot_draws_k_per_class_and_min_k_4_for_validation(pets_root, shots, val_per_class):
    result = load_dataset("oxford_pets", pets_root, num_shots=shots)
    assert labels_of(result.train) == {label: shots for label in range(5)}
    assert labels_of(result.val) == {label: val_per_class for label in range(5)}
    assert len(result.test) == 10  # the test set is never sampled
    every = load_dataset("oxford_pets", pets_root)
    assert set(result.train) <= set(every.train) and set(result.val) <= set(every.val)
    assert len(set(result.train)) == len(result.train)


def test_few_shot_same_seed_same_images_other_seed_other_images(pets_root):
    first = cached_load("oxford_pets", pets_root, num_shots=2, seed=1)
    cache = Path(splitfiles.fewshot_cache_path(first.dataset_dir, 2, 1))
    cache.unlink()  # draw again from scratch, not from the cache
    again = cached_load("oxford_pets", pets_root, num_shots=2, seed=1)
    other = cached_load("oxford_pets", pets_root, num_shots=2, seed=2)
    assert again.train == first.train and again.val == first.val
    assert set(other.train) != set(first.train)


def another_draw_in_the_cache(root: Path, num_shots: int, seed: int) -> data.DatasetSplits:
    """The (num_shots, seed) cache rewritten, still valid, to hold seed + 1's draw, which is
    returned: a reading that gives it read the cache, one that gives seed's own drew anew."""
    other = cached_load("oxford_pets", root, num_shots=num_shots, seed=seed + 1)
    folder = root / "oxford_pets" / "split_fewshot"
    stored = json.loads((folder / f"shot_{num_shots}-seed_{seed}.json").read_text())
    drawn = json.loads((folder / f"shot_{num_shots}-seed_{seed + 1}.json").read_text())
    stored.update({key: drawn[key] for key in ("train", "val", "content")})
    (folder / f"shot_{num_shots}-seed_{seed}.json").write_text(json.dumps(stored))
    return other


def test_few_shot_cache_is_json_written_atomically_and_reused(pets_root):
    first = cached_load("oxford_pets", pets_root, num_shots=4, seed=7)
    cache = pets_root / "oxford_pets" / "split_fewshot" / "shot_4-seed_7.json"
    stored = json.loads(cache.read_text())
    assert (stored["num_shots"], stored["seed"], stored["dataset"]) == (4, 7, "oxford_pets")
    assert [entry[0] for entry in stored["train"]] == [
        os.path.relpath(item.path, first.dataset_dir) for item in first.train]
    assert os.listdir(cache.parent) == [cache.name]  # no temp file left behind
    other = another_draw_in_the_cache(pets_root, 4, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DatasetWarning)
        second = cached_load("oxford_pets", pets_root, num_shots=4, seed=7)
    assert (second.train, second.val) == (other.train, other.val) != (first.train, first.val)


def test_failed_cache_write_leaves_no_partial_file_and_the_run_goes_on(pets_root, monkeypatch):
    cached_load("oxford_pets", pets_root, num_shots=2, seed=1)
    folder = pets_root / "oxford_pets" / "split_fewshot"

    def replace_fails(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(splitfiles.os, "replace", replace_fails)
    with pytest.warns(DatasetWarning, match=r"shot_2-seed_2\.json: cannot write the few-shot cache"):
        result = cached_load("oxford_pets", pets_root, num_shots=2, seed=2)
    assert labels_of(result.train) == {label: 2 for label in range(5)}
    assert sorted(os.listdir(folder)) == ["shot_2-seed_1.json"]  # no temp file, no half-written cache


def test_one_listings_shortfall_is_said_once_per_shot_count_and_the_first_count_hides_no_other(
        tmp_path):
    # the few-shot protocol draws 1, 2, 4, 8 and 16 shots from one listing, fewest first
    write_split_dataset(tmp_path, "oxford_pets", train_counts=[2, 8, 8, 8, 8])
    listing = data.read_listing("oxford_pets", str(tmp_path))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", DatasetWarning)
        for shots, seed in ((1, 1), (4, 1), (4, 2), (8, 1)):
            data.splits_from(listing, num_shots=shots, seed=seed)
    lines = [str(w.message) for w in said if issubclass(w.category, DatasetWarning)]
    assert [re.search(r"fewer than (\d+) images", line).group(1) for line in lines] == ["4", "8"]


def test_few_shot_cache_survives_moving_the_data_root(pets_root, tmp_path_factory):
    cached_load("oxford_pets", pets_root, num_shots=2)
    other = another_draw_in_the_cache(pets_root, 2, 1)
    moved = tmp_path_factory.mktemp("moved") / "data"
    pets_root.rename(moved)
    second = cached_load("oxford_pets", moved, num_shots=2)
    assert [os.path.relpath(i.path, moved) for i in second.train] == [
        os.path.relpath(i.path, pets_root) for i in other.train]


def test_class_with_fewer_than_k_images_repeats_some_as_dassl_does_and_says_so(tmp_path):
    write_split_dataset(tmp_path, "oxford_pets", train_counts=[2, 8, 8, 8, 8])
    with pytest.warns(DatasetWarning, match=r"oxford_pets: train: 1 of 5 classes have fewer than 4 images.*'abyssinian' has 2"):
        result = cached_load("oxford_pets", tmp_path, num_shots=4)
    assert labels_of(result.train) == {label: 4 for label in range(5)}  # every class K, as Dassl's repeat=True
    short = [item for item in result.train if item.label == 0]
    assert len(set(short)) == 2  # its two images, drawn with repetition to make four
    with warnings.catch_warnings():  # the cache of a short class (repeats) is valid and reused
        warnings.simplefilter("error", DatasetWarning)
        warnings.filterwarnings("ignore", "oxford_pets: train", DatasetWarning)
        again = cached_load("oxford_pets", tmp_path, num_shots=4)
    assert again.train == result.train


def test_few_shot_cache_of_the_older_rule_is_redrawn_not_reused(pets_root):
    fresh = cached_load("oxford_pets", pets_root, num_shots=2)
    cache = Path(splitfiles.fewshot_cache_path(fresh.dataset_dir, 2, 1))
    stored = json.loads(cache.read_text())
    stored["format"] = "dear-from-scratch few-shot split, version 2"  # sorted labels, no repeats
    stored["train"] = stored["train"][2:] + stored["train"][:2]  # a different (older) draw
    stored["content"] = splitfiles._fingerprint({"train": stored["train"], "val": stored["val"]})
    cache.write_text(json.dumps(stored))
    with pytest.warns(DatasetWarning, match=r"of another format .*version 2.*rebuilding"):
        rebuilt = cached_load("oxford_pets", pets_root, num_shots=2)
    assert rebuilt.train == fresh.train
    assert json.loads(cache.read_text())["format"] == splitfiles.FEWSHOT_CACHE_FORMAT


@pytest.mark.parametrize("corruption", [
    "{not json",
    '{"format": "something else"}',
    "[]",
    "",
])
def test_corrupt_few_shot_cache_is_rebuilt_not_trusted(pets_root, corruption):
    fresh = cached_load("oxford_pets", pets_root, num_shots=2)
    cache = Path(splitfiles.fewshot_cache_path(fresh.dataset_dir, 2, 1))
    cache.write_text(corruption)
    with pytest.warns(DatasetWarning, match=r"shot_2-seed_1\.json: few-shot cache .*rebuilding it"):
        rebuilt = cached_load("oxford_pets", pets_root, num_shots=2)
    assert (rebuilt.train, rebuilt.val) == (fresh.train, fresh.val)
    assert json.loads(cache.read_text())["fingerprint"]  # rewritten as a valid cache


def edited_cache_is_rebuilt(pets_root, edit, warning: str) -> None:
    """Write a 2-shot cache, edit its JSON with edit(stored), read again: the edit is noticed
    (a DatasetWarning matching `warning`) and the draw is the fresh one, not the edited one."""
    fresh = cached_load("oxford_pets", pets_root, num_shots=2)
    cache = Path(splitfiles.fewshot_cache_path(fresh.dataset_dir, 2, 1))
    stored = json.loads(cache.read_text())
    edit(stored)
    cache.write_text(json.dumps(stored))
    with pytest.warns(DatasetWarning, match=warning):
        rebuilt = cached_load("oxford_pets", pets_root, num_shots=2)
    assert rebuilt.train == fresh.train


def _outside_the_split(stored, pets_root):
    stored["train"][0][0] = "images/not_in_the_split.jpg"


def _wrong_counts(stored, pets_root):
    stored["train"][1] = stored["train"][0]  # class 0: one image twice instead of two images


def _plausible_swap(stored, pets_root):
    # One cached image swapped for another of the same class: in the split, right count per
    # class, no repeats -- only the content fingerprint can tell.
    chosen = {entry[0] for entry in stored["train"]}
    other = next(entry for entry in json.loads((pets_root / "oxford_pets" / "split_zhou_OxfordPets.json")
                                               .read_text())["train"]
                 if entry[1] == stored["train"][0][1] and "images/" + entry[0] not in chosen)
    stored["train"][0] = ["images/" + other[0], other[1], other[2]]


@pytest.mark.parametrize("edit", [_outside_the_split, _wrong_counts, _plausible_swap])
def test_edited_few_shot_cache_is_rebuilt(pets_root, edit):
    edited_cache_is_rebuilt(pets_root, lambda stored: edit(stored, pets_root),
                            "was edited after it was written")


def test_few_shot_cache_of_a_changed_split_is_rebuilt(pets_root):
    cached_load("oxford_pets", pets_root, num_shots=2)
    split_path = pets_root / "oxford_pets" / "split_zhou_OxfordPets.json"
    split = json.loads(split_path.read_text())
    split["train"] = split["train"][1:]  # the split changed under the cache
    split_path.write_text(json.dumps(split))
    with pytest.warns(DatasetWarning, match="different split"):
        result = cached_load("oxford_pets", pets_root, num_shots=2)
    every_train = {item.path for item in cached_load("oxford_pets", pets_root).train}
    assert {item.path for item in result.train} <= every_train


def test_imagenet_few_shot_samples_train_only_and_caches_it(imagenet_root):
    result = cached_load("imagenet", imagenet_root, num_shots=3, seed=1)
    assert labels_of(result.train) == {label: 3 for label in range(5)}
    assert result.val == result.test and len(result.test) == 10
    stored = json.loads((imagenet_root / "imagenet" / "split_fewshot" / "shot_3-seed_1.json").read_text())
    assert "val" not in stored and len(stored["train"]) == 15


# -----------------------------------------------------------------------------
# One reading of a dataset, shared by every subset and draw of it


def walked_image_files(folder: str) -> tuple:
    """The listing as data.py made it before (os.walk, os.path.relpath per file): what the fast
    one must give, path for path and in order, so that every draw stays the same."""
    images, skipped = [], 0
    for parent, subfolders, files in os.walk(folder):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        for filename in sorted(f for f in files if not f.startswith(".")):
            if filename.lower().endswith(data.IMAGE_EXTENSIONS):
                images.append(os.path.relpath(os.path.join(parent, filename), folder).replace(os.sep, "/"))
            else:
                skipped += 1
    return images, skipped


def test_the_listing_finds_what_os_walk_finds_in_its_order(tmp_path):
    root = tmp_path / "class"
    for name in ["b.jpg", "a.PNG", "B.jpeg", "_z.webp", "10.jpg", "9.jpg", "notes.txt", ".hidden.jpg",
                 "\u00e9.jpg", "sub/x.jpg", "sub/deeper/y.bmp", "sub/deeper/readme.md", "sub-folder/w.jpg",
                 "Sub/v.jpg", "a/z.jpg", ".cache/h.jpg"]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"")
    (root / "linked").symlink_to(root / "sub", target_is_directory=True)  # os.walk does not enter it
    (root / "link.jpg").symlink_to(root / "b.jpg")  # a link to a file is a file
    # A folder's files first, then each subfolder's (sub/x.jpg before sub/deeper/y.bmp, sub/ before
    # sub-folder/), as os.walk gives them: not one sort of the whole list.
    expected = ["10.jpg", "9.jpg", "B.jpeg", "_z.webp", "a.PNG", "b.jpg", "link.jpg", "\u00e9.jpg",
                "Sub/v.jpg", "a/z.jpg", "sub/x.jpg", "sub/deeper/y.bmp", "sub-folder/w.jpg"]
    assert data._image_files(str(root)) == walked_image_files(str(root)) == (expected, 2)


def test_a_folder_that_cannot_be_listed_is_one_line_naming_it(imagenet_root, monkeypatch):
    blocked, scandir = str(imagenet_root / "imagenet" / "images" / "val" / IMAGENET_CLASSES[2][0]), os.scandir

    def refusing_scandir(path="."):
        if os.fspath(path) == blocked:
            raise PermissionError(13, "Permission denied", blocked)
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing_scandir)
    with pytest.raises(DatasetError) as error:
        cached_load("imagenet", imagenet_root)
    assert_one_line_naming(error, f"{blocked}: cannot list this folder (Permission denied)")


def fingerprint_as_before(parts: dict, dataset_dir: str) -> str:
    """The few-shot cache's split fingerprint as data.py computed it before (os.path.relpath
    per image, the whole JSON at once): caches written then must still be read."""
    entries = {part: [[os.path.relpath(i.path, dataset_dir).replace(os.sep, "/"), i.label, i.classname]
                      for i in items] for part, items in parts.items()}
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("name", ["oxford_pets", "imagenet"])
def test_the_split_fingerprint_is_the_one_existing_caches_hold(pets_root, imagenet_root, name):
    listing = data.read_listing(name, pets_root if name == "oxford_pets" else imagenet_root)
    parts = {"train": listing.train, **({} if listing.val is None else {"val": listing.val})}
    assert len(parts) == (2 if name == "oxford_pets" else 1)  # ImageNet: no validation split of its own
    for chunk in (7, 10, 10_000):  # hashed a chunk of entries at a time: boundaries inside both lists
        assert splitfiles._fingerprint_of_items(parts, listing.dataset_dir, chunk) == fingerprint_as_before(
            parts, listing.dataset_dir)


def test_one_listing_serves_every_subset_and_draw_and_is_fingerprinted_once(pets_root, monkeypatch):
    lines, readings, fingerprints = [], [], []
    reader, fingerprint = data.READERS["split_json"], splitfiles._fingerprint_of_items

    def counted_reader(*args):
        readings.append(len(lines))  # how many lines were out when the reading began
        return reader(*args)

    monkeypatch.setitem(data.READERS, "split_json", counted_reader)
    monkeypatch.setattr(splitfiles, "_fingerprint_of_items", lambda *a: fingerprints.append(a) or fingerprint(*a))
    listing = splitfiles.read_listing("oxford_pets", pets_root, log=lines.append)
    draw = functools.partial(splitfiles.cached_draw, log=lines.append)
    selections = [{}, dict(subsample="base"), dict(subsample="new"), dict(num_shots=2, seed=1),
                  dict(num_shots=2, seed=2, subsample="base"), dict(num_shots=4, seed=1, subsample="novel")]
    splits = [data.splits_from(listing, draw=draw, **selection) for selection in selections]
    assert readings == [1] and len(fingerprints) == 1  # read once, after a line saying so; hashed once
    assert lines[0] == f"oxford_pets: reading {pets_root / 'oxford_pets'} (every image listed and checked)"
    assert re.fullmatch(r"oxford_pets: 40 train \+ 30 val \+ 10 test images, 5 classes, read in \d+\.\d s", lines[1])
    assert re.fullmatch(r"oxford_pets: 70 train \+ val images grouped by class and fingerprinted for the "
                        r"few-shot cache in \d+\.\d s", lines[2]) and len(lines) == 3
    for selection, split in zip(selections, splits):  # what a reading of its own would give
        assert split == cached_load("oxford_pets", pets_root, **selection), selection


def test_the_draws_hold_nothing_of_the_listing(imagenet_root):
    """A run keeps its draws to its end and lets the listing go (ImageNet: 1.3M Items, 250 MB):
    no item train.py draws (through the cache), nor its path, is one of the listing's own
    objects."""
    listing = data.read_listing("imagenet", imagenet_root)
    listed = {id(item) for item in listing.train} | {id(item.path) for item in listing.train}
    for _ in ("drawn", "read from the cache"):
        drawn = data.splits_from(listing, num_shots=2, seed=1, draw=splitfiles.cached_draw).train
        assert len(drawn) == 10 and not listed & ({id(i) for i in drawn} | {id(i.path) for i in drawn})


@pytest.mark.parametrize("change", ["add", "remove", "rename"])
def test_a_changed_imagenet_class_folder_redraws_the_few_shot_cache(imagenet_root, change):
    cached_load("imagenet", imagenet_root, num_shots=3, seed=1)
    folder = imagenet_root / "imagenet" / "images" / "train" / IMAGENET_CLASSES[1][0]
    image = sorted(folder.iterdir())[0]
    if change == "add":
        write_image(folder / "n01443537_new.JPEG")
    elif change == "remove":
        image.unlink()
    else:  # the same count per class: only the names tell
        image.rename(folder / "n01443537_renamed.JPEG")
    with pytest.warns(DatasetWarning, match="drawn from a different split"):
        redrawn = cached_load("imagenet", imagenet_root, num_shots=3, seed=1)
    assert {item.path for item in redrawn.train} <= {item.path for item in cached_load("imagenet", imagenet_root).train}
    assert labels_of(redrawn.train) == {label: 3 for label in range(5)}


# -----------------------------------------------------------------------------
# Bad input: one line, naming the path or flag, saying what is expected


def test_unknown_dataset_name_lists_the_known_ones(tmp_path):
    with pytest.raises(DatasetError) as error:
        load_dataset("oxford_pet", tmp_path)
    assert_one_line_naming(error, "'oxford_pet'", "oxford_pets", "imagenet_r", "eurosat")


def test_missing_root_is_named(tmp_path):
    with pytest.raises(DatasetError) as error:
        load_dataset("dtd", tmp_path / "no_such_root")
    assert_one_line_naming(error, str(tmp_path / "no_such_root"), "--root", "dtd/")


def test_missing_dataset_folder_is_named(tmp_path):
    with pytest.raises(DatasetError) as error:
        load_dataset("eurosat", tmp_path)
    assert_one_line_naming(error, str(tmp_path / "eurosat"), "dataset folder not found", "DATASETS.md")


def test_missing_split_file_says_where_it_comes_from(tmp_path):
    (tmp_path / "oxford_pets" / "images").mkdir(parents=True)
    with pytest.raises(DatasetError) as error:
        load_dataset("oxford_pets", tmp_path)
    assert_one_line_naming(error, str(tmp_path / "oxford_pets" / "split_zhou_OxfordPets.json"),
                           "split file not found", "https://github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md")


def test_image_listed_in_split_but_absent_names_the_first_missing_file(pets_root):
    missing = pets_root / "oxford_pets" / "images" / "Beagle_val3_2.jpg"
    missing.unlink()
    (pets_root / "oxford_pets" / "images" / "Bengal_test4_0.jpg").unlink()
    with pytest.raises(DatasetError) as error:
        load_dataset("oxford_pets", pets_root)
    assert_one_line_naming(error, str(missing), "split_zhou_OxfordPets.json", "2 of 80")


def test_fgvc_image_listed_but_absent_names_the_file(fgvc_root):
    missing = fgvc_root / "fgvc_aircraft" / "images" / "1000003.jpg"
    missing.unlink()
    with pytest.raises(DatasetError) as error:
        load_dataset("fgvc_aircraft", fgvc_root)
    assert_one_line_naming(error, str(missing), "images_variant_train.txt", "1 of 20")


def test_missing_imagenet_classnames_txt_says_what_it_is(tmp_path):
    (tmp_path / "imagenet-adversarial" / "imagenet-a").mkdir(parents=True)
    with pytest.raises(DatasetError) as error:
        load_dataset("imagenet_a", tmp_path)
    assert_one_line_naming(error, str(tmp_path / "imagenet-adversarial" / "classnames.txt"), "<wnid> <name>")


@pytest.mark.parametrize("entry", [["a.jpg", 0], ["/abs/a.jpg", 0, "banded"], ["a.jpg", "0", "banded"]])
def test_malformed_split_entry_is_named(tmp_path, entry):
    (tmp_path / "dtd" / "images").mkdir(parents=True)
    split = {"train": [entry], "val": [], "test": []}
    (tmp_path / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))
    with pytest.raises(DatasetError) as error:
        load_dataset("dtd", tmp_path)
    assert_one_line_naming(error, "split_zhou_DescribableTextures.json", "entry 0 of 'train'",
                           "[relative_image_path, label, classname]")


@pytest.mark.parametrize("relative", ["../../../../outside/x.jpg", "banded/../../x.jpg"])
def test_split_path_that_leaves_the_dataset_folder_is_refused(tmp_path, relative):
    write_image(tmp_path / "outside" / "x.jpg")  # it exists: the reader must not go and read it
    (tmp_path / "dtd" / "images").mkdir(parents=True)
    split = {"train": [[relative, 0, "banded"]], "val": [], "test": []}
    (tmp_path / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))
    with pytest.raises(DatasetError) as error:
        load_dataset("dtd", tmp_path)
    assert_one_line_naming(error, "entry 0 of 'train'", repr(relative), "leaves the image folder")


def test_fgvc_image_id_that_leaves_the_image_folder_is_refused(fgvc_root):
    write_image(fgvc_root / "fgvc_aircraft" / "escape.jpg")
    with open(fgvc_root / "fgvc_aircraft" / "images_variant_train.txt", "a") as f:
        f.write("../escape 707-320\n")
    with pytest.raises(DatasetError) as error:
        load_dataset("fgvc_aircraft", fgvc_root)
    assert_one_line_naming(error, "images_variant_train.txt: line 21", "leaves the image folder")


@pytest.mark.parametrize("where", ["train", "test"])
def test_an_image_listed_twice_is_refused(pets_root, where):
    split_path = pets_root / "oxford_pets" / "split_zhou_OxfordPets.json"
    split = json.loads(split_path.read_text())
    split[where].append(split["train"][0])  # twice in train, or in train and test
    split_path.write_text(json.dumps(split))
    with pytest.raises(DatasetError) as error:
        load_dataset("oxford_pets", pets_root, num_shots=2)
    assert_one_line_naming(error, "split_zhou_OxfordPets.json", "is listed twice", f"'{where}'")
    assert not (pets_root / "oxford_pets" / "split_fewshot").exists()  # nothing sampled or cached


def test_fgvc_image_listed_twice_is_refused(fgvc_root):
    first = (fgvc_root / "fgvc_aircraft" / "images_variant_train.txt").read_text().splitlines()[0]
    with open(fgvc_root / "fgvc_aircraft" / "images_variant_test.txt", "a") as f:
        f.write(first + "\n")
    with pytest.raises(DatasetError) as error:
        load_dataset("fgvc_aircraft", fgvc_root)
    assert_one_line_naming(error, "is listed twice", "'train' and 'test'")


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000,
                                  '{"train": [["a.jpg", ' + "9" * 5000 + ', "banded"]], "val": [], "test": []}'],
                         ids=["deep_nesting", "huge_integer"])
def test_extreme_split_file_is_a_one_line_error(tmp_path, text):
    (tmp_path / "dtd" / "images").mkdir(parents=True)
    (tmp_path / "dtd" / "split_zhou_DescribableTextures.json").write_text(text)
    with pytest.raises(DatasetError) as error:
        load_dataset("dtd", tmp_path)
    assert_one_line_naming(error, "not a valid JSON split file")
    assert len(str(error.value)) < 400


def test_split_file_that_is_not_json_is_named(tmp_path):
    (tmp_path / "dtd" / "images").mkdir(parents=True)
    (tmp_path / "dtd" / "split_zhou_DescribableTextures.json").write_text('{"train": [')
    with pytest.raises(DatasetError) as error:
        load_dataset("dtd", tmp_path)
    assert_one_line_naming(error, str(tmp_path / "dtd" / "split_zhou_DescribableTextures.json"),
                           "not a valid JSON split file", "download it again")


@pytest.mark.parametrize("kwargs,fragment", [
    ({"subsample": "half"}, "subsample='half'"),
    ({"num_shots": 0}, "num_shots=0"),
    ({"num_shots": 2.5}, "num_shots=2.5"),
    ({"num_shots": 2, "seed": "1"}, "seed='1'"),
])
def test_bad_arguments_name_the_flag(pets_root, kwargs, fragment):
    with pytest.raises(DatasetError) as error:
        load_dataset("oxford_pets", pets_root, **kwargs)
    assert_one_line_naming(error, fragment, "expected")


def test_few_shot_on_an_evaluation_only_variant_is_refused(tmp_path):
    with pytest.raises(DatasetError) as error:
        load_dataset("imagenet_r", tmp_path, num_shots=16)
    assert_one_line_naming(error, "imagenet_r", "test set only", "num_shots=None")


def write_truncated_jpeg(path: Path) -> None:
    noise = Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3))
    buffer = io.BytesIO()
    noise.save(buffer, format="JPEG")
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])


@pytest.mark.parametrize("corrupt", [
    lambda path: path.write_bytes(b"this is not an image"),
    write_truncated_jpeg,
], ids=["not_an_image", "truncated_jpeg"])
def test_corrupt_image_fails_at_load_time_naming_the_file(pets_root, corrupt):
    result = load_dataset("oxford_pets", pets_root)  # loading the lists does not open images
    bad = result.test[3]
    corrupt(Path(bad.path))
    dataset = ImageDataset(result.test)
    dataset[2]  # its neighbours still load
    with pytest.raises(DatasetError) as error:
        dataset[3]
    assert_one_line_naming(error, bad.path, "cannot read image", "corrupt")


def test_error_in_a_dataloader_worker_is_the_line_the_main_process_would_give(pets_root):
    result = load_dataset("oxford_pets", pets_root)
    Path(result.test[1].path).write_bytes(b"this is not an image")
    with pytest.raises(DatasetError) as direct:
        ImageDataset(result.test)[1]
    loader = torch.utils.data.DataLoader(ImageDataset(result.test), batch_size=4, num_workers=1)
    with pytest.raises(DatasetError) as from_worker:
        list(loader)
    assert str(from_worker.value) == str(direct.value)  # not the worker's traceback


# -----------------------------------------------------------------------------
# Transforms and the torch Dataset


def test_image_dataset_yields_normalised_224_tensors_and_labels(pets_root):
    result = load_dataset("oxford_pets", pets_root)
    dataset = ImageDataset(result.train, data.train_transform())
    image, label = dataset[9]
    assert image.shape == (3, 224, 224) and image.dtype == torch.float32
    assert label == result.train[9].label == 1
    assert len(dataset) == 40
    # DataLoader workers receive the dataset pickled (spawn start method): it must survive that.
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy.items == dataset.items and copy[9][1] == 1


def test_test_transform_resizes_centre_crops_and_uses_clip_mean_std():
    color = (200, 100, 50)
    image = Image.new("RGB", (300, 200), color)  # not square: resize short side, crop the long one
    tensor = data.test_transform()(image)
    assert tensor.shape == (3, 224, 224)
    expected = torch.tensor([(c / 255 - m) / s for c, m, s in zip(color, data.CLIP_MEAN, data.CLIP_STD)])
    torch.testing.assert_close(tensor.mean(dim=(1, 2)), expected, atol=1e-3, rtol=0)
    steps = data.test_transform().transforms
    assert isinstance(steps[0], T.Resize) and steps[0].interpolation == InterpolationMode.BICUBIC
    assert isinstance(steps[1], T.CenterCrop)


def test_train_transform_is_random_resized_crop_half_to_full_with_flip():
    steps = data.train_transform().transforms
    crop = steps[0]
    assert isinstance(crop, T.RandomResizedCrop)
    assert (crop.size, crop.scale, crop.interpolation) == ((224, 224), (0.5, 1.0), InterpolationMode.BICUBIC)
    assert isinstance(steps[1], T.RandomHorizontalFlip)
    assert tuple(steps[-1].mean) == data.CLIP_MEAN and tuple(steps[-1].std) == data.CLIP_STD
    # Random: two draws of one asymmetric image differ.
    image = Image.frombytes("RGB", (64, 48), bytes(range(256)) * 36)
    torch.manual_seed(0)
    draws = [data.train_transform()(image) for _ in range(4)]
    assert any(not torch.equal(draws[0], other) for other in draws[1:])


# -----------------------------------------------------------------------------
# The command line


def test_command_line_prints_a_summary(pets_root):
    run = subprocess.run([sys.executable, str(REPO / "data.py"), "--root", str(pets_root),
                          "--dataset", "oxford_pets", "--shots", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "classes   5: abyssinian, american bulldog" in run.stdout
    assert "train         10 images (2-2 per class)" in run.stdout
    assert "'a photo of a {}, a type of pet.'" in run.stdout


def test_command_line_reports_bad_root_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "data.py"), "--root", str(tmp_path / "nowhere"),
                          "--dataset", "dtd"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("data.py: error: ")
    assert str(tmp_path / "nowhere") in run.stderr


@pytest.mark.parametrize("argv", [["--shots", "two"], ["--subsample", "half"], ["--dataset", "dtd"]])
def test_command_line_usage_errors_are_one_line_without_the_usage(argv, capsys):
    with pytest.raises(SystemExit) as done:
        data.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("data.py: error: ") and "usage:" not in err


# -----------------------------------------------------------------------------
# The real CoOp split files (tests/data/coop_splits, gzipped: 350 KB instead of 9 MB; see
# its SOURCES.md), a placeholder image at every listed path. They ship with the repository,
# so these tests run in every clone: a missing file fails, it is not skipped.

COOP_SPLITS = Path(__file__).resolve().parent / "data" / "coop_splits"

# name, file, classes, train, val, test, sha256 (SOURCES.md)
REAL_SPLITS = [
    ("oxford_pets", "split_zhou_OxfordPets.json", 37, 2944, 736, 3669,
     "d7f3ffe65b3919f95132e51422894ae18686b83c331fd8c0adcdc3dc2de6301e"),
    ("caltech101", "split_zhou_Caltech101.json", 100, 4128, 1649, 2465,
     "52ce83205ff8ff8a1a18119aad6376120ae35c36e783a984bc560cbf10e73fa5"),
    ("stanford_cars", "split_zhou_StanfordCars.json", 196, 6509, 1635, 8041,
     "40acee7aa65c8e4727a32d90e884b7c3f8960b523422317e163f7af65432959d"),
    ("oxford_flowers", "split_zhou_OxfordFlowers.json", 102, 4093, 1633, 2463,
     "2f50c42fc1a17ca13c271cb4269b1347bdb43d2be672e34f74a4e4cbfbcca794"),
    ("dtd", "split_zhou_DescribableTextures.json", 47, 2820, 1128, 1692,
     "f26ebeccd2b58e68d70f07a0dc39fe49bf7b69024bac34396b954dfd87969c38"),
    ("eurosat", "split_zhou_EuroSAT.json", 10, 13500, 5400, 8100,
     "541503a77d0b26b735d85ec7a3e672804fe0aa466c2e5f07da772cc6c0af8ad2"),
    ("ucf101", "split_zhou_UCF101.json", 101, 7639, 1898, 3783,
     "d78cb834f7c5792ceaff2c5ee2d7c76a9e4086e48a3a6b01232989d29cbefdd8"),
]


def place_images(image_root: Path, relative_paths: set[str]) -> None:
    """A 1x1 JPEG at every path. Hard links to one file: tens of thousands of placeholders
    cost a link each instead of a written file (about 10x faster on a busy disk)."""
    image_root.mkdir(parents=True, exist_ok=True)
    placeholder = image_root.parent / "placeholder.jpg"
    Image.new("RGB", (1, 1), (90, 120, 150)).save(placeholder)
    made_folders = set()
    for relative in relative_paths:
        path = image_root / relative
        if path.parent not in made_folders:
            path.parent.mkdir(parents=True, exist_ok=True)
            made_folders.add(path.parent)
        try:
            os.link(placeholder, path)
        except OSError:  # a file system without hard links
            path.write_bytes(placeholder.read_bytes())


@pytest.mark.parametrize("name,filename,n_classes,n_train,n_val,n_test,sha256", REAL_SPLITS,
                         ids=[row[0] for row in REAL_SPLITS])
def test_real_coop_split_reads_with_the_published_sizes(tmp_path, name, filename, n_classes,
                                                        n_train, n_val, n_test, sha256):
    raw = gzip.decompress((COOP_SPLITS / f"{filename}.gz").read_bytes())  # CoOp's file, byte for byte
    assert hashlib.sha256(raw).hexdigest() == sha256, f"{filename} differs from SOURCES.md"
    spec = data.DATASETS[name]
    assert spec.split_file == filename
    dataset_dir = tmp_path / spec.folder
    image_root = dataset_dir / spec.image_dir
    dataset_dir.mkdir()
    (dataset_dir / filename).write_bytes(raw)
    split = json.loads(raw)
    place_images(image_root, {entry[0] for entries in split.values() for entry in entries})

    every = load_dataset(name, tmp_path)
    assert (len(every.classnames), len(every.train), len(every.val), len(every.test)) == (
        n_classes, n_train, n_val, n_test)
    assert all("_" not in classname for classname in every.classnames)
    assert every.train[0].path == str(image_root / split["train"][0][0])

    base = load_dataset(name, tmp_path, subsample="base")
    novel = load_dataset(name, tmp_path, subsample="new")
    assert (len(base.classnames), len(novel.classnames)) == (-(-n_classes // 2), n_classes // 2)
    assert base.classnames + novel.classnames == every.classnames
    assert len(base.test) + len(novel.test) == n_test

    sixteen = load_dataset(name, tmp_path, num_shots=16, seed=1)
    assert labels_of(sixteen.train) == {label: 16 for label in range(n_classes)}
    assert labels_of(sixteen.val) == {label: 4 for label in range(n_classes)}
    for subsample in ("all", "base", "new"):  # through load_dataset and its cache: Dassl's draw
        drawn = load_dataset(name, tmp_path, num_shots=16, seed=1, subsample=subsample)
        assert (relative_entries(drawn.train, image_root), relative_entries(drawn.val, image_root)) == coop_draw(
            split, 16, 1, subsample)

    image, label = ImageDataset(every.test[:1])[0]
    assert image.shape == (3, 224, 224) and label == every.test[0].label


# -----------------------------------------------------------------------------
# The papers' few-shot images: data.py draws what Dassl draws
#
# Below, Dassl's procedure written out in our own words (Dassl.pytorch,
# dassl/data/datasets/base_dataset.py: generate_fewshot_dataset with its default repeat=True,
# split_dataset_by_label; CoOp, datasets/oxford_pets.py: the few-shot train list, then the
# validation list with min(K, 4), both after Dassl's set_random_seed, then subsample_classes).
# It draws from the global `random`, as Dassl does; data.py uses its own random.Random(seed).


def dassl_few_shot(entries: list, num_shots: int) -> list:
    groups: dict = {}  # label -> its entries; a dict keeps the order labels first appear in
    for entry in entries:
        groups.setdefault(entry[1], []).append(entry)
    drawn = []
    for group in groups.values():
        drawn += random.sample(group, num_shots) if len(group) >= num_shots else random.choices(group, k=num_shots)
    return drawn


def coop_subsample(lists: list, subsample: str) -> list:
    if subsample == "all":
        return lists
    labels = sorted({entry[1] for entry in lists[0]})
    half = -(-len(labels) // 2)
    kept = labels[:half] if subsample == "base" else labels[half:]
    return [[[entry[0], kept.index(entry[1]), entry[2]] for entry in entries if entry[1] in kept] for entries in lists]


def coop_draw(split: dict, num_shots: int, seed: int, subsample: str = "all") -> tuple:
    """(train, val) of CoOp's few-shot dataset as [relative path, label, name] entries."""
    state = random.getstate()
    try:
        random.seed(seed)  # Dassl's set_random_seed, before the dataset is built
        train = dassl_few_shot(split["train"], num_shots)
        val = dassl_few_shot(split["val"], min(num_shots, 4))
    finally:
        random.setstate(state)
    train, val = coop_subsample([train, val], subsample)
    return [entry[:2] for entry in train], [entry[:2] for entry in val]


def test_dassl_transcription_on_draws_worked_out_by_hand():
    # A class of one image and K = 3: that image three times (repeat=True), whatever the seed.
    assert coop_draw({"train": [["x.jpg", 0, "x"]], "val": []}, 3, 5)[0] == [["x.jpg", 0]] * 3
    # A class of exactly K images gives all of them; classes come in the order their labels
    # first appear in the list (2 before 0), not sorted.
    split = {"train": [["c.jpg", 2, "c"], ["a.jpg", 0, "a"], ["d.jpg", 2, "c"], ["b.jpg", 0, "a"]], "val": []}
    train, _ = coop_draw(split, 2, 1)
    assert [label for _, label in train] == [2, 2, 0, 0]
    assert sorted(train[:2]) == [["c.jpg", 2], ["d.jpg", 2]] and sorted(train[2:]) == [["a.jpg", 0], ["b.jpg", 0]]
    # One class: Dassl's draw is one random.sample(class, K) right after random.seed(seed).
    five = [[f"{i}.jpg", 0, "a"] for i in range(5)]
    six = [[f"v{i}.jpg", 0, "a"] for i in range(6)]
    assert coop_draw({"train": five, "val": []}, 2, 7)[0] == [e[:2] for e in random.Random(7).sample(five, 2)]
    # Validation: min(K, 4) per class, drawn from the same stream after the train list.
    train, val = coop_draw({"train": five, "val": six}, 16, 2)  # five < 16: choices, then val
    stream = random.Random(2)
    assert train == [e[:2] for e in stream.choices(five, k=16)]
    assert val == [e[:2] for e in stream.sample(six, 4)]
    assert val != [e[:2] for e in random.Random(2).sample(six, 4)]  # not a fresh stream for val
    # Base/novel after the draw: base = the first ceil(n/2) sorted labels, relabelled from 0.
    three = {"train": [["p.jpg", 2, "p"], ["q.jpg", 1, "q"], ["r.jpg", 0, "r"]], "val": []}
    assert coop_draw(three, 1, 1, "base")[0] == [["q.jpg", 1], ["r.jpg", 0]]
    assert coop_draw(three, 1, 1, "new")[0] == [["p.jpg", 0]]


def relative_entries(items, image_root) -> list:
    return [[os.path.relpath(item.path, image_root).replace(os.sep, "/"), item.label] for item in items]


@pytest.mark.parametrize("filename", [row[1] for row in REAL_SPLITS], ids=[row[0] for row in REAL_SPLITS])
def test_few_shot_draws_equal_dassls_on_the_real_split_files(filename):
    split = json.loads(gzip.decompress((COOP_SPLITS / f"{filename}.gz").read_bytes()))
    root = "/data"
    full = {name: [data.Item(f"{root}/{entry[0]}", entry[1], data.clean_classname(entry[2])) for entry in entries]
            for name, entries in split.items()}
    classnames = data._classnames_from_items(full["train"] + full["val"] + full["test"], filename)
    for num_shots in (1, 4, 16):
        for seed in (1, 2, 3):
            listing = data.Listing(data.get_spec("dtd"), root, full["train"], full["val"], full["test"],
                                   classnames)
            train, val = data.draw_few_shot(listing, num_shots, seed).values()
            for subsample in ("all", "base", "new"):
                _, (kept_train, kept_val) = data.subsample_classes(classnames, [train, val], subsample)
                expected = coop_draw(split, num_shots, seed, subsample)
                got = relative_entries(kept_train, root), relative_entries(kept_val, root)
                assert got == expected, f"{filename} K={num_shots} seed={seed} {subsample}: not Dassl's draw"


# -----------------------------------------------------------------------------
# Your own data: a folder of class folders, or a split file in CoOp's format


def write_image_folder(folder: Path, counts: dict) -> Path:
    """folder/<class>/<i>.png, counts[class] images each (a colour per class and image)."""
    for label, (classname, n) in enumerate(counts.items()):
        for i in range(n):
            write_image(folder / classname / f"{i}.png", color=(40 * label, 10 * i, 7))
    return folder


def test_image_folder_is_split_50_20_30_per_class_and_written_as_a_coop_split(tmp_path, monkeypatch):
    folder = write_image_folder(tmp_path / "my_things", {"red_ball": 10, "cube": 7, "cone": 4})
    (folder / "cube" / "notes.txt").write_text("not an image")
    (folder / "cube" / "readme.md").write_text("not an image")
    with pytest.warns(DatasetWarning, match=r"my_things: skipped 2 non-image files"):
        spec = splitfiles.own_dataset(str(folder))
    assert (spec.name, spec.template) == ("my_things", "a photo of a {}.")
    assert not (folder / "split_my_things.json").exists()  # checked, not yet written
    result = load_dataset("my_things", None)
    # Sorted folders -> labels; underscores -> spaces; round(50%), round(20%), the rest.
    assert result.classnames == ["cone", "cube", "red ball"]
    assert [labels_of(getattr(result, part)) for part in ("train", "val", "test")] == [
        {0: 2, 1: 4, 2: 5}, {0: 1, 1: 1, 2: 2}, {0: 1, 1: 2, 2: 3}]
    written = json.loads((folder / "split_my_things.json").read_text())
    # CoOp's read_and_split_data (datasets/dtd.py) in our words: per sorted class folder, its
    # images shuffled, then round(50%) train, round(20%) val, the rest test; one fixed seed.
    rng, expected = random.Random(splitfiles.OWN_SPLIT_SEED), {"train": [], "val": [], "test": []}
    for label, name in enumerate(["cone", "cube", "red_ball"]):
        images = sorted(p.name for p in (folder / name).glob("*.png"))
        rng.shuffle(images)
        n_train, n_val = round(len(images) * 0.5), round(len(images) * 0.2)
        entries = [[f"{name}/{image}", label, name] for image in images]
        for part, chosen in zip(expected, (entries[:n_train], entries[n_train:n_train + n_val], entries[n_train + n_val:])):
            expected[part] += chosen
    assert written == expected
    every = {entry[0] for part in written.values() for entry in part}
    assert len(every) == 21 and "cube/notes.txt" not in every

    # The file is the split from now on: an edit is what the next call reads.
    written["test"].append(written["train"].pop(0))
    (folder / "split_my_things.json").write_text(json.dumps(written))
    splitfiles.own_dataset(str(folder))
    edited = load_dataset("my_things", None)
    assert len(edited.train) == 10 and len(edited.test) == 7

    # Few-shot on it: cached in the project's cache; the folder holds the split file alone.
    (folder / "split_my_things.json").unlink()
    with pytest.warns(DatasetWarning, match="skipped 2"):
        splitfiles.own_dataset(str(folder))
    monkeypatch.setenv("CLIP_CACHE_DIR", str(tmp_path / "cache"))
    before = sorted(folder.rglob("*"))
    few = cached_load("my_things", None, num_shots=2, seed=1)
    assert sorted(folder.rglob("*")) == sorted(before + [folder / "split_my_things.json"])
    assert [p.name for p in (tmp_path / "cache" / "fewshot").rglob("*.json")] == ["shot_2-seed_1.json"]
    assert labels_of(few.train) == {0: 2, 1: 2, 2: 2}
    (folder / "split_my_things.json").unlink()
    with pytest.warns(DatasetWarning, match="skipped 2"):
        splitfiles.own_dataset(str(folder))
    assert load_dataset("my_things", None) == result  # the same fixed seed draws the same split


def test_split_file_paths_are_relative_to_its_folder(tmp_path):
    folder = tmp_path / "field_photos"
    split = {"train": [], "val": [], "test": []}
    for label, name in enumerate(["oak_leaf", "pine"]):
        for part in split:
            relative = f"pictures/{name}/{part}.jpg"
            write_image(folder / relative)
            split[part].append([relative, label, name])
    (folder / "labels.json").write_text(json.dumps(split))
    spec = splitfiles.own_dataset(str(folder / "labels.json"))
    result = load_dataset(spec.name, "/nowhere")  # the root is not used for your own data
    assert (result.name, result.classnames) == ("field_photos", ["oak leaf", "pine"])
    assert result.train[0].path == str(folder / "pictures" / "oak_leaf" / "train.jpg")


def test_read_only_data_folder_writes_the_split_to_the_fallback_folder(tmp_path, monkeypatch):
    folder = write_image_folder(tmp_path / "ro_data", {"a": 4, "b": 4})
    fallback = tmp_path / "run" / "ro_data"
    real_write = splitfiles._write_json_atomically

    def read_only(path, header, lists):
        if Path(path).parent == folder:
            raise PermissionError(13, "Permission denied", str(path))
        real_write(path, header, lists)

    monkeypatch.setattr(splitfiles, "_write_json_atomically", read_only)
    splitfiles.own_dataset(str(folder), split_fallback_dir=str(fallback))
    with pytest.warns(DatasetWarning, match=r"split_ro_data\.json: cannot write the split file \(Permission denied\); wrote it to .*run"):
        first = load_dataset("ro_data", None)
    assert (fallback / "split_ro_data.json").is_file() and not (folder / "split_ro_data.json").exists()
    stored = json.loads((fallback / "split_ro_data.json").read_text())
    stored["val"], stored["test"] = stored["test"], stored["val"]  # the fallback copy is the one read
    (fallback / "split_ro_data.json").write_text(json.dumps(stored))
    splitfiles.own_dataset(str(folder), split_fallback_dir=str(fallback))
    assert load_dataset("ro_data", None).val == first.test
    splitfiles.own_dataset(str(folder))  # no fallback: the same split, drawn again, unwritten
    with pytest.warns(DatasetWarning, match="the same split is drawn again on each call"):
        assert load_dataset("ro_data", None) == first


BAD_OWN_DATA = {
    "empty folder": ({}, "0 class folders; expected at least two"),
    "one class": ({"a": 5}, "1 class folder; expected at least two"),
    "class with no image": ({"a": 5, "b": 0}, "class 'b' has 0 images"),
    "class too small": ({"a": 5, "tiny_one": 3}, "class 'tiny one' has 3 images; the 50/20/30"),
    "same class name": ({"big_cat": 5, "big cat": 5}, "'big cat' and 'big_cat' both give the class name 'big cat'"),
    "not an image": ({"a": 5, "b": 5}, "b/fake.jpg: cannot be read as an image"),
}


@pytest.mark.parametrize("case", list(BAD_OWN_DATA))
def test_bad_image_folder_is_a_one_line_error_naming_it_and_writes_nothing(tmp_path, case):
    counts, message = BAD_OWN_DATA[case]
    folder = write_image_folder(tmp_path / "bad", counts)
    folder.mkdir(exist_ok=True)
    if case == "class with no image":
        (folder / "b").mkdir()
        (folder / "b" / "notes.txt").write_text("x")
    if case == "not an image":
        (folder / "b" / "fake.jpg").write_text("this is text")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DatasetWarning)
        with pytest.raises(DatasetError) as error:
            splitfiles.own_dataset(str(folder))
    assert_one_line_naming(error, message)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
    assert "bad" not in data.DATASETS


def test_own_split_file_leaving_its_folder_or_named_like_a_benchmark_is_refused(tmp_path):
    folder = tmp_path / "mine"
    write_image(tmp_path / "outside.jpg")
    entries = [["../outside.jpg", 0, "a"], ["../outside.jpg", 1, "b"]]
    (folder).mkdir()
    (folder / "split.json").write_text(json.dumps({"train": entries[:1], "val": [], "test": entries[1:]}))
    with pytest.raises(DatasetError) as error:
        splitfiles.own_dataset(str(folder / "split.json"))
    assert_one_line_naming(error, "'../outside.jpg' leaves the image folder")
    write_image_folder(tmp_path / "dtd", {"a": 4, "b": 4})
    with pytest.raises(DatasetError) as error:
        splitfiles.own_dataset(str(tmp_path / "dtd"))
    assert_one_line_naming(error, "its name 'dtd' is that of a benchmark; rename the folder")
    with pytest.raises(DatasetError) as error:
        splitfiles.own_dataset(str(tmp_path / "nowhere"))
    assert_one_line_naming(error, "nowhere: not found")


def photo_items(folder: Path, count: int = 6) -> list:
    """JPEG photos of assorted sizes and aspect ratios, textured (a crop of a solid colour would
    hide a misplaced crop)."""
    generator = torch.Generator().manual_seed(0)
    items = []
    for index in range(count):
        width, height = 40 + 9 * index, 70 - 5 * index
        pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
        path = folder / f"photo{index}.jpg"
        Image.fromarray(pixels.numpy()).save(path, quality=90)
        items.append(data.Item(str(path), index % 2, f"class {index % 2}"))
    return items


def test_images_decoded_once_are_the_test_transforms_bit_for_bit_and_augment_as_seeded(tmp_path):
    """DecodedImages without augmentation gives test_transform's tensors exactly (the toy world's
    numbers do not move); with it, random resized crops of the kept picture, seeded per image,
    epoch and seed as ImageDataset's, the same whether 0 or 2 processes decoded; every image in
    one uint8 buffer."""
    items = photo_items(tmp_path)
    plain = data.ImageDataset(items, data.test_transform(32))
    kept = imagecache.DecodedImages(items, 32, augment=False)
    for index in range(len(items)):
        assert torch.equal(kept[index][0], plain[index][0]) and kept[index][1] == items[index].label
    assert kept.buffer.dtype == torch.uint8 and kept.buffer.shape == (len(items) * 3 * 32 * 32,)
    assert kept.image(1).shape == (3, 32, 32)
    augmented = imagecache.DecodedImages(items, 32, augment=True, seed=1)
    kept_images = [augmented.image(index) for index in range(len(items))]
    assert [min(image.shape[1:]) for image in kept_images] == [round(32 * 8 / 7)] * len(items)
    assert augmented.buffer.numel() == sum(image.numel() for image in kept_images)
    first, again, other = augmented[0][0], augmented[0][0], augmented[1][0]
    assert first.shape == (3, 32, 32) and torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(augmented[(0, 0)][0], first) and not torch.equal(augmented[(1, 0)][0], first)
    by_workers = imagecache.DecodedImages(items, 32, augment=True, seed=1, workers=2)
    assert torch.equal(by_workers.buffer, augmented.buffer)
    assert torch.equal(by_workers.shapes, augmented.shapes)
    # copied out of the loading processes' shared memory: thousands would fill /dev/shm
    assert not by_workers.buffer.is_shared()
    # Normalised as CLIP expects: the same statistics as the plain train transform's tensors.
    assert abs(float(augmented[2][0].mean()) - float(data.ImageDataset(
        items, data.train_transform(32), seed=1)[2][0].mean())) < 0.3
