"""Python child processes that import what the tests import (``support``, ``loraplex``)."""

from __future__ import annotations

import os
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with ``tests/`` on ``PYTHONPATH`` (pytest's ``pythonpath``), so a
    ``python -c`` child can ``from support... import``; ``extra``: more variables."""
    path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
