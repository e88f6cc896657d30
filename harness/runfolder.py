"""harness/runfolder.py -- the run folder: its lock (one writer at a time), the checks that a
resumed folder holds this run's files, the checkpoints, resuming, each run's history (log.txt,
metrics.jsonl, curves.png) and the copies of the role maps it used. Called by train.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import sys
import time
from typing import List, Optional

import torch
import torch.distributed as dist

import clip_model
import dear
from .errors import TrainError
from .files import lock, unwritable_reason, write_json, write_text
from .config import RUN_FORMAT, role_file_of
from .devices import Runtime, format_time, load_scaler_state
from .plan import Job, job_settings
from .sources import first_layer, load_role_file, sha256
from .pictures import draw_curves, draw_role_masks
from .monitor import Progress


CHECKPOINT_FORMAT = "dear-from-scratch checkpoint, version 1"  # checked on load: not some other .pt


def check_output_folder(output: str) -> None:
    """A fresh run's --output: a folder that can be made and written, not already holding a run."""
    if not output:
        raise TrainError("--output '': expected a folder for the run")
    if os.path.exists(output) and not os.path.isdir(output):
        raise TrainError(f"--output {output}: is a file, not a folder; choose another --output")
    if reason := unwritable_reason(output):  # tried by writing, before any data is read
        raise TrainError(f"--output {output}: {reason}; choose another --output")
    if os.path.exists(os.path.join(output, "settings.json")):
        raise TrainError(f"{output}: already holds a run; continue it with --resume, evaluate it "
                         "with --eval-only, or choose another --output")


def lock_run_folder(output: str, stack: contextlib.ExitStack) -> None:
    """One writer per run folder: <output>/.lock held until the call ends (files.lock), then the
    .tmp-* files of a write killed half-way removed (no other process can be writing them)."""
    stack.enter_context(lock(os.path.join(output, ".lock"), timeout=0, busy=(
        f"{output}: in use by another train.py process (pid {{holder}}); wait for it to end, or "
        "choose another --output")))
    for folder, _, files in os.walk(output):
        for name in files:
            if name.startswith(".tmp-"):
                os.remove(os.path.join(folder, name))  # a write killed half-way


def analyse_only(settings, clip, records: dict, runtime: Runtime,
                 stack: contextlib.ExitStack) -> int:
    """--analyse-only: the role maps' copies in a fresh --output and a line per dataset -> 0."""
    if runtime.main:
        check_output_folder(settings["output"])
        copy_role_maps(settings, clip, records)
        open_call_log(runtime, settings["output"], stack)
        for dataset in records:
            runtime.log(f"train.py: head roles of {dataset} in "
                        f"{os.path.dirname(role_copy(settings, dataset))} (roles.json, roles.txt, "
                        "roles.png, masks.png); train with them by leaving out --analyse-only "
                        "(the cache is reused)")
    return 0


def check_run_folder(settings, jobs: List[Job], stack: contextlib.ExitStack) -> None:
    """Before any work: a fresh run's --output is usable; a resumed one is locked, cleaned, and
    every results.json and checkpoint in it was made with this run's settings."""
    if not (settings["resume"] or settings["eval_only"]):
        # a fresh run: its folder is made later, whole
        return check_output_folder(settings["output"])
    if int(os.environ.get("RANK", "0")) != 0:
        return
    lock_run_folder(settings["output"], stack)
    for job in jobs:
        if load_run_file(os.path.join(job.folder, "results.json"),
                         job_settings(settings, job)) is None \
                and job.row != "zeroshot":
            load_run_file(os.path.join(job.folder, "checkpoint.pt"), job_settings(settings, job))


def start_run_folder(settings, clip, world: int, stack: contextlib.ExitStack) -> None:
    """A new run's folder: made, locked, checked again under the lock (another call may have
    started it meanwhile), then the roles it uses and, last, settings.json written."""
    os.makedirs(settings["output"], exist_ok=True)
    lock_run_folder(settings["output"], stack)
    check_output_folder(settings["output"])
    if role_file_of(settings) is not None:  # the run keeps the roles it used
        clip_model.atomic_write(os.path.join(settings["output"], "roles_file.json"),
                                lambda tmp: shutil.copyfile(role_file_of(settings), tmp))
    copy_role_maps(settings, clip, settings["role_maps"] or {})  # --resume / --eval-only read these
    saved = {k: v for k, v in settings.items() if k not in ("resume", "eval_only", "analyse_only")}
    write_json(os.path.join(settings["output"], "settings.json"), dict(
        format=RUN_FORMAT, settings=saved, torch=torch.__version__,
        python=platform.python_version(),
        command="python train.py " + " ".join(sys.argv[1:]), world_size=world))


def load_run_file(path: str, expected: dict) -> Optional[dict]:
    """A run's results.json or checkpoint.pt (None if there is none), refused unless it holds what
    train.py writes and was made with the `expected` settings: a folder mixing two runs (files
    copied in, two writers) is refused rather than summarised or continued."""
    if not os.path.isfile(path):
        return None
    results = path.endswith(".json")
    try:
        if results:
            with open(path, encoding="utf-8") as f:
                found = json.load(f)
            shaped = isinstance(found, dict) and isinstance(found.get("metrics"), dict) \
                and all(isinstance(v, float) for v in found["metrics"].values()) \
                and isinstance(found.get("job"), dict)
        else:
            # tensors and plain data, no code
            found = torch.load(path, map_location="cpu", weights_only=True)
            shaped = isinstance(found, dict) and found.get("format") == CHECKPOINT_FORMAT \
                and isinstance(found.get("epoch"), int) \
                and all(isinstance(found.get(key), dict)
                        for key in ("learnable", "optimizer", "scaler"))
        if not (shaped and isinstance(found.get("settings"), dict)):
            raise ValueError("wrong shape")  # not `assert`, which vanishes under python -O
    except Exception as error:  # noqa: BLE001 -- any unreadable file gets the same advice
        advice = "delete it and --resume evaluates that run again" if results else \
            "delete it to restart that run from scratch"
        raise TrainError(f"{path}: unreadable {'results' if results else 'checkpoint'} "
                         f"({type(error).__name__}); {advice}") from None
    if found["settings"] != expected:
        raise TrainError(f"{path}: made with other settings than this run's "
                         f"({differences(found['settings'], expected)}): the folder mixes two "
                         "runs; start again with another --output")
    return found


# Each run's history, beside its checkpoint: log.txt (every line printed for it, and every
# progress line), metrics.jsonl (one JSON object per epoch: the loss terms, training accuracy,
# lr, fusion weights, images/s, the share of time spent waiting for data, the gradient norm) and
# curves.png drawn from it. Both files are appended to (--resume continues them); metrics.jsonl is
# first cut back to the epochs of the checkpoint it resumes from. The call's own lines go to
# <output>/log.txt.
METRICS_FILE = "metrics.jsonl"


@contextlib.contextmanager
def run_log(runtime: Runtime, folder: str):
    """Inside the block, the run's lines also go to <folder>/log.txt (appended)."""
    if not runtime.main:
        yield
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "log.txt"), "a", encoding="utf-8") as handle:
        runtime.run_log = handle
        try:
            yield
        finally:
            runtime.run_log = None


@contextlib.contextmanager
def said_on_interrupt(runtime: Runtime, settings):
    """Ctrl-C: the command that continues the call, printed and kept in log.txt."""
    try:
        yield
    except KeyboardInterrupt as stop:
        again = "--eval-only" if settings["eval_only"] else "--resume"
        runtime.log("train.py: interrupted; every finished epoch is saved; continue with: "
                    f"python train.py --output {shlex.quote(settings['output'])} {again}")
        stop.said = True  # errors.one_line_errors says nothing more
        raise


def open_call_log(runtime: Runtime, output: str, stack: contextlib.ExitStack) -> None:
    """From here to the call's end its lines (and those printed before, kept) are appended to
    <output>/log.txt."""
    if not runtime.main:
        return
    handle = open(os.path.join(output, "log.txt"), "a", encoding="utf-8")
    stack.callback(handle.close)
    stack.callback(setattr, runtime, "call_log", None)
    handle.write("".join(line + "\n" for line in runtime.pending))
    runtime.pending.clear()
    runtime.call_log = handle


def append_metrics(path: str, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


def read_metrics(path: str) -> List[dict]:
    """metrics.jsonl's records (a last line cut short by a killed call is left out)."""
    if not os.path.isfile(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                break
    return records


def trim_metrics(path: str, epochs: int) -> None:
    """--resume: metrics.jsonl back to the records of the first `epochs` epochs, those of the
    checkpoint it resumes from (a killed call may have written one more)."""
    kept = [record for record in read_metrics(path) if record["epoch"] <= epochs]
    if os.path.isfile(path):
        write_text(path, "".join(json.dumps(record) + "\n" for record in kept))


def save_checkpoint(path: str, settings: dict, epoch: int, model, optimizer, scaler) -> None:
    """Only the learnable tensors, the optimizer's and scaler's state and the run's settings."""
    state = dict(format=CHECKPOINT_FORMAT, settings=settings, epoch=epoch,
                 learnable=model.learnable_state_dict(),
                 optimizer=optimizer.state_dict(), scaler=scaler.state_dict())

    def write(temporary: str) -> None:
        try:
            torch.save(state, temporary)
        except RuntimeError as error:  # torch's file writer reports a full disk this way
            raise TrainError(f"{path}: cannot write the checkpoint "
                             f"({' '.join(str(error).split())[:100]}); free disk space, then "
                             "continue with --resume") from None

    clip_model.atomic_write(path, write)  # a run killed mid-save keeps the previous epoch's


def load_optimizer_state(optimizer, state: dict) -> None:
    """The saved AdamW moments into this call's AdamW, fused or not as this call chose
    (devices.fused_optimizer: the device or precision may change on --resume); a fused one keeps
    its step counts on the parameters' device."""
    fused = [group["fused"] for group in optimizer.param_groups]
    optimizer.load_state_dict(state)  # it also loads the saved run's choice: undone below
    for group, chosen in zip(optimizer.param_groups, fused):
        group["fused"] = chosen
        for p in group["params"] if chosen else []:
            if "step" in optimizer.state[p]:
                optimizer.state[p]["step"] = optimizer.state[p]["step"].to(p.device, torch.float32)


def resume_checkpoint(job: Job, settings, model, optimizer, scaler, runtime: Runtime) -> int:
    """--resume: the run's last checkpoint loaded (the tokens, the optimizer's moments, the
    scaler) -> the epoch it ends (0: none saved yet)."""
    path = os.path.join(job.folder, "checkpoint.pt")
    checkpoint = load_run_file(path, job_settings(settings, job))
    trim_metrics(os.path.join(job.folder, METRICS_FILE), checkpoint["epoch"] if checkpoint else 0)
    if checkpoint is None:
        return 0
    model.load_learnable_state_dict(checkpoint["learnable"])
    load_optimizer_state(optimizer, checkpoint["optimizer"])
    # the precision may have changed (--amp, another GPU): a fresh scaler where none was saved;
    # after a divergence a fresh one too (a collapsed scale would take 2,000 steps a doubling)
    diverged = os.path.isfile(os.path.join(job.folder, DIVERGED_FILE))
    load_scaler_state(scaler, {} if diverged else checkpoint["scaler"],
                      lambda line: runtime.log(f"[{job.label}] {line}"), diverged)
    runtime.log(f"[{job.label}] resumed after epoch {checkpoint['epoch']}/{settings['epochs']}")
    return checkpoint["epoch"]


# A run that diverged leaves its line in <folder>/diverged.txt until its next checkpoint: --resume
# then starts a fresh loss scaler.
DIVERGED_FILE = "diverged.txt"


def mark_diverged(job: Job, line: str, runtime: Runtime) -> None:
    if runtime.main and os.path.isdir(job.folder):
        write_text(os.path.join(job.folder, DIVERGED_FILE), line + "\n")


def fp16_record(job: Job) -> Optional[dict]:
    """fp16's loss scaler over the run's epochs (metrics.jsonl): its skipped steps, their share
    and the final scale -> results.json's "fp16" (None: no epoch ran a scaler)."""
    epochs = [r for r in read_metrics(os.path.join(job.folder, METRICS_FILE)) if "loss_scale" in r]
    if not epochs:
        return None
    skipped, steps = sum(r["skipped_steps"] for r in epochs), sum(r["steps"] for r in epochs)
    return dict(skipped_steps=skipped, steps=steps, skipped_share=skipped / steps,
                loss_scale=epochs[-1]["loss_scale"])


def fusion_weights_by_branch(model: dear.DeAR) -> dict:
    """{"class": alpha_cls, attribute: its alpha, ...}: metrics.jsonl's and results.json's alpha."""
    return dict(zip(["class"] + model.attributes, model.fusion_weights().tolist()))


def end_epoch(job: Job, settings, model: dear.DeAR, optimizer, scaler, progress: Progress,
              runtime: Runtime) -> None:
    """An epoch's end, after its last read (so nothing non-finite is saved): its record appended to
    the run's metrics.jsonl, its checkpoint (rank 0 writes; every rank holds the same tokens), its
    line in the logs, and, at each quarter of the run, a line printed. No checkpoint while fp16's
    scaler is skipping steps in a row (it may be the start of a divergence, and --resume would
    keep its collapsed scale), but the last epoch's: the finished run's tokens."""
    epoch, epochs = progress.current + 1, settings["epochs"]
    alpha = fusion_weights_by_branch(model)
    record = dict(progress.last, alpha=alpha, seconds=round(time.time() - progress.epoch_started, 3))
    save = not progress.in_a_row_read or epoch == epochs
    if runtime.main:
        append_metrics(os.path.join(job.folder, METRICS_FILE), record)
        if save:
            save_checkpoint(os.path.join(job.folder, "checkpoint.pt"), job_settings(settings, job),
                            epoch, model, optimizer, scaler)
            with contextlib.suppress(FileNotFoundError):  # past a divergence now
                os.remove(os.path.join(job.folder, DIVERGED_FILE))
    progress.kept = epoch if save else progress.kept
    saved = "checkpoint saved" if save else \
        f"no checkpoint: the last {progress.in_a_row_read} steps skipped by fp16's loss scaler"
    weights = ", ".join(f"{name} {value:.2f}" for name, value in alpha.items())
    runtime.detail(f"[{job.label}] epoch {epoch}/{epochs} done in "
                   f"{format_time(record['seconds'])}; fusion weights alpha: {weights}; {saved}")
    if epoch in {math.ceil(epochs * quarter / 4) for quarter in range(1, 5)}:
        runtime.log(f"[{job.label}] epoch {epoch}/{epochs}: {progress.brief()}")


def finish_job(job: Job, settings, model: dear.DeAR, stop: int, runtime: Runtime):
    """The trained model, or None where --max-epochs-per-call stopped the run first; either way
    its curves so far drawn (curves.png) from metrics.jsonl."""
    if runtime.main:
        draw_curves(read_metrics(os.path.join(job.folder, METRICS_FILE)), job.label,
                    settings["epochs"], os.path.join(job.folder, "curves.png"))
    if runtime.world > 1:
        dist.barrier()
    if stop < settings["epochs"]:
        runtime.log(f"[{job.label}] stopped after epoch {stop}/{settings['epochs']} "
                    "(--max-epochs-per-call); continue with: "
                    f"python train.py --output {settings['output']} --resume")
        return None
    return model


def finished(job: Job, settings) -> bool:
    """The run's results.json is there (an earlier call finished it) and the call does not
    evaluate it again (--eval-only)."""
    return os.path.isfile(os.path.join(job.folder, "results.json")) and not settings["eval_only"]


def trains(job: Job, settings) -> bool:
    """Whether the run trains in this call (the progress lines' estimate of the call's time)."""
    return job.row not in ("zeroshot", "linear-probe") and not settings["eval_only"] \
        and not finished(job, settings)


def finished_checkpoint(job: Job, settings) -> dict:
    """--eval-only: the run's checkpoint, checked against its settings and finished."""
    path = os.path.join(job.folder, "checkpoint.pt")
    checkpoint = load_run_file(path, job_settings(settings, job))
    if checkpoint is None or checkpoint["epoch"] < settings["epochs"]:
        raise TrainError(f"{job.folder}: no finished checkpoint to evaluate; "
                         "finish it with --resume")
    return checkpoint


def differences(found: dict, expected: dict) -> str:
    """'lr 0.002 (expected 0.001), ...': what makes two settings dicts differ."""
    keys = [k for k in sorted(set(found) | set(expected)) if found.get(k) != expected.get(k)]
    return ", ".join(f"{k} {str(found.get(k))[:40]} (expected {str(expected.get(k))[:40]})"
                     for k in keys[:3])


def role_copy(settings, dataset: str, checked: bool = False) -> str:
    """The run folder's copy of a trained dataset's analysed role map; `checked`: the one
    --resume / --eval-only read (never the cache's), refused unless its SHA-256 is the run's."""
    path, records = (os.path.join(settings["output"], dataset, "roles", "roles.json"),
                     settings["role_maps"] or {})
    if checked and (dataset not in records or not os.path.isfile(path)
                    or sha256(path) != records[dataset]["sha256"]):
        raise TrainError(f"{path}: missing or not the role map this run was made with; the run "
                         "folder is damaged, start a new run with another --output")
    return path


def true_role_map(settings, job: Job, role_map: dear.RoleMap) -> Optional[dear.RoleMap]:
    """--ablations true-heads' map (dear.ablate's true_map), None for any other row: the heads the
    toy world's causal check singles out, read from its copy beside the run folder's role map."""
    if job.ablation != "true-heads":
        return None
    from toyworld import causal  # the toy world's alone

    path = os.path.join(os.path.dirname(role_copy(settings, job.dataset)), "causal_check.json")
    with open(path, encoding="utf-8") as f:
        return causal.true_role_map(json.load(f), role_map)


def copy_role_maps(settings, clip, records: dict) -> None:
    """The run folder keeps what the cache holds for each map it uses, and the masks of its own J
    (masks.png: a role map does not fix J, so it is drawn per run)."""
    for dataset, record in records.items():
        folder = os.path.dirname(role_copy(settings, dataset))  # <output>/<dataset>/roles/
        for name in sorted(os.listdir(record["cache"])):  # each file whole
            source = os.path.join(record["cache"], name)
            clip_model.atomic_write(os.path.join(folder, name),
                                    lambda tmp: shutil.copyfile(source, tmp))
        role_map, J = load_role_file(role_copy(settings, dataset)), first_layer(settings, clip)
        image_tokens = 1 + clip.visual.grid_size**2  # CLS + the patch grid
        masks = dear.build_role_masks(role_map, J, len(clip.visual.transformer.resblocks),
                                      image_tokens)
        draw_role_masks(masks, image_tokens, role_map.attributes, J,
                        os.path.join(folder, "masks.png"), role_map)
