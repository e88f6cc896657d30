"""Tests of train.py: the command line end to end on a tiny world that the tests write.

Each test builds (once per module) a tiny CLIP saved in OpenAI's state-dict format, a tiny BPE
merges file in OpenAI's format, and tiny datasets in CoOp's layout (dtd and ImageNet with one
variant), then runs train.py as a user would: `python train.py ...` in a subprocess where
the command line itself is the point, `train.main([...])` in-process elsewhere (the same code
path, without paying for a fresh Python per call).

    python -m pytest -q tests/test_train.py
"""

import gzip
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import clip_model  # noqa: E402
import dear  # noqa: E402
import train  # noqa: E402
from harness import (analysis, probes, cli, config, devices, monitor, plan,  # noqa: E402
                     reports, runfolder, sources)
from conftest import no_network, perturb_, torchrun  # noqa: E402,F401 -- a fixture


@pytest.fixture(autouse=True)
def registry_as_shipped(monkeypatch):
    """Your own data registers itself in data.DATASETS: each test starts from the shipped registry."""
    monkeypatch.setattr(train.data, "DATASETS", dict(train.data.DATASETS))


DTD_CLASSES = ["banded", "blotchy", "braided", "bubbly", "cracked"]  # 3 base, 2 novel
IMAGENET = [("n01440764", "tench"), ("n01443537", "goldfish"), ("n01484850", "great white shark")]


def merges_for(words):
    """A merges file that spells each word in one token: c1+c2, then +c3, ... (the last merge
    carries the end-of-word mark), as OpenAI's file would for frequent words."""
    merges = []
    for word in words:
        if len(word) < 2:
            continue
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        token = pieces[0]
        for piece in pieces[1:]:
            pair = f"{token} {piece}"
            if pair not in merges:
                merges.append(pair)
            token += piece
    return merges


def write_image(path: Path, colour) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), colour).save(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """{weights, bpe, root}: everything a run needs, made here, nothing downloaded."""
    tmp = tmp_path_factory.mktemp("train_world")
    words = " ".join(["a photo of texture"] + DTD_CLASSES + [n for _, n in IMAGENET]).split()
    merges = merges_for(words)
    bpe = tmp / "bpe_tiny.txt.gz"
    with gzip.open(bpe, "wt", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    torch.manual_seed(0)
    clip = perturb_(clip_model.CLIP(embed_dim=32, image_resolution=32, vision_layers=3, vision_width=64,
                                    vision_patch_size=8, vision_heads=2, context_length=16,
                                    vocab_size=512 + len(merges) + 2, transformer_width=64,
                                    transformer_heads=2, transformer_layers=2))
    weights = tmp / "tiny_clip.pt"
    torch.save(clip.state_dict(), weights)

    root = tmp / "data"
    split = {"train": [], "val": [], "test": []}
    for label, name in enumerate(DTD_CLASSES):  # a colour per class, a little varied per image
        for part, count in (("train", 6), ("val", 4), ("test", 4)):
            for i in range(count):
                relative = f"{name}/{name}_{part}{i}.jpg"
                write_image(root / "dtd" / "images" / relative, (50 * label, 20 * i, 200 - 40 * label))
                split[part].append([relative, label, name])
    (root / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))

    names = "".join(f"{wnid} {name}\n" for wnid, name in IMAGENET)
    for folder in ("imagenet", "imagenet-sketch"):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "classnames.txt").write_text(names)
    for label, (wnid, _) in enumerate(IMAGENET):
        for i in range(4):
            write_image(root / "imagenet" / "images" / "train" / wnid / f"{wnid}_{i}.JPEG", (80 * label, i, 60))
        for i in range(2):
            write_image(root / "imagenet" / "images" / "val" / wnid / f"val_{label}{i}.JPEG", (80 * label, 9, 60))
            write_image(root / "imagenet-sketch" / "images" / wnid / f"sketch_{i}.JPEG", (80 * label, 99, 60))
    return dict(weights=str(weights), bpe=str(bpe), root=str(root))


@pytest.fixture(autouse=True)
def analysis_cache(tmp_path, monkeypatch):
    """Each test gets an empty cache (the head analysis is cached there), never the user's."""
    monkeypatch.setenv("DEAR_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def common(world, output, *extra):
    return ["--root", world["root"], "--weights", world["weights"], "--bpe", world["bpe"],
            "--head-width", "32", "--output", str(output), "--epochs", "2", "--batch-size", "4", "--log-every", "2",
            "--device", "cpu", "--descriptions", "6", *extra]  # 6 picks: the tiny pools have 12 to 18 images


def settings_of(argv):
    """The resolved settings of a command line, as train.main would make them."""
    return config.resolve_settings(cli.build_parser(train.BOOK).parse_args(argv), train.BOOK)


def read(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def learnable(folder):
    return torch.load(Path(folder) / "checkpoint.pt", weights_only=True)["learnable"]


# ------------------------------------------------------------------------------------------
# End to end from the command line
# ------------------------------------------------------------------------------------------


def test_base2novel_from_the_command_line_writes_results_and_a_table_that_matches_them(world, tmp_path):
    out = tmp_path / "run"
    args = common(world, out, "--dataset", "dtd", "--seeds", "1", "2", "--roles", "analyse", "all-mixed",
                  "--shots", "4")  # --fusion: both rules by default
    done = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epoch 2/2: loss" in done.stdout  # a progress line per quarter of a run
    log = (out / "dtd" / "dear" / "seed1" / "log.txt").read_text()
    assert "epoch 2/2 step 2/3 loss" in log and "left" in log  # every line in the run's log

    # One finished run per method x roles x seed (zero-shot once), each with its results.
    folders = ["dtd/zeroshot"] + [f"dtd/{row}/seed{s}" for row in ("dear", "dear-all-mixed") for s in (1, 2)]
    results = {f: read(out / f / "results.json") for f in folders}
    for folder in folders[1:]:
        assert (out / folder / "checkpoint.pt").is_file()
    # One head analysis for both seeds, on the whole training split of the base classes.
    assert done.stdout.count("head analysis: the last") == 1
    for name in ("roles.json", "roles.txt", "roles.png", "masks.png", "analysis.json"):
        assert (out / "dtd" / "roles" / name).is_file(), name
    assert not list((out / "dtd" / "roles").glob("seed*"))
    roles = dear.RoleMap.load(str(out / "dtd" / "roles" / "roles.json"))
    assert (roles.vision_layers, roles.num_heads, roles.layers) == (3, 2, [0, 1, 2])  # 2 heads of 32 channels
    assert roles.source == "concept entropy (labels) on dtd train (base classes), 18 of 18 images, 3 classes"
    record = read(out / "settings.json")["settings"]["role_maps"]["dtd"]
    assert record["pool"] in roles.source and record["images"] == 18 and len(record["fingerprint"]) == 64
    assert record["sha256"] == clip_model._sha256(str(out / "dtd" / "roles" / "roles.json"))

    # The summary equals the mean of the per-run results, and the markdown shows those numbers.
    summary = read(out / "summary.json")
    table = summary["tables"]["dtd"]
    assert table["columns"] == ["Base", "Novel", "HM"]
    # Both rules, from the same trained runs: the fused logits on every test set (the first,
    # the ablation's); the class branch alone on the novel classes (MMRL's rule).
    assert list(table["rows"]) == ["zeroshot", "dear-fused", "dear-class-on-unseen", "dear-all-mixed"]
    for folder in folders[1:]:
        result = results[folder]
        assert result["logits"] == {"base": "fused", "novel": "fused"}
        assert result["logits_by_fusion"]["class-on-unseen"] == {"base": "fused", "novel": "class"}
        accuracy = result["accuracy_by_logits"]
        assert result["metrics"]["novel"] == accuracy["novel"]["fused"]
        assert result["metrics"]["base"] == accuracy["base"]["fused"]
        assert result["metrics_by_fusion"]["class-on-unseen"]["novel"] == accuracy["novel"]["class"]
        assert result["role_map"] == (record if folder.startswith("dtd/dear/") else None)
    for row, job_row, mode in (("dear-fused", "dear", "fused-everywhere"),
                               ("dear-class-on-unseen", "dear", "class-on-unseen"),
                               ("dear-all-mixed", "dear-all-mixed", "fused-everywhere")):
        metrics = [results[f"dtd/{job_row}/seed{s}"]["metrics_by_fusion"][mode] for s in (1, 2)]
        base, novel = sum(m["base"] for m in metrics) / 2, sum(m["novel"] for m in metrics) / 2
        assert table["rows"][row] == [round(base, 2), round(novel, 2), round(reports.harmonic_mean(base, novel), 2)]
    assert table["rows"]["zeroshot"][:2] == [round(results["dtd/zeroshot"]["metrics"][k], 2) for k in ("base", "novel")]
    markdown = (out / "summary.md").read_text()
    for row, values in table["rows"].items():  # each cell: mean, then "± spread" when seeds differ
        line = next(l for l in markdown.splitlines() if l.startswith(f"| {plan.row_label(row)} |"))
        cells = [x for v, d in zip(values, table["spread"][row]) for x in ([v, d] if d else [v])]
        assert [float(v) for v in re.findall(r"\d+\.\d\d", line)] == cells
    # The spread is the standard deviation of the two seeds' base accuracies.
    bases = [results[f"dtd/dear/seed{s}"]["metrics"]["base"] for s in (1, 2)]
    assert table["spread"]["dear-fused"][0] == round(abs(bases[0] - bases[1]) / 2 ** 0.5, 2)
    assert "- DeAR, fused on every test set: base fused, novel fused" in markdown
    assert "- DeAR, class branch alone on unseen classes: base fused, novel class branch alone" in markdown
    assert read(out / "settings.json")["settings"]["epochs"] == 2


def test_linear_probe_fits_the_training_classes_and_scores_only_sets_with_those_classes(monkeypatch):
    """Features stand in for CLIP's: three classes that only a *trained* linear map separates
    (their means differ in one coordinate, and a larger coordinate is noise common to all)."""
    generator = torch.Generator().manual_seed(0)
    classes = ["a", "b", "c"]

    def items(count, offset=0):
        return [(f"{offset + i}.png", i % 3) for i in range(count)]

    def fake_features(clip, listed, settings, runtime):
        labels = torch.tensor([label for _, label in listed])
        x = torch.randn(len(listed), 8, generator=generator) * 0.05
        x[:, 0] = labels.float() * 0.3  # the class, in one coordinate
        x[:, 1] = torch.randn(len(listed), generator=generator) * 3  # a large nuisance
        return x, labels

    monkeypatch.setattr(probes, "image_features", fake_features)
    split = train.data.DatasetSplits("x", "", items(30), items(12, 100), items(30, 200), classes, "{}")
    same = train.EvalSet("base", items(60, 300), classes, "{}", True)
    other = train.EvalSet("novel", items(60, 400), ["d", "e", "f"], "{}", False)
    runtime = type("R", (), {"log": staticmethod(lambda line: None)})()
    metrics = probes.linear_probe(None, split, [same, other], {}, runtime)
    assert list(metrics) == ["base"]  # no classifier for unseen classes: no novel number
    assert metrics["base"] > 95.0


# ------------------------------------------------------------------------------------------
# Checkpoints: resume, determinism, eval-only
# ------------------------------------------------------------------------------------------


def test_resume_after_a_stop_equals_an_unbroken_run_and_eval_only_reproduces_it(world, tmp_path):
    run = ["--dataset", "dtd", "--seeds", "3", "--method", "dear", "--roles", "all-mixed", "--shots", "4",
           "--epochs", "3"]
    unbroken, again, broken = tmp_path / "unbroken", tmp_path / "again", tmp_path / "broken"
    assert train.main(common(world, unbroken, *run)) == 0
    assert train.main(common(world, again, *run)) == 0
    assert train.main(common(world, broken, *run, "--max-epochs-per-call", "1")) == 0

    leaf = "dtd/dear-all-mixed/seed3"
    stopped = torch.load(broken / leaf / "checkpoint.pt", weights_only=True)
    assert stopped["epoch"] == 1 and not (broken / leaf / "results.json").exists()
    assert not (broken / "summary.md").exists()  # an unfinished call is not presented as done
    assert train.main(["--output", str(broken), "--resume"]) == 0

    reference = learnable(unbroken / leaf)
    for other in (again, broken):  # same seed, same tensors; a resumed run, the same again
        state = learnable(other / leaf)
        for name, tensor in reference.items():
            assert torch.equal(state[name], tensor), f"{other.name}: {name} differs"
        assert read(other / leaf / "results.json")["metrics"] == read(unbroken / leaf / "results.json")["metrics"]
    assert read(broken / "summary.json") == read(unbroken / "summary.json")

    before = read(unbroken / leaf / "results.json")["metrics"]
    (unbroken / leaf / "results.json").unlink()
    assert train.main(["--output", str(unbroken), "--eval-only"]) == 0
    assert read(unbroken / leaf / "results.json")["metrics"] == before


def test_resume_refuses_a_flag_that_would_change_the_run(world, tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(common(world, out, "--dataset", "dtd", "--seeds", "1", "--method", "zeroshot")) == 0
    capsys.readouterr()
    assert train.main(["--output", str(out), "--resume", "--epochs", "7"]) == 2
    assert "--epochs cannot change in a saved run" in capsys.readouterr().err
    assert train.main(common(world, out, "--dataset", "dtd")) == 2  # a second fresh run in one folder
    assert "already holds a run" in capsys.readouterr().err


def dassl_learning_rates(lr, epochs, warmup, warmup_lr):
    """Dassl's schedule as Dassl builds it (KaiyangZhou/Dassl.pytorch, dassl/optim/lr_scheduler.py,
    written again here): torch's CosineAnnealingLR(T_max = epochs), wrapped for `warmup` > 0 in
    a constant warm-up that hands over to it, WARMUP_RECOUNT = True (Dassl's default: the cosine
    is left unstepped during the warm-up). Stepped once per epoch, as Dassl's trainer does; ->
    the lr each epoch ran at."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, float(epochs))

    class ConstantWarmup(torch.optim.lr_scheduler.LRScheduler):
        def __init__(self):
            self.successor, self.warmup_epoch = cosine, warmup
            super().__init__(optimizer)

        def get_lr(self):
            if self.last_epoch >= self.warmup_epoch:
                return self.successor.get_last_lr()
            return [warmup_lr for _ in self.base_lrs]

        def step(self, epoch=None):
            if self.last_epoch >= self.warmup_epoch:
                self.successor.step()
                self._last_lr = self.successor.get_last_lr()
            else:
                super().step()

    scheduler = ConstantWarmup() if warmup > 0 else cosine
    rates = []
    for _ in range(epochs):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("lr, epochs, warmup", [(1e-3, 10, 1), (2e-3, 100, 1), (1e-3, 1, 0), (1e-3, 5, 0),
                                                (5e-3, 20, 1), (1e-3, 6, 2)])
def test_learning_rate_is_dassls_warmup_then_cosine_recounted_after_it(lr, epochs, warmup):
    settings = dict(warmup_epochs=warmup, warmup_lr=1e-5, lr=lr, epochs=epochs)
    ours = [train.learning_rate(settings, e) for e in range(epochs)]
    assert ours == pytest.approx(dassl_learning_rates(lr, epochs, warmup, 1e-5), rel=1e-9, abs=1e-15)
    if warmup:  # the epoch boundaries: the warm-up's last epoch, then the full lr (the recount)
        assert ours[warmup - 1] == 1e-5 and ours[warmup] == pytest.approx(lr)


# ------------------------------------------------------------------------------------------
# The other protocols
# ------------------------------------------------------------------------------------------


def counting_readings(monkeypatch) -> list:
    """data.py's readers, each reading recorded by the dataset's name: the list it appends to."""
    readings = []

    def counted(reader):
        return lambda spec, dataset_dir: readings.append(spec.name) or reader(spec, dataset_dir)

    for name, reader in list(train.data.READERS.items()):
        monkeypatch.setitem(train.data.READERS, name, counted(reader))
    return readings


def test_fewshot_cross_and_dg_write_the_paper_shaped_tables(world, tmp_path, monkeypatch, capsys):
    fast = ["--seeds", "1", "--roles", "all-generalization", "--epochs", "1"]
    out, readings = tmp_path / "fewshot", counting_readings(monkeypatch)
    assert train.main(common(world, out, "--protocol", "fewshot", "--dataset", "dtd", "--shots", "1", "2", *fast)) == 0
    assert readings == ["dtd"]  # one reading serves the test set and both draws
    assert capsys.readouterr().out.count("fingerprinted for the few-shot cache") == 1
    table = read(out / "summary.json")["tables"]["dtd"]
    assert table["columns"] == ["1 shot", "2 shots"]
    assert table["rows"]["zeroshot"][0] == table["rows"]["zeroshot"][1]  # zero-shot does not use shots
    for shots, value in zip((1, 2), table["rows"]["dear-all-generalization"]):
        result = read(out / f"dtd/dear-all-generalization/shots{shots}-seed1/results.json")
        assert value == round(result["metrics"]["all"], 2)
        assert result["logits"] == {"all": "fused"}  # the trained classes: fused

    # Cross-dataset and domain generalization: one training on ImageNet, tested on an ordinary
    # dataset and on a variant, one table each (both from the same trained run).
    fast += ["--shots", "4"]
    for protocol in ("cross", "dg"):
        out = tmp_path / protocol
        readings.clear()
        assert train.main(common(world, out, "--protocol", protocol, "--dataset", "dtd", "imagenet_sketch",
                                 *fast)) == 0
        assert sorted(readings) == ["dtd", "imagenet", "imagenet_sketch"]  # each dataset once
        assert [p.parent.name for p in out.rglob("checkpoint.pt")] == ["seed1"]  # trained once
        (cross_title, cross), (dg_title, dg) = read(out / "summary.json")["tables"].items()
        assert cross_title.startswith("Cross-dataset") and cross["columns"] == ["imagenet (source)", "dtd", "Average"]
        assert dg_title.startswith("Domain generalization")
        assert dg["columns"] == ["ImageNet (source)", "-Sketch", "Average"]
        result = read(out / "imagenet/dear-all-generalization/seed1/results.json")
        assert set(result["metrics"]) == {"imagenet", "dtd", "imagenet_sketch"}
        row = "dear-all-generalization"
        assert cross["rows"][row] == [round(result["metrics"][k], 2) for k in ("imagenet", "dtd", "dtd")]
        assert dg["rows"][row] == [round(result["metrics"][k], 2) for k in ("imagenet",) + ("imagenet_sketch",) * 2]
        assert result["logits"] == {"imagenet": "fused", "dtd": "fused", "imagenet_sketch": "fused"}
        assert result["logits_by_fusion"]["class-on-unseen"] == {"imagenet": "fused", "dtd": "class",
                                                                 "imagenet_sketch": "class"}
        assert "| CLIP (zero-shot) |" in (out / "summary.md").read_text()
    # 'all' is the ten other datasets and the four variants, under either protocol's name.
    for protocol in ("cross", "dg"):
        names = config.dataset_names(["all"], protocol, None, train.BOOK)
        assert len(names) == 14 and "imagenet" not in names and set(train.DG_TARGETS) <= set(names)


# ------------------------------------------------------------------------------------------
# The paper's ablations (--ablations), each a row of its own; MMRL++'s test-time beta
# ------------------------------------------------------------------------------------------


def hand_made_roles(folder: Path) -> str:
    """A roles file for the tiny CLIP (3 layers x 2 heads): every role, a colour head in layer 3."""
    heads = [dear.HeadRole(0, 0, "mixed"), dear.HeadRole(0, 1, "generalization"),
             dear.HeadRole(1, 0, "mixed"), dear.HeadRole(1, 1, "generalization"),
             dear.HeadRole(2, 0, "attribute", "colour"), dear.HeadRole(2, 1, "generalization")]
    path = folder / "roles.json"
    dear.RoleMap(3, 2, list(dear.CORE_ATTRIBUTES), heads).save(str(path))
    return str(path)


def test_each_ablation_is_a_dear_run_with_one_change_and_a_row_of_its_own(world, tmp_path, capsys,
                                                                           monkeypatch):
    models, losses, rows = {}, [], []  # row -> its DeAR; (row, lambda_fusion, branch_ce) per step
    real_build, real_loss, real_train = train.build_dear, dear.dear_loss, train.train_job

    def build(settings, inputs, change):
        models[rows[-1]] = real_build(settings, inputs, change)
        return models[rows[-1]]

    def loss(output, labels, lambda_reg, lambda_fusion, branch_ce=False):
        losses.append((rows[-1], lambda_reg == 0, lambda_fusion, branch_ce))
        return real_loss(output, labels, lambda_reg, lambda_fusion, branch_ce)

    def train_job(job, *rest):
        rows.append(job.row)
        return real_train(job, *rest)

    monkeypatch.setattr(train, "build_dear", build)
    monkeypatch.setattr(dear, "dear_loss", loss)
    monkeypatch.setattr(train, "train_job", train_job)
    out = tmp_path / "run"
    assert train.main(common(world, out, "--dataset", "dtd", "--seeds", "1", "--shots", "4",
                             "--epochs", "1", "--roles", hand_made_roles(tmp_path),
                             "--ablations", "all")) == 0
    # all: every ablation but the toy world's true-heads
    every = [name for name in dear.ABLATIONS if name != "true-heads"]
    assert read(out / "settings.json")["settings"]["ablations"] == every
    summary = read(out / "summary.json")
    assert list(summary["tables"]["dtd"]["rows"]) == [
        "zeroshot", "dear-fused", "dear-class-on-unseen", "dear-all-mixed",
        "dear-no-attribute-tokens", "dear-no-fusion-reg", "dear-mask-generalization-only",
        "dear-branch-ce", "dear-shuffled-heads", "dear-whole-layers", "dear-fixed-fusion",
        "dear-feature-fusion", "dear-no-self-reg"]
    # One change each: the model (the roles, the tokens) or the loss, nothing else.
    roles_of = {row: [(h.role, h.attribute) for h in model.role_map.heads]
                for row, model in models.items()}
    colour_head = ("attribute", "colour")
    assert colour_head in roles_of["dear"]
    assert roles_of["dear-branch-ce"] == roles_of["dear-no-fusion-reg"] == roles_of["dear"]
    assert roles_of["dear-mask-generalization-only"] == [("mixed", None) if r == colour_head else r
                                                        for r in roles_of["dear"]]
    assert set(roles_of["dear-all-mixed"]) == {("mixed", None)}
    assert models["dear"].attributes == list(dear.CORE_ATTRIBUTES)
    assert models["dear-no-attribute-tokens"].attributes == []
    paper = {(False, 0.1, False)}  # L_reg, lambda_fusion, no per-branch CE: the paper's loss
    assert {row: {(z, f, b) for r, z, f, b in losses if r == row} for row in rows} == {
        "dear": paper, "dear-all-mixed": paper, "dear-no-attribute-tokens": paper,
        "dear-mask-generalization-only": paper, "dear-no-fusion-reg": {(False, 0.0, False)},
        "dear-branch-ce": {(False, 0.1, True)}, "dear-shuffled-heads": paper,
        "dear-whole-layers": paper, "dear-fixed-fusion": paper, "dear-feature-fusion": paper,
        "dear-no-self-reg": {(True, 0.1, False)}}
    assert models["dear-feature-fusion"].fuse == "features" and models["dear"].fuse == "logits"
    assert "fusion_logits" not in models["dear-fixed-fusion"].learnable_tensors()
    # Each run's settings name its ablation; every DeAR run reports its learned fusion weights.
    markdown = (out / "summary.md").read_text()
    assert "## Learned fusion weights alpha (mean ± sd over seeds)" in markdown
    for row, model in models.items():
        folder = out / "dtd" / row / "seed1"
        ablation = {"dear": None, "dear-all-mixed": "no-role-mask"}.get(row, row[len("dear-"):])
        checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)
        assert checkpoint["settings"]["job"]["ablation"] == ablation
        result = read(folder / "results.json")
        assert result["job"]["ablation"] == ablation
        alpha = model.fusion_weights().tolist()
        assert result["alpha"] == dict(zip(["class"] + model.attributes, alpha))
        assert sum(alpha) == pytest.approx(1)
        assert summary["alpha"]["dtd"][row]["class"] == [round(alpha[0], 3), 0.0]
        absent = 1 + len(dear.CORE_ATTRIBUTES) - len(alpha)
        cells = [f"{a:.2f} ± 0.00" for a in alpha] + ["-"] * absent
        assert f"| {plan.row_label(row)} | {' | '.join(cells)} |" in markdown
    assert read(out / "dtd/dear-no-attribute-tokens/seed1/results.json")["alpha"] == {"class": 1.0}
    assert learnable(out / "dtd/dear-no-attribute-tokens/seed1")["vision_tokens"].shape[1] == 0
    # --resume refuses another list of ablations, and a checkpoint of another ablation.
    import shutil

    refused(["--output", out, "--resume", "--ablations", "branch-ce"], capsys,
            "--ablations cannot change")
    (out / "dtd/dear-no-fusion-reg/seed1/results.json").unlink()
    shutil.copy(out / "dtd/dear-branch-ce/seed1/checkpoint.pt",
                out / "dtd/dear-no-fusion-reg/seed1/checkpoint.pt")
    refused(["--output", out, "--resume"], capsys, "made with other settings than this run's")


def test_no_role_mask_is_the_row_of_all_heads_mixed_made_once():
    for roles in (["analyse"], ["analyse", "all-mixed"]):
        settings = dict(method=["dear"], roles=roles, ablations=["no-role-mask", "no-fusion-reg"],
                        protocol="base2novel", source=None, dataset=["dtd"], shots=[16], seeds=[1],
                        output="o")
        assert [(j.row, j.roles, j.ablation) for j in plan.plan_jobs(settings)] == [
            ("dear", "analyse", None), ("dear-all-mixed", "all-mixed", "no-role-mask"),
            ("dear-no-fusion-reg", "analyse", "no-fusion-reg")]


@pytest.mark.parametrize("flags, message", [
    (["--method", "zeroshot", "--ablations", "branch-ce"],
     "--ablations branch-ce: each is a DeAR row; add dear to --method"),
    (["--roles", "all-mixed", "--ablations", "no-role-mask", "no-fusion-reg"],
     "--ablations no-fusion-reg: it changes the DeAR row, which --roles all-mixed does not make"),
    (["--ablations", "no-mask"], "argument --ablations: invalid choice: 'no-mask'"),
    (["--test-beta", "trained"], "--test-beta is for --protocol cross or dg; base2novel tests"),
    (["--protocol", "cross", "--test-beta", "target"], "argument --test-beta: invalid choice"),
])
def test_an_ablation_or_test_beta_that_cannot_apply_is_refused_before_any_folder(
        world, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    argv = common(world, out, "--dataset", "dtd", "--seeds", "1", *flags)
    if "invalid choice" not in message:
        refused(argv, capsys, message, out)
        return
    with pytest.raises(SystemExit) as stop:  # argparse's own refusal: one line too, exit status 2
        train.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and message in lines[0] and not out.exists()


@pytest.mark.parametrize("test_beta", ["per-target", "trained"])
def test_cross_and_dg_test_each_target_at_mmrlpps_beta_or_all_at_the_trained_one(
        world, tmp_path, monkeypatch, test_beta):
    seen = []  # (test set, DeAR's beta while it was scored); then the retrieval check's
    real_evaluate, real_retrieval = train.evaluate, probes.retrieval_check

    def evaluate(model, clip, tokenizer, eval_set, settings, runtime, beta=None):
        assert model is None or model.beta == 0.2  # built at the training beta, never reassigned
        seen.append((eval_set.name, beta))
        return real_evaluate(model, clip, tokenizer, eval_set, settings, runtime, beta)

    def retrieval(model, *rest):
        seen.append(("retrieval", model.beta))
        return real_retrieval(model, *rest)

    monkeypatch.setattr(train, "evaluate", evaluate)
    monkeypatch.setattr(probes, "retrieval_check", retrieval)
    out = tmp_path / test_beta
    assert train.main(common(world, out, "--protocol", "dg", "--dataset", "dtd", "imagenet_sketch",
                             "--seeds", "1", "--shots", "2", "--epochs", "1", "--roles",
                             "all-mixed", "--beta", "0.2", "--test-beta", test_beta)) == 0
    # Trained at 0.2 on ImageNet: its own test set at 0.2, each target at MMRL++'s beta for it.
    expected = dict(imagenet=0.2, dtd=0.5, imagenet_sketch=0.7)
    if test_beta == "trained":
        expected = dict.fromkeys(expected, 0.2)
    assert seen == [("imagenet", None), ("dtd", None), ("imagenet_sketch", None),  # zero-shot
                    *expected.items(), ("retrieval", 0.2)]  # then the training beta again
    assert read(out / "imagenet/dear-all-mixed/seed1/results.json")["test_beta"] == expected
    assert read(out / "summary.json")["test_beta"] == expected
    rule = {"per-target": "MMRL++'s per target (trainers/config.py, task CD;",
            "trained": "the training beta on every target"}[test_beta]
    betas = ", ".join(f"{name} {beta:g}" for name, beta in expected.items())
    assert f"- DeAR's beta at test time, {rule}" in (out / "summary.md").read_text()
    assert f": {betas}\n" in (out / "summary.md").read_text()


# ------------------------------------------------------------------------------------------
# Task-adaptive fusion at the evaluate() level; the head analysis's images
# ------------------------------------------------------------------------------------------


def test_evaluate_scores_the_fused_and_the_class_branch_logits_and_each_set_gets_its_own(world):
    import data

    clip, _ = clip_model.load(world["weights"], head_width=32)
    tokenizer = clip_model.SimpleTokenizer(world["bpe"])
    roles = dear.RoleMap.uniform("mixed", 3, 2, range(3), list(dear.CORE_ATTRIBUTES))
    torch.manual_seed(0)
    model = dear.DeAR(clip, roles, first_layer=2, beta=0.3).eval()
    with torch.no_grad():  # attribute branches decisive (alpha_cls ~ 0) and unlike the class branch
        model.tokens.attribute_proj.normal_(0, 1.0)
        model.tokens.vision_tokens.normal_(0, 1.0)
        model.fusion_logits.copy_(torch.tensor([-20.0, 1.0, 2.0, 3.0, 4.0, 5.0]))
    settings, runtime = dict(eval_batch_size=3, workers=0), devices.Runtime(torch.device("cpu"))
    sets = {}
    for name, subsample, trained in (("base", "base", True), ("novel", "new", False)):
        d = data.load_dataset("dtd", world["root"], num_shots=None, subsample=subsample)
        sets[name] = train.EvalSet(name, d.test, d.classnames, d.template, trained)
    differs = False
    for name, eval_set in sets.items():
        accuracy = train.evaluate(model, clip, tokenizer, eval_set, settings, runtime)
        # By hand: every test image through DeAR's forward, both kinds of logits.
        ids = tokenizer.tokenize([eval_set.template.format(c) for c in eval_set.classnames], clip.context_length)
        transform = data.test_transform(clip.visual.input_resolution)
        dataset = data.ImageDataset(eval_set.items, transform)
        images = torch.stack([dataset[i][0] for i in range(len(dataset))])
        labels = torch.tensor([item.label for item in eval_set.items])
        with torch.no_grad():
            out = model(images, model.prepare_classes(ids))
        fused = 100.0 * (out.logits.argmax(-1) == labels).float().mean().item()
        alone = 100.0 * (out.branch_logits[:, 0].argmax(-1) == labels).float().mean().item()
        assert accuracy == pytest.approx({"fused": fused, "class": alone}), name
        differs |= (out.logits.argmax(-1) != out.branch_logits[:, 0].argmax(-1)).any().item()
        # The documented rule: fused on the trained classes, the class branch alone elsewhere.
        assert dear.scoring_logits("class-on-unseen", eval_set.trained) == ("fused" if name == "base" else "class")
        assert dear.scoring_logits("fused-everywhere", eval_set.trained) == "fused"
    assert differs, "the two kinds of logits agree on every image: the test could not tell them apart"


def plain_analysis_images(items, cap: int, seed: int) -> list:
    """dear.analysis_images as it was before: every class's whole seeded order built, then one
    image per class in turn, round by round (the fast one only builds the rounds it needs)."""
    generator, by_class = torch.Generator().manual_seed(seed), {}
    for item in items:
        by_class.setdefault(item.label, []).append(item)
    queues = [[group[i] for i in torch.randperm(len(group), generator=generator).tolist()]
              for _, group in sorted(by_class.items())]
    queues = [queues[i] for i in torch.randperm(len(queues), generator=generator).tolist()]
    depths = range(max(map(len, queues), default=0))
    return [queue[depth] for depth in depths for queue in queues if depth < len(queue)][:cap]


def test_the_analysis_images_are_the_plain_round_robins_at_every_cap():
    sizes = [1, 7, 3, 12, 2, 5]  # uneven classes: some run out in the early rounds
    items = [train.data.Item(f"c{label}/{i}.jpg", label, f"c{label}") for label, n in enumerate(sizes)
             for i in range(n)]
    random.Random(0).shuffle(items)  # the classes' images interleaved, labels out of order
    for cap in (0, 1, 4, 6, 7, 11, 12, 13, 16, 20, 29, 30, 100):
        for seed in (0, 3):
            assert dear.analysis_images(items, cap, seed) == plain_analysis_images(items, cap, seed), (cap, seed)


def test_the_analysis_images_cover_every_class_evenly_and_follow_the_seed():
    items = [train.data.Item(f"c{label}/{i}.jpg", label, f"c{label}") for label in range(10) for i in range(8)]
    chosen = dear.analysis_images(items, 25, seed=1)
    per_class = [sum(item.label == c for item in chosen) for c in range(10)]
    assert len(chosen) == 25 and max(per_class) - min(per_class) <= 1 and min(per_class) == 2
    assert len({item.path for item in chosen}) == 25
    assert dear.analysis_images(items, 25, seed=1) == chosen  # seeded
    assert dear.analysis_images(items, 25, seed=2) != chosen  # ... by the run's seed
    few = dear.analysis_images(items, 4, seed=1)
    assert len({item.label for item in few}) == 4  # a cap below the class count: one per class
    assert sorted(dear.analysis_images(items, 500, seed=3), key=lambda i: i.path) == sorted(items, key=lambda i: i.path)


# ------------------------------------------------------------------------------------------
# The head analysis: once per model and image pool, cached, reused, copied into each run
# ------------------------------------------------------------------------------------------


def test_one_cached_head_analysis_serves_every_protocol_that_asks_for_the_same_pool(world, tmp_path, capsys,
                                                                                    analysis_cache):
    pool = ["--analysis-pool", "imagenet:test", "--method", "dear", "--roles", "analyse", "--seeds", "1",
            "--epochs", "1", "--shots", "2"]
    first = tmp_path / "first"
    assert train.main(common(world, first, "--dataset", "dtd", *pool)) == 0
    out = capsys.readouterr().out
    assert out.count("head analysis: the last") == 1 and "reusing" not in out
    entries = [p for p in (analysis_cache / "head-analysis").iterdir() if p.is_dir()]
    assert len(entries) == 1 and (entries[0] / "roles.png").is_file()
    record = read(first / "settings.json")["settings"]["role_maps"]["dtd"]
    assert record["pool"] == "imagenet test, 6 of 6 images, 3 classes" and record["cache"] == str(entries[0])
    assert read(first / "dtd/dear/seed1/results.json")["role_map"] == record

    # Another protocol, dataset, seed and shot count, the same model and pool: reused, in one line.
    second = tmp_path / "second"
    assert train.main(common(world, second, "--dataset", "dtd", "--protocol", "cross", *pool[:-4],
                             "--seeds", "2", "--epochs", "1", "--shots", "4")) == 0
    out = capsys.readouterr().out
    assert out.count(f"head analysis: reusing the role map cached in {entries[0]}") == 1
    assert "concept entropy" not in out
    assert read(second / "settings.json")["settings"]["role_maps"]["imagenet"]["fingerprint"] == record["fingerprint"]
    assert (second / "imagenet/roles/roles.json").read_bytes() == (first / "dtd/roles/roles.json").read_bytes()

    # The pool is fingerprinted by its images' names and sizes: a changed image is a new pool.
    image = next(Path(world["root"], "imagenet/images/val").rglob("*.JPEG"))
    original = image.read_bytes()
    try:
        image.write_bytes(original + b"\0")
        assert train.main(common(world, tmp_path / "third", "--dataset", "dtd", *pool)) == 0
        assert capsys.readouterr().out.count("head analysis: the last") == 1
    finally:
        image.write_bytes(original)
    assert len([p for p in (analysis_cache / "head-analysis").iterdir() if p.is_dir()]) == 2

    # --resume and --eval-only read the run folder's copy, never the cache; a changed copy is refused.
    import shutil

    shutil.rmtree(analysis_cache / "head-analysis")
    (first / "dtd/dear/seed1/results.json").unlink()
    assert train.main(["--output", str(first), "--eval-only"]) == 0
    assert not (analysis_cache / "head-analysis").exists()
    roles = first / "dtd/roles/roles.json"
    roles.write_text(roles.read_text() + " ")  # any change to the copy
    refused(["--output", first, "--eval-only"], capsys, "roles.json: missing or not the role map this run was made")


def test_analyse_only_writes_the_roles_and_pictures_then_stops_and_training_reuses_them(world, tmp_path, capsys):
    out = tmp_path / "roles-first"
    assert train.main(common(world, out, "--dataset", "dtd", "--analyse-only")) == 0
    for name in ("roles.json", "roles.txt", "roles.png", "masks.png", "analysis.json"):
        assert (out / "dtd/roles" / name).is_file(), name
    assert not (out / "settings.json").exists() and not (out / "dtd/zeroshot").exists()  # nothing trained
    assert "head analysis: done in" in capsys.readouterr().out
    assert train.main(common(world, out, "--dataset", "dtd", "--seeds", "1", "--epochs", "1", "--shots", "2",
                             "--method", "dear")) == 0
    assert "head analysis: reusing the role map" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--descriptions", "100000"], "--descriptions 100000: TextSpan can make 1..32 picks per head here"),
    (["--descriptions", "7", "--analysis-pool", "imagenet:test"],
     "--descriptions 7: TextSpan can make 1..6 picks per head here (the span of 6 images' contributions"),
    (["--descriptions", "7", "--analysis-images", "5"], "--descriptions 7: TextSpan can make 1..5 picks"),
    (["--analysis-pool", "imagenet:val", "--analysis-images", "1", "--descriptions", "1"],
     "the head analysis has 1 image(s)"),
    (["--analysis-pool", "imagenet_sketch:train"], "imagenet_sketch is a test set only; use imagenet_sketch:test"),
    (["--analysis-pool", "imagenet"], "expected 'train' or DATASET:SPLIT"),
    (["--analysis-pool", "imagenett:test"], "--analysis-pool imagenett: not a dataset name; did you mean imagenet?"),
    (["--dataset", "dtd", "imagenet", "--protocol", "cross"], "--dataset imagenet: it is the --source"),
])
def test_an_analysis_its_images_cannot_support_is_refused_before_any_work(world, tmp_path, capsys,
                                                                           analysis_cache, flags, message):
    out = tmp_path / "run"
    refused(common(world, out, "--dataset", "dtd", "--seeds", "1", "--shots", "4", *flags), capsys, message, out)
    assert not analysis_cache.exists()


def test_descriptions_past_the_bank_or_the_image_cap_stop_before_the_model_is_read(world, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setattr(sources, "open_inputs", lambda *args: pytest.fail("work began before the check"))
    out = tmp_path / "run"
    for flags, message in ((["--descriptions", "100000"], "TextSpan keeps 32 singular directions"),
                           (["--descriptions", "30", "--analysis-images", "29"], "the span of 29 images'")):
        refused(common(world, out, "--dataset", "dtd", *flags), capsys, message, out)


def test_a_run_folder_of_an_earlier_format_is_refused_in_one_line(stopped_run, tmp_path, capsys):
    out, _ = copy_run(stopped_run, tmp_path)
    saved = read(out / "settings.json")
    assert saved["format"] == config.RUN_FORMAT
    del saved["format"]  # as every folder before this version
    (out / "settings.json").write_text(json.dumps(saved))
    for flag in ("--resume", "--eval-only"):
        line = refused(["--output", out, flag], capsys, "settings.json: a run folder of an earlier train.py (format 1")
        assert "start a new run" in line


# ------------------------------------------------------------------------------------------
# Several processes: torchrun with gloo on CPU
# ------------------------------------------------------------------------------------------


def test_torchrun_with_two_processes_trains_and_writes_one_result(world, tmp_path):
    out = tmp_path / "ddp"
    args = common(world, out, "--dataset", "dtd", "--seeds", "1", "--method", "dear", "--roles", "analyse",
                  "--shots", "4")
    done = torchrun("train.py", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("train.py: done") == 1  # rank 0 alone prints
    assert "x 2 processes" in done.stdout
    result = read(out / "dtd/dear/seed1/results.json")
    assert set(result["metrics"]) == {"base", "novel", "hm"}
    assert (out / "summary.md").is_file() and (out / "dtd" / "roles" / "roles.json").is_file()
    assert not list(out.rglob(".tmp-*"))  # no half-written file left behind


def test_torchrun_processes_stop_a_run_together_when_one_has_a_nan(world, tmp_path):
    """Two processes (gloo), a NaN loss on rank 1 alone: the guard's state is reduced over the
    processes at each read, so both stop seed 1 at the same step, one line says so, and both go
    on to seed 2 (no collective left waiting for a process that stopped). fp16 (simulated on the
    CPU): the other process sees only DDP's averaged gradients, non-finite, which its loss scaler
    would skip (benchmarks/nan_on_rank.py)."""
    out = tmp_path / "ddp"
    args = common(world, out, "--dataset", "dtd", "--seeds", "1", "2", "--method", "dear",
                  "--roles", "all-mixed", "--shots", "4", "--augment", "off",
                  "--batch-size", "2")  # 12 images: 3 steps per process and epoch
    done = torchrun("benchmarks/nan_on_rank.py", *args)
    assert done.returncode == 1, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("train.py: [")]
    assert len(said) == 1 and said[0].startswith(
        "train.py: [dtd / dear-all-mixed / seed 1] diverged at epoch 1, step 2: loss (total) not "
        "finite (fp16, "), done.stdout
    assert done.stderr.count("train.py: 1 of 2 runs diverged (above)") == 1, done.stderr[-3000:]
    assert (out / "dtd/dear-all-mixed/seed2/results.json").is_file()
    assert not (out / "dtd/dear-all-mixed/seed1/results.json").exists()


# ------------------------------------------------------------------------------------------
# Bad input: one line on stderr, exit status 2, no run folder
# ------------------------------------------------------------------------------------------


def wrong_roles_file(tmp_path):
    """A role file for another architecture: 12 layers x 12 heads (ViT-B/16)."""
    role_map = dear.RoleMap.uniform("mixed", 12, 12, range(8, 12), list(dear.CORE_ATTRIBUTES))
    path = tmp_path / "vit_b16_roles.json"
    role_map.save(str(path))
    return str(path)


@pytest.mark.parametrize("case, message", [
    ("unknown dataset", "--dataset oxford_pet: not a dataset name, nor a folder or split file of your own; "
                        "did you mean oxford_pets?"),
    ("missing root", "nowhere: no such folder; --dataset dtd is read from it: set DATA"),
    ("missing weights", "neither a model name"),
    ("roles for another model", "made for a vision tower of 12 layers, this model has 3"),
    ("unknown flag value", "argument --protocol: invalid choice: 'base2new'"),
    ("no cuda", "this machine has no CUDA device"),
    ("two role sources", "give at most one of 'analyse' or a roles file"),
    ("inverted thresholds", "low_bits=3 is above high_bits=1"),
    ("old fusion name", "argument --fusion: 'adaptive' is an old name: use class-on-unseen"),
    ("descriptions past the span", "--descriptions 100000: TextSpan can make 1..32 picks per head here"),
])
def test_bad_input_ends_in_one_line_and_exit_status_2_without_a_run_folder(world, tmp_path, case, message):
    if case == "no cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "run"
    args = common(world, out, "--dataset", "dtd", "--seeds", "1", "--shots", "4")
    change = {
        "unknown dataset": ["--dataset", "oxford_pet"],
        "missing root": ["--root", str(tmp_path / "nowhere")],
        "missing weights": ["--weights", str(tmp_path / "ViT-B-16.pt")],
        "roles for another model": ["--roles", wrong_roles_file(tmp_path)],
        "unknown flag value": ["--protocol", "base2new"],
        "no cuda": ["--device", "cuda"],
        "inverted thresholds": ["--low-bits", "3", "--high-bits", "1"],
        "two role sources": ["--roles", "analyse", wrong_roles_file(tmp_path)],
        "old fusion name": ["--fusion", "adaptive"],
        "descriptions past the span": ["--descriptions", "100000"],
    }[case]
    done = subprocess.run([sys.executable, "train.py", *args, *change], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error:"), done.stderr
    assert message in lines[0]
    assert not out.exists()


# ------------------------------------------------------------------------------------------
# The toy world from nothing: pretraining, head analysis, causal check, three rows
# ------------------------------------------------------------------------------------------


def test_toyworld_runs_end_to_end_from_an_empty_cache(tmp_path):
    out, cache = tmp_path / "toy", tmp_path / "cache"
    env = dict(os.environ, DEAR_CACHE_DIR=str(cache))
    done = subprocess.run([sys.executable, "train.py", "--dataset", "toyworld", "--toy-scale", "miniature",
                           "--seeds", "1", "2", "--epochs", "2", "--output", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pretraining" in done.stdout.lower()  # nothing was cached: the toy CLIP was trained first
    assert (cache / "toyworld" / "miniature").is_dir()
    # One head analysis (and one causal check) for every seed: the role map belongs to the model.
    assert done.stdout.count("head analysis: the last") == 1
    assert len(re.findall(r"causal check: \d+ heads ablated", done.stdout)) == 1
    assert "reusing the role map" not in done.stdout
    assert re.search(r"head analysis: done in \d+:\d\d:\d\d", done.stdout)
    # No line over 160 columns (the pretraining's header included), the folders as the quick start's
    printed = done.stdout.replace(str(cache), "~/.cache/clip-from-scratch").replace(str(out), "runs/toy")
    assert max(map(len, printed.splitlines())) <= 160, max(printed.splitlines(), key=len)

    summary = read(out / "summary.json")
    table = summary["tables"]["toyworld"]
    assert list(table["rows"]) == ["zeroshot", "linear-probe", "dear-all-mixed", "dear-all-generalization",
                                   "dear-fused", "dear-class-on-unseen"]  # the toy table's rows
    markdown = (out / "summary.md").read_text()
    for label in ("CLIP (zero-shot)", "Linear probe", "DeAR, all heads mixed (no mask)",
                  "DeAR, all heads generalization", "| DeAR, fused on every test set |",
                  "| DeAR, class branch alone on unseen classes |"):
        assert label in markdown
    # All generalization: no attribute branch can read the image, so the class branch alone.
    # The all-generalization row's blind tokens: said once in the header, no warning per run.
    assert "dear-all-generalization: no head lets an attribute token read the image" in done.stdout
    assert "left out of the fusion" not in done.stderr
    general = read(out / "toyworld/dear-all-generalization/seed1/results.json")["accuracy_by_logits"]
    assert general["base"]["fused"] == general["base"]["class"]
    # Attribute-conditioned retrieval: pictures per feature in every DeAR run folder; the
    # precision@10 table with a blind token reported as blind, never ranked.
    retrieval = read(out / "retrieval.json")
    attributes = ["colour", "shape", "texture", "position"]
    assert all(retrieval["dear-all-generalization"][a] == dict.fromkeys(attributes, "blind") for a in attributes)
    for name in ["class", "frozen CLIP"] + attributes:
        cells = retrieval["dear-all-mixed"][name]
        assert list(cells) == attributes and all(0 <= mean <= 100 for mean, _ in cells.values()), name
        assert (out / "toyworld/dear-all-mixed/seed1" / f"retrieval_{name.replace(' ', '_')}.png").is_file()
    assert "| colour token | blind |" in (out / "retrieval.md").read_text()
    roles = out / "toyworld" / "roles"
    for name in ("roles.json", "roles.png", "masks.png", "causal_check.md", "causal_check.json"):
        assert (roles / name).is_file(), name
    causal = read(roles / "causal_check.json")
    assert len(causal["heads"]) == len(dear.RoleMap.load(str(roles / "roles.json")).heads)
    # The run reads the toy world as any CoOp dataset: the saved settings point at the cache.
    settings = read(out / "settings.json")["settings"]
    assert settings["weights"].startswith(str(cache)) and settings["root"].startswith(str(cache))
    fingerprint = settings["role_maps"]["toyworld"]["fingerprint"]
    # Unset --descriptions: the toy bank's rule (its fewest values of an attribute: 4), not the paper's 20.
    assert settings["role_maps"]["toyworld"]["picks"] == 4
    assert all(len(head.descriptions) == 4 for head in dear.RoleMap.load(str(roles / "roles.json")).heads)

    # Other seeds and shots: the same model and pool, so the cached map, said in one line; and the
    # paper's ablations, a row each.
    again = tmp_path / "again"
    done = subprocess.run([sys.executable, "train.py", "--dataset", "toyworld", "--toy-scale", "miniature",
                           "--seeds", "3", "--shots", "2", "--epochs", "1", "--method", "dear", "--roles",
                           "analyse", "--ablations", "all", "--output", str(again)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("head analysis: reusing the role map cached in") == 1
    assert "concept entropy of every head" not in done.stdout and "causal check" not in done.stdout
    assert list(read(again / "summary.json")["tables"]["toyworld"]["rows"]) == [
        "dear-fused", "dear-class-on-unseen", "dear-all-mixed", "dear-no-attribute-tokens",
        "dear-no-fusion-reg", "dear-mask-generalization-only", "dear-branch-ce",
        "dear-shuffled-heads", "dear-whole-layers", "dear-true-heads", "dear-fixed-fusion",
        "dear-feature-fusion", "dear-no-self-reg"]
    retrieval = read(again / "retrieval.json")
    assert list(retrieval["dear-no-attribute-tokens"]) == ["class", "frozen CLIP"]  # no token: none
    assert list(retrieval["dear-branch-ce"]) == ["class"] + attributes + ["frozen CLIP"]
    assert read(again / "settings.json")["settings"]["role_maps"]["toyworld"]["fingerprint"] == fingerprint
    assert read(again / "toyworld/roles/causal_check.json") == causal

    # A resumed run reads its own copy, never the cache; a task build killed half-way leaves a
    # folder that the next call removes.
    import shutil

    shutil.rmtree(cache / "head-analysis")
    (out / "toyworld/dear/seed2/results.json").unlink()
    leftover = Path(settings["root"]) / ".toyworld-building-killed"
    leftover.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEAR_CACHE_DIR", str(cache))
        assert train.main(["--output", str(out), "--eval-only"]) == 0
    assert (out / "toyworld/dear/seed2/results.json").is_file() and not (cache / "head-analysis").exists()
    assert not leftover.exists()

    # A pool of the user's own: toy phrases without labels, clustered; the causal check follows.
    from toyworld import world as toy_world

    pool = tmp_path / "toy_phrases.txt"
    pool.write_text("\n".join(text for text, _, _ in toy_world.toy_bank()) + "\n", encoding="utf-8")
    mine = tmp_path / "mine"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEAR_CACHE_DIR", str(cache))
        assert train.main(["--dataset", "toyworld", "--toy-scale", "miniature", "--bank", str(pool),
                           "--descriptions", "4", "--analyse-only", "--output", str(mine)]) == 0
    assert dear.RoleMap.load(str(mine / "toyworld/roles/roles.json")).concepts == "clusters"
    assert (mine / "toyworld/roles/clusters.md").is_file() and (mine / "toyworld/roles/causal_check.md").is_file()


# ------------------------------------------------------------------------------------------
# Runs you can trust: every bad input refused up front (in-process: the same code path)
# ------------------------------------------------------------------------------------------


def refused(argv, capsys, fragment, output=None):
    """train.main(argv) ends in exit status 2, one line on stderr holding `fragment`, no traceback,
    and (when given) no run folder."""
    capsys.readouterr()
    assert train.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error:"), err
    assert fragment in lines[0], lines[0]
    if output is not None:
        assert not Path(output).exists(), "a run folder was made"
    return lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "0"], "--epochs 0: expected a positive integer"),
    (["--batch-size", "0"], "--batch-size 0: expected a positive integer"),
    (["--lr", "0"], "--lr 0.0: expected a positive, finite learning rate"),
    (["--lr", "inf"], "--lr inf: expected a positive, finite"),
    (["--lambda-fusion", "nan"], "--lambda-fusion nan: expected a finite weight"),
    (["--beta", "nan"], "--beta nan: beta=nan is outside [0, 1]"),
    (["--head-width", "0"], "--head-width 0: expected a positive integer"),
    (["--analysis-images", "0"], "--analysis-images 0"),
    (["--descriptions", "0"], "--descriptions 0"),
    (["--eval-batch-size", "0"], "--eval-batch-size 0"),
    (["--log-every", "0"], "--log-every 0"),
    (["--max-epochs-per-call", "0"], "--max-epochs-per-call 0"),
    (["--max-epochs-per-call", "-1"], "--max-epochs-per-call -1"),
    (["--text-tokens", "-1"], "--text-tokens -1: expected an integer >= 0"),
    (["--text-tokens", "100000"], "--text-tokens 100000: expected at most the model's context length (16)"),
    (["--first-layer", "0"], "--first-layer 0: expected a positive integer"),
    (["--first-layer", "3"], "--first-layer 3: first_layer J=3 is out of range: use 1..2"),  # text: 2
    (["--workers", "-1"], "--workers -1: expected an integer >= 0"),
    (["--seeds", "-1"], "--seeds -1: expected integers from 0 to 4294967295"),
    (["--seeds", str(2**64)], "--seeds 18446744073709551616"),
    (["--low-bits", "2", "--high-bits", "1"], "--low-bits 2.0: low_bits=2 is above high_bits=1"),
    (["--high-bits=-inf"], "--high-bits -inf: high_bits=-inf: expected a finite entropy"),
    (["--device", "meta"], "--device meta: not a device"),
    (["--device", "cpu:3"], "--device cpu:3: not a device"),
])
def test_a_zero_negative_or_non_finite_value_is_refused_not_replaced(world, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    refused(common(world, out, "--dataset", "dtd", "--seeds", "1", "--shots", "4", *flags), capsys, message, out)


def test_a_dataset_without_a_recipe_is_refused_not_given_another_datasets(world, tmp_path, capsys, monkeypatch):
    """RECIPES is one default per protocol plus the exceptions; a trainable dataset with no row
    at all (one added to data.py and forgotten here) must not silently train with another's."""
    monkeypatch.delitem(train.RECIPES["base2novel"], "dtd")
    out = tmp_path / "run"
    refused(common(world, out, "--dataset", "dtd", "--seeds", "1"), capsys,
            "--dataset dtd: train.py has no base2novel recipe for it; add it to RECIPES", out)


def test_help_shows_each_default_from_the_one_table_that_holds_it(monkeypatch, capsys):
    """Defaults are written once (Recipe, RECIPES, DEFAULTS, TOY_DEFAULTS): the help text and
    --recipes are generated from them, so changing a table changes the help, the recipes' table
    and the resolved setting alike."""
    monkeypatch.setitem(train.DEFAULTS, "log_every", 7)
    monkeypatch.setitem(train.RECIPES["cross"], "imagenet", train.Recipe(epochs=3, batch_size=32))
    text = " ".join(cli.build_parser(train.BOOK).format_help().split())
    assert "a progress line in log.txt every N steps (default 7)" in text
    assert "training epochs, the warm-up's included (default 10; per dataset: --recipes)" in text
    assert "(default analyse; toyworld: all-mixed all-generalization analyse)" in text
    assert "every N steps (default 20)" not in text  # the old --log-every default is nowhere
    table = cli.recipes_table(train.BOOK).splitlines()
    cross = table.index("cross and dg:")
    imagenet = next(line for line in table[cross:] if line.split()[:1] == ["imagenet"])
    assert imagenet.split()[1:3] == ["3", "32"]  # epochs, batch_size: the table's
    settings = settings_of(["--dataset", "dtd", "--device", "cpu"])
    assert settings["log_every"] == 7 and settings["epochs"] == train.Recipe().epochs == 10
    assert settings_of((
        ["--dataset", "imagenet_sketch", "--protocol", "dg", "--device", "cpu"]))["epochs"] == 3


HELP_ALONE = """
import runpy, sys
sys.argv = ["train.py", *sys.argv[1:]]
try:
    runpy.run_path("train.py", run_name="__main__")
except SystemExit as stop:
    print("exit status", stop.code or 0, file=sys.stderr)
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


@pytest.mark.parametrize("flag", ["--help", "--recipes"])
def test_help_and_recipes_answer_without_importing_torch_in_under_120_lines(flag):
    """python train.py --help (and --recipes) answers before torch is imported (a moment, not the
    seconds torch takes), the help in under 120 lines, none past 120 columns."""
    done = subprocess.run([sys.executable, "-c", HELP_ALONE, flag], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.stderr.strip().endswith("exit status 0\ntorch imported: False"), done.stderr[-2000:]
    lines = done.stdout.splitlines()
    if flag == "--help":
        assert 60 < len(lines) < 120 and max(map(len, lines)) <= 120
        assert lines[0] == "usage: python train.py --dataset NAME|all|toyworld|PATH [options]"
    else:
        assert lines[0].startswith("Recipes") and any(l.startswith("  oxford_pets") for l in lines)


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "oxford_pet"], "--dataset oxford_pet: not a dataset name, nor a folder or split file of "
                                  "your own; did you mean oxford_pets?"),
    (["--dataset", "toyworld", "--protocol", "fewshoot"], "argument --protocol: invalid choice: 'fewshoot'"),
    (["--dataset", "toyworld", "--epochs", "0"], "--epochs 0: expected a positive integer"),
    (["--dataset", "toyworld", "--seeds", "one"], "argument --seeds: invalid int value: 'one'"),
    (["--dataset", "oxford_pets", "--root"], "--root: expected one argument; is $DATA set? export DATA="),
    (["--dataset", "oxford_pets"], "--root is not given; --dataset oxford_pets is read from it"),
    (["--dataset", "toyworld", "--source", "imagenett"], "--source imagenett: not a dataset name; did you mean"),
    (["--dataset", "toyworld", "--resume"], "--resume and --eval-only need --output"),
    (["--output", "no/such/run", "--eval-only"], "--output no/such/run: no such folder"),
    (["--dataset", "toyworld", "--roles", "no/such/roles.json"], "--roles no/such/roles.json: no such file"),
])
def test_a_refusal_that_needs_no_tensor_comes_before_torch_is_imported(argv, message):
    """A misspelled name, a wrong choice, a bad number or a missing path costs a moment, not the
    seconds and the 800 MB of importing torch: one line, exit status 2, torch never imported."""
    done = subprocess.run([sys.executable, "-c", HELP_ALONE, *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("train.py: error:"), done.stderr[-2000:]
    assert message in lines[0] and lines[1:] == ["exit status 2", "torch imported: False"], done.stderr


def test_the_names_checked_before_torch_are_data_pys_registry():
    assert cli.registry_names() == list(train.data.DATASETS)  # read from its source, not imported


def test_a_torchvision_built_for_another_torch_is_one_line_naming_both_versions_and_the_fix(tmp_path):
    """A CPU-only torch beside a CUDA torchvision fails in `import torchvision` (here faked: a
    torchvision that raises what the real one raised): one line, exit status 2, no traceback."""
    fake = tmp_path / "fake" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    done = subprocess.run([sys.executable, "train.py", "--dataset", "toyworld", "--output", str(tmp_path / "run")],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(fake.parent)))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert re.match(r"train.py: error: torchvision \S+ does not work with torch \S+ \(operator torchvision::nms "
                    r"does not exist\); install both from the same index", lines[0]), lines[0]
    assert not (tmp_path / "run").exists()


def test_each_protocol_trains_with_the_lineages_recipe_and_its_per_dataset_values():
    """MMRL++ (yunncheng/MMRL): the protocol's yaml (configs/trainers/MMRLpp/), then
    trainers/config.py's beta and regularisation weight per dataset, which MMRL's train.py
    merges last; the cross-dataset table (CD) is not the base-to-novel one (B2N, FS)."""
    def resolved(*argv):
        s = settings_of([*argv, "--device", "cpu"])
        return [s[k] for k in ("epochs", "batch_size", "lr", "warmup_epochs", "beta", "lambda_reg")]

    assert resolved("--dataset", "oxford_pets") == [10, 4, 1e-3, 1, 0.7, 0.01]  # vit_b16.yaml + B2N
    assert resolved("--dataset", "imagenet") == [5, 32, 1e-3, 1, 0.9, 0.2]  # vit_b16_imagenet.yaml + B2N
    assert resolved("--dataset", "dtd", "--protocol", "fewshot") == [100, 32, 2e-3, 1, 0.9, 7.0]  # few_shot.yaml
    assert resolved("--dataset", "imagenet", "--protocol", "fewshot") == [5, 32, 1e-3, 1, 0.9, 0.2]
    for protocol in ("cross", "dg"):  # vit_b16_cross_datasets.yaml + CD's ImageNet
        assert resolved("--dataset", "all", "--protocol", protocol) == [1, 32, 1e-3, 0, 0.9, 0.1]
    assert resolved("--dataset", "eurosat", "--beta", "0.3") == [10, 4, 1e-3, 1, 0.3, 0.01]  # a typed flag wins


def write_json_file(path, value):
    Path(path).write_text(json.dumps(value))
    return str(path)


def test_unusable_paths_and_files_are_refused_before_any_folder(world, tmp_path, capsys, openclip_bpe_path):
    run = ["--dataset", "dtd", "--seeds", "1", "--shots", "4"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    refused(common(world, a_file, *run), capsys, f"--output {a_file}: is a file")
    refused(common(world, a_file / "run", *run), capsys, f"lies under {a_file}, which is a file")
    if os.path.isdir("/proc"):  # not writable even for root
        refused(common(world, "/proc/dear-run", *run), capsys, "--output /proc/dear-run: cannot write in /proc")

    out = tmp_path / "run"
    layer_as_text = json.loads(Path(wrong_roles_file(tmp_path)).read_text())
    layer_as_text["heads"][0]["layer"] = "9"
    for roles, fragment in ((write_json_file(tmp_path / "list.json", [1, 2]), "not a DeAR role file"),
                            (write_json_file(tmp_path / "text.json", layer_as_text), "not a DeAR role file")):
        refused(common(world, out, *run, "--roles", roles), capsys, fragment, out)
    # The model's vocabulary against the BPE file: CLIP's real file, an empty one.
    refused(common(world, out, *run, "--bpe", openclip_bpe_path), capsys, "gives a vocabulary of 49408 tokens", out)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    refused(common(world, out, *run, "--bpe", empty), capsys, "gives a vocabulary of 514 tokens", out)
    # Damaged files: a checkpoint cut short (an interrupted download), a pool that is binary.
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(Path(world["weights"]).read_bytes()[:4000])
    refused(common(world, out, *run, "--weights", truncated), capsys,
            f"{truncated}: cannot be read as a checkpoint (truncated, corrupt or not a PyTorch file", out)
    binary = tmp_path / "pool.txt.gz"
    binary.write_bytes(gzip.compress(b"a photo of red\n" * 20))
    refused(common(world, out, *run, "--bank", binary), capsys,
            f"--bank {binary}: not UTF-8 text; save the pool as UTF-8", out)


def test_toyworld_refuses_a_model_of_its_own_and_resume_refuses_eval_only(tmp_path, capsys, world, monkeypatch):
    out = tmp_path / "toy"
    monkeypatch.setenv("DEAR_CACHE_DIR", str(tmp_path / "cache"))  # were it not refused: seconds, not minutes
    toy = ["--dataset", "toyworld", "--toy-scale", "miniature", "--epochs", "1", "--seeds", "1", "--output", out]
    refused([*toy, "--weights", world["weights"]], capsys, "--weights: the toy world brings its own model", out)
    refused([*toy, "--weights", "ViT-B/16"], capsys, "drop --weights", out)
    refused(["--output", out, "--resume", "--eval-only"], capsys, "--resume and --eval-only: give one")


def copy_of_data(world, tmp_path, edit):
    """A copy of the tiny data root with dtd's split edited by edit(split)."""
    root = tmp_path / "data"
    import shutil

    shutil.copytree(world["root"], root, ignore=shutil.ignore_patterns("split_fewshot"))
    split_path = root / "dtd" / "split_zhou_DescribableTextures.json"
    split = json.loads(split_path.read_text())
    edit(split)
    split_path.write_text(json.dumps(split))
    return root


@pytest.mark.parametrize("case, message", [
    ("empty train", "no training images of the base classes"),
    ("empty test", "no test images of the base classes"),
    ("no novel test", "no test images of the novel classes"),
])
def test_an_empty_set_is_an_error_not_a_row_of_zeros(world, tmp_path, capsys, case, message):
    edit = {"empty train": lambda s: s.update(train=[]),
            "empty test": lambda s: s.update(test=[]),
            "no novel test": lambda s: s.update(test=[e for e in s["test"] if e[1] < 3])}[case]
    root, out = copy_of_data(world, tmp_path, edit), tmp_path / "run"
    refused(common(world, out, "--dataset", "dtd", "--seeds", "1", "--shots", "4", "--root", root), capsys,
            message, out)


def test_an_error_in_a_dataloader_worker_is_one_short_line(world, tmp_path, capsys):
    root, out = copy_of_data(world, tmp_path, lambda s: None), tmp_path / "run"
    bad = root / "dtd" / "images" / "banded" / "banded_test1.jpg"
    bad.write_bytes(b"not an image")
    line = refused(common(world, out, "--dataset", "dtd", "--seeds", "1", "--method", "zeroshot", "--root", root,
                          "--workers", "1"), capsys, f"{bad}: cannot read image")
    assert len(line) < 400 and "Traceback" not in line


# ------------------------------------------------------------------------------------------
# One writer per run folder
# ------------------------------------------------------------------------------------------


def test_a_running_call_holds_the_folder_and_its_death_releases_it(world, tmp_path, capsys):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    holder = subprocess.Popen([sys.executable, "train.py", *common(world, out, "--dataset", "dtd", "--seeds", "1",
                                                                   "--method", "dear", "--roles", "all-mixed",
                                                                   "--shots", "4", "--epochs", "100000")],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        checkpoint = out / "dtd/dear-all-mixed/seed1/checkpoint.pt"
        for _ in range(1200):  # training has started once the first checkpoint exists
            if checkpoint.exists() or holder.poll() is not None:
                break
            time.sleep(0.1)
        assert holder.poll() is None, holder.stderr.read()
        # (--max-epochs-per-call: were it not refused, it would still end)
        refused(["--output", out, "--resume", "--max-epochs-per-call", "1"], capsys,
                f"in use by another train.py process (pid {holder.pid})")
        refused(["--output", out, "--eval-only"], capsys, "in use by another train.py process")
    finally:
        holder.kill()
        holder.wait()
    (out / "dtd/dear-all-mixed/seed1/.tmp-x-checkpoint.pt").write_bytes(b"half a file")  # a killed write
    assert train.main(["--output", str(out), "--resume", "--max-epochs-per-call", "1"]) == 0  # the lock is free
    assert not list(out.rglob(".tmp-*")), "a killed write's temporary file was left"
    assert not (out / ".lock").exists(), "a finished call left its .lock"


def test_ctrl_c_prints_the_command_that_continues_keeps_it_in_the_log_and_that_command_works(world, tmp_path):
    out = tmp_path / "run"
    caller = subprocess.Popen([sys.executable, "train.py", *common(world, out, "--dataset", "dtd", "--seeds", "1",
                                                                   "--method", "dear", "--roles", "all-mixed",
                                                                   "--shots", "4", "--epochs", "100000")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        for _ in range(1200):  # training has started once the first checkpoint exists
            if (out / "dtd/dear-all-mixed/seed1/checkpoint.pt").exists() or caller.poll() is not None:
                break
            time.sleep(0.1)
        caller.send_signal(signal.SIGINT)
        stdout, stderr = caller.communicate(timeout=120)
    finally:
        caller.kill()
    assert caller.returncode == 130 and stderr == "", stderr
    said = stdout.splitlines()[-1]
    assert said.startswith("train.py: interrupted; every finished epoch is saved; continue with: python train.py ")
    assert said in (out / "log.txt").read_text().splitlines()
    command = shlex.split(said.split("continue with: ")[1])
    assert command[:2] == ["python", "train.py"] and command[2:] == ["--output", str(out), "--resume"]
    assert not (out / ".lock").exists()
    assert train.main([*command[2:], "--max-epochs-per-call", "1"]) == 0  # the command continues the run


# ------------------------------------------------------------------------------------------
# Resume cannot change the computation
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stopped_run(world, tmp_path_factory):
    """A DeAR run with a roles file, stopped after epoch 1 of 2: (folder, roles file)."""
    tmp = tmp_path_factory.mktemp("stopped")
    roles = dear.RoleMap.uniform("mixed", 3, 2, range(3), list(dear.CORE_ATTRIBUTES))
    roles.save(str(tmp / "roles.json"))
    out = tmp / "run"
    assert train.main(common(world, out, "--dataset", "dtd", "--seeds", "1", "--method", "zeroshot", "dear",
                             "--roles", str(tmp / "roles.json"), "--shots", "4", "--augment", "off",
                             "--max-epochs-per-call", "1")) == 0
    return out, tmp / "roles.json"


def copy_run(stopped_run, tmp_path):
    import shutil

    out, roles = stopped_run
    shutil.copytree(out, tmp_path / "run")
    return tmp_path / "run", roles  # the roles file stays where the run was made with it


@pytest.mark.parametrize("changed", ["weights", "bpe", "roles"])
def test_resume_with_other_input_files_is_refused_saying_which(world, stopped_run, tmp_path, capsys, changed):
    out, roles = copy_run(stopped_run, tmp_path)
    saved = read(out / "settings.json")["settings"]
    assert read(out / "roles_file.json") == read(roles)  # the run keeps the roles it used
    if changed == "weights":
        state = torch.load(world["weights"], weights_only=True)
        state["visual.proj"] = state["visual.proj"] + 0.01
        torch.save(state, tmp_path / "other.pt")
        argv, fragment = ["--weights", tmp_path / "other.pt"], f"--weights {tmp_path / 'other.pt'}: not the file"
    elif changed == "bpe":  # the same vocabulary size, other merges
        with gzip.open(world["bpe"], "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
        lines[1], lines[2] = lines[2], lines[1]
        with gzip.open(tmp_path / "other.txt.gz", "wt", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        argv, fragment = ["--bpe", tmp_path / "other.txt.gz"], "other.txt.gz: not the file this run was made with"
    else:
        original = roles.read_text()
        dear.RoleMap.uniform("generalization", 3, 2, range(3), list(dear.CORE_ATTRIBUTES)).save(str(roles))
        argv, fragment = [], f"--roles {roles}: not the file this run was made with"
    try:
        refused(["--output", out, "--resume", *argv], capsys, fragment)
    finally:
        if changed == "roles":
            roles.write_text(original)  # the module's other tests resume from it
    assert read(out / "settings.json")["settings"] == saved
    # The same content in another place is the same input.
    if changed == "weights":
        import shutil

        shutil.copy(world["weights"], tmp_path / "moved.pt")
        assert train.main(["--output", str(out), "--resume", "--weights", str(tmp_path / "moved.pt")]) == 0


def test_resume_accepts_the_same_value_of_a_computation_flag_and_refuses_another(stopped_run, tmp_path, capsys):
    out, _ = copy_run(stopped_run, tmp_path)
    refused(["--output", out, "--resume", "--augment", "on"], capsys, "--augment cannot change in a saved run")
    refused(["--output", out, "--resume", "--text-tokens", "0"], capsys, "--text-tokens cannot change")
    assert train.main(["--output", str(out), "--resume", "--augment", "off", "--dataset", "dtd", "--seeds", "1",
                       "--workers", "0"]) == 0
    assert (out / "summary.md").is_file()


@pytest.mark.parametrize("damage, message", [
    ("mixed results", "the folder mixes two runs"),
    ("empty results", "unreadable results"),
    ("checkpoint without optimizer", "unreadable checkpoint"),
    ("checkpoint without settings", "unreadable checkpoint"),
    ("settings as a list", "settings.json: unreadable"),
])
def test_a_damaged_or_mixed_run_folder_is_refused_in_one_line(stopped_run, tmp_path, capsys, damage, message):
    out, _ = copy_run(stopped_run, tmp_path)
    results, checkpoint = out / "dtd/zeroshot/results.json", out / "dtd/dear/seed1/checkpoint.pt"
    if damage == "mixed results":  # another writer's run, with another lr
        result = read(results)
        result["settings"]["lr"] = 0.002
        results.write_text(json.dumps(result))
    elif damage == "empty results":
        results.write_text("")
    elif damage.startswith("checkpoint"):
        state = torch.load(checkpoint, weights_only=True)
        del state["optimizer" if "optimizer" in damage else "settings"]
        torch.save(state, checkpoint)
    else:
        (out / "settings.json").write_text("[]")
    refused(["--output", out, "--resume"], capsys, message)
    if damage == "mixed results":
        refused(["--output", out, "--eval-only"], capsys, "lr 0.002 (expected 0.001)")


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_run_resumes(world, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    argv = common(world, out, "--dataset", "dtd", "--seeds", "1", "--method", "dear", "--roles", "all-mixed",
                  "--shots", "4", "--epochs", "1")

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:595] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    line = refused(argv, capsys, "cannot write the checkpoint")
    assert "free disk space" in line and not list(out.rglob(".tmp-*"))
    monkeypatch.undo()
    assert train.main(["--output", str(out), "--resume"]) == 0


# ------------------------------------------------------------------------------------------
# Your own data: --dataset PATH, a folder of class folders or a split file
# ------------------------------------------------------------------------------------------

OWN_CLASSES = ["red_dots", "blue", "green", "gold"]  # 2 base, 2 novel


def write_own_folder(folder: Path, images_per_class: int = 10) -> Path:
    for label, name in enumerate(OWN_CLASSES):
        for i in range(images_per_class):
            write_image(folder / name / f"{name}{i}.png", (60 * label, 15 * i, 250 - 60 * label))
    (folder / "blue" / "notes.txt").write_text("a file that is not an image")
    return folder


@pytest.fixture(scope="module")
def own_data(tmp_path_factory):
    """An ImageFolder tree and a split file (paths relative to its folder), in a tmp folder."""
    tmp = tmp_path_factory.mktemp("own")
    folder = write_own_folder(tmp / "my_textures")
    split = {"train": [], "val": [], "test": []}
    for label, name in enumerate(OWN_CLASSES):
        for part, count in (("train", 4), ("val", 2), ("test", 3)):
            for i in range(count):
                relative = f"pics/{name}_{part}{i}.png"
                write_image(tmp / "labelled" / relative, (60 * label, 20 * i, 90))
                split[part].append([relative, label, name])
    (tmp / "labelled" / "my_split.json").write_text(json.dumps(split))
    return dict(folder=str(folder), split=str(tmp / "labelled" / "my_split.json"))


def test_own_data_offline_names_the_flags_that_give_the_files_and_the_toy_clip_stands_in(
        own_data, tmp_path, capsys, no_network, monkeypatch):
    """--dataset PATH with no network and nothing cached: one line naming --weights and --bpe and
    the toy CLIP's files, before any run folder; with those files the flow runs on the folder,
    and its few images per class are one line (repeated to make the shots, as Dassl does)."""
    monkeypatch.setenv("CLIP_CACHE_DIR", str(tmp_path / "empty-cache"))
    import shutil

    folder = tmp_path / "my_textures"  # a copy: the split it writes stays in this test
    shutil.copytree(own_data["folder"], folder)
    out = tmp_path / "run"
    line = refused(["--dataset", folder, "--output", out], capsys,
                   "CLIP ViT-B/16: cannot download", out)
    assert line.endswith("without network give the files: --weights PATH (OpenAI's ViT-B-16.pt) and "
                         "--bpe PATH (bpe_simple_vocab_16e6.txt.gz); or try the flow on the toy "
                         "CLIP: --weights toyworld/assets/full/clip.pt --bpe "
                         "toyworld/assets/full/bpe.txt.gz"), line
    toy = REPO / "toyworld" / "assets" / "full"
    capsys.readouterr()
    before = set(folder.rglob("*"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert train.main(["--dataset", str(folder), "--output", str(out), "--weights",
                           str(toy / "clip.pt"), "--bpe", str(toy / "bpe.txt.gz"), "--roles",
                           "all-mixed", "--seeds", "1", "--epochs", "1", "--device", "cpu"]) == 0
    shots = [str(w.message) for w in caught if "repeat" in str(w.message)]
    assert shots == ["my_textures: train: every class has fewer than 16 images (5 each); val: every "
                     "class has fewer than 4 images (2 each); each draw repeats some to make the "
                     "shots, as Dassl does"], shots
    assert (out / "summary.md").is_file()
    # The folder holds what the README says: its images and the split file; the few-shot draw is
    # cached with the rest, in the project's cache.
    assert set(folder.rglob("*")) - before <= {folder / "split_my_textures.json"}
    assert len(list((tmp_path / "empty-cache" / "fewshot").glob("my_textures-*/shot_16-seed_1.json"))) == 1


def test_a_small_folder_says_under_its_table_what_its_columns_and_shots_can_mean(world, tmp_path, capsys):
    """3 classes x 6 images: 2 base and 1 novel class (a novel column of one class is 100% by
    construction) and 3 training images per class for 16 shots: said under the table, in
    summary.md and on screen; the retrieval pictures show the 5 neighbours there are, not 8."""
    folder = tmp_path / "three"
    for label, name in enumerate(["red", "green", "blue"]):
        for i in range(6):
            write_image(folder / name / f"{name}{i}.png", (80 * label, 20 * i, 200 - 60 * label))
    out = tmp_path / "run"
    capsys.readouterr()
    assert train.main(common(world, out, "--dataset", str(folder), "--seeds", "1", "--epochs", "1",
                             "--method", "zeroshot", "dear", "--roles", "all-mixed")[2:]) == 0
    notes = ["three's base column scores among 2 classes: chance is 50%.",
             "three's novel column scores among 1 class: every image has one answer, so 100% is a given, "
             "not a result.",
             "three: 16 shots asked, but each class holds only 3 distinct training images; the draw repeats "
             "them to make the shots."]
    printed, summary = capsys.readouterr().out, (out / "summary.md").read_text()
    block = ["Notes on the data:", *(f"- {note}" for note in notes)]
    for text in (summary, printed):
        lines = text.splitlines()
        assert lines[lines.index(block[0]):][:4] == block
    assert read(out / "summary.json")["notes"] == notes
    with Image.open(out / "three/dear-all-mixed/seed1/retrieval_class.png") as picture:
        assert picture.width == 12 + (1 + 5) * (64 + 4) + 8  # the query and its 5 neighbours, 64-px tiles


def test_own_image_folder_runs_base2novel_end_to_end_and_eval_only_reproduces_it(world, own_data, tmp_path):
    out = tmp_path / "run"
    args = common(world, out, "--dataset", own_data["folder"], "--seeds", "1", "--shots", "2", "--epochs", "1",
                  "--roles", "analyse")[2:]  # no --root: your own data needs none
    assert "--root" not in args
    done = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "skipped 1 non-image file" in done.stderr
    assert (Path(own_data["folder"]) / "split_my_textures.json").is_file()  # written next to the data
    table = read(out / "summary.json")["tables"]["my_textures"]  # the folder's name
    assert table["columns"] == ["Base", "Novel", "HM"]
    assert list(table["rows"]) == ["zeroshot", "dear-fused", "dear-class-on-unseen"]
    assert (out / "my_textures" / "roles" / "roles.json").is_file()  # the head analysis ran on it
    result = read(out / "my_textures" / "dear" / "seed1" / "results.json")
    saved = read(out / "settings.json")["settings"]
    assert saved["dataset"] == ["my_textures"] and saved["dataset_paths"] == {"my_textures": own_data["folder"]}
    (out / "my_textures" / "dear" / "seed1" / "results.json").unlink()
    assert train.main(["--output", str(out), "--eval-only"]) == 0
    assert read(out / "my_textures" / "dear" / "seed1" / "results.json")["metrics"] == result["metrics"]


def test_own_split_file_runs_fewshot_and_cross_with_its_template(world, own_data, tmp_path):
    fast = ["--seeds", "1", "--roles", "all-generalization", "--epochs", "1", "--template", "a {} texture."]
    out = tmp_path / "fewshot"
    assert train.main(common(world, out, "--protocol", "fewshot", "--dataset", own_data["split"], "--shots", "1", "2",
                             *fast)) == 0
    table = read(out / "summary.json")["tables"]["labelled"]  # the split file's folder's name
    assert table["columns"] == ["1 shot", "2 shots"]
    assert (out / "labelled" / "dear-all-generalization" / "shots2-seed1" / "results.json").is_file()

    out = tmp_path / "cross"  # as a target of cross-dataset evaluation, beside a benchmark
    assert train.main(common(world, out, "--protocol", "cross", "--dataset", own_data["split"], "dtd", *fast,
                             "--shots", "4")) == 0
    (title, table), = read(out / "summary.json")["tables"].items()
    assert table["columns"] == ["imagenet (source)", "labelled", "dtd", "Average"]
    result = read(out / "imagenet/dear-all-generalization/seed1/results.json")
    assert set(result["metrics"]) == {"imagenet", "labelled", "dtd"}

    unset = config.settings_from_flags(cli.build_parser(train.BOOK).parse_args(["--dataset", own_data["split"], "dtd"]),
                                     train.BOOK)
    assert unset["output"] == os.path.join("runs", "base2novel-labelled-dtd")  # a name, not a path, in the folder
    recipe = train.Recipe()  # the default recipe, for each value not typed
    assert (unset["epochs"], unset["batch_size"], unset["lr"], unset["shots"]) == (
        recipe.epochs, recipe.batch_size, recipe.lr, [recipe.shots])

    # The template reaches every prompt: training and each test set, own data and benchmarks.
    settings = settings_of(common(world, tmp_path / "unused", "--protocol", "cross", "--dataset", own_data["split"], "dtd",
                                *fast))
    datasets = train.Datasets(settings["root"], log=print)
    assert {s.template for s in train.evaluation_sets(settings, datasets, "imagenet")} == {"a {} texture."}
    assert train.training_split(settings, datasets, "imagenet", 1, 2).prompts[0] == "a tench texture."
    plain = settings_of(common(world, tmp_path / "unused", "--protocol", "fewshot", "--dataset", own_data["split"], "dtd"))
    assert [s.template for s in train.evaluation_sets(plain, datasets, "labelled")] == ["a photo of a {}."]
    assert [s.template for s in train.evaluation_sets(plain, datasets, "dtd")] == ["{} texture."]


@pytest.mark.parametrize("case, message", [
    ("empty folder", "0 class folders; expected at least two"),
    ("one class", "1 class folder; expected at least two"),
    ("class with no image", "class 'blue' has 0 images"),
    ("class too small", "class 'gold' has 3 images; the 50/20/30 train/val/test split needs at least 4"),
    ("not an image", "gold/broken.png: cannot be read as an image"),
    ("same class name", "class folders 'red dots' and 'red_dots' both give the class name 'red dots'"),
    ("split leaves its folder", "image path '../outside.png' leaves the image folder"),
    ("no such path", "nowhere: not found; expected a folder of class folders"),
    ("benchmark's name", "its name 'dtd' is that of a benchmark; rename the folder"),
    ("two with one name", "two have the same folder name"),
    ("template without {}", "--template 'a photo': expected a prompt with one '{}'"),
    ("template with an attribute", "--template '{.x}': expected a prompt with one '{}'"),
])
def test_bad_own_data_ends_in_one_line_and_exit_2_before_any_work(world, tmp_path, capsys, case, message):
    folder = tmp_path / "data" / "mine"
    folder.mkdir(parents=True)
    if case not in ("empty folder", "one class"):
        write_own_folder(folder, 4)
    if case == "one class":
        write_own_folder(tmp_path / "other", 4)
        (tmp_path / "other" / "gold").rename(folder / "gold")
    target = [str(folder)]
    extra = {"class with no image": lambda: [p.unlink() for p in (folder / "blue").glob("*.png")],
             "class too small": lambda: (folder / "gold" / "gold0.png").unlink(),
             "not an image": lambda: (folder / "gold" / "broken.png").write_bytes(b"\x89PNG but no more"),
             "same class name": lambda: write_image(folder / "red dots" / "x.png", (1, 2, 3))}
    extra.get(case, lambda: None)()
    if case == "split leaves its folder":
        write_image(tmp_path / "data" / "outside.png", (1, 2, 3))
        entries = [["../outside.png", 0, "a"], ["red_dots/red_dots0.png", 1, "b"]]
        (folder / "split.json").write_text(json.dumps({"train": entries, "val": [], "test": entries[1:]}))
        target = [str(folder / "split.json")]
    if case == "no such path":
        target = [str(tmp_path / "nowhere")]
    if case == "benchmark's name":
        target = [str(folder.rename(tmp_path / "data" / "dtd"))]
    if case == "two with one name":
        target = [str(folder), str(write_own_folder(tmp_path / "elsewhere" / "mine", 4))]
    flags = ["--template", "{.x}" if "attribute" in case else "a photo"] if case.startswith("template") else []
    before = sorted(tmp_path.rglob("*"))
    out = tmp_path / "run"
    refused(common(world, out, "--dataset", *target, "--seeds", "1", *flags), capsys, message, out)
    assert sorted(tmp_path.rglob("*")) == before  # no split file, no cache, no run folder


# ------------------------------------------------------------------------------------------
# The head analysis' description pool (--bank) and where its concepts come from (--concepts)
# ------------------------------------------------------------------------------------------


def test_a_pool_without_labels_is_clustered_and_recorded(world, tmp_path, capsys, analysis_cache):
    pool = tmp_path / "my_pool.txt"
    words = ["red", "blue", "green", "striped", "dotted", "round", "square", "banded", "bubbly", "cracked"]
    pool.write_text("# my own descriptions\n" + "".join(f"a photo of {w} texture\n" for w in words) + "a photo of red texture\n")
    out = tmp_path / "run"
    assert train.main(common(world, out, "--dataset", "dtd", "--analyse-only", "--bank", str(pool))) == 0
    printed = capsys.readouterr().out
    assert "10 distinct descriptions (1 repeated lines dropped)" in printed
    role_map = dear.RoleMap.load(str(out / "dtd/roles/roles.json"))
    assert role_map.concepts == "clusters" and role_map.source.startswith("concept entropy (clusters) on dtd")
    assert all(c == dear.NOISE or c.startswith("cluster ") for h in role_map.heads for c in h.concepts)
    clusters = (out / "dtd/roles/clusters.md").read_text()
    assert clusters.startswith("# Concepts of the head analysis: clusters") and "adjusted Rand" not in clusters
    record = read(out / "dtd/roles/analysis.json")
    assert record["concepts"] == dict(source="clusters", encoder=dict(name="clip"), bank=str(pool),
                                      min_cluster_size=None, min_samples=None, cluster_names=None)
    # The project's labelled bank: labels by default; the clusters asked for are another analysis.
    labelled = tmp_path / "labelled"
    assert train.main(common(world, labelled, "--dataset", "dtd", "--analyse-only")) == 0
    assert dear.RoleMap.load(str(labelled / "dtd/roles/roles.json")).concepts == "labels"
    clustered = tmp_path / "clustered"
    assert train.main(common(world, clustered, "--dataset", "dtd", "--analyse-only", "--concepts", "clusters",
                             "--min-cluster-size", "3")) == 0
    assert "reusing" not in capsys.readouterr().out
    assert "adjusted Rand index" in (clustered / "dtd/roles/clusters.md").read_text()  # labels to compare with
    fingerprints = {read(f / "dtd/roles/analysis.json")["fingerprint"] for f in (out, labelled, clustered)}
    assert len(fingerprints) == 3


def test_textspans_pool_comes_from_the_cache_offline_or_an_error_says_where_to_put_it(world, tmp_path, capsys,
                                                                                     analysis_cache, monkeypatch):
    import urllib.request

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    out = tmp_path / "run"
    cached = analysis_cache / "image_descriptions_general.txt"
    line = refused(common(world, out, "--dataset", "dtd", "--analyse-only", "--bank", "textspan"), capsys,
                   "--bank textspan: cannot download https://raw.githubusercontent.com/yossigandelsman/", out)
    assert f"put that file (SHA-256 39c6bf3e788684d9...) at {cached}" in line
    # A call that analyses no head reads no pool: nothing is fetched, nothing is refused.
    zeroshot = tmp_path / "zeroshot"
    assert train.main(common(world, zeroshot, "--dataset", "dtd", "--method", "zeroshot", "--bank", "textspan")) == 0
    assert read(zeroshot / "settings.json")["settings"]["fingerprints"]["bank"] is None
    shared = REPO.parent / "shared" / "textspan" / "image_descriptions_general.txt"
    if not shared.is_file():
        pytest.skip("TextSpan's pool is not beside this checkout (../shared/textspan/)")
    import shutil

    shutil.copyfile(shared, cached)
    assert train.main(common(world, out, "--dataset", "dtd", "--analyse-only", "--bank", "textspan")) == 0
    record = read(out / "dtd/roles/analysis.json")
    assert record["concepts"]["source"] == "clusters" and record["concepts"]["bank"] == "textspan"
    assert len({t for h in dear.RoleMap.load(str(out / "dtd/roles/roles.json")).heads for t in h.descriptions}) > 6


@pytest.mark.parametrize("case, message", [
    ("missing pool", "no such description pool"),
    ("empty pool", "no descriptions in it"),
    ("not utf-8", "not UTF-8 text; save the pool as UTF-8"),
    ("too few lines", "3 distinct descriptions, and TextSpan makes 20 picks per head; give a pool of at least 20"),
    ("labels missing", "concepts 'labels' needs a label on every description"),
    ("typed picks past the pool", "--descriptions 9: TextSpan can make 1..8 picks per head here (the bank has 8"),
    ("min cluster size", "--min-cluster-size 1: expected an integer >= 2"),
    ("min samples", "--min-samples 0: expected a positive integer"),
    ("cluster names", "--cluster-names"),
])
def test_a_bad_pool_or_clustering_setting_is_one_line_before_any_work(world, tmp_path, capsys, analysis_cache,
                                                                      case, message):
    pool = tmp_path / "pool.txt"
    labelled = "".join(f"a photo of {w}\tcolour\n" for w in ("red", "blue", "green", "pink", "teal", "grey", "tan"))
    content = {"empty pool": b"# nothing\n\n", "not utf-8": b"a r\xe9d photo\n",
               "too few lines": b"one\ntwo\nthree\n", "labels missing": (labelled + "a photo\n").encode(),
               "typed picks past the pool": (labelled + "a photo\tshape\n").encode()}.get(case)
    if content is not None:
        pool.write_bytes(content)
    names = tmp_path / "names.json"
    names.write_text('{"3": "colour", "x": "shape"}')
    flags = {"min cluster size": ["--min-cluster-size", "1"], "min samples": ["--min-samples", "0"],
             "cluster names": ["--cluster-names", str(names)],
             "labels missing": ["--bank", str(pool), "--concepts", "labels"],
             "typed picks past the pool": ["--bank", str(pool), "--descriptions", "9"]}.get(case, ["--bank", str(pool)])
    args = [a for a in common(world, tmp_path / "run", "--dataset", "dtd", "--analyse-only") if a != "6"]
    args.remove("--descriptions")  # the pool's own default number of picks, unless the case types one
    refused(args + flags, capsys, message, tmp_path / "run")
    assert not analysis_cache.exists()


# ------------------------------------------------------------------------------------------
# The analysis as a whole (--analysis), its code in the cache key, and cheap checks first
# ------------------------------------------------------------------------------------------


def test_analysis_paper_resolves_to_the_papers_settings_and_typed_flags_win(world, tmp_path):
    paper = f"sbert:{cli.SBERT_MODEL}"
    keys = ("analysis", "bank", "concepts", "sentence_encoder", "analysis_pool", "descriptions")
    # ImageNet under --root: its validation images, one map for the model.
    settings = settings_of(common(world, tmp_path / "a", "--dataset", "dtd", "--analysis", "paper"))
    assert [settings[k] for k in keys] == ["paper", "textspan", "clusters", paper, "imagenet:test", 6]
    # No ImageNet under --root: the trained dataset's training images, and the header says so.
    root = tmp_path / "data"
    root.mkdir()
    (root / "dtd").symlink_to(Path(world["root"]) / "dtd")
    argv = [a if a != world["root"] else str(root) for a in common(world, tmp_path / "b", "--dataset", "dtd",
                                                                   "--analysis", "paper")]
    argv.remove("--descriptions")
    argv.remove("6")
    settings = settings_of(argv)
    assert [settings[k] for k in keys] == ["paper", "textspan", "clusters", paper, "train", None]
    header = config.analysis_header(settings, "clusters", toy=False)
    assert header[:7] == ["head analysis: --analysis paper, the paper's Sec. 3.2:", "  --bank textspan",
                          "  --concepts clusters", f"  --sentence-encoder {paper}",
                          "  --analysis-pool train",
                          "  20 picks per head (capped where a head's width allows fewer)",
                          "  no ImageNet under --root: the trained dataset's training images, not "
                          "ImageNet's validation images (the paper's)"]
    assert header[7] == "head analysis: still the project's, not the paper's (docs/METHOD.md Sec. 3):"
    assert "  HDBSCAN's min_cluster_size = the picks per head" in header
    assert "  at most 2000 images" in header
    assert max(map(len, header)) <= 160
    # The toy world: its own bank without labels (its tokenizer knows only toy words), its own images.
    settings = settings_of(["--dataset", "toyworld", "--analysis", "paper"])
    assert [settings[k] for k in keys] == ["paper", "project-unlabelled", "clusters", paper, "train", None]
    # Typed flags win; labels need no encoder, so the preset's SBERT is dropped with them.
    settings = settings_of(common(world, tmp_path / "c", "--dataset", "dtd", "--analysis", "paper", "--bank",
                                  "project", "--concepts", "labels", "--analysis-pool", "train"))
    assert [settings[k] for k in keys] == ["paper", "project", "labels", "clip", "train", 6]
    header = config.analysis_header(settings, "labels", toy=False)
    assert "  --bank project (typed; the paper's: textspan)" in header
    assert not any("--sentence-encoder" in line for line in header)
    # The default: the project's analysis, and its header says it is not the paper's.
    settings = settings_of(common(world, tmp_path / "d", "--dataset", "dtd"))
    assert [settings[k] for k in keys] == ["project", "project", None, "clip", "train", 6]
    assert config.analysis_header(settings, "labels", toy=False) == [
        "head analysis: the project's, not the paper's (--analysis paper): --bank project, concepts labels, "
        "--analysis-pool train"]


def test_analysis_paper_offline_without_textspans_pool_is_one_line(world, tmp_path, capsys, monkeypatch,
                                                                   analysis_cache):
    import urllib.request

    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: (_ for _ in ()).throw(
        urllib.error.URLError("no network")))
    out = tmp_path / "run"
    line = refused(common(world, out, "--dataset", "dtd", "--analysis", "paper", "--sentence-encoder", "clip"),
                   capsys, "--analysis paper reads TextSpan's pool: --bank textspan: cannot download", out)
    assert f"put that file (SHA-256 39c6bf3e788684d9...) at {analysis_cache}" in line


def test_the_analysis_cache_misses_when_the_code_of_the_analysis_changes(world, tmp_path, capsys, monkeypatch):
    """A changed line in any of harness.analysis.analysis_code's modules makes another map."""
    flags = ["--dataset", "dtd", "--analyse-only"]
    assert train.main(common(world, tmp_path / "a", *flags)) == 0
    assert "reusing the role map" not in capsys.readouterr().out
    assert train.main(common(world, tmp_path / "b", *flags)) == 0
    assert "reusing the role map" in capsys.readouterr().out
    getsource = analysis.inspect.getsource
    for index, part in enumerate(analysis.analysis_code(toy=False)):  # the method's, the harness's
        with monkeypatch.context() as patch:
            patch.setattr(analysis.inspect, "getsource", lambda obj: getsource(obj) + "#" * (obj is part))
            assert train.main(common(world, tmp_path / f"edited{index}", *flags)) == 0
        assert "reusing the role map" not in capsys.readouterr().out, part


@pytest.mark.parametrize("flags, message", [
    ([], "/oxford_pets: dataset folder not found"),
    (["--bank", "textspan"], "/oxford_pets: dataset folder not found"),
    (["--analysis", "paper", "--sentence-encoder", "clip"], "/oxford_pets: dataset folder not found"),
    (["--analysis-pool", "imagenet:test"], "/oxford_pets: dataset folder not found"),
    (["--bank", "textspan", "--concepts", "labels"], "--concepts labels: TextSpan's pool has no labels"),
    (["--bank", "textspan", "--sentence-encoder", "sbert:/nowhere"], "sbert:/nowhere: no such folder"),
    (["--protocol", "cross", "--dataset", "all"], "/imagenet: dataset folder not found"),
])
def test_every_check_that_costs_nothing_comes_before_any_download(tmp_path, capsys, monkeypatch, no_network,
                                                                  flags, message):
    """A dataset missing under --root, or a bad flag, is reported before CLIP's weights, TextSpan's
    pool or an SBERT model is fetched: nothing is asked of the network (an empty cache, no --weights)."""
    import urllib.request

    fetched = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, *a, **k: fetched.append(url) or
                        (_ for _ in ()).throw(urllib.error.URLError("no network")))
    monkeypatch.setenv("DEAR_CACHE_DIR", str(tmp_path / "cache"))
    root, out = tmp_path / "empty", tmp_path / "run"
    root.mkdir()
    if "dataset folder" not in message:  # a bad flag: refused before the download, the data there
        (root / "oxford_pets").mkdir()
    argv = ["--root", root, "--output", out, *flags]
    refused((argv if "--dataset" in flags else ["--dataset", "oxford_pets", *argv]), capsys, message, out)
    assert fetched == [] and no_network == [] and not (tmp_path / "cache").exists()

# ------------------------------------------------------------------------------------------
# The token construction (--tokens separate | shared)
# ------------------------------------------------------------------------------------------


def test_k_follows_a_under_shared_and_another_typed_k_or_tokens_is_refused(world, tmp_path, capsys):
    # The tiny world trains the five core attributes: A = 5, not the separate default K = 4 (the
    # toy world's A = 4 would hide a K that stayed 4).
    base = common(world, tmp_path / "run", "--dataset", "dtd", "--seeds", "1")
    assert settings_of(base)["tokens"] == "separate" and settings_of(base)["text_tokens"] == 4
    assert settings_of(base + ["--tokens", "shared"])["text_tokens"] == 5  # resolved, as saved
    assert settings_of(base + ["--tokens", "shared", "--text-tokens", "5"])["text_tokens"] == 5
    assert settings_of(base + ["--text-tokens", "2"])["text_tokens"] == 2  # separate: any K
    for k in ("4", "0"):
        refused(base + ["--tokens", "shared", "--text-tokens", k], capsys,
                f"--text-tokens {k}: K = {k} text tokens: under tokens 'shared' the text tower "
                "receives the A = 5 tokens of the vision tower; leave K unset", tmp_path / "run")
    with pytest.raises(SystemExit) as stop:  # argparse's refusal: one line, exit status 2
        train.main(base + ["--tokens", "joint"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1
    assert "argument --tokens: invalid choice: 'joint'" in lines[0]
    assert not (tmp_path / "run").exists()


def test_shared_reuses_the_analysis_reports_its_parameters_and_resume_refuses_other_tokens(
        world, tmp_path, capsys, analysis_cache):
    run = ["--dataset", "dtd", "--seeds", "1", "--method", "dear", "--roles", "analyse",
           "--epochs", "1", "--shots", "2"]
    separate, shared = tmp_path / "separate", tmp_path / "shared"
    assert train.main(common(world, separate, *run)) == 0
    printed = capsys.readouterr().out
    assert printed.count("head analysis: the last") == 1
    assert "learnable (separate tokens): 3,526 (" in printed  # per component: in the log files
    assert "learnable: vision_tokens 960 + text_tokens 512 + attribute_proj 2,048 + " \
           "fusion_logits 6" in (separate / "log.txt").read_text()
    # Only --tokens changes: the analysis reads the frozen CLIP alone, so its cache serves both.
    assert train.main(common(world, shared, *run, "--tokens", "shared")) == 0
    printed = capsys.readouterr().out
    assert "head analysis: reusing the role map cached" in printed
    assert "head analysis: the last" not in printed
    # J = 1 of a 3-layer vision and 2-layer text tower, widths 64, E = 32, A = K = 5:
    # 5 x 64 + (64 x 64 + 3 x 576) + (64 x 64 + 2 x 576) + (64 x 64 + 64 x 32) + 6
    components = dict(latent_tokens=320, vision_aligner=5_824, text_aligner=5_248,
                      attribute_proj_residual=6_144, fusion_logits=6)
    assert "learnable (shared tokens): 17,542 (" in printed
    assert "learnable: latent_tokens 320 + vision_aligner 5,824 + text_aligner 5,248 + " \
           "attribute_proj_residual 6,144 + fusion_logits 6" in (shared / "log.txt").read_text()
    result = read(shared / "dtd/dear/seed1/results.json")
    assert result["parameters"] == dict(tokens="shared", learnable=17_542, components=components)
    assert read(separate / "dtd/dear/seed1/results.json")["parameters"]["components"] == dict(
        vision_tokens=960, text_tokens=512, attribute_proj=2_048, fusion_logits=6)
    saved = read(shared / "settings.json")["settings"]
    assert (saved["tokens"], saved["text_tokens"]) == ("shared", 5)
    assert read(separate / "settings.json")["settings"]["role_maps"]["dtd"]["fingerprint"] == \
        saved["role_maps"]["dtd"]["fingerprint"]
    assert "latent_tokens" in learnable(shared / "dtd/dear/seed1")
    # --tokens is a setting: a saved run continues only with its own.
    (shared / "dtd/dear/seed1/results.json").unlink()
    refused(["--output", shared, "--resume", "--tokens", "separate"], capsys,
            "--tokens cannot change in a saved run")
    assert train.main(["--output", str(shared), "--resume", "--tokens", "shared"]) == 0


def test_torchrun_trains_shared_tokens_with_blind_branches_and_no_attribute_tokens(world, tmp_path):
    """Two processes (gloo), find_unused_parameters off under --tokens shared: a learnable tensor
    without a gradient would stop the second step. Rows: a roles file, all heads generalization
    (every attribute branch blind), no attribute tokens (the text tower's latent tokens alone)."""
    out = tmp_path / "ddp"
    args = common(world, out, "--dataset", "dtd", "--seeds", "1", "--method", "dear",
                  "--tokens", "shared", "--roles", hand_made_roles(tmp_path), "all-generalization",
                  "--ablations", "no-attribute-tokens",
                  "--shots", "4")  # 12 images: 2 steps per process and epoch
    done = torchrun("train.py", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "x 2 processes" in done.stdout and done.stdout.count("train.py: done") == 1
    for row in ("dear", "dear-all-generalization", "dear-no-attribute-tokens"):
        result = read(out / "dtd" / row / "seed1" / "results.json")
        assert result["parameters"]["tokens"] == "shared"
        assert set(result["metrics"]) == {"base", "novel", "hm"}
    alone = read(out / "dtd/dear-no-attribute-tokens/seed1/results.json")["parameters"]
    assert "vision_aligner" not in alone["components"]


# ------------------------------------------------------------------------------------------
# The test sets' trained flag, the recipe's beta, the one ablation function
# ------------------------------------------------------------------------------------------


def test_each_protocols_test_sets_are_marked_trained_exactly_where_the_classes_were_trained(world, tmp_path):
    """The flag decides the scoring rule (class-on-unseen: the class branch alone where False):
    few-shot's one test set holds the trained classes and is scored like base, never like novel."""
    datasets = train.Datasets(world["root"], log=print)

    def marks(protocol: str, trained: str, *datasets_flag):
        settings = settings_of(common(world, tmp_path / "unused", "--protocol", protocol, "--dataset", *datasets_flag))
        return {s.name: s.trained for s in train.evaluation_sets(settings, datasets, trained)}

    assert marks("fewshot", "dtd", "dtd") == {"all": True}
    assert marks("base2novel", "dtd", "dtd") == {"base": True, "novel": False}
    assert marks("cross", "imagenet", "dtd") == {"imagenet": True, "dtd": False}
    (fewshot,) = train.evaluation_sets(settings_of(common(world, tmp_path / "u", "--protocol", "fewshot", "--dataset",
                                                          "dtd")), datasets, "dtd")
    assert [dear.scoring_logits(mode, fewshot.trained) for mode in cli.FUSION_MODES] == ["fused", "fused"]


def test_build_dear_keeps_the_recipes_beta_and_evaluate_scores_at_the_beta_it_is_given(world, tmp_path):
    """The toy recipe's beta is DeAR's own default (0.5), so no toy run shows a dropped one:
    Oxford Pets' recipe (MMRL++'s 0.7) must reach the model, and evaluate's beta the pass alone."""
    import data

    settings = settings_of(common(world, tmp_path / "unused", "--dataset", "oxford_pets"))
    assert settings["beta"] == train.RECIPES["base2novel"]["oxford_pets"].beta == 0.7
    clip, _ = clip_model.load(world["weights"], head_width=32)
    tokenizer = clip_model.SimpleTokenizer(world["bpe"])
    inputs = sources.Inputs(clip, tokenizer, list(dear.CORE_ATTRIBUTES), [], "labels", None, False, {})
    roles = dear.RoleMap.uniform("mixed", 3, 2, range(3))
    torch.manual_seed(0)
    model = train.build_dear(settings, inputs, dear.ablate(None, roles, inputs.attributes, 0.1)).eval()
    assert model.beta == 0.7
    with torch.no_grad():
        for tensor in (model.tokens.vision_tokens, model.tokens.text_tokens):
            tensor.normal_(0, 3.0)
    at_02 = train.build_dear(dict(settings, beta=0.2), inputs,
                             dear.ablate(None, roles, inputs.attributes, 0.1)).eval()
    at_02.load_learnable_state_dict(model.learnable_state_dict())
    d = data.load_dataset("dtd", world["root"], num_shots=None, subsample="new")
    novel = train.EvalSet("novel", d.test, d.classnames, d.template, False)
    options, runtime = dict(eval_batch_size=8, workers=0), devices.Runtime(torch.device("cpu"))
    seen, encode_image = [], model.encode_image  # the beta each batch's image pass ran at
    model.encode_image = lambda images, beta=None: (seen.append(beta), encode_image(images, beta=beta))[1]
    given = train.evaluate(model, clip, tokenizer, novel, options, runtime, beta=0.2)
    assert seen and set(seen) == {0.2} and model.beta == 0.7  # given to the pass; the model's kept
    assert given == train.evaluate(at_02, clip, tokenizer, novel, options, runtime)


# Each ablation's one change, as the fields of dear.Ablated it moves.
ABLATION_CHANGES = {"no-role-mask": {"role_map"}, "no-attribute-tokens": {"role_map", "attributes"},
                    "no-fusion-reg": {"lambda_fusion"},
                    "mask-generalization-only": {"role_map", "class_branch_fallback"},
                    "branch-ce": {"branch_ce"}, "shuffled-heads": {"role_map"},
                    "whole-layers": {"role_map"}, "true-heads": {"role_map"},
                    "fixed-fusion": {"fixed_alpha"}, "feature-fusion": {"fuse"},
                    "no-self-reg": {"lambda_reg"}}


def measured_map() -> dear.RoleMap:
    """The tiny CLIP's three layers x two heads, measured: one attribute head, one generalization."""
    roles = {(2, 0): ("attribute", "colour", 0.1), (1, 1): ("generalization", None, 3.0)}
    heads = [dear.HeadRole(layer, head, *roles.get((layer, head), ("mixed", None, 1.5)))
             for layer in range(3) for head in range(2)]
    return dear.RoleMap(3, 2, list(dear.CORE_ATTRIBUTES), heads, source="measured")


def test_build_dear_warns_of_left_out_branches_only_where_the_header_has_not_said_so(tiny_clip):
    """The header says a map blind by construction (all-generalization) and the fallback to the
    class branch; a run warns (dear.LeftOutWarning) only of branches it has not said."""

    attributes = list(dear.CORE_ATTRIBUTES)
    settings = dict(first_layer="auto", beta=0.7, text_tokens=2, tokens="separate", lambda_fusion=0.3,
                    lambda_reg=1.0)
    inputs = sources.Inputs(tiny_clip, None, attributes, [], "labels", None, False, {})

    def warned(role_map, ablation=None) -> list:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train.build_dear(settings, inputs, dear.ablate(ablation, role_map, attributes, 0.3))
        return [str(w.message) for w in caught if issubclass(w.category, dear.LeftOutWarning)]

    def measured(colour_head: bool) -> dear.RoleMap:  # every other head a generalization head
        heads = [dear.HeadRole(layer, head, "generalization", None, 3.0)
                 for layer in range(3) for head in range(2)]
        if colour_head:
            heads[4] = dear.HeadRole(2, 0, "attribute", "colour", 0.1)
        return dear.RoleMap(3, 2, attributes, heads, source="measured")

    assert warned(sources.role_map_for("all-generalization", tiny_clip, attributes, None)) == []
    assert warned(measured(colour_head=False)) == []  # the fallback to the class branch, said
    blind = warned(measured(colour_head=True))  # colour's head alone: the other tokens are blind
    assert len(blind) == 1 and "shape" in blind[0] and "colour" not in blind[0]


def test_each_ablation_makes_exactly_its_one_change_and_the_rows_follow(tiny_clip, world, tmp_path):
    assert set(ABLATION_CHANGES) == set(dear.ABLATIONS)
    attributes, analysed = list(dear.CORE_ATTRIBUTES), measured_map()
    plain = dear.ablate(None, analysed, attributes, 0.3)
    assert plain == (analysed, attributes, True, 0.3, False, 1.0, "logits", None)
    true_map = dear.RoleMap.uniform("generalization", 3, 2, range(3))
    for name, fields in ABLATION_CHANGES.items():
        change = dear.ablate(name, analysed, attributes, 0.3, true_map=true_map)
        moved = {f for f in dear.Ablated._fields if getattr(change, f) != getattr(plain, f)}
        assert moved == fields, name
    roles_of = lambda m: [(h.layer, h.head, h.role, h.attribute) for h in m.heads]  # noqa: E731
    no_mask = dear.ablate("no-role-mask", analysed, attributes, 0.3).role_map
    assert roles_of(no_mask) == roles_of(sources.role_map_for("all-mixed", tiny_clip, attributes, None))
    none = dear.ablate("no-attribute-tokens", analysed, attributes, 0.3)
    assert none.attributes == [] and none.role_map.attributes == []
    assert {h.role for h in none.role_map.heads} == {"mixed"}
    only = dear.ablate("mask-generalization-only", analysed, attributes, 0.3)
    assert [r[2] for r in roles_of(only.role_map)] == ["mixed" if r[2] == "attribute" else r[2]
                                                       for r in roles_of(analysed)]
    assert dear.ablate("no-fusion-reg", analysed, attributes, 0.3).lambda_fusion == 0.0
    assert dear.ablate("branch-ce", analysed, attributes, 0.3).branch_ce
    # Built: the map made by hand keeps every branch (without the switch it would fall back).
    settings = dict(first_layer="auto", beta=0.7, text_tokens=2, tokens="separate", lambda_fusion=0.3,
                    lambda_reg=1.0)
    inputs = sources.Inputs(tiny_clip, None, attributes, [], "labels", None, False, {})
    built = train.build_dear(settings, inputs, only)
    assert not built.class_branch_only and not dear.falls_back_to_class_branch(analysed)
    assert dear.falls_back_to_class_branch(built.role_map)  # measured, no attribute head left
    assert train.build_dear(settings, inputs, none).attributes == []
    # The rows: no-role-mask is --roles all-mixed's row; each other one the DeAR row changed.
    # all: the toy world's true-heads left out elsewhere, and refused there when asked for
    rows = plan.dear_rows(settings_of(common(world, tmp_path / "u", "--dataset", "dtd", "--ablations", "all")))
    assert rows == [("dear", "analyse", None), ("dear-all-mixed", "all-mixed", "no-role-mask")] + [
        (f"dear-{name}", "analyse", name) for name in dear.ABLATIONS
        if name not in ("no-role-mask", "true-heads")]
    with pytest.raises(train.TrainError, match="--ablations true-heads: the toy world.s only"):
        settings_of(common(world, tmp_path / "v", "--dataset", "dtd", "--ablations", "true-heads"))
    with pytest.raises(dear.DeARError, match="ablation 'no-such': use one of no-role-mask, "):
        dear.ablate("no-such", analysed, attributes, 0.3)


# ------------------------------------------------------------------------------------------
# A non-finite step: the run stops at its last finite checkpoint, the call goes on
# ------------------------------------------------------------------------------------------


def poisoned_loss(monkeypatch, poisoned, what: str):
    """dear.dear_loss as train.py calls it, with each call n (1-based, over the whole call's runs)
    where poisoned(n) made non-finite: the loss term ce NaN, or (what="gradient") a finite loss
    whose gradient is NaN (0 * d sqrt(x)/dx at x = 0), as a fused attention kernel's backward
    gives it."""
    real, calls = dear.dear_loss, []

    def loss(output, labels, *args, **kwargs):
        losses = real(output, labels, *args, **kwargs)
        calls.append(1)
        if poisoned(len(calls)):
            if what == "ce":
                losses["ce"] = losses["ce"] * float("nan")
                losses["total"] = losses["total"] + losses["ce"]
            else:
                alpha = output.alpha[0]
                losses["total"] = losses["total"] + 0 * torch.sqrt(alpha - alpha.detach())
        return losses
    monkeypatch.setattr(train.dear, "dear_loss", loss)
    return calls


@pytest.mark.parametrize("what, said", [("ce", "loss (total, ce) and gradients not finite"),
                                        ("gradient", "gradients not finite")])
def test_a_non_finite_step_stops_its_run_at_its_last_finite_checkpoint_and_resume_continues(
        world, tmp_path, monkeypatch, capsys, what, said):
    """12 training images of 3 classes in batches of 4: 3 steps an epoch. The 5th step of seed
    1 (epoch 2, step 2) goes non-finite: that run stops with one line, keeps epoch 1's checkpoint
    (finite) and writes no results.json; seed 2 trains and is tabled alone; the call exits 1;
    --resume trains seed 1 from epoch 1 to the end."""
    out = tmp_path / "run"
    argv = common(world, out, "--dataset", "dtd", "--method", "dear", "--roles", "all-mixed",
                  "--seeds", "1", "2", "--shots", "4", "--epochs", "3", "--augment", "off")
    with monkeypatch.context() as patch:
        poisoned_loss(patch, lambda n: n == 5, what=what)
        capsys.readouterr()
        assert train.main(argv) == 1
    printed, stderr = capsys.readouterr()
    seed1, seed2 = out / "dtd" / "dear-all-mixed" / "seed1", out / "dtd" / "dear-all-mixed" / "seed2"
    line = next(l for l in printed.splitlines() if "diverged" in l)
    kernel = devices.sdpa_kernel_used(torch.device("cpu"), None, None)  # flash on today's CPUs
    assert line == ("train.py: [dtd / dear-all-mixed / seed 1] diverged at epoch 2, step 2: "
                    f"{said} (fp32, attention sdpa ({kernel})); epoch 1's checkpoint kept; "
                    "try --attention explicit or another --amp, then --resume")
    # what to change, since --resume as it was repeats the divergence: the command to continue
    assert stderr.strip().splitlines()[-1] == (
        "train.py: 1 of 2 runs diverged (above); the others' numbers are in the tables; --resume as "
        "it was would diverge again: continue with another --attention or --amp (python train.py "
        f"--output {out} --resume --attention explicit), or start again with a smaller --lr and "
        "another --output")
    checkpoint = torch.load(seed1 / "checkpoint.pt", weights_only=True)
    assert checkpoint["epoch"] == 1
    assert all(torch.isfinite(t).all() for t in checkpoint["learnable"].values())
    assert not (seed1 / "results.json").exists() and (seed2 / "results.json").is_file()
    assert [r["epoch"] for r in runfolder.read_metrics(str(seed1 / "metrics.jsonl"))] == [1]
    summary = (out / "summary.md").read_text()
    assert "DeAR, all heads mixed (no mask) (1 run diverged, not in the mean)" in summary
    assert read(out / "summary.json")["tables"]["dtd"]["rows"]["dear-all-mixed"][0] == \
        round(read(seed2 / "results.json")["metrics"]["base"], 2)  # seed 2 alone
    # The next call, without the poison, finishes seed 1 from its epoch-1 checkpoint.
    capsys.readouterr()
    assert train.main(["--output", str(out), "--resume"]) == 0
    assert "resumed after epoch 1/3" in capsys.readouterr().out
    assert torch.load(seed1 / "checkpoint.pt", weights_only=True)["epoch"] == 3
    assert (seed1 / "results.json").is_file()
    assert [r["epoch"] for r in runfolder.read_metrics(str(seed1 / "metrics.jsonl"))] == [1, 2, 3]


def fp16_run(world, out, monkeypatch, poisoned, epochs: int):
    """One DeAR run of 3 steps an epoch under fp16 with its loss scaler (simulated on the CPU),
    the steps where poisoned(n) given a NaN gradient -> train.main's exit status."""
    from test_devices import simulated

    simulated(monkeypatch, torch.float16)
    poisoned_loss(monkeypatch, poisoned, what="gradient")
    return train.main(common(world, out, "--dataset", "dtd", "--method", "dear", "--roles",
                             "all-mixed", "--seeds", "1", "--shots", "4", "--epochs", str(epochs),
                             "--augment", "off"))


def test_fp16s_skipped_steps_are_counted_per_epoch_and_reported_in_results_and_summary(
        world, tmp_path, monkeypatch):
    """One skipped step in 27: counted in its epoch's metrics.jsonl record, and the run's share
    and final loss scale in results.json and summary.md."""
    out = tmp_path / "run"
    assert fp16_run(world, out, monkeypatch, lambda n: n == 2, epochs=9) == 0
    leaf = out / "dtd" / "dear-all-mixed" / "seed1"
    assert "1 steps skipped by fp16's loss scaler" in (leaf / "log.txt").read_text()
    records = runfolder.read_metrics(str(leaf / "metrics.jsonl"))
    assert [r["skipped_steps"] for r in records] == [1] + [0] * 8  # per epoch, not per call
    assert read(leaf / "results.json")["fp16"] == dict(skipped_steps=1, steps=27,
                                                       skipped_share=1 / 27, loss_scale=32768.0)
    assert ("fp16's loss scaler, dtd / dear-all-mixed / seed 1: 1 of 27 steps skipped (3.7%), "
            "final scale 32768") in (out / "summary.md").read_text()


def test_every_fifth_step_skipped_stops_the_run_by_its_share_of_skipped_steps(
        world, tmp_path, monkeypatch, capsys):
    """Every 5th step's gradient NaN (an fp16 kernel's, not an overflow): each is skipped and the
    scale halves; past MAX_SKIPPED_SHARE of the steps (after SHARE_STEPS' allowance) the run
    stops as diverged, never finishing with a results.json."""
    out = tmp_path / "run"
    assert fp16_run(world, out, monkeypatch, lambda n: n % 5 == 0, epochs=20) == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if "diverged" in l)
    assert ("diverged at epoch 19, step 2: 11 of 56 steps skipped by fp16's loss scaler (above 5%) "
            "(fp16, ") in line and "epoch 18's checkpoint kept" in line
    assert not (out / "dtd" / "dear-all-mixed" / "seed1" / "results.json").exists()


def test_no_checkpoint_while_steps_are_skipped_in_a_row_and_resume_starts_a_fresh_scaler(
        world, tmp_path, monkeypatch, capsys):
    """Every step from the 6th on skipped: epoch 2 ends on a skip, so its checkpoint is not taken
    (nor any later one); the run stops by its share of skips with epoch 1's checkpoint, and
    --resume continues from it with a fresh loss scaler, not the collapsed one."""
    out = tmp_path / "run"
    leaf = out / "dtd" / "dear-all-mixed" / "seed1"
    with monkeypatch.context() as patch:
        assert fp16_run(world, out, patch, lambda n: n >= 6, epochs=9) == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if "diverged" in l)
    assert "12 of 17 steps skipped" in line and "epoch 1's checkpoint kept" in line
    assert torch.load(leaf / "checkpoint.pt", weights_only=True)["epoch"] == 1
    assert "epoch 2/9 done in" in (leaf / "log.txt").read_text()
    assert "no checkpoint: the last 1 steps skipped by fp16's loss scaler" in (leaf / "log.txt").read_text()
    from test_devices import simulated

    simulated(monkeypatch, torch.float16)
    assert train.main(["--output", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "resumed in fp16 after a divergence: a fresh loss scaler (65536)" in printed
    assert read(leaf / "results.json")["fp16"]["loss_scale"] == 65536.0
    assert not (leaf / runfolder.DIVERGED_FILE).exists()


@pytest.mark.parametrize("poisoned, said, off", [
    (lambda n: n >= 3, f"{monitor.MAX_SKIPPED_IN_A_ROW} steps in a row skipped by fp16's loss "
     "scaler", "MIN_LOSS_SCALE"),  # the 20th in a row: step 22 (the scale: 1/16)
    (lambda n: n % 5 == 0, "fp16's loss scale fell to 0.5 (below 1)", "MAX_SKIPPED_IN_A_ROW")])
def test_fp16s_skips_in_a_row_and_a_collapsed_scale_stop_the_run(
        world, tmp_path, monkeypatch, capsys, poisoned, said, off):
    """The other two bounds, each alone: the share's and the other one taken out of the way."""
    monkeypatch.setattr(monitor, "SHARE_STEPS", 10**6)
    monkeypatch.setattr(monitor, off, 0 if off == "MIN_LOSS_SCALE" else 10**6)
    assert fp16_run(world, tmp_path / "run", monkeypatch, poisoned, epochs=30) == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if "diverged" in l)
    assert f": {said} (fp16, " in line


def test_a_training_step_waits_on_the_device_only_at_the_progress_read(
        world, tmp_path, monkeypatch):
    """Host syncs counted in the training steps, under fp16 (simulated, its scaler on) and the
    branch-ce row: each call from the project's code or torch's GradScaler that makes the host
    wait on a GPU (.item(), .tolist(), .nonzero(), bool/float/int of a tensor, .cpu(), a blocking
    copy to a device). Only the guard's read every --log-every steps and at each epoch's end may
    sync: no scaler step reading found_inf (a plain AdamW's), no blocking label copy, no
    nonzero() of the branches in the fusion."""
    from test_devices import simulated

    ours = (str(REPO / "train.py"), str(REPO / "dear.py"), str(REPO / "clip_model.py"),
            str(REPO / "harness"), os.path.join("torch", "amp", "grad_scaler.py"))
    syncs, counting = [], [False]

    def counted(name, real):
        def call(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            copy = name != "to" or (not kwargs.get("non_blocking") and any(
                isinstance(a, (torch.device, str)) for a in (*args, kwargs.get("device"))))
            if counting[0] and copy and any(caller.startswith(p) or p in caller for p in ours):
                syncs.append(f"{name} from {os.path.basename(caller)}")
            return real(self, *args, **kwargs)
        return call

    for name in ("item", "tolist", "nonzero", "__bool__", "__float__", "__int__", "cpu", "to"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    real_epoch, steps = monitor.Progress.epoch, []

    def epoch(self, *args):  # counting inside the loop's body alone: the step and its read
        for step, batch in real_epoch(self, *args):
            counting[0] = True
            yield step, batch
            counting[0] = False
            steps.append(step)
    monkeypatch.setattr(monitor.Progress, "epoch", epoch)
    simulated(monkeypatch, torch.float16)
    assert train.main(common(world, tmp_path / "run", "--dataset", "dtd", "--method", "dear",
                             "--ablations", "branch-ce", "--seeds", "1", "--shots", "4",
                             "--augment", "off")) == 0
    # 2 runs x 2 epochs x 3 steps; --log-every 2: a read at steps 2 and 3 of each epoch
    assert len(steps) == 12 and syncs == ["tolist from monitor.py"] * 8, syncs


def test_each_run_keeps_its_log_metrics_and_curves_across_a_resume_and_eval_only(
        stopped_run, tmp_path):
    """log.txt (every line printed for the run, and every progress line), metrics.jsonl (one record
    per epoch) and curves.png in the run's folder; the call's own log.txt in the output folder.
    --resume appends; a record of an epoch past the checkpoint (a call killed between the two
    writes) is cut first; --eval-only leaves the history as it was."""
    out, _ = copy_run(stopped_run, tmp_path)
    leaf = out / "dtd" / "dear" / "seed1"
    assert [r["epoch"] for r in runfolder.read_metrics(str(leaf / "metrics.jsonl"))] == [1]
    first = (leaf / "log.txt").read_text()
    assert "epoch 1/2 step 3/3 loss" in first and "stopped after epoch 1/2" in first
    with open(leaf / "metrics.jsonl", "a") as f:  # epoch 2's record, written before a kill
        f.write(json.dumps(dict(runfolder.read_metrics(str(leaf / "metrics.jsonl"))[0], epoch=2)) + "\n")
        f.write('{"epoch": 3, "lo')  # and a line cut short
    assert train.main(["--output", str(out), "--resume"]) == 0
    records = runfolder.read_metrics(str(leaf / "metrics.jsonl"))
    assert [r["epoch"] for r in records] == [1, 2]
    assert set(records[1]) >= {"epoch", "lr", "loss", "train_accuracy", "alpha", "images_per_second",
                               "data_wait", "gradient_norm", "skipped_steps", "seconds"}
    assert set(records[1]["loss"]) == {"total", "ce", "reg", "fusion"}
    assert records[1]["alpha"]["class"] > 0 and 0 <= records[1]["data_wait"] <= 1
    second = (leaf / "log.txt").read_text()
    assert second.startswith(first) and "resumed after epoch 1/2" in second  # appended
    assert "epoch 2/2 step 3/3 loss" in second and "test: base" in second
    assert (leaf / "curves.png").stat().st_size > 1000
    call_log = (out / "log.txt").read_text()
    assert call_log.count("train.py: base2novel on dtd") == 2 and "train.py: done in" in call_log
    assert "== run 1/2: dtd / zeroshot (already finished) ==" in call_log  # the resumed call's
    kept = {name: (leaf / name).read_bytes() for name in ("metrics.jsonl", "curves.png")}
    assert train.main(["--output", str(out), "--eval-only"]) == 0
    assert {name: (leaf / name).read_bytes() for name in kept} == kept
    assert (leaf / "log.txt").read_text().startswith(second)
