"""harness/runfolder.py -- the run folder: files written whole (a temporary name, then a rename), the
lock (one writer at a time), the checks that a resumed folder holds this run's files, the
checkpoints, resuming, each run's history (log.txt, metrics.jsonl, curves.png) and the copies of
the role maps it used. Called by train.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import secrets
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

import clip_model
import dear
from .errors import TrainError
from .config import RUN_FORMAT, role_file_of
from .devices import Runtime, format_time, load_scaler_state
from .plan import Job, job_settings
from .sources import first_layer, load_role_file, sha256
from .pictures import draw_curves, draw_role_masks
from .monitor import Progress


CHECKPOINT_FORMAT = "dear-from-scratch checkpoint, version 1"  # checked on load: not some other .pt


# whole or not at all, the file closed before the rename
def write_text(path: str, text: str) -> None:
    clip_model.atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json(path: str, value) -> None:
    write_text(path, json.dumps(value, indent=2, allow_nan=False) + "\n")  # NaN is not JSON


def unwritable_reason(path: str) -> Optional[str]:
    """None if files can be made in `path` (or the nearest existing folder above it, where a later
    makedirs writes), else the reason in a short phrase. Tried by writing a probe file: os.access
    is not enough (root, read-only mounts)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)  # up to the folder a makedirs would start from
    if not os.path.isdir(existing):
        return f"lies under {existing}, which is a file"
    probe = os.path.join(existing, f".tmp-write-test-{secrets.token_hex(6)}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)  # nothing is left behind by the check
    except OSError as error:
        return f"cannot write in {existing} ({error.strerror or error})"
    return None


@contextlib.contextmanager
def waiting_lock(path: str, waiting_message: str, log: Callable[[str], None] = print,
                 timeout: Optional[float] = None):
    """An exclusive lock on the file `path` around a cache entry checked, then written; its
    holder's pid is written in the file. A second process logs `waiting_message` and the holder
    once, and waits until the first leaves (then finds the entry made), or for at most `timeout`
    seconds: then one line naming the holder (TrainError). The OS drops the lock however its
    holder ends; no lock where fcntl is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"  # the pid its holder wrote
            bound = f", at most {format_time(timeout)}" if timeout is not None else ""
            log(f"{waiting_message} (held by pid {holder}{bound})")
            if not flock_within(handle, timeout):
                raise TrainError(f"{path}: held by another process (pid {holder}) for more "
                                 f"than {format_time(timeout)}; let it finish, or end it if it "
                                 "is stuck, then run again") from None
        handle.truncate(0)  # ours now: our pid, for the next caller ("a+": writes go to the end)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield


def flock_within(handle, timeout: Optional[float]) -> bool:
    """Take the exclusive lock on an open file, waiting at most `timeout` seconds (None: as long
    as it takes) -> whether it was taken. flock has no timeout of its own: it is tried each
    second."""
    import fcntl

    if timeout is None:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks until the holder's block ends
        return True
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.01)))


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
    """One writer per run folder: an exclusive lock on <output>/.lock held until the call ends,
    which removes the file (the OS drops the lock when the process dies, even by SIGKILL: a file
    left then is no stale lock), then the .tmp-* files of a write killed half-way removed (no
    other process can be writing them)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; do not start two calls on one folder there
        return
    path = os.path.join(output, ".lock")
    handle = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(handle.fileno()).st_ino != os.stat(path).st_ino:
            raise OSError  # its holder removed it as we opened it (below): held till a moment ago
    except OSError:
        handle.seek(0)
        holder = handle.read().strip()  # the pid its holder wrote
        handle.close()
        raise TrainError(f"{output}: in use by another train.py "
                         f"process{f' (pid {holder})' if holder else ''}; wait for it to end, or "
                         "choose another --output") from None
    # ours now: our pid, for the next caller's message ("a+": writes go to the end)
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()

    def release() -> None:  # removed while still held (no .lock left behind), then closed
        with contextlib.suppress(OSError):
            os.remove(path)
        handle.close()  # closing the file releases the lock

    stack.callback(release)
    for folder, _, files in os.walk(output):
        for name in files:
            if name.startswith(".tmp-"):
                os.remove(os.path.join(folder, name))  # a write killed half-way


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


def resume_checkpoint(job: Job, settings, model, optimizer, scaler, runtime: Runtime) -> int:
    """--resume: the run's last checkpoint loaded (the tokens, the optimizer's moments, the
    scaler) -> the epoch it ends (0: none saved yet)."""
    path = os.path.join(job.folder, "checkpoint.pt")
    checkpoint = load_run_file(path, job_settings(settings, job))
    trim_metrics(os.path.join(job.folder, METRICS_FILE), checkpoint["epoch"] if checkpoint else 0)
    if checkpoint is None:
        return 0
    model.load_learnable_state_dict(checkpoint["learnable"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    # the precision may have changed (--amp, another GPU): a fresh scaler where none was saved
    load_scaler_state(scaler, checkpoint["scaler"],
                      lambda line: runtime.log(f"[{job.label}] {line}"))
    runtime.log(f"[{job.label}] resumed after epoch {checkpoint['epoch']}/{settings['epochs']}")
    return checkpoint["epoch"]


def fusion_weights_by_branch(model: dear.DeAR) -> dict:
    """{"class": alpha_cls, attribute: its alpha, ...}: metrics.jsonl's and results.json's alpha."""
    return dict(zip(["class"] + model.attributes, model.fusion_weights().tolist()))


def end_epoch(job: Job, settings, model: dear.DeAR, optimizer, scaler, progress: Progress,
              runtime: Runtime) -> None:
    """An epoch's end, after its last read (so nothing non-finite is saved): its record appended to
    the run's metrics.jsonl, its checkpoint (rank 0 writes; every rank holds the same tokens), its
    line in the logs, and, at each quarter of the run, a line printed."""
    epoch, epochs = progress.current + 1, settings["epochs"]
    alpha = fusion_weights_by_branch(model)
    record = dict(progress.last, alpha=alpha, seconds=round(time.time() - progress.epoch_started, 3))
    if runtime.main:
        append_metrics(os.path.join(job.folder, METRICS_FILE), record)
        save_checkpoint(os.path.join(job.folder, "checkpoint.pt"), job_settings(settings, job),
                        epoch, model, optimizer, scaler)
    weights = ", ".join(f"{name} {value:.2f}" for name, value in alpha.items())
    runtime.detail(f"[{job.label}] epoch {epoch}/{epochs} done in "
                   f"{format_time(record['seconds'])}; fusion weights alpha: {weights}; "
                   "checkpoint saved")
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
