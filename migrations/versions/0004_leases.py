"""Reservation owners and leases on allocations; idempotency keys bound to caller and request.

Revision ID: 0004_leases
Revises: 0003_audit_checkpoints
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_leases"
down_revision = "0003_audit_checkpoints"
branch_labels = None
depends_on = None
phase = "expand"  # additive only: see vgpumgr.db.schema

_LEASED = sa.text("owner_pid IS NOT NULL")


def upgrade() -> None:
    op.add_column("allocations", sa.Column("owner_host", sa.String(255)))
    op.add_column("allocations", sa.Column("owner_boot", sa.String(36)))
    op.add_column("allocations", sa.Column("owner_pid", sa.Integer()))
    op.add_column("allocations", sa.Column("owner_started", sa.BigInteger()))
    op.add_column("allocations", sa.Column("lease_until", sa.DateTime(timezone=True)))
    op.create_index("ix_allocations_leased", "allocations", ["host_id"], sqlite_where=_LEASED,
                    postgresql_where=_LEASED)
    op.create_table(
        "idempotency_keys",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("caller", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("nonce", sa.String(32), nullable=False),
        sa.Column("status", sa.Integer()),
        sa.Column("response", sa.JSON()),
        sa.Column("owner_boot", sa.String(36)),
        sa.Column("owner_pid", sa.Integer()),
        sa.Column("owner_started", sa.BigInteger()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("host_id", "key", name="uq_idempotency_keys_host_key"),
    )
    op.create_index("ix_idempotency_keys_expires", "idempotency_keys", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_keys_expires", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
    op.drop_index("ix_allocations_leased", table_name="allocations")
    with op.batch_alter_table("allocations") as batch:
        for column in ("lease_until", "owner_started", "owner_pid", "owner_boot", "owner_host"):
            batch.drop_column(column)
