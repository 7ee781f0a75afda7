"""Request bodies. Identifiers are checked again by vgpumgr.ids inside the service; these bound sizes and types."""

from __future__ import annotations

from datetime import date
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from vgpumgr.placement.placer import Policy

Name = Field(min_length=1, max_length=64)
TypeRef = Field(min_length=1, max_length=128, description="type id (nvidia-232), name (GRID T4-4Q) or short (T4-4Q)")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PolicyIn(Strict):
    strategy: Literal["pack", "spread"] = "pack"
    numa: int | None = Field(default=None, ge=0, le=1024)
    pin_gpu: str | None = Field(default=None, max_length=32)
    pin_parent: str | None = Field(default=None, max_length=32)
    allow_models: list[str] = Field(default_factory=list, max_length=32)
    deny_models: list[str] = Field(default_factory=list, max_length=32)
    deny_gpus: list[str] = Field(default_factory=list, max_length=256)

    def to_policy(self) -> Policy:
        return Policy(strategy=self.strategy, numa=self.numa, pin_gpu=self.pin_gpu, pin_parent=self.pin_parent,
                      allow_models=tuple(self.allow_models), deny_models=tuple(self.deny_models),
                      deny_gpus=frozenset(self.deny_gpus))


def policy_of(p: PolicyIn | None) -> Policy | None:
    return p.to_policy() if p is not None else None


class VgpuCreate(Strict):
    type: str = TypeRef
    vm: str | None = Field(default=None, max_length=64)
    uuid: str | None = Field(default=None, max_length=36, description="mdev UUID to use (default: a new one)")
    policy: PolicyIn | None = None


class PassthroughCreate(Strict):
    address: str = Field(min_length=1, max_length=32)
    vm: str | None = Field(default=None, max_length=64)


class VgpuEnsure(Strict):
    """Make sure the mdev `uuid` exists for `vm`, of `type` (on `parent` when given): what hooks ask for."""

    uuid: str = Field(min_length=1, max_length=36)
    type: str = TypeRef
    vm: str = Name
    parent: str | None = Field(default=None, max_length=32)


class VmRelease(Strict):
    vm: str = Name
    uuids: list[str] | None = Field(default=None, max_length=64,
                                    description="only these mdev UUIDs or PCI addresses (default: all of the VM)")
    grace: float = Field(default=0.0, ge=0, le=60)


class DomainHook(Strict):
    domain: str = Name
    xml: str = Field(min_length=1, max_length=1_000_000)
    grace: float = Field(default=0.0, ge=0, le=60)


class MigrationSettle(Strict):
    domain: str = Name


class VmMigrate(Strict):
    """Migrate the VM to another host: `to` is the destination's libvirt URI; `to_api`/`to_token` name the
    destination's vgpumgr service for the preflight (optional: its migrate-begin hook checks anyway)."""

    to: str = Field(min_length=1, max_length=1024)
    offline: bool = False
    dry_run: bool = False
    to_api: str | None = Field(default=None, max_length=1024)
    to_token: str | None = Field(default=None, max_length=4096)


class ProxmoxCheck(Strict):
    """May `vm` start with a `type` vGPU on one of `candidates` (the VFs of its hostpci line, in order)?"""

    vm: str = Name
    type: str = TypeRef
    candidates: list[str] = Field(min_length=1, max_length=64)


class ProxmoxRecord(Strict):
    """Record the VF Proxmox chose for `vm` and wrote `type` to."""

    vm: str = Name
    type: str = TypeRef
    vf: str = Field(min_length=1, max_length=32)


class PlacementRequest(Strict):
    type: str = TypeRef
    vm: str | None = Field(default=None, max_length=64)
    policy: PolicyIn | None = None


class VmCreate(Strict):
    name: str = Name
    vgpus: list[str] = Field(default_factory=list, max_length=16)
    passthrough: list[str] = Field(default_factory=list, max_length=16)
    mig: list[str] = Field(default_factory=list, max_length=16)
    memory_mib: int = Field(default=4096, ge=128, le=16 * 1024 * 1024)
    vcpus: int = Field(default=2, ge=1, le=1024)
    disk: str | None = Field(default=None, max_length=4096)
    network: str | None = Field(default=None, max_length=256)
    firmware: Literal["bios", "efi"] = "bios"
    display: bool = False
    policy: PolicyIn | None = None
    start: bool = False
    print_xml: bool = Field(default=False, description="render and validate only; change nothing")


class VmAttach(Strict):
    type: str = TypeRef


class LicencePoolCreate(Strict):
    name: str = Name
    edition: str = Field(min_length=1, max_length=16, description="vApps, vPC, vCS or vWS")
    seats: int = Field(ge=0, le=1_000_000)
    unit: Literal["vm", "gpu"] = "vm"
    expires: date | None = None


class LicencePoolChange(Strict):
    seats: int | None = Field(default=None, ge=0, le=1_000_000)
    expires: date | None = None
    clear_expiry: bool = False


class ReconcileRequest(Strict):
    fix: bool = False
    remove_unknown: bool = False


class GuestTelemetryChoice(Strict):
    """For one VM or for one licence pool's VMs (exactly one of the two)."""

    vm: str | None = Field(default=None, min_length=1, max_length=64)
    pool: str | None = Field(default=None, min_length=1, max_length=64)
    telemetry: Literal["on", "off", "default"]
