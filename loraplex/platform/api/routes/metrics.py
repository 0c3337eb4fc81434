"""``GET /metrics``: Prometheus' text format (``observability.metrics``); behind the admin token
where ``metrics_require_admin`` says so (by default: with auth=keys, whose series name tenants)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from loraplex.platform.api.deps import StateDep
from loraplex.platform.api.errors import forbidden
from loraplex.platform.api.observability.metrics import CONTENT_TYPE
from loraplex.platform.api.tenancy.auth import check_admin

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def metrics(request: Request, state: StateDep) -> Response:
    """Every series of this replica, read now (engine and gateway snapshots, request counters)."""
    require_admin = state.settings.serving.metrics_require_admin
    if require_admin is None:
        require_admin = state.gateway is not None and state.gateway.settings.auth == "keys"
    if require_admin:
        if state.gateway is None:
            raise forbidden("metrics need the admin token, and a single-tenant server has none")
        check_admin(state.gateway.settings.admin_token, request)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
