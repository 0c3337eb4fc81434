"""Who is calling: the bearer credential of a request, as a tenant or as the admin.

    bearer_token(request)              the credential of ``Authorization: Bearer <token>``, or None
    authenticate_tenant(db, mode, req) the calling tenant; 401 otherwise (``open`` mode: ``local``)
    check_admin(expected, request)     nothing, or 401 / 403

Keys are looked up by their sha256 and compared in constant time (``services.keys``); the admin
token with ``hmac.compare_digest``. Neither a key nor the token is ever logged, and a 401 never
says whether a key was wrong, revoked or expired.
"""

from __future__ import annotations

import hmac
import logging

from pydantic import SecretStr
from starlette.requests import Request

from loraplex.platform.api.errors import APIError, forbidden, unauthorized
from loraplex.platform.api.services import keys, tenants
from loraplex.platform.api.services.errors import NotFound
from loraplex.platform.settings import AuthMode
from loraplex.storage.db import Database, Tenant

logger = logging.getLogger(__name__)

LOCAL_TENANT = "local"
"""The tenant every call runs as with ``auth="open"``."""
OPEN_MODE_TOKEN = "local"
"""The one bearer token open mode accepts (clients that must send a key send this one)."""
_MAX_HEADER_CHARS = 1024


def bearer_token(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``; None when there is no such header."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip() or len(header) > _MAX_HEADER_CHARS:
        raise unauthorized("The Authorization header must be 'Bearer <API key>'.")
    return token.strip()


def check_open_mode_credential(request: Request) -> None:
    """Open mode runs a request as ``local`` only without ``Authorization`` or with
    ``Bearer local``: a key sent to a server that ignores keys is a mistake to report (401)."""
    token = bearer_token(request)
    if token is not None and not hmac.compare_digest(token, OPEN_MODE_TOKEN):
        raise unauthorized(
            "This server runs in open mode (no API keys): send no Authorization header, or "
            f"'Bearer {OPEN_MODE_TOKEN}'; start it with auth=keys to use keys."
        )


async def authenticate_tenant(db: Database, mode: AuthMode, request: Request) -> Tenant:
    """The tenant the request's API key belongs to; 401 for a missing, wrong, revoked or expired key,
    or a disabled tenant. With ``mode="open"`` every request is the ``local`` tenant."""
    if mode == "open":
        check_open_mode_credential(request)
        return await local_tenant(db)
    token = bearer_token(request)
    if token is None:
        raise unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <API key>' "
            "(an operator creates keys with `loraplex keys create`)."
        )
    async with db.transaction() as session:
        tenant = await keys.authenticate(session, token)
    if tenant is None:
        raise unauthorized("Incorrect API key provided, or the key was revoked or has expired.")
    return tenant


async def local_tenant(db: Database) -> Tenant:
    """The built-in ``local`` tenant, created on first use; 401 while an operator has disabled it."""
    try:
        async with db.transaction() as session:
            tenant = await tenants.get_tenant(session, LOCAL_TENANT)
    except NotFound:
        async with db.transaction(write=True) as session:
            tenant = await tenants.ensure_tenant(session, LOCAL_TENANT)
    if tenant.disabled:
        raise unauthorized(f"The tenant '{LOCAL_TENANT}' is disabled.")
    return tenant


def check_admin(expected: SecretStr | None, request: Request) -> None:
    """Pass when the request carries the admin token; 403 when none is configured, 401 otherwise."""
    if expected is None:
        raise forbidden(
            "The admin API is disabled: start the server with an admin token (LORAPLEX_ADMIN_TOKEN).",
            code="admin_disabled",
        )
    token = bearer_token(request)
    if token is None:
        raise _admin_refused("Send the admin token as 'Authorization: Bearer <admin token>'.")
    if not admin_token_matches(expected, token):
        raise _admin_refused("Incorrect admin token.")


def admin_token_matches(expected: SecretStr, presented: str) -> bool:
    """Whether ``presented`` is the admin token (constant time)."""
    return hmac.compare_digest(
        presented.encode("utf-8", "surrogatepass"), expected.get_secret_value().encode()
    )


def _admin_refused(message: str) -> APIError:
    return unauthorized(message, code="invalid_admin_token")
