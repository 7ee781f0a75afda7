"""NVIDIA mixed-size vGPU mode per GPU, so that `vgpumgr restore` can set it again after a reboot (the driver
forgets it). NULL: not set by vgpumgr (left as the driver has it). Expand only: one nullable column.

Revision ID: 0010_mixed_size
Revises: 0009_rolling_upgrades
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_mixed_size"
down_revision = "0009_rolling_upgrades"
branch_labels = None
depends_on = None
phase = "expand"


def upgrade() -> None:
    with op.batch_alter_table("gpu_boot_state") as batch:
        batch.add_column(sa.Column("vgpu_mode", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("gpu_boot_state") as batch:
        batch.drop_column("vgpu_mode")
