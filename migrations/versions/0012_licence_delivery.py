"""Licence token delivery: how each VM gets NVIDIA's client configuration token (fw_cfg, guest agent or none),
when it was delivered and with which token (fingerprint only; the token itself stays a file on each host), and
when its guest first reported licensed; a pool's default delivery mode.

Revision ID: 0012_licence_delivery
Revises: 0011_scheduler
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_licence_delivery"
down_revision = "0011_scheduler"
branch_labels = None
depends_on = None
phase = "expand"


def upgrade() -> None:
    op.create_table(
        "licence_deliveries",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("vm", sa.String(64), nullable=False),
        sa.Column("vm_uuid", sa.String(36)),
        sa.Column("mode", sa.String(8)),
        sa.Column("method", sa.String(8)),
        sa.Column("fingerprint", sa.String(32)),
        sa.Column("server", sa.String(512)),
        sa.Column("delivered_at", sa.DateTime(timezone=True)),
        sa.Column("started_at", sa.DateTime(timezone=True)),
        sa.Column("first_licensed_at", sa.DateTime(timezone=True)),
        sa.Column("error", sa.Text()),
        sa.UniqueConstraint("host_id", "vm", name="uq_licence_deliveries_host_vm"),
    )
    with op.batch_alter_table("licence_pools") as batch:
        batch.add_column(sa.Column("delivery", sa.String(8)))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # in place (SQLite 3.35+): a batch copy would drop licence_pools, which the leases reference
        op.execute("ALTER TABLE licence_pools DROP COLUMN delivery")
    else:
        op.drop_column("licence_pools", "delivery")
    op.drop_table("licence_deliveries")
