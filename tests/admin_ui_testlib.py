"""Signing in to the admin UI from a test client, as a browser would (form, nonce cookie)."""

from __future__ import annotations

import re

import httpx

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
