"""Open mode's guard: a server without keys answers only the machine it runs on.

``auth="open"`` runs every call as the tenant ``local`` and binds only loopback addresses, but a
web page the developer visits can still reach ``localhost``: a cross-site form can post to it,
and DNS rebinding can make ``evil.example`` resolve to ``127.0.0.1``. So in open mode:

| check | refusal |
|---|---|
| ``Host`` names a loopback name or the bound address (DNS rebinding) | 421 misdirected_request |
| an ``Origin`` header, when sent, names one of those too (a cross-site page) | 403 cross_origin |

The routes add the rest: JSON endpoints take only ``application/json`` (a page cannot send it
cross-site without a CORS preflight, which this server never grants), and an ``Authorization``
header other than ``Bearer local`` is refused rather than ignored (``tenancy.auth``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.platform.api.errors import APIError
from loraplex.platform.api.middleware import send_error

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "0:0:0:0:0:0:0:1"})


def _hostname(authority: str) -> str:
    """The host of ``host[:port]`` (IPv6 in brackets), lower case."""
    return (urlsplit(f"//{authority}").hostname or "").lower()


class OpenModeGuard:
    """ASGI middleware of an open-mode server: the ``Host`` and ``Origin`` checks above."""

    def __init__(self, app: ASGIApp, bound_host: str) -> None:
        self.app = app
        self.allowed = LOOPBACK_NAMES | {bound_host.strip("[]").lower()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", [])
        }
        host = _hostname(headers.get("host", ""))
        if host not in self.allowed:
            await send_error(
                send,
                APIError(
                    421,
                    "This server runs in open mode and answers only requests addressed to the local "
                    "machine (Host: localhost or 127.0.0.1).",
                    code="misdirected_request",
                ),
            )
            return
        origin = headers.get("origin")
        if origin is not None and _hostname(urlsplit(origin).netloc) not in self.allowed:
            await send_error(
                send,
                APIError(
                    403,
                    "This server runs in open mode and refuses requests from web pages of other sites.",
                    code="cross_origin",
                ),
            )
            return
        await self.app(scope, receive, send)
