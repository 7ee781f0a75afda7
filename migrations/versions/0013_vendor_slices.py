"""Vendor mode steps a reboot loses, recorded per GPU for `vgpumgr restore`: Ascend's vNPU VM mode, the VF count
AMD's GIM was loaded with (checked, never written), Intel's per-VF memory quotas (vgpumgr/vendors/steps.py).

Revision ID: 0013_vendor_slices
Revises: 0012_licence_delivery
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_vendor_slices"
down_revision = "0012_licence_delivery"
branch_labels = None
depends_on = None
phase = "expand"


def upgrade() -> None:
    with op.batch_alter_table("gpu_boot_state") as batch:
        batch.add_column(sa.Column("vendor_state", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("gpu_boot_state") as batch:
        batch.drop_column("vendor_state")
