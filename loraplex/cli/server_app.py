"""``build_server_app``: the app ``loraplex serve`` runs, composed here, above both its parts.

The API layer (``platform.api.build_app``) knows nothing of the admin web UI; the UI is a client
of the API layer. This composition root joins them: with tenants, the UI is mounted under
``/admin`` and its upload form gets the upload size limit.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import FastAPI

from loraplex import admin_ui
from loraplex.adapters import LoRARequest
from loraplex.platform.api.app import build_app
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.settings import ServerSettings


def build_server_app(
    engine: AsyncEngine, settings: ServerSettings, loras: Mapping[str, LoRARequest] | None = None
) -> FastAPI:
    """``build_app``'s API, with the admin web UI under ``/admin`` unless single-tenant."""
    with_ui = not settings.serving.single_tenant
    app = build_app(engine, settings, loras, upload_paths=(admin_ui.UPLOAD_PATH,) if with_ui else ())
    if with_ui:
        admin_ui.mount_admin_ui(app, settings.gateway)
    return app
