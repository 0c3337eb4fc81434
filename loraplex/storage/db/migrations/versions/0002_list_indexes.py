"""Indexes for paged lists: keys by (tenant_id, id), adapters by (owner_id, id), usage by time
and by adapter version.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03

Every list of the admin and tenant APIs is read a page at a time from a cursor (keyset
pagination, ``services.pages``); these indexes let each query seek to its cursor instead of
sorting a whole tenant's rows. ``ix_api_keys_tenant_id`` goes: the (tenant_id, id) index
answers every lookup by tenant_id alone too (the foreign key's cascade among them).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(op.f("ix_api_keys_tenant_id_id"), "api_keys", ["tenant_id", "id"])
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.create_index(op.f("ix_adapters_owner_id_id"), "adapters", ["owner_id", "id"])
    op.create_index(op.f("ix_usage_records_created_at_id"), "usage_records", ["created_at", "id"])
    op.create_index(
        op.f("ix_usage_records_adapter_version_created_at"),
        "usage_records",
        ["adapter_version", "created_at"],
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_usage_records_adapter_version_created_at"), table_name="usage_records")
    op.drop_index(op.f("ix_usage_records_created_at_id"), table_name="usage_records")
    op.drop_index(op.f("ix_adapters_owner_id_id"), table_name="adapters")
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])
    op.drop_index(op.f("ix_api_keys_tenant_id_id"), table_name="api_keys")
