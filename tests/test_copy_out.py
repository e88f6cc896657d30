"""Copy-out: clip_model.py and dear.py used from someone else's project, with nothing else.

The README's "Use it in your own project" script is extracted from README.md (between its
markers, so the two cannot drift) and run in a subprocess from a temporary project that holds
only the two copied files, inside a package (`vendor/`). No path to this repository is on
sys.path: the subprocess runs with the temporary folder as its working directory and an
empty PYTHONPATH. The CLIP is a tiny random one saved by `clip_model.save` (heads 16 wide,
GELU: it loads right only because the file carries both), the BPE file a few merges.
About 10 s on 2 CPU cores.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import clip_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["a", "red", "green", "blue", "yellow", "purple", "square", "circle", "triangle", "star", "thing",
         "dax", "wug", "blicket", "toma"]  # the script's class names: one token each, as CLIP's vocabulary would


def readme_script() -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    found = re.search(r"<!-- copy-out script: begin -->\s*```python\n(.*?)```\s*<!-- copy-out script: end -->",
                      text, re.S)
    assert found, "README.md has no script between the copy-out markers"
    return found.group(1)


def write_bpe(path: str) -> None:
    """A merges file that spells each of WORDS as one token (left-to-right merges)."""
    merges = []
    for word in WORDS:
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            if (symbols[0], symbols[1]) not in merges:
                merges.append((symbols[0], symbols[1]))
            symbols = [symbols[0] + symbols[1]] + symbols[2:]
    with open(path, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """<tmp>/myproj/{adapt.py, tiny_clip.pt, bpe.txt, vendor/{__init__.py, clip_model.py, dear.py}}."""
    folder = tmp_path_factory.mktemp("myproj")
    (folder / "vendor").mkdir()
    (folder / "vendor" / "__init__.py").write_text("")
    for name in ("clip_model.py", "dear.py"):
        shutil.copy(os.path.join(ROOT, name), folder / "vendor" / name)
    (folder / "adapt.py").write_text(readme_script())
    write_bpe(str(folder / "bpe.txt"))
    vocab = clip_model.SimpleTokenizer(str(folder / "bpe.txt")).vocab_size
    torch.manual_seed(0)
    tiny = clip_model.CLIP(embed_dim=32, image_resolution=32, vision_layers=4, vision_width=64,
                           vision_patch_size=8, vision_heads=4, context_length=8, vocab_size=vocab,
                           transformer_width=64, transformer_heads=4, transformer_layers=2, activation="gelu")
    clip_model.save(tiny, str(folder / "tiny_clip.pt"))
    return folder


def run_alone(folder, *args) -> subprocess.CompletedProcess:
    """Python in `folder` with no path to the repository: cwd there, PYTHONPATH empty."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(PYTHONPATH="", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def accuracies(stdout: str):
    found = re.search(r"zero-shot ([\d.]+)%\s+DeAR ([\d.]+)%", stdout)
    assert found, f"no result line in:\n{stdout}"
    return float(found.group(1)), float(found.group(2))


@pytest.mark.parametrize("roles", ["analysis", "by-hand"])
def test_the_readme_script_trains_past_zero_shot_from_a_package_holding_only_the_two_files(project, roles):
    result = run_alone(project, "adapt.py", "tiny_clip.pt", "bpe.txt", *(["by-hand"] if roles == "by-hand" else []))
    assert result.returncode == 0, result.stderr[-3000:]
    zero_shot, adapted = accuracies(result.stdout)
    # A random CLIP's text tower barely tells made-up names apart, so the margin is modest here
    # (46% against 26% with the analysed roles, measured); the toy CLIP's test below holds
    # the gain the README states. Training that does nothing stays near 25%.
    assert adapted >= zero_shot + 15, f"DeAR {adapted}% does not beat zero-shot {zero_shot}% clearly"
    assert "Head roles" in result.stdout and "learnable" in result.stdout
    retrieved = dict(re.findall(r"retrieval by (.+): (\d+)% same colour", result.stdout))
    # The role file read back; a random CLIP has no specialised head, so the analysis' tokens may all be blind.
    assert {"class", "frozen CLIP"} | ({"colour"} if roles == "by-hand" else set()) <= set(retrieved), result.stdout
    assert (project / "roles.json").is_file()


def test_the_readme_script_on_the_toy_clip_offline_prints_the_gain_the_readme_states(project):
    """The README's script on the model a user has offline, the shipped toy CLIP: its labels are
    words no CLIP has read, so zero-shot is at chance (25% of 4 classes) and DeAR learns them
    from 64 images (the README states 25% -> 98%; here at least 90%, another CPU's arithmetic
    may move an image or two)."""
    toy = os.path.join(ROOT, "toyworld", "assets", "full")
    result = run_alone(project, "adapt.py", os.path.join(toy, "clip.pt"), os.path.join(toy, "bpe.txt.gz"))
    assert result.returncode == 0, result.stderr[-3000:]
    zero_shot, adapted = accuracies(result.stdout)
    assert zero_shot <= 40 and adapted >= 90, (zero_shot, adapted)
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert f"zero-shot {zero_shot:.1f}%" in readme, "the README states another zero-shot number"


def test_the_two_files_also_work_at_the_top_level_of_a_project(tmp_path):
    for name in ("clip_model.py", "dear.py"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    result = run_alone(tmp_path, "-c", "import dear, clip_model, os; "
                       "assert dear.clip_model is clip_model; print(os.path.dirname(clip_model.__file__))")
    assert result.returncode == 0, result.stderr[-2000:]
    assert os.path.samefile(result.stdout.strip(), tmp_path)  # the copy, not the repository's file


ROLE_FILE_AND_RETRIEVAL = """
import torch
from vendor import clip_model, dear

clip, _ = clip_model.load("tiny_clip.pt")
L, H = len(clip.visual.transformer.resblocks), clip.visual.transformer.heads
heads = [dear.HeadRole(l, h, "attribute", "colour") if h == 0 else dear.HeadRole(l, h, "generalization")
         for l in range(L) for h in range(H)]  # every layer: no mixed head
roles = dear.RoleMap(L, H, ["colour", "shape"], heads, low_bits=0.25, high_bits=0.75, source="by hand")
roles.save("roles.json")
again = dear.RoleMap.load("roles.json")
assert again == roles, (again, roles)
model = dear.DeAR(clip, again, beta=0.3)  # no head lets the shape token read the image: it is blind
R = clip.visual.input_resolution
features = dear.retrieval_features(model, torch.randn(6, 3, R, R, generator=torch.Generator().manual_seed(0)))
assert list(features) == ["class", "colour", "frozen CLIP"], list(features)
ranking = dear.rank_gallery(features["colour"], features["colour"], k=3, same_images=True)
assert ranking.shape == (6, 3) and not (ranking == torch.arange(6)[:, None]).any(), ranking
print(again.table())
print("precision", dear.precision_at_k(ranking, [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]))
"""


def test_the_two_files_alone_write_and_read_a_role_file_rank_a_gallery_and_run_their_demo(project):
    (project / "roles_and_retrieval.py").write_text(ROLE_FILE_AND_RETRIEVAL)
    result = run_alone(project, "roles_and_retrieval.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Head roles (by hand)" in result.stdout and "precision" in result.stdout
    for how in (["-m", "vendor.dear"], [os.path.join("vendor", "dear.py")]):  # in the package, and as a script
        demo = run_alone(project, *how)
        assert demo.returncode == 0 and "Head roles (hand-made demo)" in demo.stdout, demo.stderr[-3000:]


CLUSTER = """
import torch
import dear

torch.manual_seed(0)
e = torch.eye(4)
points = torch.cat([e[0] + 0.01 * torch.randn(6, 4), e[1] + 0.01 * torch.randn(6, 4)])  # two groups
try:
    print("clusters", dear.cluster_picks([f"t{i}" for i in range(12)], points, 3)[0])
except dear.DeARError as error:
    print("DeARError", error)
"""


def test_clustering_alone_needs_clustering_py_and_says_so_in_one_line(tmp_path):
    """clip_model.py + dear.py import and run without clustering.py; asking them to cluster the
    picks is one DeARError line naming the file; with clustering.py beside them, it clusters."""
    for name in ("clip_model.py", "dear.py"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "cluster.py").write_text(CLUSTER)
    alone = run_alone(tmp_path, "cluster.py")
    assert alone.returncode == 0, alone.stderr[-2000:]
    line = alone.stdout.strip()
    assert line.startswith("DeARError clustering the picks needs clustering.py") and "\n" not in line, line
    assert "copy clustering.py beside dear.py" in line
    shutil.copy(os.path.join(ROOT, "clustering.py"), tmp_path / "clustering.py")
    both = run_alone(tmp_path, "cluster.py")
    assert both.returncode == 0 and both.stdout.strip() == "clusters " + str(["cluster 0"] * 6 + ["cluster 1"] * 6), both.stdout + both.stderr[-2000:]
