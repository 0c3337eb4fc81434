"""The admin web UI, served by the gateway's app under ``/admin`` (``mount_admin_ui``).

Server-rendered pages (Jinja2, ``templates/``) with a small hand-written script for the live
parts (``static/admin.js``: upload progress, the dashboard's polling and charts, the
playground's stream); every asset ships in this package, nothing is fetched from elsewhere.

| module | what |
|---|---|
| ``sessions`` | sign-in sessions (server side, revocable) and the failed sign-in limit |
| ``security`` | the viewer of a request (operator or tenant), cookies, CSRF and same-site checks |
| ``views`` | rendering, and the headers every page carries (CSP: this origin only) |
| ``signin`` | ``/admin``: sign in with the admin token or a tenant's key, sign out |
| ``tenant_pages`` | tenants, quotas, keys (the operator); a tenant's own key prefixes |
| ``adapter_pages`` | adapters: list, versions, upload, delete |
| ``live_pages`` | dashboard and its JSON, usage, playground |

Every rule and query is the gateway's (``platform.api.services``, the catalog, ``Gateway``):
routes here only read forms, call those, and render. An operator sees everything; a tenant
only its own adapters, key prefixes, usage and counters (each query is filtered by the tenant
of the session, never by a name from the request).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from loraplex.admin_ui import adapter_pages, live_pages, signin, tenant_pages
from loraplex.admin_ui.adapter_pages import UPLOAD_PATH
from loraplex.admin_ui.security import SignInRequired, UIState, wants_json
from loraplex.admin_ui.sessions import SessionStore, SignInLimiter
from loraplex.admin_ui.views import render
from loraplex.platform.api.errors import APIError, to_api_error, unauthorized
from loraplex.platform.api.observability.error_handlers import error_response
from loraplex.platform.api.observability.record import note_error
from loraplex.platform.api.services.errors import ServiceError
from loraplex.platform.settings import GatewaySettings

__all__ = ["UPLOAD_PATH", "mount_admin_ui"]

STATIC_DIR = Path(__file__).parent / "static"


def mount_admin_ui(app: FastAPI, settings: GatewaySettings) -> None:
    """Serve the admin UI from ``app`` (an app with tenants)."""
    app.state.admin_ui = UIState(
        sessions=SessionStore(settings.admin_session_ttl_s),
        signins=SignInLimiter(settings.admin_signin_max_failures),
    )
    for module in (signin, tenant_pages, adapter_pages, live_pages):
        app.include_router(module.router)
    app.mount("/admin/static", StaticFiles(directory=STATIC_DIR), name="admin-static")

    @app.exception_handler(SignInRequired)
    async def _sign_in(request: Request, _: Exception) -> Response:
        # A browser's page or form goes to the sign-in page; a script's call gets 401.
        browser = "text/html" in request.headers.get("accept", "")
        if wants_json(request) or (request.method != "GET" and not browser):
            return error_response(request, unauthorized("Sign in to the admin UI first.", code="signed_out"))
        return RedirectResponse("/admin", status_code=303)

    # A page answers an error as a page; everything else (the APIs, the UI's JSON calls) keeps
    # the app's OpenAI error body: the same mapping, ``to_api_error``.
    async def _error(request: Request, exc: Exception) -> Response:
        error = to_api_error(exc)
        if not _is_page(request):
            return error_response(request, error)
        note_error(request.scope, error)
        return render(request, "error.html", None, status=error.status, message=error.message)

    for error_class in (APIError, ServiceError):
        app.add_exception_handler(error_class, _error)


def _is_page(request: Request) -> bool:
    path = request.url.path
    return (
        request.method == "GET"
        and path.startswith("/admin")
        and not path.startswith(("/admin/api", "/admin/ui/", "/admin/static"))
        and not wants_json(request)
    )
