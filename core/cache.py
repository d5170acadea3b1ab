"""The project's one cache root: ``$FOCUSED_PRETRAIN_CACHE``, else ``~/.cache/focused-pretrain``.

Trained tokenizers and token caches (``data.cache_dir``'s default) and the lm-eval task data's default
folder (``<root>/eval_data``) live under it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CACHE_ENV = "FOCUSED_PRETRAIN_CACHE"
DEFAULT_ROOT = "~/.cache/focused-pretrain"
# Before one root, the eval data's default sat under an underscore-spelled folder; still read, with a note.
LEGACY_EVAL_DATA = "~/.cache/focused_pretrain/eval_data"


def cache_root() -> Path:
    """``$FOCUSED_PRETRAIN_CACHE``, else ``~/.cache/focused-pretrain`` (user-expanded; not created here)."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_ROOT).expanduser()


def default_eval_data() -> Path | None:
    """``<cache root>/eval_data`` when it is a directory, else the legacy folder when that one is (with a
    one-line deprecation note on stderr), else None."""
    path = cache_root() / "eval_data"
    if path.is_dir():
        return path
    legacy = Path(LEGACY_EVAL_DATA).expanduser()
    if legacy.is_dir():
        print(
            f"note: reading the eval data from {LEGACY_EVAL_DATA}, a deprecated location; move it to {path}",
            file=sys.stderr,
        )
        return legacy
    return None
