"""The fleet's freshness and summaries through indexes: a placer at ten thousand hosts finds the stale hosts,
the hosts whose summary is behind their generation, and one type's hosts by their room without a pass over
every host.

- `fleet_fresh_until(heartbeat_at, stale_after_s)` (PostgreSQL): the moment a host goes stale, an immutable
  function (adding seconds does not depend on the time zone) so that it can be indexed; a host is fresh while
  it is at or after `now()`. Indexed, the planner also knows how many hosts are stale.
- the hosts whose type summary is not true for their generation (a partial index: empty once every host runs
  this release);
- one type's summary rows by their room (`short, open_gpus, free`): counted from the index alone.

Revision ID: 0016_fleet_fresh_index
Revises: 0015_fleet_host_types
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016_fleet_fresh_index"
down_revision = "0015_fleet_host_types"
branch_labels = None
depends_on = None
phase = "expand"  # indexes and a function only: the previous release writes the same rows

UNSUMMARIZED = "types_generation IS NULL OR types_generation <> generation"
FRESH_UNTIL_SQL = (
    "CREATE OR REPLACE FUNCTION fleet_fresh_until(heartbeat_at timestamptz, stale_after_s double precision) "
    "RETURNS timestamptz LANGUAGE sql IMMUTABLE PARALLEL SAFE AS "
    "$$ SELECT heartbeat_at + stale_after_s * interval '1 second' $$")


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(sa.text(FRESH_UNTIL_SQL))
        op.execute(sa.text("CREATE INDEX ix_fleet_hosts_fresh_until ON fleet_hosts "
                           "(fleet_fresh_until(heartbeat_at, stale_after_s))"))
    op.create_index("ix_fleet_hosts_unsummarized", "fleet_hosts", ["host_id"],
                    postgresql_where=sa.text(UNSUMMARIZED), sqlite_where=sa.text(UNSUMMARIZED))
    op.create_index("ix_fleet_host_types_room", "fleet_host_types", ["short", "open_gpus", "free"])


def downgrade() -> None:
    op.drop_index("ix_fleet_host_types_room", table_name="fleet_host_types")
    op.drop_index("ix_fleet_hosts_unsummarized", table_name="fleet_hosts")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(sa.text("DROP INDEX ix_fleet_hosts_fresh_until"))
        op.execute(sa.text("DROP FUNCTION fleet_fresh_until(timestamptz, double precision)"))
