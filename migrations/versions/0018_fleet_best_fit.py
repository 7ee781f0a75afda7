"""`fleet place --policy pack` by best fit: each host's summary row of a type says how much framebuffer its
fullest GPU with a free instance of the type has left (`fleet_host_types.tightest_mb`: the least `region_mb -
used_mb` of those GPUs), kept by every publish in its own transaction (vgpumgr.fleet.writes), and an index in
the new order (`ix_fleet_host_types_fit`: type, that room, free instances, host) gives a placer the best hosts
without reading the others.

`fleet_hosts.fit_generation` is the generation those values are true for. The previous release moves the counts
and carries `types_generation` on without them; a host whose `fit_generation` is behind is read from its own
rows (a partial index finds them, `ix_fleet_hosts_unfit`: empty once every host runs this release), and while
more than a few hosts are behind `pack` keeps the previous order (vgpumgr.ops.fleet).

Nothing is filled in here: adding nullable columns does not rewrite the tables, so the step holds the fleet's
tables only for the new indexes, not for a pass over every host's rows (21 s on a 10,005-host fleet, tried). Each
host fills its own values as it publishes: its next change finds its best fit not true and takes it afresh, and
its next full heartbeat rewrites its summary.

Revision ID: 0018_fleet_best_fit
Revises: 0017_fleet_gpu_room
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018_fleet_best_fit"
down_revision = "0017_fleet_gpu_room"
branch_labels = None
depends_on = None
phase = "expand"  # columns and indexes only: the previous release writes the rows it wrote before

ROOMY = "free > 0"
UNFIT = "fit_generation IS NULL OR fit_generation <> generation"


def upgrade() -> None:
    op.add_column("fleet_host_types", sa.Column("tightest_mb", sa.Integer(), nullable=True))
    op.add_column("fleet_hosts", sa.Column("fit_generation", sa.BigInteger(), nullable=True))
    op.create_index("ix_fleet_host_types_fit", "fleet_host_types", ["short", "tightest_mb", "free", "host"],
                    postgresql_where=sa.text(ROOMY), sqlite_where=sa.text(ROOMY))
    op.create_index("ix_fleet_hosts_unfit", "fleet_hosts", ["host_id"],
                    postgresql_where=sa.text(UNFIT), sqlite_where=sa.text(UNFIT))


def downgrade() -> None:
    op.drop_index("ix_fleet_hosts_unfit", table_name="fleet_hosts")
    op.drop_index("ix_fleet_host_types_fit", table_name="fleet_host_types")
    # plain ALTER TABLE (SQLite 3.35 and later): a batch would copy fleet_host_types without its expression index
    # (ix_fleet_host_types_spread), which SQLite's reflection cannot see
    op.execute(sa.text("ALTER TABLE fleet_hosts DROP COLUMN fit_generation"))
    op.execute(sa.text("ALTER TABLE fleet_host_types DROP COLUMN tightest_mb"))
