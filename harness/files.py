"""harness/files.py -- files written whole, folders tried for writing, and the one file lock: a leaf
(it imports clip_model.py and errors.py alone), so that the harness and toyworld/ both take their
files from here and neither imports the other for them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import time
from pathlib import Path
from typing import Callable, Optional

import clip_model
from .errors import TrainError


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
def lock(path: str, waiting: str = "", log: Callable[[str], None] = print,
         timeout: Optional[float] = None, busy: str = ""):
    """An exclusive lock on the file `path` for the block, its holder's pid written in it, the file
    removed when the block ends. Held by another process: `waiting` is logged once with the
    holder's pid, then the lock is tried every 0.2 s for at most `timeout` seconds (None: as long
    as it takes; 0: once), then one line: `busy` ({holder}: the pid) or one naming the holder
    (TrainError). The OS drops a lock however its holder ends; no lock where fcntl is missing
    (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    bound = "" if timeout is None else str(datetime.timedelta(seconds=int(timeout)))  # h:mm:ss
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        handle = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(handle.fileno()), os.stat(path)):
                break  # ours, and still the file at `path`, not one its last holder removed
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"  # the pid its holder wrote
            if deadline is not None and time.monotonic() >= deadline:
                handle.close()
                raise TrainError((busy or "{path}: held by another process (pid {holder}) for more "
                                  "than {bound}; let it finish, or end it if it is stuck, then run "
                                  "again").format(path=path, holder=holder, bound=bound)) from None
            if waiting:
                log(f"{waiting} (held by pid {holder}{f', at most {bound}' if bound else ''})")
                waiting = ""  # said once
            time.sleep(0.2)
        handle.close()
    try:
        handle.truncate(0)  # ours now: our pid, for the next caller ("a+": writes go to the end)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)  # before the lock goes: a waiter then finds it gone and opens anew
        handle.close()
