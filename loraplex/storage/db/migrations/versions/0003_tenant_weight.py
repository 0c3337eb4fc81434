"""Tenants get a fair-share weight (default 1).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

Existing tenants get weight 1 through the server default, so the column can be NOT NULL at once
on every backend (SQLite adds such a column without rebuilding the table).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("weight", sa.Float(), server_default="1", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("weight")
