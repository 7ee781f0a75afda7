"""The fleet: cordoned hosts.

Revision ID: 0007_fleet
Revises: 0005_restore
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_fleet"
down_revision = "0005_restore"
branch_labels = None
depends_on = None
phase = "expand"  # additive only: see vgpumgr.db.schema


def upgrade() -> None:
    op.create_table(
        "host_cordons",
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("reason", sa.Text()),
        sa.Column("cordoned_by", sa.String(255), nullable=False),
        sa.Column("cordoned_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("host_cordons")
