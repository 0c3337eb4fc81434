"""Where loraplex keeps files it derives on this machine (converted models, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "LORAPLEX_CACHE"
"""The variable that moves the cache. ``loraplex serve`` declares it as the setting ``cache``
(``ProcessSettings`` in ``loraplex/platform/settings``) and exports the effective value here
before anything reads it; this module never imports the platform, so the environment is the
channel."""


def default_cache_root() -> Path:
    """``~/.cache/loraplex``: the cache when ``$LORAPLEX_CACHE`` is unset or empty."""
    return Path(os.path.join(os.path.expanduser("~"), ".cache", "loraplex"))


def cache_root() -> Path:
    """``$LORAPLEX_CACHE``, else ``~/.cache/loraplex``: safe to delete, rebuilt on demand."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else default_cache_root()
