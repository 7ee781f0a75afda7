"""Guest-side telemetry, opt-in: per VM or per licence pool, whether vgpumgr may read the VM's GPUs from inside
its guest through the QEMU guest agent (vgpumgr/ops/guest_watch.py).

Revision ID: 0014_guest_telemetry
Revises: 0013_vendor_slices
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_guest_telemetry"
down_revision = "0013_vendor_slices"
branch_labels = None
depends_on = None
phase = "expand"


def upgrade() -> None:
    op.create_table(
        "guest_telemetry",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("vm", sa.String(64)),
        sa.Column("pool_id", sa.Integer(), sa.ForeignKey("licence_pools.id", ondelete="CASCADE")),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("vm", name="uq_guest_telemetry_vm"),
        sa.UniqueConstraint("pool_id", name="uq_guest_telemetry_pool"),
        sa.CheckConstraint("(vm IS NULL) <> (pool_id IS NULL)", name="ck_guest_telemetry_one"),
    )


def downgrade() -> None:
    op.drop_table("guest_telemetry")
