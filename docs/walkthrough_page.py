"""docs/walkthrough_page.py -- the page machinery of docs/walkthrough.py, kept out of its steps:
step, show and picture record what each step prints and draws; write turns the script's cells
and those records into docs/walkthrough.md (or --output DIR's)."""

import argparse
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))  # docs/
parser = argparse.ArgumentParser(description="DeAR step by step on the toy world.")
parser.add_argument("--output", default=HERE, help="folder for walkthrough.md and walkthrough/")
OUTPUT = parser.parse_known_args()[0].output  # known only: Jupyter passes its own arguments
PAGE = {"steps": {}, "current": None}  # {step number: what it printed, its pictures}


def step(number: int) -> None:
    """Step `number` starts: what show() prints and picture() draws from here on is its own."""
    PAGE["current"] = PAGE["steps"].setdefault(number, {"printed": [], "pictures": []})
    print(f"\n---- {f'step {number}' if number else 'setup'} " + "-" * 80)


def show(*parts) -> None:
    """print, also kept for the page."""
    line = " ".join(str(part) for part in parts)
    print(line)
    PAGE["current"]["printed"].append(line)


def picture(name: str) -> str:
    """The path a step draws `name` (a .png) at, listed on its page."""
    os.makedirs(os.path.join(OUTPUT, "walkthrough"), exist_ok=True)
    PAGE["current"]["pictures"].append(f"walkthrough/{name}")
    return os.path.join(OUTPUT, "walkthrough", name)


def write(script: str, header: str) -> str:
    """The page from the script's cells (`# %% ` lines; the last, which writes it, left out) and
    what each step printed and drew -> its path. header: the paragraph under the page's title."""
    with open(script, encoding="utf-8") as f:
        cells = re.split(r"^# %% ", f.read(), flags=re.M)[1:-1]  # the setup, then the steps
    lines = ["# DeAR, step by step, on the toy world", "", header, ""]
    for number, cell in enumerate(cells):
        title, *body = cell.rstrip().splitlines()
        lead = next((i for i, line in enumerate(body) if not line.startswith("# ")), len(body))
        prose = [line[2:] for line in body[:lead]]  # the comment block under the title
        code = [line.replace("  # noqa: E402", "") for line in body[lead:]
                if not line.startswith("step(")]
        record = PAGE["steps"][number]
        lines += [f"## {title}", "", " ".join(prose), "", "```python", *code, "```", "",
                  "```text", *record["printed"], "```", ""]
        lines += [f"![{os.path.basename(p)}]({p})" for p in record["pictures"]] + [""]
    path = os.path.join(OUTPUT, "walkthrough.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    return path
