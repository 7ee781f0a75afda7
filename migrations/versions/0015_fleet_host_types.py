"""The fleet at ten thousand hosts: each host's free instances per vGPU type summed over its GPUs
(`fleet_host_types`, written in the transaction of the publish that moves its `fleet_capacity` rows), with partial
indexes that give a placer the best hosts of a type without grouping every host's rows, and the generation a
host's summary is true for (`fleet_hosts.types_generation`: a host still running the previous release leaves it
behind, and placement then reads that host's own rows).

Revision ID: 0015_fleet_host_types
Revises: 0014_guest_telemetry
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_fleet_host_types"
down_revision = "0014_guest_telemetry"
branch_labels = None
depends_on = None
phase = "expand"  # additive only: the previous release keeps publishing (its hosts are read from their own rows)


def upgrade() -> None:
    with op.batch_alter_table("fleet_hosts") as batch:
        batch.add_column(sa.Column("types_generation", sa.BigInteger(), nullable=True))
    op.create_table(
        "fleet_host_types",
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("short", sa.String(128), primary_key=True),
        sa.Column("host", sa.String(255).with_variant(sa.String(255, collation="C"), "postgresql"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("device_id", sa.String(8), nullable=False),
        sa.Column("framebuffer_mb", sa.Integer()),
        sa.Column("boards", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("open_gpus", sa.Integer(), nullable=False),
        sa.Column("free", sa.Integer(), nullable=False),
        sa.Column("used", sa.Integer(), nullable=False),
        sa.Column("max", sa.Integer(), nullable=False),
        postgresql_with={"fillfactor": 70},
    )
    room = sa.text("free > 0")
    op.create_index("ix_fleet_host_types_pack", "fleet_host_types", ["short", "free", "host"],
                    postgresql_where=room, sqlite_where=room)
    op.create_index("ix_fleet_host_types_spread", "fleet_host_types", ["short", sa.text("(-free)"), "host"],
                    postgresql_where=room, sqlite_where=room)
    several = sa.text("boards > 1")
    op.create_index("ix_fleet_host_types_boards", "fleet_host_types", ["short"],
                    postgresql_where=several, sqlite_where=several)
    # the hosts published so far: summed once here, then kept by each publish
    op.execute(sa.text(SUMMARY_SQL))
    op.execute(sa.text("UPDATE fleet_hosts SET types_generation = generation"))


SUMMARY_SQL = (
    "INSERT INTO fleet_host_types (host_id, short, host, name, model, device_id, framebuffer_mb, boards, gpus, "
    "open_gpus, free, used, max) SELECT c.host_id, c.short, min(n.name), min(c.name), min(c.model), "
    "min(c.device_id), min(c.framebuffer_mb), count(DISTINCT c.model || '/' || c.device_id), count(*), "
    "sum(CASE WHEN c.free > 0 THEN 1 ELSE 0 END), sum(c.free), sum(c.used), sum(coalesce(c.max, 0)) "
    "FROM fleet_capacity c JOIN hosts n ON n.id = c.host_id GROUP BY c.host_id, c.short")


def downgrade() -> None:
    op.drop_index("ix_fleet_host_types_boards", table_name="fleet_host_types")
    op.drop_index("ix_fleet_host_types_spread", table_name="fleet_host_types")
    op.drop_index("ix_fleet_host_types_pack", table_name="fleet_host_types")
    op.drop_table("fleet_host_types")
    with op.batch_alter_table("fleet_hosts") as batch:
        batch.drop_column("types_generation")
