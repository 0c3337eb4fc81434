"""Where loraplex keeps files it derives on this machine (converted models, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$LORAPLEX_CACHE``, else ``~/.cache/loraplex``: safe to delete, rebuilt on demand."""
    root = os.environ.get("LORAPLEX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "loraplex")
    return Path(root)
