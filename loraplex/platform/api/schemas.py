"""Request and response bodies of the gateway's own APIs (admin and adapters).

Create / Update bodies refuse unknown fields (a misspelt quota must not be silently ignored);
``*Public`` bodies are what the API returns, built from the database rows. Quotas absent or
null mean unlimited; in a PATCH, an absent field is left as it is and null makes it unlimited.
"""

from __future__ import annotations

from datetime import datetime
from typing import Generic, Self, TypeVar

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from loraplex.platform.api.services.keys import CreatedKey
from loraplex.platform.api.services.pages import Page
from loraplex.platform.api.services.tenants import QuotaField
from loraplex.platform.api.services.usage import UsageTotals
from loraplex.storage.db import Adapter, ApiKey, Tenant, UsageRecord, UsageStatus, Visibility

T = TypeVar("T")


class ListOf(BaseModel, Generic[T]):
    """OpenAI's list shape: one page of ``data``; ``after=<last_id>`` asks for the next one."""

    object: str = "list"
    data: list[T]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

    @classmethod
    def of_page(cls, page: Page[T]) -> Self:
        return cls(data=page.items, first_id=page.first_id, last_id=page.last_id, has_more=page.has_more)


class Quotas(BaseModel):
    """A tenant's limits; None is unlimited."""

    model_config = ConfigDict(extra="forbid", strict=True)

    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    max_adapters: int | None = None
    max_adapter_bytes: int | None = None


class TenantCreate(Quotas):
    name: str
    disabled: bool = False
    weight: float = 1.0
    """Fair-share weight, in (0, 1000]: the tenant's share of the engine under load, relative."""


class TenantUpdate(Quotas):
    """PATCH: only the fields sent change."""

    disabled: bool | None = None
    weight: float | None = None
    """A new fair-share weight (null is refused: the weight is never unlimited)."""

    def quota_changes(self) -> dict[QuotaField, int | None]:
        fields: tuple[QuotaField, ...] = (
            "rpm",
            "tpm",
            "max_concurrency",
            "max_adapters",
            "max_adapter_bytes",
        )
        return {f: getattr(self, f) for f in fields if f in self.model_fields_set}


class TenantPublic(BaseModel):
    object: str = "tenant"
    name: str
    disabled: bool
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    max_adapters: int | None
    max_adapter_bytes: int | None
    weight: float
    created_at: datetime

    @classmethod
    def of(cls, tenant: Tenant) -> TenantPublic:
        return cls(
            name=tenant.name,
            disabled=tenant.disabled,
            weight=tenant.weight,
            rpm=tenant.rpm,
            tpm=tenant.tpm,
            max_concurrency=tenant.max_concurrency,
            max_adapters=tenant.max_adapters,
            max_adapter_bytes=tenant.max_adapter_bytes,
            created_at=tenant.created_at,
        )


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=128)
    expires_at: AwareDatetime | None = None


class KeyPublic(BaseModel):
    """A key as listings show it: its prefix, never the key."""

    object: str = "api_key"
    id: int
    prefix: str
    tenant: str
    name: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None

    @classmethod
    def of(cls, key: ApiKey) -> KeyPublic:
        return cls(
            id=key.id,
            prefix=key.prefix,
            tenant=key.tenant.name,
            name=key.name,
            created_at=key.created_at,
            expires_at=key.expires_at,
            revoked_at=key.revoked_at,
            last_used_at=key.last_used_at,
        )


class KeyCreated(KeyPublic):
    """The answer to creating a key: the only time the key itself is shown."""

    key: str

    @classmethod
    def created(cls, key: CreatedKey) -> KeyCreated:
        return cls(
            id=key.id,
            key=key.key,
            prefix=key.prefix,
            tenant=key.tenant,
            name=key.name,
            created_at=key.created_at,
            expires_at=key.expires_at,
        )


class AdapterPublic(BaseModel):
    """One version of an adapter; ``model`` is what the owner puts in a request's ``model``."""

    object: str = "adapter"
    model: str
    owner: str
    name: str
    version: str
    visibility: Visibility
    base_model: str
    rank: int
    target_modules: list[str]
    bytes: int
    created_at: datetime

    @classmethod
    def of(cls, adapter: Adapter) -> AdapterPublic:
        return cls(
            model=adapter.name,
            owner=adapter.owner.name,
            name=adapter.name,
            version=adapter.version,
            visibility=adapter.visibility,
            base_model=adapter.base_model,
            rank=adapter.rank,
            target_modules=list(adapter.target_modules),
            bytes=adapter.nbytes,
            created_at=adapter.created_at,
        )


class AdapterDeleted(BaseModel):
    object: str = "adapter.deleted"
    owner: str
    name: str
    versions: list[str]
    deleted: bool = True


class UsagePublic(BaseModel):
    tenant: str
    request_id: str
    adapter: str | None
    adapter_version: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    latency_ms: float
    status: UsageStatus
    created_at: datetime

    @classmethod
    def of(cls, record: UsageRecord) -> UsagePublic:
        return cls(
            tenant=record.tenant.name,
            request_id=record.request_id,
            adapter=record.adapter_name,
            adapter_version=record.adapter_version,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            completion_tokens=record.completion_tokens,
            latency_ms=record.latency_ms,
            status=record.status,
            created_at=record.created_at,
        )


class UsageReport(ListOf[UsagePublic]):
    """Totals over every record the filter matches, and one page of those records, newest first."""

    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, totals: UsageTotals, records: Page[UsageRecord]) -> UsageReport:
        return cls(
            num_requests=totals.num_requests,
            prompt_tokens=totals.prompt_tokens,
            cached_tokens=totals.cached_tokens,
            completion_tokens=totals.completion_tokens,
            data=[UsagePublic.of(r) for r in records.items],
            first_id=records.first_id,
            last_id=records.last_id,
            has_more=records.has_more,
        )
