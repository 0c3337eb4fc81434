"""Who may upload now: a tenant's uploads count like its requests, and a few run at once.

An upload is the most expensive thing a tenant can ask for (a body of up to
``max_upload_bytes``, an archive to extract, weights to parse and check), so before its body is
read it passes, in order:

| check | limit | refusal |
|---|---|---|
| this tenant's uploads in flight (this process) | ``max_uploads_per_tenant`` | 429 too_many_uploads |
| the tenant's ``rpm`` and ``max_concurrency`` (shared by replicas) | per tenant | 429 / 503 |

Validation itself then runs on the catalog's own bounded thread pool (``upload_workers``), so
however many uploads are admitted, the threads that tokenize and render requests stay free.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loraplex.platform.api.errors import APIError
from loraplex.platform.api.tenancy.quotas import Quota
from loraplex.platform.api.tenancy.tenant_gate import TenantGate
from loraplex.storage.db import Tenant


class UploadAdmission:
    """Admits one tenant's upload at a time through ``admit`` (an async context manager)."""

    def __init__(self, gate: TenantGate, max_per_tenant: int) -> None:
        self.gate = gate
        self.max_per_tenant = max_per_tenant
        self._in_flight: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        """Uploads of ``tenant`` admitted and not finished, in this process."""
        return self._in_flight.get(tenant, 0)

    @asynccontextmanager
    async def admit(self, tenant: Tenant) -> AsyncIterator[None]:
        """Hold an upload slot of ``tenant`` while the body is read and validated; 429 otherwise."""
        name = tenant.name
        if self.in_flight(name) >= self.max_per_tenant:
            self.gate.num_quota_refusals += 1
            raise APIError(
                429,
                f"upload limit reached: {self.max_per_tenant} uploads of this tenant in flight; "
                "retry when one has finished",
                code="too_many_uploads",
                err_type="requests",
                headers={"Retry-After": "1"},
            )
        self._in_flight[name] = self.in_flight(name) + 1
        try:
            slot = None
            if tenant.rpm is not None or tenant.max_concurrency is not None:
                quota = Quota(rpm=tenant.rpm, max_concurrency=tenant.max_concurrency)
                slot = await self.gate.take_slot(tenant, quota, f"upload-{uuid.uuid4().hex}")
            try:
                yield
            finally:
                if slot is not None:
                    await self.gate.limiter.settle(slot, 0)
        finally:
            left = self.in_flight(name) - 1
            if left > 0:
                self._in_flight[name] = left
            else:
                self._in_flight.pop(name, None)
