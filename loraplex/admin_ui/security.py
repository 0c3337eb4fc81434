"""Who is looking at the admin UI, and the checks every request of it passes.

| dependency | gives | refuses |
|---|---|---|
| ``ViewerDep`` | the signed-in ``Viewer`` (operator, or a tenant and its row) | to sign-in (JSON: 401) |
| ``OperatorDep`` | the operator's ``Viewer`` | a tenant: 403 |
| ``check_csrf`` | nothing: a state-changing request carries the session's CSRF token | 403 |

The cookie is HttpOnly (no script reads it), SameSite=Strict (no other site's page sends it),
Secure when the request came over TLS, and lasts ``admin_session_ttl_s``. Every POST also needs
the session's CSRF token (a form field or the ``X-CSRF-Token`` header) and is refused when the
browser says it came from another site (``Origin`` / ``Sec-Fetch-Site``): three locks where one
would do, because a forged request would act with the operator's powers.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, Request
from starlette.responses import Response

from loraplex.admin_ui.sessions import AdminSession, SessionStore, SignInLimiter
from loraplex.platform.api.deps import get_gateway
from loraplex.platform.api.errors import APIError, forbidden
from loraplex.platform.api.gateway import Gateway
from loraplex.platform.api.services import keys
from loraplex.storage.db import Tenant

SESSION_COOKIE = "lpx_admin_session"
SIGNIN_COOKIE = "lpx_admin_signin"
"""Before sign-in: a random value the sign-in form must echo (no forged sign-ins either)."""
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"
COOKIE_PATH = "/admin"


@dataclass
class UIState:
    """What the admin UI keeps per app."""

    sessions: SessionStore
    signins: SignInLimiter
    chart_cache: dict[int | None, tuple[float, dict[str, int]]] = field(default_factory=dict)
    """The dashboard's tokens-per-tenant of the last hour, per viewer tenant id (None: all), with
    when each goes stale: an hour of usage rows is read at most every ``CHART_TTL_S``, however
    many dashboards poll."""


@dataclass(frozen=True)
class Viewer:
    """The signed-in party of one request."""

    session: AdminSession
    token: str
    tenant: Tenant | None
    """The tenant's row, loaded for this request (None for the operator)."""

    @property
    def is_operator(self) -> bool:
        return self.session.role == "operator"

    @property
    def name(self) -> str:
        return "operator" if self.tenant is None else self.tenant.name


class SignInRequired(Exception):
    """No live session: a page answers with the sign-in page, a JSON call with 401."""


def ui_state(request: Request) -> UIState:
    state = request.app.state.admin_ui
    assert isinstance(state, UIState), "mount_admin_ui sets app.state.admin_ui"
    return state


def wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "") or request.url.path.startswith(
        "/admin/ui/"
    )


async def current_viewer(request: Request) -> Viewer:
    """The request's viewer; ``SignInRequired`` without a live session."""
    token = request.cookies.get(SESSION_COOKIE)
    store = ui_state(request).sessions
    session = store.get(token)
    if session is None or token is None:
        raise SignInRequired()
    if session.role == "operator":
        if get_gateway(request).settings.admin_token is None:  # the token was removed: no operator
            store.revoke(token)
            raise SignInRequired()
        return Viewer(session, token, None)
    assert session.key_id is not None
    async with get_gateway(request).db.transaction() as db_session:
        key = await keys.usable_key(db_session, session.key_id)
    if key is None:  # revoked, expired, or its tenant disabled or deleted: the session ends with it
        store.revoke(token)
        raise SignInRequired()
    return Viewer(session, token, key.tenant)


ViewerDep = Annotated[Viewer, Depends(current_viewer)]


def forbidden_for_tenants() -> APIError:
    return forbidden("Only the operator may do this.", code="operator_only")


async def operator_viewer(viewer: ViewerDep) -> Viewer:
    if not viewer.is_operator:
        raise forbidden_for_tenants()
    return viewer


OperatorDep = Annotated[Viewer, Depends(operator_viewer)]


def check_same_site(request: Request) -> None:
    """Refuse a request a browser says came from another site (403)."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        raise _csrf_refused()
    origin = request.headers.get("origin")
    if origin is not None and origin != "null":
        parts = urlsplit(origin)
        if parts.netloc != request.headers.get("host", "") or parts.scheme != request.url.scheme:
            raise _csrf_refused()
    elif origin == "null":
        raise _csrf_refused()


def check_csrf(request: Request, viewer: Viewer, form_token: str | None = None) -> None:
    """A state-changing request must be same-site and carry the session's CSRF token (403)."""
    check_same_site(request)
    presented = form_token or request.headers.get(CSRF_HEADER) or ""
    if not hmac.compare_digest(presented.encode(), viewer.session.csrf_token.encode()):
        raise _csrf_refused()


def _csrf_refused() -> APIError:
    return forbidden(
        "This request did not come from a page of this admin UI (CSRF check failed); reload the page.",
        code="csrf_failed",
    )


def set_session_cookie(response: Response, request: Request, token: str, max_age_s: float) -> None:
    response.set_cookie(
        SESSION_COOKIE,
        token,
        max_age=int(max_age_s),
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_session_cookie(response: Response, request: Request) -> None:
    response.delete_cookie(
        SESSION_COOKIE,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def client_address(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


def gateway_of(request: Request) -> Gateway:
    return get_gateway(request)
