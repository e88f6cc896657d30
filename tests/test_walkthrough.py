"""docs/walkthrough.py runs top to bottom from a fresh cache (each of its eleven steps asserts the
invariant it shows, so a broken step fails here), and the page in docs/ is the one it writes: the
same steps, the same code, every picture there. A one-line bug in where encode_text puts its
tokens stops it at the forward step. About 85 CPU-seconds, then half that."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
WALKTHROUGH = ROOT / "docs" / "walkthrough.py"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: the first test fills it from nothing, the next reuses it."""
    return tmp_path_factory.mktemp("cache")


def skeleton(page: str) -> list:
    """What does not depend on the machine that ran it: the headings, the code, the pictures."""
    headings = re.findall(r"^## .*$", page, flags=re.M)
    code = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    pictures = re.findall(r"!\[[^]]*\]\(([^)]+)\)", page)
    return [headings, code, pictures]


def test_the_walkthrough_runs_and_docs_holds_the_page_it_writes(tmp_path, cache):
    env = subprocess_env(cache)
    done = subprocess.run([sys.executable, str(WALKTHROUGH), "--output",
                           str(tmp_path / "page")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every step's invariant held" in done.stdout and not done.stderr.strip(), done.stderr
    fresh = (tmp_path / "page" / "walkthrough.md").read_text(encoding="utf-8")
    headings, code, pictures = skeleton(fresh)
    assert headings[0].startswith("## Setup") and len(headings) == 12
    assert [h.split(".")[0] for h in headings[1:]] == [f"## Step {n}" for n in range(1, 12)]
    printed = re.findall(r"```text\n(.*?)```", fresh, flags=re.S)
    assert len(printed) == 12 and all(block.strip() for block in printed)  # every step shows some
    assert all((tmp_path / "page" / p).stat().st_size > 1000 for p in pictures)
    shipped = (ROOT / "docs" / "walkthrough.md").read_text(encoding="utf-8")
    assert skeleton(shipped) == [headings, code, pictures], \
        "docs/walkthrough.md is not the page docs/walkthrough.py writes: run it again"
    assert all((ROOT / "docs" / p).is_file() for p in pictures)


# One line of dear.DeAR.encode_text changed: t_c read where the prompt had its end-of-text token,
# not K places right. The walkthrough runs on that code.
BUG = ("classes.eot + K)", "classes.eot)")
RUN_WITH_BUG = """
import inspect, runpy, sys, textwrap
sys.path.insert(0, {root!r})
import dear
source = textwrap.dedent(inspect.getsource(dear.DeAR.encode_text))
assert source.count({old!r}) == 1
namespace = dict(vars(dear))
exec(source.replace({old!r}, {new!r}), namespace)
dear.DeAR.encode_text = namespace["encode_text"]
sys.argv = [{script!r}, "--output", {page!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_a_one_line_bug_in_encode_texts_token_positions_stops_the_forward_step(tmp_path, cache):
    code = RUN_WITH_BUG.format(root=str(ROOT), old=BUG[0], new=BUG[1], script=str(WALKTHROUGH),
                               page=str(tmp_path / "page"))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=subprocess_env(cache),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode != 0 and "AssertionError" in done.stderr, done.stderr[-3000:]
    assert "---- step 7" in done.stdout and "---- step 8" not in done.stdout, done.stdout[-3000:]
