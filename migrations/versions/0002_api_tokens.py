"""API bearer tokens: name, role and the sha256 of the secret (the secret itself is never stored).

Revision ID: 0002
Revises: 0001
Create Date: 2026-09-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None
phase = "expand"  # additive only: see vgpumgr.db.schema


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
        sa.UniqueConstraint("name", name="uq_api_tokens_name"),
        sa.UniqueConstraint("secret_sha256", name="uq_api_tokens_secret"),
        sa.CheckConstraint("role IN ('admin', 'operator', 'hook', 'auditor')", name="ck_api_tokens_role"),
    )


def downgrade() -> None:
    op.drop_table("api_tokens")
