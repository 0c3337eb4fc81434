"""Debian's chromium for the browser tests, driven by Playwright (never a downloaded browser).

``chromium_path()`` finds ``/usr/bin/chromium``; when it is missing and the tests run as root on
a machine with apt-get, it installs the ``chromium`` package first, as the database fixtures
install PostgreSQL. A test skips (with the reason) only when neither is possible.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("LORAPLEX_TEST_CHROMIUM", "/usr/bin/chromium"))
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


def chromium_path() -> Path:
    """The chromium binary, installed with apt-get if missing and allowed; else the test skips."""
    if CHROMIUM.exists():
        return CHROMIUM
    if os.geteuid() == 0 and shutil.which("apt-get") is not None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=False, env=env)
        if CHROMIUM.exists():
            return CHROMIUM
    pytest.skip(
        f"no chromium at {CHROMIUM}, and it could not be installed (apt-get install chromium as root)"
    )
