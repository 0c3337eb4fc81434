"""``/admin``: the sign-in form, signing in and out.

The admin token signs in as the operator; a tenant's API key as that tenant (only while the
key authenticates: ``keys.check_key``, the same rules as the API). A wrong credential never
says which kind it was. Failed attempts are limited per client address (429 with
``Retry-After``), and the form itself carries a random value bound to a cookie, so another site
cannot sign a browser in to an account of its choosing.
"""

from __future__ import annotations

import hmac
import math
import secrets
from typing import Annotated

from fastapi import APIRouter, Form, Request
from starlette.responses import RedirectResponse, Response

from loraplex.admin_ui.security import (
    COOKIE_PATH,
    SESSION_COOKIE,
    SIGNIN_COOKIE,
    SignInRequired,
    ViewerDep,
    check_csrf,
    check_same_site,
    clear_session_cookie,
    client_address,
    current_viewer,
    gateway_of,
    set_session_cookie,
    ui_state,
)
from loraplex.admin_ui.views import SECURITY_HEADERS, render
from loraplex.platform.api.services import keys
from loraplex.platform.api.tenancy.auth import admin_token_matches

router = APIRouter(prefix="/admin", include_in_schema=False)

HOME = "/admin/dashboard"


def _signin_page(request: Request, status: int = 200, error: str | None = None) -> Response:
    nonce = secrets.token_urlsafe(24)
    response = render(request, "signin.html", None, status=status, error=error, signin_nonce=nonce)
    response.set_cookie(
        SIGNIN_COOKIE,
        nonce,
        max_age=3600,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.get("")
async def home(request: Request) -> Response:
    """The sign-in form, or the dashboard for a signed-in browser."""
    try:
        await current_viewer(request)
    except SignInRequired:
        return _signin_page(request)
    return RedirectResponse(HOME, status_code=303, headers=SECURITY_HEADERS)


@router.post("/sign-in")
async def sign_in(
    request: Request,
    credential: Annotated[str, Form(max_length=512)] = "",
    csrf_token: Annotated[str, Form(max_length=128)] = "",
) -> Response:
    check_same_site(request)
    expected_nonce = request.cookies.get(SIGNIN_COOKIE, "")
    if not expected_nonce or not hmac.compare_digest(expected_nonce.encode(), csrf_token.encode()):
        return _signin_page(request, 403, "The sign-in form expired; please try again.")
    state = ui_state(request)
    client = client_address(request)
    wait_s = state.signins.retry_after(client)
    if wait_s > 0:
        response = _signin_page(
            request, 429, f"Too many failed sign-ins from your address; try again in {math.ceil(wait_s)} s."
        )
        response.headers["Retry-After"] = str(math.ceil(wait_s))
        return response
    gateway = gateway_of(request)
    credential = credential.strip()
    token = gateway.settings.admin_token
    if token is not None and credential and admin_token_matches(token, credential):
        cookie, _ = state.sessions.create("operator")
    else:
        async with gateway.db.transaction() as session:
            holder = await keys.check_key(session, credential) if credential else None
        if holder is None:
            state.signins.failed(client)
            return _signin_page(request, 401, "That is neither the admin token nor a valid API key.")
        cookie, _ = state.sessions.create("tenant", holder.tenant.name, holder.key_id)
    state.signins.succeeded(client)
    response = RedirectResponse(HOME, status_code=303, headers=SECURITY_HEADERS)
    set_session_cookie(response, request, cookie, state.sessions.ttl_s)
    response.delete_cookie(SIGNIN_COOKIE, path=COOKIE_PATH)
    return response


@router.post("/sign-out")
async def sign_out(
    request: Request, viewer: ViewerDep, csrf_token: Annotated[str, Form(max_length=128)] = ""
) -> Response:
    check_csrf(request, viewer, csrf_token)
    ui_state(request).sessions.revoke(request.cookies.get(SESSION_COOKIE))
    response = RedirectResponse("/admin", status_code=303, headers=SECURITY_HEADERS)
    clear_session_cookie(response, request)
    return response
