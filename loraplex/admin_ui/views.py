"""Rendering the admin UI's pages: the Jinja2 templates of this package, and the headers every
page is sent with.

Templates autoescape everything. Pages load only this package's ``static/`` files, and the
Content-Security-Policy says so to the browser (no inline script, nothing from another origin),
so a name a tenant chose can never run as script, and no page reaches outside the server.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse

from loraplex.admin_ui.security import CSRF_FIELD, Viewer

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

_env = Environment(
    loader=PackageLoader("loraplex.admin_ui", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)


def _bytes(n: int | None) -> str:
    if n is None:
        return "unlimited"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M UTC")


def _quota(value: int | None) -> str:
    return "unlimited" if value is None else f"{value:,}"


_env.filters["bytes"] = _bytes
_env.filters["when"] = _when
_env.filters["quota"] = _quota


def render(
    request: Request, template: str, viewer: Viewer | None, status: int = 200, **context: Any
) -> HTMLResponse:
    """The page ``template`` for ``viewer`` (None: signed out)."""
    html = _env.get_template(template).render(
        request=request,
        viewer=viewer,
        csrf_field=CSRF_FIELD,
        csrf_token=None if viewer is None else viewer.session.csrf_token,
        path=request.url.path,
        **context,
    )
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)
