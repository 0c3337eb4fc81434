"""API keys: create (the key is shown once), authenticate, list, revoke.

A key is ``lpx-`` + 32 random bytes (urlsafe base64, 43 characters). The database keeps its
sha256 (to find it) and its first ``PREFIX_LEN`` characters (to show it); the key itself is
returned once, by ``create_key``, and is never stored or logged. sha256 without a salt is
right here: the key has 256 bits of entropy, so no dictionary or rainbow table applies, and
an unsalted digest is what lets ``authenticate`` find the key with one indexed lookup.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Select, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.api.services.errors import InvalidInput, NotFound
from loraplex.platform.api.services.pages import Page, PageRequest, int_cursor, make_page
from loraplex.storage.db.models import ApiKey, Tenant, utcnow

logger = logging.getLogger(__name__)

KEY_PREFIX = "lpx-"
KEY_BYTES = 32
PREFIX_LEN = 12
"""``lpx-`` and 8 characters (48 bits) of the random part: enough to tell keys apart."""
_MAX_KEY_LEN = 256  # longer than any key we issue: refused before hashing
LAST_USED_RESOLUTION = timedelta(seconds=60)
"""``last_used_at`` is written at most this often per key, not on every request."""


@dataclass(frozen=True)
class CreatedKey:
    """A new key: the only object that ever holds the key in clear."""

    id: int
    key: str = field(repr=False)  # repr=False: logging this object never prints the key
    prefix: str
    tenant: str
    name: str | None
    created_at: datetime
    expires_at: datetime | None


def hash_key(key: str) -> str:
    """sha256 hex of a presented key: what ``api_keys.key_hash`` holds."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


async def create_key(
    session: AsyncSession,
    tenant: Tenant,
    *,
    name: str | None = None,
    expires_at: datetime | None = None,
    now: datetime | None = None,
) -> CreatedKey:
    """A new key for ``tenant``; its plaintext is in the result and nowhere else.

    ``expires_at`` must be timezone-aware and in the future (``now``: the clock, for tests).
    """
    now = now or utcnow()
    if expires_at is not None and (expires_at.tzinfo is None or expires_at <= now):
        raise InvalidInput("expires_at", "must be a timezone-aware time in the future")
    if name is not None and not 1 <= len(name) <= 128:
        raise InvalidInput("name", "a key name is 1-128 characters")
    key = KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)
    row = ApiKey(
        tenant_id=tenant.id,
        key_hash=hash_key(key),
        prefix=key[:PREFIX_LEN],
        name=name,
        created_at=now,
        expires_at=expires_at,
    )
    session.add(row)
    await session.flush()
    logger.info("created API key id %d for tenant %s", row.id, tenant.name)
    return CreatedKey(
        id=row.id,
        key=key,
        prefix=row.prefix,
        tenant=tenant.name,
        name=name,
        created_at=row.created_at,
        expires_at=row.expires_at,
    )


@dataclass(frozen=True)
class KeyCheck:
    """A key that authenticates: its tenant, when the key stops working by itself, and its id."""

    tenant: Tenant
    expires_at: datetime | None
    key_id: int


def well_formed(presented_key: str) -> bool:
    """Whether ``presented_key`` has the format of a key we issue (checked before any lookup)."""
    return presented_key.startswith(KEY_PREFIX) and len(presented_key) <= _MAX_KEY_LEN


async def authenticate(
    session: AsyncSession, presented_key: str, *, now: datetime | None = None
) -> Tenant | None:
    """The tenant ``presented_key`` belongs to, or None: unknown, revoked, expired, tenant disabled.

    Every refusal is the same None, so a caller cannot tell a revoked key from a wrong one.
    Updates the key's ``last_used_at`` (at most once per ``LAST_USED_RESOLUTION``).
    """
    checked = await check_key(session, presented_key, now=now)
    return None if checked is None else checked.tenant


async def check_key(
    session: AsyncSession, presented_key: str, *, now: datetime | None = None
) -> KeyCheck | None:
    """``authenticate``, with the key's id and expiry (a cache of the answer must not outlive it;
    an admin UI session lasts while that key authenticates)."""
    if not well_formed(presented_key):
        return None  # the format is public: refusing it early tells an attacker nothing secret
    presented_hash = hash_key(presented_key)
    # Constant time with respect to the secret: the database compares *hashes*, and what the
    # timing of an index lookup can reveal is how much of sha256(guess) matches a stored hash.
    # Learning a stored hash byte by byte that way does not get an attacker closer to a key
    # (finding an input with a chosen sha256 is preimage search), so the key never leaks
    # through timing. compare_digest then makes the final equal/not-equal decision itself in
    # constant time, whatever the database's collation or comparison did.
    row = await session.scalar(select(ApiKey).where(ApiKey.key_hash == presented_hash))
    if row is None or not hmac.compare_digest(row.key_hash, presented_hash):
        return None
    now = now or utcnow()
    if not _usable(row, now):
        return None
    # Taken first: a failed _touch expires the row, and async cannot reload it.
    checked = KeyCheck(row.tenant, row.expires_at, row.id)
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
        await _touch(session, row, now)
    return checked


async def usable_key(session: AsyncSession, key_id: int, *, now: datetime | None = None) -> ApiKey | None:
    """Key ``key_id`` if it still authenticates (not revoked, not expired, tenant enabled), else None:
    what a session opened with that key checks on every request."""
    row = await session.get(ApiKey, key_id, populate_existing=True)
    return row if row is not None and _usable(row, now or utcnow()) else None


def _usable(row: ApiKey, now: datetime) -> bool:
    if row.revoked_at is not None or (row.expires_at is not None and row.expires_at <= now):
        return False
    return not row.tenant.disabled


async def _touch(session: AsyncSession, row: ApiKey, now: datetime) -> None:
    # last_used_at is advisory. On SQLite this transaction has read already, so its write can
    # fail with "database is locked" when another connection committed in between; that must
    # not refuse a valid key. The savepoint undoes just this write; the next request retries it.
    key_id = row.id  # read before: a rolled-back savepoint expires the row's attributes
    try:
        async with session.begin_nested():
            row.last_used_at = now
    except OperationalError as e:
        logger.warning("could not record the use of API key id %d (will retry): %s", key_id, e.orig)


async def list_keys(
    session: AsyncSession,
    tenant: Tenant | None = None,
    *,
    prefix: str | None = None,
    include_revoked: bool = True,
) -> list[ApiKey]:
    """Keys of ``tenant`` (every tenant's if None), oldest first; ``prefix``: those starting so.

    All at once: for small databases and tests; listings use ``page_keys``."""
    return list(await session.scalars(_keys_query(tenant, prefix, include_revoked)))


async def page_keys(
    session: AsyncSession,
    page: PageRequest,
    tenant: Tenant | None = None,
    *,
    prefix: str | None = None,
    include_revoked: bool = True,
) -> Page[ApiKey]:
    """One page of ``list_keys`` (the cursor is the last key's id): the (tenant_id, id) index
    is walked from the cursor, so any page costs the same."""
    query = _keys_query(tenant, prefix, include_revoked).limit(page.limit + 1)
    if page.after is not None:
        query = query.where(ApiKey.id > int_cursor(page.after))
    return make_page(list(await session.scalars(query)), page, lambda k: str(k.id))


def _keys_query(tenant: Tenant | None, prefix: str | None, include_revoked: bool) -> Select[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.id)
    if tenant is not None:
        query = query.where(ApiKey.tenant_id == tenant.id)
    if prefix:
        query = query.where(ApiKey.prefix.startswith(prefix, autoescape=True))  # '%', '_' literal
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return query


async def revoke_key(
    session: AsyncSession, key_id: int, *, tenant: Tenant | None = None, now: datetime | None = None
) -> ApiKey:
    """Revoke key ``key_id`` (idempotent: the first revocation time stays).

    With ``tenant``, a key of another tenant is ``NotFound``, like a key that does not exist.
    """
    row = await session.get(ApiKey, key_id)
    if row is None or (tenant is not None and row.tenant_id != tenant.id):
        raise NotFound("key", str(key_id))
    if row.revoked_at is None:
        row.revoked_at = now or utcnow()
        await session.flush()
        logger.info("revoked API key id %d", row.id)
    return row
