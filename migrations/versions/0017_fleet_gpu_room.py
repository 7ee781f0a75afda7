"""Each published GPU's room on its own row: `fleet_gpus.region_mb` (its largest type's framebuffer: the whole
GPU) and `fleet_gpus.used_mb` (the framebuffer of the vGPUs on it, each type's used instances times its
framebuffer), written with the GPU's other rows in the same transaction (vgpumgr.fleet.writes), so that `fleet
place`'s fragmentation hint finds the GPUs with a type's GB free, and `fleet compact` the whole GPU, without
summing every GPU's rows of fleet_capacity. An index of the GPUs holding vGPUs by the framebuffer they have
free (`ix_fleet_gpus_room`) gives the hint the GPUs with a type's GB free from one range; one by their vGPUs
(`ix_fleet_gpus_held`) gives `fleet compact` the GPUs holding the fewest first, and a type's row of one GPU is
found from `ix_fleet_capacity_short_gpu` (short, host, GPU; it serves `ix_fleet_capacity_short`'s scans as well,
but that index stays: an expand step removes nothing while the previous release may still run) instead of
reading every type row of the GPU. None of them is on a type row's counts, which
every change moves (those rows are still updated in place).

`fleet_gpus.room_at` is the `published_at` these were written with: a host still running the previous release
moves `published_at` (and `vgpus`) without them, and its GPUs are then judged from their own rows, found through
a partial index (`ix_fleet_gpus_unroomed`, empty once every host runs this release).

Revision ID: 0017_fleet_gpu_room
Revises: 0016_fleet_fresh_index
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_fleet_gpu_room"
down_revision = "0016_fleet_fresh_index"
branch_labels = None
depends_on = None
phase = "expand"  # columns and an index only: the previous release writes the rows it wrote before

HOLDING = "vgpus > 0"
UNROOMED = "room_at IS NULL OR room_at <> published_at"
# the GPUs published so far: summed once here, then kept by each publish
ROOM_SQL = (
    "UPDATE fleet_gpus SET region_mb = (SELECT max(c.framebuffer_mb) FROM fleet_capacity c WHERE c.host_id = "
    "fleet_gpus.host_id AND c.gpu = fleet_gpus.address), used_mb = (SELECT coalesce(sum(c.used * "
    "coalesce(c.framebuffer_mb, 0)), 0) FROM fleet_capacity c WHERE c.host_id = fleet_gpus.host_id AND c.gpu = "
    "fleet_gpus.address), room_at = published_at")


def upgrade() -> None:
    with op.batch_alter_table("fleet_gpus") as batch:
        batch.add_column(sa.Column("region_mb", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("used_mb", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("room_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(sa.text(ROOM_SQL))
    op.create_index("ix_fleet_gpus_room", "fleet_gpus", [sa.text("(region_mb - used_mb)")],
                    postgresql_where=sa.text(HOLDING), sqlite_where=sa.text(HOLDING))
    op.create_index("ix_fleet_gpus_unroomed", "fleet_gpus", ["host_id"],
                    postgresql_where=sa.text(UNROOMED), sqlite_where=sa.text(UNROOMED))
    op.create_index("ix_fleet_gpus_held", "fleet_gpus", ["vgpus", "host_id", "address"],
                    postgresql_where=sa.text(HOLDING), sqlite_where=sa.text(HOLDING))
    op.create_index("ix_fleet_capacity_short_gpu", "fleet_capacity", ["short", "host_id", "gpu"])


def downgrade() -> None:
    op.drop_index("ix_fleet_capacity_short_gpu", table_name="fleet_capacity")
    op.drop_index("ix_fleet_gpus_held", table_name="fleet_gpus")
    op.drop_index("ix_fleet_gpus_unroomed", table_name="fleet_gpus")
    op.drop_index("ix_fleet_gpus_room", table_name="fleet_gpus")
    with op.batch_alter_table("fleet_gpus") as batch:
        batch.drop_column("room_at")
        batch.drop_column("used_mb")
        batch.drop_column("region_mb")
