"""
runs.py -- the run-folder harness: boilerplate a student of the method need not read.

train.py is the teaching path (recipes, data, model, head analysis, the loop, evaluation);
everything a run folder needs to be safe and repeatable lives here instead: settings
resolution and validation, refusing to resume over other settings, input fingerprints, the
folder lock and the cache locks, checkpoint files and their checks, temporary-file cleanup,
the summary tables and their markdown, and the PNG pictures (roles, masks, retrieval).

How it fits the project: it imports clip_model.py, dear.py and data.py as it needs; train.py
imports it; nothing else in the library does (clip_model.py, dear.py and data.py stay
copyable without it), and it never imports train.py: what it needs from there (the recipe
table, for one) train.py passes in.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Callable, Optional


# ------------------------------------------------------------------------------------------
# Files: writability, locks
# ------------------------------------------------------------------------------------------


def unwritable_reason(path: str) -> Optional[str]:
    """None if files can be made in `path`, or in the nearest existing folder above it (the
    one a later makedirs would write into); else the reason, as a short phrase. Tried by
    writing a probe file: os.access is not enough (root, read-only mounts). Used by
    train.py's --output check, the head-analysis cache and `python -m toyworld`'s path checks."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"lies under {existing}, which is a file"
    probe = os.path.join(existing, f".tmp-write-test-{secrets.token_hex(6)}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)
    except OSError as error:
        return f"cannot write in {existing} ({error.strerror or error})"
    return None


@contextlib.contextmanager
def waiting_lock(path: str, waiting_message: str, log: Callable[[str], None] = print):
    """An exclusive lock on the file `path` (created if missing) for a `with` block, around a
    cache entry that is checked and then written: a second process logs `waiting_message`
    once and blocks until the first leaves the block, then finds the entry made. The OS drops
    the lock however its holder ends. No lock where fcntl is missing (Windows). The one copy:
    the head-analysis cache and the toy world's cache use it."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            log(waiting_message)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
