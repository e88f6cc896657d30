"""harness/errors.py -- the harness's one error, TrainError (bad input: one line naming the flag or
file and what to do), and how train.py's main turns every known error into that one line, exit
status 2. It imports no torch at the top: cli.py's early refusals raise TrainError before torch
is loaded.
"""

from __future__ import annotations

import sys
from typing import Callable


class TrainError(Exception):
    """Bad input to train.py: one line naming the flag or file and what to do."""


def one_line_errors(call: Callable[[], int]) -> int:
    """call() -> its exit status; a known error is one line on stderr and exit status 2, before
    any work where the checks come first (and --resume continues after one that came later)."""
    import warnings

    import clip_model  # their errors: imported here, as torch is loaded by now anyway
    import data
    import dear

    # data.py's warnings (a class with fewer than K images, a rebuilt cache) as one line each.
    warnings.formatwarning = lambda message, category, *rest: f"warning: {message}\n"
    try:
        return call()
    except (TrainError, data.DatasetError, dear.DeARError, clip_model.CLIPError) as error:
        message = str(error)
    except OSError as error:  # a full disk, a folder made read-only mid-run: one line too
        where = f"{error.filename}: " if error.filename else ""
        message = f"{where}{error.strerror or error}; fix it, then continue with --resume"
    except KeyboardInterrupt as stop:  # with the run folder's command: runfolder.said_on_interrupt
        if not getattr(stop, "said", False):
            print("train.py: interrupted before any run started; give the same command again",
                  file=sys.stderr)
        return 130
    print(f"train.py: error: {message}", file=sys.stderr)
    return 2


def matching_torchvision() -> None:
    """torchvision (data.py's transforms) built for this torch, or one line naming both versions
    and the fix, exit status 2: a CPU-only torch beside a CUDA torchvision dies in `import
    torchvision` with a 22-line traceback ending 'operator torchvision::nms does not exist'."""
    try:
        import torchvision  # noqa: F401
    except (RuntimeError, ImportError, OSError) as error:
        import torch
        from importlib import metadata

        try:
            found = f"torchvision {metadata.version('torchvision')}"
        except metadata.PackageNotFoundError:
            found = "no torchvision"
        cause = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        print(f"train.py: error: {found} does not work with torch {torch.__version__} ({cause}); "
              "install both from the same index, e.g. pip install torch torchvision --index-url "
              "https://download.pytorch.org/whl/cpu", file=sys.stderr)
        raise SystemExit(2) from None
