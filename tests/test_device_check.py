"""Tests of benchmarks/device_check.py, the one command that proves the GPU path.

No GPU here: the script runs as `--device cpu --quick` (every check, a tiny CLIP), so that it
cannot rot between the rare moments a GPU is at hand; its checks are shown to fail on the
bugs they are there for (PyTorch issue 196678's among them); its FLOP count, which the MFU
rests on, is held against torch's own count of a real step; and the GPU table is looked up by
name as a GPU reports it.

    python -m pytest -q tests/test_device_check.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_train_step  # noqa: E402
import device_check  # noqa: E402
from conftest import subprocess_env  # noqa: E402


def test_quick_mode_runs_every_check_on_the_cpu_quietly_and_writes_the_table_it_prints(tmp_path):
    out = tmp_path / "table"
    env = subprocess_env(tmp_path / "cache")
    done = subprocess.run([sys.executable, "benchmarks/device_check.py", "--device", "cpu", "--quick",
                           "--output", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr == ""  # no warning leaks: every one is a finding or silenced at its cause
    # The title says what was skipped, never "all passed" over it: the CPU has neither the
    # memory-efficient nor cuDNN's fused attention.
    title = next(line for line in done.stdout.splitlines() if line.startswith("Device check:"))
    assert "; passed with 2 skipped (3. fused attention, EFFICIENT_ATTENTION: " in title
    assert "all" not in title

    record = json.loads((out / "device_check_cpu_quick.json").read_text())
    rows = record["checks"]
    counts = {"1.": 2, "2.": 2, "3.": 5, "4.": 2, "5.": 5, "6.": 3}
    assert [row["check"][:2] for row in rows] == [n for n, k in counts.items() for _ in range(k)]
    for row in rows:  # nothing may be skipped here but a kernel the CPU lacks
        unavailable = row["check"].startswith("3. fused") and row["values"].get("available") == 0
        figures = row["check"].startswith(("3. the kernel", "6."))  # measured, not judged (--quick)
        assert row["status"] == ("skip" if unavailable else "info" if figures else "pass"), row
    assert rows[0]["values"]["image"] <= 1e-3 and rows[1]["values"]["difference"] <= 1e-3
    assert all(row["values"]["changed"] == 0 for row in rows[2:4])
    attention = {row["check"].rsplit(", ", 1)[1]: row for row in rows if row["check"].startswith("3. fused")}
    assert attention["MATH"]["values"]["available"] == 14  # 7 cases (2 of issue 196678), fp16 and bf16
    assert "fp16 196678 192 out" in attention["FLASH_ATTENTION"]["figures"]
    picked = rows[4]["values"]["picked"]  # what torch runs on DeAR's calls, with grad
    assert set(picked) == {"fp16 vision 22", "fp16 text 28", "bf16 vision 22", "bf16 text 28"}
    assert set(picked.values()) <= {"flash", "math"}
    steps = [row for row in rows if row["check"].startswith("4. DeAR steps")]
    assert not steps[0]["values"]["unmoved"] and not steps[1]["values"]["clip_changed"]
    assert next(row for row in rows if row["check"].startswith("5. resume"))["values"]["bit_identical"]
    nan = next(row for row in rows if "NaN loss on rank 1" in row["check"])  # nan_on_rank.py's step
    assert "seed 1] diverged at epoch 1, step 2: loss (total) not finite" in nan["figures"]
    precision = {row["values"]["precision"]: row["values"] for row in rows if row["check"].startswith("6.")}
    assert precision["fp32"]["max_logit_change"] == 0 and precision["fp16"]["max_logit_change"] > 0
    # The printed table is the Markdown file's table, line for line.
    table = (out / "device_check_cpu_quick.md").read_text().split("\n\n", 1)[1].strip()
    assert table in done.stdout


def test_a_torchrun_run_that_hangs_is_stopped_with_its_processes_and_exit_status_124(tmp_path, monkeypatch):
    """A process left waiting on a collective must not hang device_check: past TORCHRUN_TIMEOUT
    torchrun gets SIGTERM, which it passes on to its processes (SIGKILL would leave them running)."""
    script = tmp_path / "hang.py"
    script.write_text("import os, time\nwith open(os.environ['PIDS'] + os.environ['RANK'], 'w') as f:\n"
                      "    f.write(str(os.getpid()))\ntime.sleep(60)\n")
    monkeypatch.setattr(device_check, "TORCHRUN_TIMEOUT", 10)  # its processes start in seconds
    monkeypatch.setenv("PIDS", str(tmp_path / "pid"))
    assert device_check.train_py(str(tmp_path), "hang", script=str(script)) == 124
    assert (tmp_path / "hang.txt").read_text().endswith("device_check: timed out after 10 s\n")
    for rank in "01":
        with pytest.raises(ProcessLookupError):  # no such process: ended, not left behind
            os.kill(int((tmp_path / f"pid{rank}").read_text()), 0)


@pytest.fixture
def tiny_clip():
    return device_check.random_clip(device_check.TINY)


def amp_rows(tiny_clip) -> list:
    return device_check.check_amp_steps(tiny_clip, device_check.TINY, torch.device("cpu"), quick=True)


def test_the_amp_check_passes_a_good_step_and_fails_one_that_touches_clip(tiny_clip, monkeypatch):
    assert [row[1] for row in amp_rows(tiny_clip)] == ["pass", "pass"]
    build = device_check.build_step

    def touching_clip(clip, *args, **kwargs):  # an optimizer that also moves a CLIP weight
        model, step, images, last = build(clip, *args, **kwargs)

        def bad_step():
            step()
            with torch.no_grad():
                clip.visual.proj.add_(1e-3)

        return model, bad_step, images, last

    monkeypatch.setattr(device_check, "build_step", touching_clip)
    rows = amp_rows(tiny_clip)
    assert [row[1] for row in rows] == ["fail", "fail"]
    assert rows[0][3]["clip_changed"] == ["visual.proj"]


def test_the_amp_check_fails_a_step_that_leaves_a_learnable_tensor_without_gradient(tiny_clip, monkeypatch):
    build = device_check.build_step

    def detached_text_tokens(*args, **kwargs):  # e.g. the text tokens cut off the graph
        model, step, images, last = build(*args, **kwargs)
        model.tokens.text_tokens.requires_grad_(False)
        return model, step, images, last

    monkeypatch.setattr(device_check, "build_step", detached_text_tokens)
    rows = amp_rows(tiny_clip)
    assert [row[1] for row in rows] == ["fail", "fail"]
    assert rows[0][3]["unmoved"] == ["text_tokens"] and "NOT finite" in rows[0][2]


def test_the_flop_count_of_a_step_equals_torchs_own_count_of_a_real_step(tiny_clip):
    """The MFU's numerator: step_flops against torch's FlopCounterMode over one real DeAR step
    (the plain attention kernel, whose matrix products the counter sees), to 1%."""
    flop_counter = pytest.importorskip("torch.utils.flop_counter")
    attention = pytest.importorskip("torch.nn.attention")  # torch >= 2.3: choose the plain kernel
    _, step, _, last = device_check.build_step(tiny_clip, device_check.TINY, torch.device("cpu"), 8, 20, None)
    step()
    with attention.sdpa_kernel(attention.SDPBackend.MATH), flop_counter.FlopCounterMode(display=False) as counter:
        step()
    estimate = bench_train_step.step_flops(device_check.TINY, 8, 20, last["prompt_tokens"])
    assert abs(estimate / counter.get_total_flops() - 1) < 0.01, (estimate, counter.get_total_flops())


def test_the_scores_check_fails_scores_rounded_to_the_autocast_precision(monkeypatch):
    """fused_logits as it was: the similarity matmul and the alpha einsum inside autocast."""
    def inside_autocast(self, features, text_features):
        unit = [torch.nn.functional.normalize(t, dim=-1) for t in (features, text_features)]
        branches = self.clip.logit_scale.exp() * unit[0] @ unit[1].T
        alpha = self.fusion_weights().to(branches.dtype)
        return torch.einsum("bkc,k->bc", branches, alpha), branches

    assert [row[1] for row in device_check.check_scores(torch.device("cpu"))] == ["pass", "pass"]
    monkeypatch.setattr(device_check.dear.DeAR, "fused_logits", inside_autocast)
    rows = device_check.check_scores(torch.device("cpu"))
    assert [row[1] for row in rows] == ["fail", "fail"]
    assert all(row[3]["changed"] > 30 for row in rows)


def math_row(monkeypatch, kernel) -> tuple:
    """check_attention's MATH row with torch's fused attention replaced by `kernel`."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", kernel)
    rows = device_check.check_attention(device_check.TINY, torch.device("cpu"))
    return next(row for row in rows if row[0].endswith("MATH"))


def test_the_attention_check_fails_a_kernel_that_drops_the_mask(monkeypatch):
    """A fused kernel that ignored DeAR's per-head masks (and the causal one) in every case."""
    fused = torch.nn.functional.scaled_dot_product_attention
    row = math_row(monkeypatch, lambda q, k, v, attn_mask=None, **kwargs: fused(q, k, v, **kwargs))
    assert row[1] == "fail" and row[2].count("FAIL") == 14  # every case, fp16 and bf16


def test_the_attention_check_sees_pytorch_issue_196678s_case(monkeypatch):
    """A kernel wrong only where a row's logsumexp is below -88.7 (as cuDNN's in issue 196678: its
    rows come out zero here) fails on the issue's inputs alone; random inputs never reach it."""
    fused = torch.nn.functional.scaled_dot_product_attention

    def underflowing(q, k, v, attn_mask=None, **kwargs):
        scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5 + attn_mask.float()
        low = scores.logsumexp(-1, keepdim=True) < -88.7  # (B, H, N, 1)
        return fused(q, k, v, attn_mask=attn_mask, **kwargs).masked_fill(low, 0)

    row = math_row(monkeypatch, underflowing)
    cases = row[2].split(" (allowed")[0].split("; ")
    failed = [case.split(" out")[0] for case in cases if case.endswith("FAIL")]
    assert row[1] == "fail" and failed == ["fp16 196678 64", "bf16 196678 64", "fp16 196678 192",
                                          "bf16 196678 192"]


def test_the_verdicts_are_kept_per_gpu_and_build_where_attention_auto_reads_them(
        tmp_path, monkeypatch):
    """device_check's verdicts on each fused kernel, kept per GPU and build; --attention auto on
    that GPU then leaves a wrong kernel out and takes cuDNN's once it passed."""
    monkeypatch.setenv("DEAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(device_check.devices, "gpu_build", lambda device: "GPU A, torch x, cuDNN y")
    device_check.keep_verdicts("GPU B, torch x, cuDNN y", {"CUDNN_ATTENTION": "wrong"})
    device_check.keep_verdicts("GPU A, torch x, cuDNN y",
                               {"EFFICIENT_ATTENTION": "wrong", "CUDNN_ATTENTION": "ok"})
    gpu = torch.device("cuda", 0)
    assert device_check.devices.kernel_verdicts(gpu) == {"EFFICIENT_ATTENTION": "wrong",
                                                      "CUDNN_ATTENTION": "ok"}
    assert device_check.devices.attention_choice("auto", gpu)[1] == ["FLASH_ATTENTION",
                                                                 "CUDNN_ATTENTION", "MATH"]


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0),
    ("NVIDIA A10G", 70.0), ("NVIDIA GeForce RTX 4090", 165.0), ("NVIDIA Some Future GPU", None),
])
def test_a_gpu_finds_its_peak_by_the_name_it_reports(name, peak):
    assert bench_train_step.peak_tflops(name)[0] == peak
    assert bench_train_step.peak_tflops(name, 123.0) == (123.0, "--peak-tflops")


def test_a_check_that_breaks_fails_the_table_and_the_exit_status_and_the_others_still_run(tmp_path, monkeypatch):
    ran = []

    def broken_parity(*args):
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(device_check, "check_parity", broken_parity)
    checks = ("check_scores", "check_attention", "check_amp_steps", "check_train_py", "check_precision")
    for name in checks:
        monkeypatch.setattr(device_check, name, lambda *args, name=name: ran.append(name) or [])
    assert device_check.main(["--device", "cpu", "--quick", "--output", str(tmp_path)]) == 1
    record = json.loads((tmp_path / "device_check_cpu_quick.json").read_text())
    assert not record["passed"] and record["checks"][0]["status"] == "fail"
    assert "same device" in record["checks"][0]["figures"]
    assert ran == list(checks)
