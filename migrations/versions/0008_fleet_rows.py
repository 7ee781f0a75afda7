"""The fleet's published rows: what each host publishes about itself, its GPUs and their free instances per vGPU
type (a cache of its own sysfs and records, see vgpumgr.fleet), and an index to find a VM's host by its name.

Revision ID: 0008_fleet_rows
Revises: 0007_fleet
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_fleet_rows"
down_revision = "0007_fleet"
branch_labels = None
depends_on = None
phase = "expand"  # additive only: see vgpumgr.db.schema


def upgrade() -> None:
    op.create_index("ix_vms_name", "vms", ["name"])
    op.create_table(
        "fleet_hosts",
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("endpoint", sa.String(512)),
        sa.Column("migration_uri", sa.String(512)),
        sa.Column("driver_version", sa.String(64)),
        sa.Column("version", sa.String(32), nullable=False),
        sa.Column("heartbeat_s", sa.Float(), nullable=False),
        sa.Column("stale_after_s", sa.Float(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("vgpus", sa.Integer(), nullable=False),
    )
    op.create_table(
        "fleet_gpus",
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("address", sa.String(16), primary_key=True),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("vendor_id", sa.String(8), nullable=False),
        sa.Column("device_id", sa.String(8), nullable=False),
        sa.Column("subsystem_vendor_id", sa.String(8)),
        sa.Column("subsystem_device_id", sa.String(8)),
        sa.Column("driver", sa.String(64)),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("numa_node", sa.Integer()),
        sa.Column("vgpus", sa.Integer(), nullable=False),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "fleet_capacity",
        sa.Column("host_id", sa.Integer(), primary_key=True),
        sa.Column("gpu", sa.String(16), primary_key=True),
        sa.Column("type_id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("short", sa.String(128), nullable=False),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("framebuffer_mb", sa.Integer()),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("device_id", sa.String(8), nullable=False),
        sa.Column("free", sa.Integer(), nullable=False),
        sa.Column("used", sa.Integer(), nullable=False),
        sa.Column("max", sa.Integer()),
        sa.ForeignKeyConstraint(["host_id", "gpu"], ["fleet_gpus.host_id", "fleet_gpus.address"],
                                ondelete="CASCADE", name="fk_fleet_capacity_gpu"),
        postgresql_with={"fillfactor": 70},
    )
    op.create_index("ix_fleet_capacity_short", "fleet_capacity", ["short"])


def downgrade() -> None:
    op.drop_index("ix_fleet_capacity_short", table_name="fleet_capacity")
    op.drop_table("fleet_capacity")
    op.drop_table("fleet_gpus")
    op.drop_table("fleet_hosts")
    op.drop_index("ix_vms_name", table_name="vms")
