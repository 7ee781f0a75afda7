"""The vGPU scheduler each GPU should have (`vgpumgr scheduler set`): NVML's setting does not survive a reboot
or a driver reload, so vgpumgr records it, applies it once the GPU holds no vGPU and again at boot (`restore`).

Revision ID: 0011_scheduler
Revises: 0010_mixed_size
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_scheduler"
down_revision = "0010_mixed_size"
branch_labels = None
depends_on = None
phase = "expand"


def upgrade() -> None:
    op.create_table(
        "gpu_scheduler_intents",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("address", sa.String(16), nullable=False),
        sa.Column("policy", sa.String(16), nullable=False),
        sa.Column("timeslice_ms", sa.Integer()),
        sa.Column("frequency_hz", sa.Integer()),
        sa.Column("avg_factor", sa.Integer()),
        sa.Column("applied_at", sa.DateTime(timezone=True)),
        sa.Column("pending_reason", sa.String(512)),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("host_id", "address", name="uq_gpu_scheduler_intents_host_address"),
        sa.CheckConstraint("policy IN ('best-effort', 'equal-share', 'fixed-share')",
                           name="ck_gpu_scheduler_intents_policy"),
    )


def downgrade() -> None:
    op.drop_table("gpu_scheduler_intents")
