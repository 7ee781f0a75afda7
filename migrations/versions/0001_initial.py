"""Initial schema: hosts, GPUs, type catalogue, VMs, allocations, licence pools and leases, audit chain.

Revision ID: 0001
Revises:
Create Date: 2026-09-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None
phase = "expand"  # additive only: see vgpumgr.db.schema

TS = sa.DateTime(timezone=True)
SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
LIVE = sa.text("state IN ('reserved', 'active')")
HELD = sa.text("released_at IS NULL")


def upgrade() -> None:
    op.create_table(
        "hosts",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False, unique=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("last_seen", TS, nullable=False),
    )
    op.create_table(
        "gpus",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("address", sa.String(16), nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("uuid", sa.String(64)),
        sa.Column("serial", sa.String(64)),
        sa.Column("vendor_id", sa.String(8)),
        sa.Column("device_id", sa.String(8)),
        sa.Column("first_seen", TS, nullable=False),
        sa.Column("last_seen", TS, nullable=False),
        sa.UniqueConstraint("host_id", "address", name="uq_gpus_host_address"),
    )
    op.create_table(
        "vgpu_types",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("gpu_model", sa.String(255), nullable=False),
        sa.Column("type_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("series", sa.String(1)),
        sa.Column("framebuffer_mb", sa.Integer()),
        sa.Column("max_instances", sa.Integer()),
        sa.Column("mig_slices", sa.Integer()),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("host_id", "gpu_model", "type_id", name="uq_vgpu_types_host_model_type"),
    )
    op.create_table(
        "vms",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("uuid", sa.String(36)),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("host_id", "name", name="uq_vms_host_name"),
    )
    op.create_table(
        "licence_pools",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("edition", sa.String(8), nullable=False),
        sa.Column("seats", sa.Integer(), nullable=False),
        sa.Column("unit", sa.String(8), nullable=False),
        sa.Column("expires", sa.Date()),
        sa.Column("created_at", TS, nullable=False),
        sa.CheckConstraint("seats >= 0", name="ck_licence_pools_seats"),
        sa.CheckConstraint("unit IN ('vm', 'gpu')", name="ck_licence_pools_unit"),
        sa.CheckConstraint("edition IN ('vApps', 'vPC', 'vCS', 'vWS')", name="ck_licence_pools_edition"),
    )
    op.create_table(
        "licence_leases",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("pool_id", sa.Integer(), sa.ForeignKey("licence_pools.id", ondelete="RESTRICT"),
                  nullable=False),
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("vm_id", sa.Integer(), sa.ForeignKey("vms.id", ondelete="CASCADE"), nullable=False),
        sa.Column("gpu_id", sa.Integer(), sa.ForeignKey("gpus.id", ondelete="SET NULL")),
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("acquired_at", TS, nullable=False),
        sa.Column("released_at", TS),
    )
    op.create_index("uq_licence_leases_held", "licence_leases", ["pool_id", "holder"], unique=True,
                    sqlite_where=HELD, postgresql_where=HELD)
    op.create_index("ix_licence_leases_vm", "licence_leases", ["vm_id"])
    op.create_table(
        "allocations",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("host_id", sa.Integer(), sa.ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("uuid", sa.String(36)),
        sa.Column("pci_address", sa.String(16)),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("parent", sa.String(64), nullable=False),
        sa.Column("gpu_id", sa.Integer(), sa.ForeignKey("gpus.id", ondelete="SET NULL")),
        sa.Column("type_id", sa.String(64), nullable=False),
        sa.Column("type_name", sa.String(255)),
        sa.Column("series", sa.String(16)),
        sa.Column("vm_id", sa.Integer(), sa.ForeignKey("vms.id", ondelete="SET NULL")),
        sa.Column("lease_id", sa.Integer(), sa.ForeignKey("licence_leases.id", ondelete="SET NULL")),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("idempotency_key", sa.String(128)),
        sa.Column("detail", sa.JSON()),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("activated_at", TS),
        sa.Column("released_at", TS),
        sa.CheckConstraint("state IN ('reserved', 'active', 'released')", name="ck_allocations_state"),
        sa.UniqueConstraint("host_id", "idempotency_key", name="uq_allocations_host_idem"),
    )
    op.create_index("uq_allocations_live_uuid", "allocations", ["host_id", "uuid"], unique=True,
                    sqlite_where=LIVE, postgresql_where=LIVE)
    op.create_index("uq_allocations_live_pci", "allocations", ["host_id", "pci_address"], unique=True,
                    sqlite_where=LIVE, postgresql_where=LIVE)
    op.create_index("ix_allocations_host_state", "allocations", ["host_id", "state"])
    op.create_index("ix_allocations_vm", "allocations", ["vm_id"])
    op.create_index("ix_allocations_lease", "allocations", ["lease_id"])
    op.create_table(
        "audit_events",
        sa.Column("seq", SEQ, primary_key=True, autoincrement=False),
        sa.Column("at", TS, nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("gpu", sa.String(64)),
        sa.Column("vm", sa.String(64)),
        sa.Column("vgpu", sa.String(64)),
        sa.Column("error", sa.Text()),
        sa.Column("detail", sa.JSON()),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.CheckConstraint("outcome IN ('ok', 'failed', 'warning')", name="ck_audit_events_outcome"),
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"])
    op.create_index("ix_audit_events_vm", "audit_events", ["vm"])
    op.create_index("ix_audit_events_gpu", "audit_events", ["gpu"])
    head = op.create_table(
        "audit_head",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("seq", SEQ, nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.CheckConstraint("id = 1", name="ck_audit_head_single"),
    )
    op.bulk_insert(head, [{"id": 1, "seq": 0, "hash": "0" * 64}])


def downgrade() -> None:
    for table in ("audit_head", "audit_events", "allocations", "licence_leases", "licence_pools",
                  "vms", "vgpu_types", "gpus", "hosts"):
        op.drop_table(table)
