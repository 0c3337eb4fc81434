"""Initial schema: tenants, API keys, adapters, usage records.

Revision ID: 0001
Revises:
Create Date: 2026-12-02

Drafted by autogenerate, then reviewed: timestamps are plain ``DateTime(timezone=True)``
(``UTCDateTime`` only converts in Python), constraint names follow ``Base.metadata``'s naming
convention so later revisions can drop them by name on every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str, *, nullable: bool) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("disabled", sa.Boolean(), nullable=False),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrency", sa.Integer(), nullable=True),
        sa.Column("max_adapters", sa.Integer(), nullable=True),
        sa.Column("max_adapter_bytes", sa.BigInteger(), nullable=True),
        _timestamp("created_at", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=True),
        _timestamp("created_at", nullable=False),
        _timestamp("expires_at", nullable=True),
        _timestamp("revoked_at", nullable=True),
        _timestamp("last_used_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("visibility", sa.String(length=16), nullable=False),
        sa.Column("base_model", sa.String(length=512), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        _timestamp("created_at", nullable=False),
        sa.CheckConstraint("visibility IN ('private', 'public')", name=op.f("ck_adapters_visibility")),
        sa.ForeignKeyConstraint(
            ["owner_id"], ["tenants.id"], name=op.f("fk_adapters_owner_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint("owner_id", "name", "version", name=op.f("uq_adapters_owner_id_name_version")),
    )
    op.create_table(
        "usage_records",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("adapter_name", sa.String(length=193), nullable=True),
        sa.Column("adapter_version", sa.String(length=64), nullable=True),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        _timestamp("created_at", nullable=False),
        sa.CheckConstraint(
            "status IN ('ok', 'aborted', 'error', 'rejected')", name=op.f("ck_usage_records_status")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_records_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_records")),
    )
    op.create_index(
        op.f("ix_usage_records_tenant_id_created_at"), "usage_records", ["tenant_id", "created_at"]
    )


def downgrade() -> None:
    op.drop_table("usage_records")
    op.drop_table("adapters")
    op.drop_table("api_keys")
    op.drop_table("tenants")
