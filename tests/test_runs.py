"""Tests of the harness's reports.py and files.py on their own: the summary tables'
arithmetic (HM of the means, empty cells, the spread), the cache lock. The
harness's end-to-end guarantees (resume refusal, fingerprints, the folder lock, checkpoints,
one-line errors) are tested through the command line in tests/test_train.py.

    python -m pytest -q tests/test_runs.py
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness import files, reports  # noqa: E402


def test_summary_leaves_the_linear_probe_novel_and_hm_empty_and_shows_the_spread():
    settings = dict(protocol="base2novel", dataset=["a"], roles=["analyse"], ablations=[],
                    fusion=["class-on-unseen"], seeds=[1, 2], shots=[16], test_beta=None)
    results = [dict(job=dict(dataset="a", row="linear-probe", shots=16), metrics=dict(base=b)) for b in (80.0, 84.0)]
    results += [dict(job=dict(dataset="a", row="dear", shots=16), metrics=dict(base=b, novel=n))
                for b, n in ((70.0, 50.0), (74.0, 54.0))]
    table = reports.summarise(settings, results)["tables"]["a"]
    assert table["rows"]["linear-probe"] == [82.0, None, None]
    assert table["spread"]["linear-probe"][0] == round(4 / 2 ** 0.5, 2)
    assert table["spread"]["dear-class-on-unseen"][:2] == [round(4 / 2 ** 0.5, 2)] * 2
    lines = reports.markdown(dict(tables={"a": table}), dict(settings, weights="w")).splitlines()
    assert "| Linear probe (frozen image features) | 82.00 ± 2.83 | - | - |" in lines
    assert not any("names no attribute head" in line for line in lines)
    fallen = dict(settings, weights="w", role_maps={"a": dict(class_branch_only=True)})
    assert "- The head analysis of a names no attribute head: DeAR falls back to the class branch alone there." \
        in reports.markdown(dict(tables={"a": table}), fallen).splitlines()


def test_the_summary_reads_the_same_wherever_the_weights_lie_but_for_their_own_line():
    # A clone at a longer path once moved the prose's line breaks, and the golden test failed.
    settings = dict(protocol="base2novel", dataset=["a"], roles=["analyse"], ablations=[],
                    fusion=["fused-everywhere"], seeds=[1], shots=[2], test_beta=None)
    run = dict(job=dict(dataset="a", row="dear", shots=2), metrics=dict(base=70.0, novel=30.0))
    summary = reports.summarise(settings, [run])
    short, long = "/w/clip.pt", "/a/much/longer/folder/than/the/recording/machines/clone/clip.pt"
    texts = [reports.markdown(summary, dict(settings, weights=path)).splitlines()
             for path in (short, long)]
    assert [line.replace(long, short) for line in texts[1]] == texts[0]
    assert f"CLIP weights: {long}" in texts[1]


def test_a_datasets_hm_is_the_hm_of_its_mean_base_and_mean_novel_not_the_mean_of_per_seed_hms():
    settings = dict(protocol="base2novel", dataset=["a"], roles=["analyse"], ablations=[],
                    fusion=["fused-everywhere"], seeds=[1, 2], shots=[16], test_beta=None)
    results = [dict(job=dict(dataset="a", row="dear", shots=16), metrics=dict(base=b, novel=n))
               for b, n in ((90.0, 10.0), (50.0, 50.0))]
    table = reports.summarise(settings, results)["tables"]["a"]
    # mean base 70, mean novel 30: HM 42.0; the per-seed HMs 18 and 50 would average 34.0
    assert table["rows"]["dear-fused"] == [70.0, 30.0, 42.0]


def test_summary_takes_hm_of_the_averages_as_the_paper_does():
    settings = dict(protocol="base2novel", dataset=["a", "b"], roles=["analyse"], ablations=[],
                    fusion=["class-on-unseen"], seeds=[1], shots=[16], test_beta=None)
    results = [dict(job=dict(dataset=d, row="dear", shots=16), metrics=dict(base=b, novel=n))
               for d, b, n in (("a", 90.0, 10.0), ("b", 50.0, 50.0))]
    summary = reports.summarise(settings, results)
    average = summary["tables"]["Average over 2 datasets"]["rows"]["dear-class-on-unseen"]
    # base 70, novel 30: HM(70, 30) = 42.0, not the mean of the per-dataset HMs (18.0 and 50.0)
    assert average == [70.0, 30.0, 42.0]
    assert summary["tables"]["a"]["rows"]["dear-class-on-unseen"] == [90.0, 10.0, 18.0]


@pytest.mark.skipif(sys.platform == "win32", reason="no file locks on this system")
def test_the_lock_names_its_holder_while_held_and_leaves_no_file(tmp_path):
    path = tmp_path / "entry.lock"
    with files.lock(str(path)):
        assert path.read_text().strip() == str(os.getpid())  # for a waiter's message
    assert not path.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="no file locks on this system")
def test_a_second_writer_of_a_cache_entry_waits_for_the_first(tmp_path):
    path, released = tmp_path / "entry.lock", tmp_path / "released"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1); "
                               "open(sys.argv[2], 'w').close(); f.close()", str(path), str(released)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    lines = []
    with files.lock(str(path), "waiting for it", lines.append):
        assert released.exists(), "the lock was taken while the first writer held it"
    holder.wait()
    assert len(lines) == 1 and "waiting for it" in lines[0]
