"""The gateway's tables: tenants, their API keys, their adapters, and what they used.

Every change here needs a migration in ``migrations/versions/`` (``tests/storage/db`` checks
that the migrated schema and these models do not drift apart). Timestamps are timezone-aware
UTC on both backends (``UTCDateTime``). Quota columns are NULL for "unlimited".
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

Visibility = Literal["private", "public"]
VISIBILITIES: tuple[Visibility, ...] = ("private", "public")

UsageStatus = Literal["ok", "aborted", "error", "rejected"]
"""How a request ended: finished, the client went away, an engine/server error, refused (quota)."""
USAGE_STATUSES: tuple[UsageStatus, ...] = ("ok", "aborted", "error", "rejected")

TENANT_NAME_MAX = 64
ADAPTER_NAME_MAX = 128
KEY_PREFIX_MAX = 16


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    PostgreSQL's ``timestamptz`` returns aware datetimes but SQLite stores text without an
    offset and returns naive ones; comparing the two raises ``TypeError``. Values are
    converted to UTC on the way in (naive ones are refused: their zone is a guess) and
    tagged UTC on the way out, so ``expires_at < now`` means the same thing everywhere.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware one (datetime.now(UTC))")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base; constraint names are fixed so later migrations can name them."""

    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


class Tenant(Base):
    """A customer of the gateway: owns API keys and adapters, has quotas."""

    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(TENANT_NAME_MAX), unique=True)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    rpm: Mapped[int | None] = mapped_column(Integer)
    """Requests per minute."""
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    """Tokens (prompt + completion) per minute."""
    max_concurrency: Mapped[int | None] = mapped_column(Integer)
    """Requests in flight at once."""
    max_adapters: Mapped[int | None] = mapped_column(Integer)
    """Adapter names the tenant may own (each name may have several versions)."""
    max_adapter_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """Bytes of every stored version of every adapter the tenant owns, together."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    """Fair-share weight: under load, the tenant's share of the engine relative to the others'."""

    def __repr__(self) -> str:
        return f"Tenant(id={self.id!r}, name={self.name!r}, disabled={self.disabled!r})"


class ApiKey(Base):
    """A tenant's API key; the database only ever holds its sha256, never the key."""

    __tablename__ = "api_keys"
    # (tenant_id, id): a tenant's keys in id order, read a page at a time from any cursor
    # (keyset pagination); it also serves every lookup by tenant_id alone.
    __table_args__ = (Index(None, "tenant_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """sha256 hex of the whole key: what ``authenticate`` looks up."""
    prefix: Mapped[str] = mapped_column(String(KEY_PREFIX_MAX))
    """The key's first characters, shown in listings so an operator can tell keys apart."""
    name: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    tenant: Mapped[Tenant] = relationship(lazy="joined", innerjoin=True)

    def __repr__(self) -> str:  # no hash either: it is a password-equivalent lookup key
        return f"ApiKey(id={self.id!r}, prefix={self.prefix!r}, tenant_id={self.tenant_id!r})"


class Adapter(Base):
    """One version of a tenant's LoRA adapter; the newest version of a name is the one served."""

    __tablename__ = "adapters"
    __table_args__ = (
        UniqueConstraint("owner_id", "name", "version"),
        # A tenant's versions in id order: the admin list filtered by tenant, a page at a time.
        Index(None, "owner_id", "id"),
        CheckConstraint("visibility IN ('private', 'public')", name="visibility"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # No index of its own: the unique (owner_id, name, version) index starts with it.
    owner_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(ADAPTER_NAME_MAX))
    version: Mapped[str] = mapped_column(String(64))
    """sha256 hex of the adapter's content (``loraplex.adapters.content_version``)."""
    visibility: Mapped[Visibility] = mapped_column(String(16), default="private")
    base_model: Mapped[str] = mapped_column(String(512))
    rank: Mapped[int] = mapped_column(Integer)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(String(1024))
    """Where the files are in the adapter store (relative to the store's root)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    owner: Mapped[Tenant] = relationship(lazy="joined", innerjoin=True)

    def __repr__(self) -> str:
        return f"Adapter(id={self.id!r}, name={self.name!r}, version={self.version[:12]!r})"


class UsageRecord(Base):
    """What one request used: tokens, latency, how it ended. Never the prompt."""

    __tablename__ = "usage_records"
    __table_args__ = (
        Index(None, "tenant_id", "created_at"),
        # Every tenant's records newest first, a page at a time (the admin's usage list).
        Index(None, "created_at", "id"),
        # What one adapter version served lately (the admin UI's adapter list).
        Index(None, "adapter_version", "created_at"),
        CheckConstraint("status IN ('ok', 'aborted', 'error', 'rejected')", name="status"),
    )

    # BIGINT on PostgreSQL (many rows); SQLite autoincrements only an INTEGER primary key.
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    adapter_name: Mapped[str | None] = mapped_column(String(TENANT_NAME_MAX + 1 + ADAPTER_NAME_MAX))
    """The adapter as the request named it (``name`` or ``owner/name``); NULL for the base model."""
    adapter_version: Mapped[str | None] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(128))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    """Prompt tokens served from the prefix cache (a subset of ``prompt_tokens``)."""
    completion_tokens: Mapped[int] = mapped_column(Integer)
    latency_ms: Mapped[float] = mapped_column(Float)
    status: Mapped[UsageStatus] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    tenant: Mapped[Tenant] = relationship(lazy="joined", innerjoin=True)

    def __repr__(self) -> str:
        return f"UsageRecord(id={self.id!r}, tenant_id={self.tenant_id!r}, status={self.status!r})"
