"""docs/walkthrough.py runs top to bottom from a fresh cache (each of its ten steps asserts the
invariant it shows, so a broken step fails here), and the page in docs/ is the one it writes: the
same steps, the same code, every picture there. About a minute on 2 cores."""

import re
import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def skeleton(page: str) -> list:
    """What does not depend on the machine that ran it: the headings, the code, the pictures."""
    headings = re.findall(r"^## .*$", page, flags=re.M)
    code = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    pictures = re.findall(r"!\[[^]]*\]\(([^)]+)\)", page)
    return [headings, code, pictures]


def test_the_walkthrough_runs_and_docs_holds_the_page_it_writes(tmp_path):
    env = subprocess_env(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "walkthrough.py"), "--output",
                           str(tmp_path / "page")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every step's invariant held" in done.stdout and not done.stderr.strip(), done.stderr
    fresh = (tmp_path / "page" / "walkthrough.md").read_text(encoding="utf-8")
    headings, code, pictures = skeleton(fresh)
    assert headings[0].startswith("## Setup") and len(headings) == 11
    assert [h.split(".")[0] for h in headings[1:]] == [f"## Step {n}" for n in range(1, 11)]
    printed = re.findall(r"```text\n(.*?)```", fresh, flags=re.S)
    assert len(printed) == 11 and all(block.strip() for block in printed)  # every step shows some
    assert all((tmp_path / "page" / p).stat().st_size > 1000 for p in pictures)
    shipped = (ROOT / "docs" / "walkthrough.md").read_text(encoding="utf-8")
    assert skeleton(shipped) == [headings, code, pictures], \
        "docs/walkthrough.md is not the page docs/walkthrough.py writes: run it again"
    assert all((ROOT / "docs" / p).is_file() for p in pictures)
