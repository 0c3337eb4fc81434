"""``check_ready``: whether this replica should get traffic (``GET /ready``).

Ready means every check passes:

    draining     SIGTERM received: the server is finishing its requests       shutting_down
    engine       the engine loop has stopped (the model loads before the app)  engine_dead
    database     it does not answer within CHECK_TIMEOUT_S                     database_unavailable
    migrations   its revision is not the code's head (another replica is       migrations_not_at_head
                 migrating it, or an old schema)
    quotas       Redis does not answer a PING and the failure policy is        quota_backend_down
                 fail_closed (every limited request would get 503)

With ``quota_failure_policy = fail_open`` a Redis outage is reported (``checks.quotas: down``)
but the replica stays ready: it serves, uncounted, as the policy says. A single-tenant server
has only the first two checks. ``/health`` stays the engine's liveness alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.platform.api.lifecycle import Lifecycle
from loraplex.platform.api.tenancy.quotas import RedisQuotaLimiter
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.storage.db import current_revision

if TYPE_CHECKING:
    from loraplex.platform.api.gateway import Gateway

CHECK_TIMEOUT_S = 2.0
"""How long one dependency may take to answer before it counts as down."""


@dataclass(frozen=True)
class Readiness:
    """The answer of ``check_ready``: ready or the first failing reason, and every check's state."""

    reason: str | None
    """None when ready; else the first failing check's reason code."""
    message: str
    checks: dict[str, str] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.reason is None


async def check_ready(engine: AsyncEngine, lifecycle: Lifecycle, gateway: Gateway | None) -> Readiness:
    """Run the checks of the module docstring (the database's and Redis's within ``CHECK_TIMEOUT_S``)."""
    checks: dict[str, str] = {}
    failures: list[tuple[str, str]] = []
    checks["draining"] = "yes" if lifecycle.draining else "no"
    if lifecycle.draining:
        failures.append(("shutting_down", "the server is shutting down"))
    checks["engine"] = "ok" if engine.is_alive else "dead"
    if not engine.is_alive:
        failures.append(("engine_dead", "the engine has stopped"))
    if gateway is not None:
        await _check_database(gateway, checks, failures)
        await _check_quotas(gateway, checks, failures)
    if failures:
        reason = failures[0][0]
        return Readiness(reason, f"Not ready: {'; '.join(m for _, m in failures)}.", checks)
    return Readiness(None, "ready", checks)


async def _check_database(gateway: Gateway, checks: dict[str, str], failures: list[tuple[str, str]]) -> None:
    # Through the outage gate first: during a known outage this answers at once (no timeout per probe).
    try:
        ok, why = await asyncio.wait_for(gateway.database_ready(), CHECK_TIMEOUT_S)
    except Exception as exc:  # not an outage by the gate's rules (e.g. the database dropped): still down
        ok, why = False, f"the database does not answer ({type(exc).__name__})"
    if not ok:
        checks["database"] = "down"
        failures.append(("database_unavailable", why.rstrip(".") or "the database does not answer"))
        return
    try:
        revision = await asyncio.wait_for(current_revision(gateway.db.engine), CHECK_TIMEOUT_S)
    except Exception as exc:  # any failure to answer is "down"; the type tells the operator which
        checks["database"] = f"down ({type(exc).__name__})"
        failures.append(("database_unavailable", "the database does not answer"))
        return
    checks["database"] = "ok"
    if revision != gateway.head_revision:
        checks["migrations"] = f"at {revision}, head is {gateway.head_revision}"
        failures.append(("migrations_not_at_head", f"the database is at revision {revision}, not the head"))
    else:
        checks["migrations"] = "ok"


async def _check_quotas(gateway: Gateway, checks: dict[str, str], failures: list[tuple[str, str]]) -> None:
    limiter = gateway.limiter
    if not isinstance(limiter, RedisQuotaLimiter):
        checks["quotas"] = "in process"
        return
    try:
        await asyncio.wait_for(limiter.client.ping(), CHECK_TIMEOUT_S)
    except Exception as exc:  # reported below; the limiter's own calls count the outage
        checks["quotas"] = f"down ({type(exc).__name__})"
        if gateway.settings.quota_failure_policy == "fail_closed":
            failures.append(("quota_backend_down", "Redis for quotas does not answer (fail_closed)"))
        return
    checks["quotas"] = "ok"
