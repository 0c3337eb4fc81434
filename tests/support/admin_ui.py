"""The admin UI in tests: signing in from a test client, and the browser for the browser tests.

ui_sign_in(client, credential)   sign in as a browser would (form, nonce cookie)
csrf_of(client)                  the signed-in session's CSRF token
chromium_path()                  Debian's chromium, driven by Playwright (never a downloaded browser):
                                 ``/usr/bin/chromium`` (``LORAPLEX_TEST_CHROMIUM``); when it is missing and
                                 the tests run as root on a machine with apt-get, the ``chromium`` package
                                 is installed first, as the database fixtures install PostgreSQL. A test
                                 skips (with the reason) only when neither is possible.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

_NONCE = re.compile(r'name="csrf_token" value="([^"]+)"')
_META = re.compile(r'<meta name="csrf-token" content="([^"]+)">')


async def ui_sign_in(client: httpx.AsyncClient, credential: str) -> httpx.Response:
    """Fetch the sign-in form, post ``credential`` with its nonce; the answer (303 on success)."""
    form = await client.get("/admin")
    match = _NONCE.search(form.text)
    assert match, form.text
    return await client.post("/admin/sign-in", data={"credential": credential, "csrf_token": match.group(1)})


async def csrf_of(client: httpx.AsyncClient) -> str:
    """The CSRF token of the signed-in session (from any page's meta tag)."""
    page = await client.get("/admin/dashboard")
    match = _META.search(page.text)
    assert match, page.text
    return match.group(1)


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
