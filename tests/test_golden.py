"""A golden record of two fixed runs on the shipped toy CLIP, so that a change meant to move no
number (a rename, a reordering, a module split) provably moves none.

  run 1: train.py --dataset toyworld --seeds 1 --epochs 2 --shots 2 --method dear
         --ablations all             (labels as concepts; every ablation row; 9 runs)
  run 2: train.py --dataset toyworld --analyse-only --concepts clusters --descriptions 6
         (the paper's route: the picks clustered by HDBSCAN over CLIP's text tower)

Recorded in tests/golden/: each run's printed lines (times, speeds and paths masked), roles.json
byte for byte, the tables (summary.md, retrieval.md), and per run folder the numbers of its
results.json (accuracies exactly; learned weights and retrieval precision to 1e-6, the last bits
a reordered sum may move). The shipped model and the task's images are the same on every machine
(docs/MEASURED.md, "Same model everywhere"); the trained numbers are the same on the same kind of
CPU. To record again after a change that is meant to move numbers:

    DEAR_RECORD_GOLDEN=1 python -m pytest -q tests/test_golden.py
"""

import json
import os
import re

import pytest

import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(REPO, "tests", "golden")
RECORD = os.environ.get("DEAR_RECORD_GOLDEN") == "1"

RUNS = {
    "ablations": ["--dataset", "toyworld", "--seeds", "1", "--epochs", "2", "--shots", "2",
                  "--method", "dear", "--ablations", "all"],
    "clusters": ["--dataset", "toyworld", "--analyse-only", "--concepts", "clusters",
                 "--descriptions", "6"],
}
EXACT = ("metrics", "metrics_by_fusion", "logits_by_fusion", "accuracy_by_logits", "parameters",
         "test_beta", "fusion", "logits")
CLOSE = ("alpha", "retrieval")


def masked(text: str, output: str, cache: str) -> str:
    """Printed lines without what depends on the machine's speed or the folders' names."""
    text = text.replace(output, "<output>").replace(cache, "<cache>").replace(REPO, "<repo>")
    text = re.sub(r"\d+:\d\d:\d\d", "<time>", text)
    text = re.sub(r"\d+(\.\d+)? img/s", "<speed>", text)
    return re.sub(r"in \d+\.\d+ s\b", "in <seconds>", text)


def numbers(results: dict) -> dict:
    return {key: results[key] for key in EXACT + CLOSE if key in results}


def assert_close(actual, expected, where: str) -> None:
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), where
        for key in expected:
            assert_close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, float):
        assert actual == pytest.approx(expected, abs=1e-6), where
    else:
        assert actual == expected, where


def check(name: str, produced: str, what: str) -> None:
    path = os.path.join(GOLDEN, name)
    if RECORD:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(produced)
        return
    with open(path) as f:
        assert produced == f.read(), f"{what} differs from {path}"


@pytest.mark.parametrize("run", list(RUNS))
def test_fixed_toy_runs_print_and_write_what_they_wrote_when_recorded(run, tmp_path, capsys,
                                                                       monkeypatch):
    output, cache = str(tmp_path / "out"), str(tmp_path / "cache")
    monkeypatch.delenv("CLIP_CACHE_DIR", raising=False)
    monkeypatch.setenv("DEAR_CACHE_DIR", cache)
    capsys.readouterr()
    assert train.main([*RUNS[run], "--output", output]) == 0
    printed = capsys.readouterr().out
    check(f"{run}/stdout.txt", masked(printed, output, cache), "what the run printed")
    with open(os.path.join(output, "toyworld", "roles", "roles.json")) as f:
        check(f"{run}/roles.json", f.read(), "roles.json")
    if run != "ablations":
        return
    for table in ("summary.md", "retrieval.md"):
        with open(os.path.join(output, table)) as f:
            check(f"{run}/{table}", masked(f.read(), output, cache), table)
    found = {}
    for folder, _, files in sorted(os.walk(os.path.join(output, "toyworld"))):
        if "results.json" in files:
            with open(os.path.join(folder, "results.json")) as f:
                found[os.path.relpath(folder, output)] = numbers(json.load(f))
    path = os.path.join(GOLDEN, run, "results.json")
    if RECORD:
        with open(path, "w") as f:
            json.dump(found, f, indent=1, sort_keys=True)
        return
    with open(path) as f:
        assert_close(found, json.load(f), "results")
