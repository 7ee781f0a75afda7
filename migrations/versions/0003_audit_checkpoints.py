"""Audit chain: no two events may extend the same predecessor (a fork), enforced by the database.

The head-row lock already serialises appends; this index makes a fork impossible even for a writer
that bypasses it (another tool, a bug, several hosts racing on one PostgreSQL database).

Revision ID: 0003_audit_checkpoints
Revises: 0002
Create Date: 2026-09-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_audit_checkpoints"
down_revision = "0002"
branch_labels = None
depends_on = None
phase = "expand"  # additive only: see vgpumgr.db.schema


def upgrade() -> None:
    forks = op.get_bind().execute(sa.text(
        "SELECT prev_hash, MIN(seq), MAX(seq) FROM audit_events GROUP BY prev_hash HAVING COUNT(*) > 1")).all()
    if forks:
        seqs = ", ".join(f"{lo} and {hi}" for _, lo, hi in forks[:5])
        raise RuntimeError(f"the audit chain is already forked (events {seqs} share a predecessor); "
                           "run `vgpumgr audit verify` and restore the database from a backup before upgrading")
    op.create_index("uq_audit_events_prev_hash", "audit_events", ["prev_hash"], unique=True)


def downgrade() -> None:
    op.drop_index("uq_audit_events_prev_hash", table_name="audit_events")
