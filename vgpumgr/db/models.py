"""SQLAlchemy models: what vgpumgr remembers about hosts, GPUs, vGPUs, VMs, licences and the audit trail.

Several hosts may share one (PostgreSQL) database, so every host-local row carries `host_id`.
Licence pools are not host-local: one pool of seats serves every host that shares the database.
The partial unique indexes on `allocations` are what make a double allocation impossible, whatever
the code above them gets wrong.

Long because: it declares every table in one place (the migrations and tests/test_db.py compare them as one
metadata), and the fleet's published rows joined them.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

ALLOC_RESERVED = "reserved"
ALLOC_ACTIVE = "active"
ALLOC_RELEASED = "released"
ALLOC_STATES = (ALLOC_RESERVED, ALLOC_ACTIVE, ALLOC_RELEASED)
LIVE_STATES = (ALLOC_RESERVED, ALLOC_ACTIVE)

UNIT_VM = "vm"
UNIT_GPU = "gpu"

OUTCOME_OK = "ok"
OUTCOME_FAILED = "failed"
OUTCOME_WARNING = "warning"
OUTCOMES = (OUTCOME_OK, OUTCOME_FAILED, OUTCOME_WARNING)

GENESIS_HASH = "0" * 64

# The same predicate on both dialects: a row holds its device while it is reserved or active.
_LIVE = text("state IN ('reserved', 'active')")
_HELD = text("released_at IS NULL")
_LEASED = text("owner_pid IS NOT NULL")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC in Python on every dialect.

    SQLite has no time zones: store naive UTC there and put the zone back on the way out, so a value
    read back equals the value written (the audit hash depends on it)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; use an aware UTC datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    pass


class Host(Base):
    __tablename__ = "hosts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    code_version: Mapped[str | None] = mapped_column(String(32))  # the vgpumgr it last ran
    code_schema: Mapped[int | None] = mapped_column(Integer)  # that code's newest schema revision (its ordinal)


class SchemaInfo(Base):
    """One row: the contract level (vgpumgr.db.schema)."""

    __tablename__ = "vgpumgr_schema"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    contract_level: Mapped[int] = mapped_column(Integer)
    changed_by: Mapped[str | None] = mapped_column(String(255))


class Gpu(Base):
    """A physical GPU (a PF or a whole passthrough device), identified per host by PCI address."""

    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("host_id", "address", name="uq_gpus_host_address"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    address: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(255), default="")
    uuid: Mapped[str | None] = mapped_column(String(64))
    serial: Mapped[str | None] = mapped_column(String(64))
    vendor_id: Mapped[str | None] = mapped_column(String(8))
    device_id: Mapped[str | None] = mapped_column(String(8))
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    host: Mapped[Host] = relationship(lazy="joined")


class VgpuTypeEntry(Base):
    """The static catalogue of vGPU types a GPU model supports (type ids are model-local)."""

    __tablename__ = "vgpu_types"
    __table_args__ = (
        UniqueConstraint("host_id", "gpu_model", "type_id", name="uq_vgpu_types_host_model_type"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    gpu_model: Mapped[str] = mapped_column(String(255))
    type_id: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(255))
    backend: Mapped[str] = mapped_column(String(32))
    series: Mapped[str | None] = mapped_column(String(1))
    framebuffer_mb: Mapped[int | None] = mapped_column(Integer)
    max_instances: Mapped[int | None] = mapped_column(Integer)
    mig_slices: Mapped[int | None] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class Vm(Base):
    __tablename__ = "vms"
    __table_args__ = (UniqueConstraint("host_id", "name", name="uq_vms_host_name"),
                      Index("ix_vms_name", "name"))  # the fleet finds a VM's host by its name

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    uuid: Mapped[str | None] = mapped_column(String(36))
    state: Mapped[str] = mapped_column(String(32), default="defined")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class LicencePool(Base):
    __tablename__ = "licence_pools"
    __table_args__ = (
        CheckConstraint("seats >= 0", name="ck_licence_pools_seats"),
        CheckConstraint("unit IN ('vm', 'gpu')", name="ck_licence_pools_unit"),
        CheckConstraint("edition IN ('vApps', 'vPC', 'vCS', 'vWS')", name="ck_licence_pools_edition"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    edition: Mapped[str] = mapped_column(String(8))
    seats: Mapped[int] = mapped_column(Integer)
    unit: Mapped[str] = mapped_column(String(8))
    expires: Mapped[date | None] = mapped_column(Date)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    delivery: Mapped[str | None] = mapped_column(String(8))  # its VMs' licence token delivery (fwcfg|agent|none)

    def expired(self, today: date) -> bool:
        return self.expires is not None and self.expires < today


class LicenceLease(Base):
    """One seat taken from a pool. `holder` is the seat's identity inside the pool ("vm:<id>" or
    "vm:<id>/gpu:<id>"), unique among held leases so one VM never holds two seats for one need."""

    __tablename__ = "licence_leases"
    __table_args__ = (
        Index("uq_licence_leases_held", "pool_id", "holder", unique=True,
              sqlite_where=_HELD, postgresql_where=_HELD),
        Index("ix_licence_leases_vm", "vm_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    pool_id: Mapped[int] = mapped_column(ForeignKey("licence_pools.id", ondelete="RESTRICT"))
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    vm_id: Mapped[int] = mapped_column(ForeignKey("vms.id", ondelete="CASCADE"))
    gpu_id: Mapped[int | None] = mapped_column(ForeignKey("gpus.id", ondelete="SET NULL"))
    holder: Mapped[str] = mapped_column(String(64))
    acquired_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    released_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    pool: Mapped[LicencePool] = relationship(lazy="joined")


class LicenceDelivery(Base):
    """How a VM gets NVIDIA's client configuration token and when it last got it: the token's fingerprint and
    server only, never the token (vgpumgr.licensing.token)."""

    __tablename__ = "licence_deliveries"
    __table_args__ = (UniqueConstraint("host_id", "vm", name="uq_licence_deliveries_host_vm"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    vm: Mapped[str] = mapped_column(String(64))
    vm_uuid: Mapped[str | None] = mapped_column(String(36))
    mode: Mapped[str | None] = mapped_column(String(8))  # chosen for this VM; None: its pool's, else the default
    method: Mapped[str | None] = mapped_column(String(8))  # how it was last delivered: fwcfg | agent
    fingerprint: Mapped[str | None] = mapped_column(String(32))
    server: Mapped[str | None] = mapped_column(String(512))
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # the VM's last start seen by vgpumgr
    first_licensed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # its guest's first licensed state since
    error: Mapped[str | None] = mapped_column(Text)


class Allocation(Base):
    """One vGPU (or passthrough device) handed, or about to be handed, to a VM."""

    __tablename__ = "allocations"
    __table_args__ = (
        CheckConstraint("state IN ('reserved', 'active', 'released')", name="ck_allocations_state"),
        UniqueConstraint("host_id", "idempotency_key", name="uq_allocations_host_idem"),
        # A live mdev UUID, or a live PCI function (SR-IOV VF / passthrough GPU), belongs to one allocation.
        Index("uq_allocations_live_uuid", "host_id", "uuid", unique=True,
              sqlite_where=_LIVE, postgresql_where=_LIVE),
        Index("uq_allocations_live_pci", "host_id", "pci_address", unique=True,
              sqlite_where=_LIVE, postgresql_where=_LIVE),
        Index("ix_allocations_host_state", "host_id", "state"),
        Index("ix_allocations_vm", "vm_id"),
        Index("ix_allocations_lease", "lease_id"),
        Index("ix_allocations_leased", "host_id", sqlite_where=_LEASED, postgresql_where=_LEASED),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    uuid: Mapped[str | None] = mapped_column(String(36))  # mdev UUID; None for VF/passthrough
    pci_address: Mapped[str | None] = mapped_column(String(16))  # VF or passthrough function
    backend: Mapped[str] = mapped_column(String(32))
    parent: Mapped[str] = mapped_column(String(64))  # mdev parent or the VF's PF
    gpu_id: Mapped[int | None] = mapped_column(ForeignKey("gpus.id", ondelete="SET NULL"))
    type_id: Mapped[str] = mapped_column(String(64))  # nvidia-232, mtty-1, passthrough
    type_name: Mapped[str | None] = mapped_column(String(255))
    series: Mapped[str | None] = mapped_column(String(16))
    vm_id: Mapped[int | None] = mapped_column(ForeignKey("vms.id", ondelete="SET NULL"))
    lease_id: Mapped[int | None] = mapped_column(ForeignKey("licence_leases.id", ondelete="SET NULL"))
    state: Mapped[str] = mapped_column(String(16), default=ALLOC_RESERVED)
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    activated_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    released_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The reservation's owner while an operation is in flight (reserve -> activate, or vm create -> define,
    # vm delete -> release): a process identified by host, boot, pid and start time, and a lease expiry.
    # NULL once the operation finished; a row still owned by a dead process or past its lease is rolled back.
    owner_host: Mapped[str | None] = mapped_column(String(255))
    owner_boot: Mapped[str | None] = mapped_column(String(36))
    owner_pid: Mapped[int | None] = mapped_column(Integer)
    owner_started: Mapped[int | None] = mapped_column(BigInteger)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime)

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


class IdempotencyKey(Base):
    """One Idempotency-Key of one caller, bound to the fingerprint of the request that first used it.

    `response` is NULL while the request runs (then `owner_*` names the process running it); `nonce` derives
    the allocation keys of that request, so a retry after a crash finds what the first attempt made."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (
        UniqueConstraint("host_id", "key", name="uq_idempotency_keys_host_key"),
        Index("ix_idempotency_keys_expires", "expires_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(128))
    caller: Mapped[str] = mapped_column(String(255))
    fingerprint: Mapped[str] = mapped_column(String(64))
    nonce: Mapped[str] = mapped_column(String(32))
    status: Mapped[int | None] = mapped_column(Integer)
    response: Mapped[Any | None] = mapped_column(JSON)
    owner_boot: Mapped[str | None] = mapped_column(String(36))
    owner_pid: Mapped[int | None] = mapped_column(Integer)
    owner_started: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AuditEvent(Base):
    """Append-only. `hash` = sha256(prev_hash + canonical JSON of the other fields); see vgpumgr.audit.chain."""

    __tablename__ = "audit_events"
    __table_args__ = (
        CheckConstraint("outcome IN ('ok', 'failed', 'warning')", name="ck_audit_events_outcome"),
        Index("ix_audit_events_at", "at"),
        Index("ix_audit_events_vm", "vm"),
        Index("ix_audit_events_gpu", "gpu"),
        Index("uq_audit_events_prev_hash", "prev_hash", unique=True),  # no fork: one successor per event
    )

    seq: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                     autoincrement=False)
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    host: Mapped[str] = mapped_column(String(255))
    actor: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(64))
    outcome: Mapped[str] = mapped_column(String(16))
    gpu: Mapped[str | None] = mapped_column(String(64))
    vm: Mapped[str | None] = mapped_column(String(64))
    vgpu: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64), unique=True)


class AuditHead(Base):
    """A single row (id 1): the last event's seq and hash. Appends lock it, which serializes the chain."""

    __tablename__ = "audit_head"
    __table_args__ = (CheckConstraint("id = 1", name="ck_audit_head_single"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"))
    hash: Mapped[str] = mapped_column(String(64))


class GpuBootState(Base):
    """What a reboot takes from a GPU that vgpumgr uses: how many VFs its PF had, and whether MIG was on
    (None: not known / not to be touched). `vgpumgr restore` brings it back."""

    __tablename__ = "gpu_boot_state"
    __table_args__ = (
        UniqueConstraint("host_id", "address", name="uq_gpu_boot_state_host_address"),
        CheckConstraint("numvfs IS NULL OR numvfs >= 0", name="ck_gpu_boot_state_numvfs"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    address: Mapped[str] = mapped_column(String(16))
    numvfs: Mapped[int | None] = mapped_column(Integer)
    mig_enabled: Mapped[bool | None] = mapped_column(Boolean)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    vgpu_mode: Mapped[str | None] = mapped_column(String(16))  # "mixed" / "equal" (NVIDIA vGPU mode); None: untouched
    # vendor mode steps to bring back (vgpumgr/vendors/steps.py): {"step": {...}} per step, None: nothing recorded
    vendor_state: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class MigGpuInstance(Base):
    """A MIG GPU instance vgpumgr made or used, at its placement (GI ids change when it is re-created)."""

    __tablename__ = "mig_gpu_instances"
    __table_args__ = (UniqueConstraint("host_id", "gpu", "start", name="uq_mig_gpu_instances_host_gpu_start"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    gpu: Mapped[str] = mapped_column(String(16))
    profile: Mapped[str] = mapped_column(String(32))
    profile_id: Mapped[int] = mapped_column(Integer)
    start: Mapped[int] = mapped_column(Integer)
    size: Mapped[int] = mapped_column(Integer)
    compute_instance: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class GpuSchedulerIntent(Base):
    """The vGPU scheduler a GPU should have (`vgpumgr scheduler set`). `applied_at` None: not applied yet, for
    `pending_reason` (a vGPU exists on the GPU); `restore` and the GPU's next empty moment apply it."""

    __tablename__ = "gpu_scheduler_intents"
    __table_args__ = (
        UniqueConstraint("host_id", "address", name="uq_gpu_scheduler_intents_host_address"),
        CheckConstraint("policy IN ('best-effort', 'equal-share', 'fixed-share')",
                        name="ck_gpu_scheduler_intents_policy"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    address: Mapped[str] = mapped_column(String(16))
    policy: Mapped[str] = mapped_column(String(16))
    timeslice_ms: Mapped[int | None] = mapped_column(Integer)
    frequency_hz: Mapped[int | None] = mapped_column(Integer)
    avg_factor: Mapped[int | None] = mapped_column(Integer)
    applied_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    pending_reason: Mapped[str | None] = mapped_column(String(512))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class HostCordon(Base):
    """A cordoned host: the fleet places nothing new on it (`vgpumgr host cordon`). No row: not cordoned."""

    __tablename__ = "host_cordons"

    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    reason: Mapped[str | None] = mapped_column(Text)
    cordoned_by: Mapped[str] = mapped_column(String(255))
    cordoned_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


# -- what each host publishes for the fleet: a cache of its own sysfs and records (vgpumgr.fleet) --------


_UNSUMMARIZED = text("types_generation IS NULL OR types_generation <> generation")
_UNFIT = text("fit_generation IS NULL OR fit_generation <> generation")


class FleetHost(Base):
    __tablename__ = "fleet_hosts"
    __table_args__ = (
        # the hosts placement reads from their own rows (vgpumgr.fleet.ranked.irregular)
        Index("ix_fleet_hosts_unsummarized", "host_id", postgresql_where=_UNSUMMARIZED, sqlite_where=_UNSUMMARIZED),
        Index("ix_fleet_hosts_unfit", "host_id", postgresql_where=_UNFIT, sqlite_where=_UNFIT),
        # when each host goes stale (PostgreSQL; the function is migration 0016's): the stale hosts found, and
        # counted by the planner, through an index
        Index("ix_fleet_hosts_fresh_until", text("fleet_fresh_until(heartbeat_at, stale_after_s)"))
        .ddl_if(dialect="postgresql"),
    )

    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    endpoint: Mapped[str | None] = mapped_column(String(512))  # where its REST service answers
    migration_uri: Mapped[str | None] = mapped_column(String(512))  # libvirt's URI for a migration into it
    driver_version: Mapped[str | None] = mapped_column(String(64))  # NVIDIA host driver (vGPU manager)
    version: Mapped[str] = mapped_column(String(32))  # vgpumgr's
    heartbeat_s: Mapped[float] = mapped_column(Float)
    stale_after_s: Mapped[float] = mapped_column(Float)  # heartbeat x factor: older is stale
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime)
    generation: Mapped[int] = mapped_column(BigInteger)  # +1 per publish
    gpus: Mapped[int] = mapped_column(Integer)
    vgpus: Mapped[int] = mapped_column(Integer)
    # the generation its fleet_host_types rows are true for: a host that runs an older vgpumgr moves
    # `generation` alone, and placement then reads that host's own rows instead of its summary
    types_generation: Mapped[int | None] = mapped_column(BigInteger)
    # the generation its fleet_host_types.tightest_mb values are true for: the previous release moves the counts
    # (and carries types_generation on) without them
    fit_generation: Mapped[int | None] = mapped_column(BigInteger)


_UNROOMED = "room_at IS NULL OR room_at <> published_at"


class FleetGpu(Base):
    __tablename__ = "fleet_gpus"
    # the GPUs holding vGPUs by the framebuffer they have free: `fleet place`'s fragmentation hint
    __table_args__ = (
        Index("ix_fleet_gpus_room", text("(region_mb - used_mb)"), postgresql_where=text("vgpus > 0"),
              sqlite_where=text("vgpus > 0")),
        # GPUs whose room a previous release's publish left behind: read from their own rows (empty once every
        # host runs this release)
        Index("ix_fleet_gpus_unroomed", "host_id", postgresql_where=text(_UNROOMED),
              sqlite_where=text(_UNROOMED)),
        # the GPUs holding vGPUs, fewest first: `fleet compact`'s candidates
        Index("ix_fleet_gpus_held", "vgpus", "host_id", "address", postgresql_where=text("vgpus > 0"),
              sqlite_where=text("vgpus > 0")),
    )

    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    address: Mapped[str] = mapped_column(String(16), primary_key=True)
    model: Mapped[str] = mapped_column(String(255))
    vendor_id: Mapped[str] = mapped_column(String(8))
    device_id: Mapped[str] = mapped_column(String(8))
    subsystem_vendor_id: Mapped[str | None] = mapped_column(String(8))
    subsystem_device_id: Mapped[str | None] = mapped_column(String(8))
    driver: Mapped[str | None] = mapped_column(String(64))
    mode: Mapped[str] = mapped_column(String(16))
    numa_node: Mapped[int | None] = mapped_column(Integer)
    vgpus: Mapped[int] = mapped_column(Integer)
    published_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # its room, written with its type rows (vgpumgr.fleet.writes): the largest type's framebuffer (the whole GPU)
    # and the framebuffer of its vGPUs; true for its host's summary generation (fleet_hosts.types_generation)
    region_mb: Mapped[int | None] = mapped_column(Integer)
    used_mb: Mapped[int | None] = mapped_column(Integer)
    room_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # the published_at they were written with


class FleetCapacity(Base):
    """Free and used instances of one vGPU type on one published GPU."""

    __tablename__ = "fleet_capacity"
    __table_args__ = (
        ForeignKeyConstraint(["host_id", "gpu"], ["fleet_gpus.host_id", "fleet_gpus.address"], ondelete="CASCADE",
                             name="fk_fleet_capacity_gpu"),
        # not on the counts, which every change moves: PostgreSQL then updates the row in place (HOT, with the
        # room the fill factor leaves) and neither database touches an index
        Index("ix_fleet_capacity_short", "short"),  # the previous release's; a contract step may drop it
        Index("ix_fleet_capacity_short_gpu", "short", "host_id", "gpu"),  # a type's rows; one GPU's of a type
        {"postgresql_with": {"fillfactor": 70}},
    )

    host_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpu: Mapped[str] = mapped_column(String(16), primary_key=True)
    type_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    short: Mapped[str] = mapped_column(String(128))
    backend: Mapped[str] = mapped_column(String(32))
    framebuffer_mb: Mapped[int | None] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(255))  # the GPU's, as in fleet_gpus: the placer reads no join
    device_id: Mapped[str] = mapped_column(String(8))
    free: Mapped[int] = mapped_column(Integer)
    used: Mapped[int] = mapped_column(Integer)
    max: Mapped[int | None] = mapped_column(Integer)


class GuestTelemetry(Base):
    """Whether vgpumgr may read a VM's GPUs from inside its guest (through the guest agent): chosen for one VM
    (`vm` set) or for the VMs holding a seat of one licence pool (`pool_id` set). Off where nothing is chosen."""

    __tablename__ = "guest_telemetry"
    __table_args__ = (UniqueConstraint("vm", name="uq_guest_telemetry_vm"),
                      UniqueConstraint("pool_id", name="uq_guest_telemetry_pool"),
                      CheckConstraint("(vm IS NULL) <> (pool_id IS NULL)", name="ck_guest_telemetry_one"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    vm: Mapped[str | None] = mapped_column(String(64))
    pool_id: Mapped[int | None] = mapped_column(ForeignKey("licence_pools.id", ondelete="CASCADE"))
    enabled: Mapped[bool] = mapped_column(Boolean)
    changed_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class FleetHostType(Base):
    """One host's capacity for one vGPU type (short name), summed over its GPUs: written by a full publish in its
    transaction and after a change by the host's follower (vgpumgr.fleet.writes, vgpumgr.fleet.follow; meanwhile
    the host's generation says it is behind), so a placer finds the best hosts through an index instead of
    grouping every host's rows (vgpumgr.fleet.ranked)."""

    __tablename__ = "fleet_host_types"
    __table_args__ = (
        # the hosts with a free instance in order; only rows with room are indexed. By free alone: the previous
        # release's `pack` (a contract step may drop it)
        Index("ix_fleet_host_types_pack", "short", "free", "host", postgresql_where=text("free > 0"),
              sqlite_where=text("free > 0")),
        # `pack`: the host whose fullest GPU with a free instance has the least framebuffer left (best fit)
        Index("ix_fleet_host_types_fit", "short", "tightest_mb", "free", "host", postgresql_where=text("free > 0"),
              sqlite_where=text("free > 0")),
        Index("ix_fleet_host_types_spread", "short", text("(-free)"), "host", postgresql_where=text("free > 0"),
              sqlite_where=text("free > 0")),
        # the rare host with two boards offering one short name: read from its own rows
        Index("ix_fleet_host_types_boards", "short", postgresql_where=text("boards > 1"),
              sqlite_where=text("boards > 1")),
        # one type's hosts counted by their room from the index alone (vgpumgr.fleet.ranked.counts)
        Index("ix_fleet_host_types_room", "short", "open_gpus", "free"),
        {"postgresql_with": {"fillfactor": 70}},
    )

    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    short: Mapped[str] = mapped_column(String(128), primary_key=True)
    host: Mapped[str] = mapped_column(String(255).with_variant(String(255, collation="C"), "postgresql"))
    name: Mapped[str] = mapped_column(String(255))
    model: Mapped[str] = mapped_column(String(255))  # of its first board (the only one, where boards == 1)
    device_id: Mapped[str] = mapped_column(String(8))
    framebuffer_mb: Mapped[int | None] = mapped_column(Integer)
    boards: Mapped[int] = mapped_column(Integer)  # distinct (model, device id) offering it
    gpus: Mapped[int] = mapped_column(Integer)
    open_gpus: Mapped[int] = mapped_column(Integer)  # of them with a free instance
    free: Mapped[int] = mapped_column(Integer)
    used: Mapped[int] = mapped_column(Integer)
    max: Mapped[int] = mapped_column(Integer)  # the GPUs' maxima summed (0 where unknown)
    # of its GPUs with a free instance, the least framebuffer left (region_mb - used_mb); None: none, or unknown
    tightest_mb: Mapped[int | None] = mapped_column(Integer)
