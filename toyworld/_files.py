"""
toyworld/_files.py -- the one small file helper the toy world's caches share.

Every file the toy world writes (the CLIP state dict, the BPE merges, the config JSON, the
task's split) is written through `atomic_write`: the content goes to a temporary file in the
same folder, which is renamed onto the real name only once it is complete. A run that is
killed half-way therefore leaves either the old file or no file, never half of one, and the
cache checks in pretrain.py / task.py can trust that a file which exists was finished.

It uses clip_model.atomic_write (the project's one helper for the same job; the toy world
imports clip_model anyway, to build its CLIP); this module only adds the JSON convenience.
"""

from __future__ import annotations

import json

import clip_model


atomic_write = clip_model.atomic_write  # write(temporary_path), then rename onto `path`


def atomic_write_json(path: str, value) -> None:
    """Write `value` as indented JSON, atomically."""
    text = json.dumps(value, indent=2, ensure_ascii=False) + "\n"

    def write(temporary: str) -> None:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)
