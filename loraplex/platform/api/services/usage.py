"""Usage records: one row per request (tokens, latency, how it ended), and queries over them.

Nothing of the request's text is stored; the adapter is stored as the request named it
(``name`` or ``owner/name``) with its version, so a record stays readable after the adapter
is deleted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import BigInteger, ColumnElement, func, literal, select, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.api.services.errors import InvalidInput, NotFound
from loraplex.platform.api.services.pages import Page, PageRequest, decode_cursor, encode_cursor, make_page
from loraplex.storage.db.models import USAGE_STATUSES, Tenant, UsageRecord, UsageStatus, UTCDateTime

MAX_QUERY_ROWS = 10_000


@dataclass(frozen=True)
class Usage:
    """What one request used, as the gateway reports it when the request ends."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the prefix cache served (at most ``prompt_tokens``)."""
    completion_tokens: int
    latency_ms: float
    status: UsageStatus
    adapter_name: str | None = None
    """As the request named it (``name`` or ``owner/name``); None for the base model."""
    adapter_version: str | None = None


@dataclass(frozen=True)
class UsageFilter:
    """Which records a query covers; every field left None matches everything."""

    tenant: Tenant | None = None
    since: datetime | None = None
    """Inclusive."""
    until: datetime | None = None
    """Exclusive."""
    adapter_name: str | None = None
    status: UsageStatus | None = None


@dataclass(frozen=True)
class UsageTotals:
    """Sums over the records a filter matches."""

    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


async def record_usage(
    session: AsyncSession, tenant: Tenant, usage: Usage, *, at: datetime | None = None
) -> UsageRecord:
    """Store one request's usage; ``NotFound`` if the tenant was deleted meanwhile."""
    _check(usage)
    record = UsageRecord(
        tenant_id=tenant.id,
        adapter_name=usage.adapter_name,
        adapter_version=usage.adapter_version,
        request_id=usage.request_id,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        completion_tokens=usage.completion_tokens,
        latency_ms=usage.latency_ms,
        status=usage.status,
    )
    if at is not None:
        record.created_at = at
    session.add(record)
    try:
        await session.flush()
    except IntegrityError:  # the only constraint an insert can break here is the tenant FK
        raise NotFound("tenant", tenant.name) from None
    return record


async def query_usage(
    session: AsyncSession, where: UsageFilter | None = None, *, limit: int = 1000
) -> list[UsageRecord]:
    """Records matching ``where``, newest first, at most ``limit`` (up to ``MAX_QUERY_ROWS``)."""
    if not 1 <= limit <= MAX_QUERY_ROWS:
        raise InvalidInput("limit", f"must be from 1 to {MAX_QUERY_ROWS}")
    query = (
        select(UsageRecord)
        .where(*_conditions(where or UsageFilter()))
        .order_by(UsageRecord.created_at.desc(), UsageRecord.id.desc())
        .limit(limit)
    )
    return list(await session.scalars(query))


async def page_usage(session: AsyncSession, where: UsageFilter, page: PageRequest) -> Page[UsageRecord]:
    """One page of ``query_usage`` (newest first). The opaque cursor holds the last record's
    (created_at, id): the query goes on below it in the (tenant_id, created_at) or
    (created_at) index."""
    query = (
        select(UsageRecord)
        .where(*_conditions(where))
        .order_by(UsageRecord.created_at.desc(), UsageRecord.id.desc())
        .limit(page.limit + 1)
    )
    if page.after is not None:
        at, after_id = decode_cursor(page.after, (str, int))
        try:
            when = datetime.fromisoformat(str(at))
        except ValueError:
            raise InvalidInput("after", "not a cursor this list gave") from None
        if when.tzinfo is None:
            raise InvalidInput("after", "not a cursor this list gave")
        # Typed literals: the cursor's time goes through UTCDateTime like the column's values.
        below = tuple_(literal(when, UTCDateTime()), literal(after_id, BigInteger()))
        query = query.where(tuple_(UsageRecord.created_at, UsageRecord.id) < below)
    rows = list(await session.scalars(query))
    return make_page(rows, page, lambda r: encode_cursor(r.created_at.isoformat(), r.id))


async def usage_totals(session: AsyncSession, where: UsageFilter | None = None) -> UsageTotals:
    """Request count and token sums over the records matching ``where``."""
    row = (
        await session.execute(
            select(
                func.count(UsageRecord.id),
                func.coalesce(func.sum(UsageRecord.prompt_tokens), 0),
                func.coalesce(func.sum(UsageRecord.cached_tokens), 0),
                func.coalesce(func.sum(UsageRecord.completion_tokens), 0),
            ).where(*_conditions(where or UsageFilter()))
        )
    ).one()
    return UsageTotals(*(int(value) for value in row))


def _conditions(where: UsageFilter) -> Sequence[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    if where.tenant is not None:
        conditions.append(UsageRecord.tenant_id == where.tenant.id)
    if where.since is not None:
        conditions.append(UsageRecord.created_at >= where.since)
    if where.until is not None:
        conditions.append(UsageRecord.created_at < where.until)
    if where.adapter_name is not None:
        conditions.append(UsageRecord.adapter_name == where.adapter_name)
    if where.status is not None:
        conditions.append(UsageRecord.status == where.status)
    return conditions


def _check(usage: Usage) -> None:
    for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        value = getattr(usage, field)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
            raise InvalidInput(field, "must be a non-negative integer")
    if usage.cached_tokens > usage.prompt_tokens:
        raise InvalidInput("cached_tokens", "cannot exceed prompt_tokens")
    if not usage.latency_ms >= 0:  # also refuses NaN
        raise InvalidInput("latency_ms", "must be a non-negative number")
    if usage.status not in USAGE_STATUSES:
        raise InvalidInput("status", f"must be one of {', '.join(USAGE_STATUSES)}")
    if not 1 <= len(usage.request_id) <= 128:
        raise InvalidInput("request_id", "must be 1-128 characters")


@dataclass(frozen=True)
class ServedTotals:
    """What requests on one adapter version used."""

    num_requests: int
    tokens: int
    """Prompt + completion."""


async def served_by_version(
    session: AsyncSession, versions: Sequence[str], since: datetime
) -> dict[str, ServedTotals]:
    """Requests and tokens per adapter version (content sha256) since ``since``, for the versions
    given (a page of them): the (adapter_version, created_at) index bounds the rows read."""
    if not versions:
        return {}
    query = (
        select(
            UsageRecord.adapter_version,
            func.count(UsageRecord.id),
            func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens),
        )
        .where(UsageRecord.adapter_version.in_(list(set(versions))), UsageRecord.created_at >= since)
        .group_by(UsageRecord.adapter_version)
    )
    return {
        str(version): ServedTotals(int(count), int(tokens or 0))
        for version, count, tokens in await session.execute(query)
    }


async def tokens_by_tenant(
    session: AsyncSession, since: datetime, tenant: Tenant | None = None
) -> dict[str, int]:
    """Prompt + completion tokens per tenant name over the records since ``since`` (``tenant``:
    that one only); the dashboard's per-tenant chart. Reads the (created_at, id) index range."""
    query = (
        select(UsageRecord.tenant_id, func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens))
        .where(UsageRecord.created_at >= since)
        .group_by(UsageRecord.tenant_id)
    )
    if tenant is not None:
        query = query.where(UsageRecord.tenant_id == tenant.id)
    totals = {tenant_id: int(total or 0) for tenant_id, total in await session.execute(query)}
    if not totals:
        return {}
    names = await session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(list(totals))))
    return {name: totals[tenant_id] for tenant_id, name in names}
