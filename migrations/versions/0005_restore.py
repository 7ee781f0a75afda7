"""What a reboot takes away and `vgpumgr restore` brings back: VFs enabled per PF, MIG mode per GPU, and
the GPU instances at their placements.

Revision ID: 0005_restore
Revises: 0004_leases
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_restore"
down_revision = "0004_leases"
branch_labels = None
depends_on = None
phase = "expand"  # additive only: see vgpumgr.db.schema


def upgrade() -> None:
    op.create_table(
        "gpu_boot_state",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("address", sa.String(16), nullable=False),
        sa.Column("numvfs", sa.Integer()),
        sa.Column("mig_enabled", sa.Boolean()),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("host_id", "address", name="uq_gpu_boot_state_host_address"),
        sa.CheckConstraint("numvfs IS NULL OR numvfs >= 0", name="ck_gpu_boot_state_numvfs"),
    )
    op.create_table(
        "mig_gpu_instances",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("gpu", sa.String(16), nullable=False),
        sa.Column("profile", sa.String(32), nullable=False),
        sa.Column("profile_id", sa.Integer(), nullable=False),
        sa.Column("start", sa.Integer(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("compute_instance", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("host_id", "gpu", "start", name="uq_mig_gpu_instances_host_gpu_start"),
    )


def downgrade() -> None:
    op.drop_table("mig_gpu_instances")
    op.drop_table("gpu_boot_state")
