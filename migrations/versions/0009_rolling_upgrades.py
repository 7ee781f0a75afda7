"""Rolling upgrades: the schema's contract level (the oldest code it still serves) and, per host, the vgpumgr
version and newest schema revision its code knows (vgpumgr.db.schema).

Revision ID: 0009_rolling_upgrades
Revises: 0008_fleet_rows
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_rolling_upgrades"
down_revision = "0008_fleet_rows"
branch_labels = None
depends_on = None
phase = "expand"  # additive only: see vgpumgr.db.schema


def upgrade() -> None:
    table = op.create_table(
        "vgpumgr_schema",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("contract_level", sa.Integer(), nullable=False),  # code older than this ordinal must not run
        sa.Column("changed_by", sa.String(255)),
    )
    op.bulk_insert(table, [{"id": 1, "contract_level": 0, "changed_by": None}])
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("code_version", sa.String(32)))
        batch.add_column(sa.Column("code_schema", sa.Integer()))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # SQLite 3.35+ drops a column in place; a batch copy would drop `hosts` and cascade to every row of the host
        op.execute("ALTER TABLE hosts DROP COLUMN code_schema")
        op.execute("ALTER TABLE hosts DROP COLUMN code_version")
    else:
        op.drop_column("hosts", "code_schema")
        op.drop_column("hosts", "code_version")
    op.drop_table("vgpumgr_schema")
