"""GPUs, types, vGPUs (allocations), placements and the hooks' endpoints."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response

from api.auth import READ, VGPU_WRITE, require
from api.deps import idempotency_key, service
from api.idempotent import FastJSONResponse, idempotent
from api.schemas import (
    DomainHook,
    MigrationSettle,
    PassthroughCreate,
    PlacementRequest,
    ProxmoxCheck,
    ProxmoxRecord,
    VgpuCreate,
    VgpuEnsure,
    VmRelease,
    policy_of,
)
from api.tokens import HOOK, Token
from api.writes import one_at_a_time
from vgpumgr import ids
from vgpumgr.errors import InvalidInput, NotFound, PermissionDenied
from vgpumgr.ops.allocate import Owner
from vgpumgr.service import Service

router = APIRouter(prefix="/v1")
REFRESH = Query(default=False, description="re-read sysfs now instead of using the cached inventory")
STATES = "^(reserved|active|released)$"


def _inventory(svc: Service, refresh: bool):  # noqa: ANN202
    return svc.snapshot(refresh=refresh).inventory


@router.get("/gpus", tags=["inventory"])
def list_gpus(refresh: bool = REFRESH, svc: Service = Depends(service), _: Token = Depends(require(*READ))
              ) -> list[dict[str, Any]]:
    return [g.to_json() for g in _inventory(svc, refresh).gpus]


@router.get("/gpus/{address}", tags=["inventory"])
def get_gpu(address: str, refresh: bool = REFRESH, svc: Service = Depends(service),
            _: Token = Depends(require(*READ))) -> dict[str, Any]:
    address = ids.pci_address(address)
    inv = _inventory(svc, refresh)
    g = inv.gpu(address)
    if g is None:
        raise NotFound(f"no GPU {address}", hint="GET /v1/gpus lists the GPUs")
    types = [t.to_json() for t in inv.types if t.gpu == address or t.parent == address]
    return {**g.to_json(), "types": _with_gpu_available(svc, types),
            "mdevs": [m.to_json() for m in inv.mdevs if m.gpu == address],
            "vf_vgpus": [v.to_json() for v in inv.vf_vgpus if v.gpu == address]}


@router.get("/vendors", tags=["inventory"])
def list_vendor_cards(svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> list[dict[str, Any]]:
    """Cards besides NVIDIA with a vendor profile: mechanism, driver, VFs and their mode steps' state."""
    return svc.vendor_cards()


@router.get("/types", tags=["inventory"])
def list_types(parent: str | None = Query(default=None, max_length=32), gpu: str | None = Query(default=None,
               max_length=32), available: bool = False, refresh: bool = REFRESH, svc: Service = Depends(service),
               _: Token = Depends(require(*READ))) -> list[dict[str, Any]]:
    parent = ids.parent_name(parent) if parent else None
    gpu = ids.pci_address(gpu) if gpu else None
    return _with_gpu_available(svc, [t.to_json() for t in _inventory(svc, refresh).types
                                     if (parent is None or t.parent == parent) and (gpu is None or t.gpu == gpu)
                                     and (not available or t.available_instances > 0)])


def _with_gpu_available(svc: Service, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A GPU in mixed-size mode: its rows say what it can make of each type now (`gpu_available`)."""
    from vgpumgr.ops import slot_map

    gpus = {r["gpu"] for r in rows if r.get("gpu") and r["backend"] == "nvidia-vf"}
    return slot_map.with_gpu_available(rows, slot_map.mixed_size_free(svc, only=gpus)) if gpus else rows


@router.get("/devices", tags=["inventory"])
def list_devices(refresh: bool = REFRESH, svc: Service = Depends(service), _: Token = Depends(require(*READ))
                 ) -> dict[str, list[dict[str, Any]]]:
    """The mdevs and VF vGPUs that exist on the host now, recorded by vgpumgr or not."""
    inv = _inventory(svc, refresh)
    return {"mdevs": [m.to_json() for m in inv.mdevs], "vf_vgpus": [v.to_json() for v in inv.vf_vgpus]}


def _allocations(svc: Service, vm: str | None, gpu: str | None, state: str | None, live: bool | None
                 ) -> list[dict[str, Any]]:
    return svc.allocations(vm=ids.vm_name(vm) if vm else None, gpu=ids.pci_address(gpu) if gpu else None,
                           state=state, live=live)


@router.get("/vgpus", tags=["vgpus"])
def list_vgpus(vm: str | None = Query(default=None, max_length=64), gpu: str | None = Query(default=None,
               max_length=32), state: str | None = Query(default=None, pattern=STATES),
               live: bool | None = Query(default=True, description="true: reserved or active; false: released"),
               svc: Service = Depends(service), token: Token = Depends(require(*READ, HOOK))) -> list[dict[str, Any]]:
    if token.role == HOOK and not vm:
        raise PermissionDenied("a hook token may only list the vGPUs of one VM", hint="pass ?vm=NAME")
    return _allocations(svc, vm, gpu, state, None if state else live)


@router.post("/vgpus", status_code=201, tags=["vgpus"])
async def create_vgpu(body: VgpuCreate, request: Request, key: str | None = Depends(idempotency_key),
                      svc: Service = Depends(service), token: Token = Depends(require(*VGPU_WRITE))
                      ) -> dict[str, Any]:
    """Place and create one vGPU. Retrying with the same Idempotency-Key returns the same vGPU."""
    if token.role == HOOK and not body.vm:
        raise PermissionDenied("a hook token may only allocate vGPUs for a named VM", hint="set `vm`")
    started = time.perf_counter()

    def run(alloc_key: str | None) -> tuple[int, Any]:
        return 201, svc.allocate(body.type, vm=body.vm, policy=policy_of(body.policy), idempotency_key=alloc_key,
                                 uuid=body.uuid, actor=token.actor)

    result = await one_at_a_time(request.app, lambda: idempotent(request, svc, token, key, body, run))
    request.app.state.metrics.observe_allocation(time.perf_counter() - started)
    return result


@router.post("/vgpus/passthrough", status_code=201, tags=["vgpus"])
async def create_passthrough(body: PassthroughCreate, request: Request, key: str | None = Depends(idempotency_key),
                             svc: Service = Depends(service), token: Token = Depends(require(*VGPU_WRITE))
                             ) -> dict[str, Any]:
    if token.role == HOOK and not body.vm:
        raise PermissionDenied("a hook token may only allocate GPUs for a named VM", hint="set `vm`")
    return await one_at_a_time(request.app, lambda: idempotent(request, svc, token, key, body, lambda k: (
        201, svc.allocate_passthrough(body.address, vm=body.vm, idempotency_key=k, actor=token.actor))))


def _ref(ref: str) -> str:
    if ids.is_pci_address(ref):
        return ids.pci_address(ref)
    try:
        return ids.mdev_uuid(ref)
    except InvalidInput:
        raise InvalidInput(f"'{ref}' is neither an mdev UUID nor a PCI address",
                           hint="name a vGPU by its UUID or a VF vGPU/passthrough GPU by its PCI address") from None


@router.get("/vgpus/{ref}", tags=["vgpus"])
def get_vgpu(ref: str, svc: Service = Depends(service), token: Token = Depends(require(*READ, HOOK))
             ) -> dict[str, Any]:
    return svc.find_allocation(_ref(ref))


@router.delete("/vgpus/{ref}", tags=["vgpus"])
async def delete_vgpu(request: Request, ref: str, grace: float = Query(default=0.0, ge=0, le=60),
                      vm: str | None = Query(default=None, max_length=64, description="owner: the VM releasing it"),
                      allocation_id: int | None = Query(default=None, ge=1, description="owner: the allocation's id"),
                      idempotency_key: str | None = Query(default=None, max_length=128,
                                                          description="owner: the allocation's idempotency key"),
                      svc: Service = Depends(service), token: Token = Depends(require(*VGPU_WRITE))
                      ) -> dict[str, Any]:
    """Destroy a vGPU and release its record and licence seat. With an owner (`vm` and `allocation_id` or
    `idempotency_key`; required for hook tokens), a vGPU that has changed hands since is left alone: 409."""
    def release() -> FastJSONResponse:  # the checks in this order: the errors' precedence is the API's
        reference = _ref(ref)
        if token.role == HOOK and svc.find_allocation(reference)["vm"] is None:
            raise PermissionDenied(f"{reference} belongs to no VM; a hook token may only release a VM's vGPUs",
                                   hint="use an operator token")
        owner = Owner(vm, allocation_id=allocation_id, idempotency_key=idempotency_key) if vm else None
        if token.role == HOOK and owner is None:
            raise InvalidInput("a hook token must name the owner of the vGPU it releases",
                               hint="pass ?vm=NAME&allocation_id=ID (or &idempotency_key=KEY)")
        if owner is None and (allocation_id is not None or idempotency_key):
            raise InvalidInput("an owner needs the VM", hint="add ?vm=NAME")
        return FastJSONResponse(svc.release(reference, actor=token.actor, grace=grace, owner=owner))

    return await one_at_a_time(request.app, release)


@router.get("/placements", tags=["placements"])
def list_placements(vm: str | None = Query(default=None, max_length=64), gpu: str | None = Query(default=None,
                    max_length=32), svc: Service = Depends(service), _: Token = Depends(require(*READ))
                    ) -> list[dict[str, Any]]:
    """The live allocations: which vGPU sits where, for which VM."""
    return _allocations(svc, vm, gpu, None, True)


@router.post("/placements/preview", tags=["placements"])
def preview_placement(body: PlacementRequest, svc: Service = Depends(service),
                      _: Token = Depends(require(*READ))) -> dict[str, Any]:
    """What placement would choose now, and why each other candidate was refused. Changes nothing."""
    return svc.place(body.type, body.vm, policy_of(body.policy)).as_dict()


# -- hooks ---------------------------------------------------------------------------------------------
@router.post("/hooks/ensure", tags=["hooks"])
async def hook_ensure(body: VgpuEnsure, request: Request, key: str | None = Depends(idempotency_key),
                      svc: Service = Depends(service), token: Token = Depends(require(*VGPU_WRITE))
                      ) -> dict[str, Any]:
    """Make sure mdev `uuid` exists for `vm` (201 when it had to be created, 200 when it was there)."""
    def run(alloc_key: str | None) -> tuple[int, Any]:
        alloc, created = svc.ensure_vgpu(uuid=body.uuid, type_name=body.type, vm=body.vm, parent=body.parent,
                                        idempotency_key=alloc_key, actor=token.actor)
        return (201 if created else 200), alloc

    return await one_at_a_time(request.app, lambda: idempotent(request, svc, token, key, body, run))


# The two VM-release hooks stay on the thread pool, without a turn: each of the VM's vGPUs may wait up to
# `grace` seconds for NVIDIA's driver, and holding one turn across all of them would make other writes wait
# for the whole VM; the host lock, taken per vGPU, lets them in between.
@router.post("/hooks/release", tags=["hooks"])
def hook_release(body: VmRelease, svc: Service = Depends(service), token: Token = Depends(require(*VGPU_WRITE))
                 ) -> dict[str, Any]:
    """Release the live vGPUs of a VM (those listed, or all). Failures are listed under `errors`."""
    return svc.release_vm_vgpus(body.vm, body.uuids, grace=body.grace, actor=token.actor)


@router.post("/hooks/libvirt/prepare", tags=["hooks"])
async def hook_libvirt_prepare(body: DomainHook, request: Request, key: str | None = Depends(idempotency_key),
                               svc: Service = Depends(service), token: Token = Depends(require(*VGPU_WRITE))
                               ) -> dict[str, Any]:
    return await one_at_a_time(request.app, lambda: idempotent(request, svc, token, key, body, lambda k: (
        200, svc.libvirt_prepare(body.domain, body.xml, actor=token.actor, key_prefix=k))))


@router.post("/hooks/libvirt/migrate", tags=["hooks"])
async def hook_libvirt_migrate(body: DomainHook, request: Request, svc: Service = Depends(service),
                               token: Token = Depends(require(*VGPU_WRITE))) -> dict[str, Any]:
    """`migrate begin` / `restore begin` on the destination: reserve the incoming domain's vGPUs here and
    return its XML rewritten to them (`xml` null: unchanged). 409 with every reason when this host cannot
    take it; nothing is left reserved then. A retry of the same migration gets the same vGPUs."""
    return await one_at_a_time(request.app, lambda: svc.libvirt_migrate(body.domain, body.xml, actor=token.actor))


@router.post("/migrations/preflight", tags=["migrations"])
def migration_preflight(body: DomainHook, svc: Service = Depends(service), _: Token = Depends(require(*READ))
                        ) -> dict[str, Any]:
    """Where each vGPU of a domain migrating here would land, and why not. Changes nothing."""
    return svc.migration_preflight(body.domain, body.xml)


@router.post("/migrations/settle", tags=["migrations"])
async def migration_settle(body: MigrationSettle, request: Request, svc: Service = Depends(service),
                           token: Token = Depends(require(*VGPU_WRITE))) -> dict[str, Any]:
    """The source reports a migration to this host finished: the arrived vGPUs become plain records."""
    done = await one_at_a_time(request.app, lambda: svc.migration_settle(body.domain, actor=token.actor))
    return {"vm": body.domain, "settled": done}


@router.post("/hooks/libvirt/release", tags=["hooks"])
def hook_libvirt_release(body: DomainHook, svc: Service = Depends(service),
                         token: Token = Depends(require(*VGPU_WRITE))) -> dict[str, Any]:
    return svc.libvirt_release(body.domain, body.xml, grace=body.grace, actor=token.actor)


@router.post("/hooks/proxmox/check", tags=["hooks"])
def hook_proxmox_check(body: ProxmoxCheck, svc: Service = Depends(service),
                       token: Token = Depends(require(*VGPU_WRITE))) -> dict[str, Any]:
    """Proxmox pre-start on a vendor-VF card: may the VM get this type on one of the VFs? 409 with the
    reasons when it may not. Changes no device; releases the VM's own leftover records and other VMs' stale
    records on the candidate VFs (`released_stale`, audited as vgpu.release-stale)."""
    return svc.proxmox_check(body.vm, body.type, body.candidates, actor=token.actor)


@router.post("/hooks/proxmox/record", tags=["hooks"])
async def hook_proxmox_record(body: ProxmoxRecord, request: Request, response: Response,
                              svc: Service = Depends(service), token: Token = Depends(require(*VGPU_WRITE))
                              ) -> dict[str, Any]:
    """Proxmox post-start: record the VF Proxmox chose and take the licence seat (201 new, 200 known)."""
    alloc, made = await one_at_a_time(request.app, lambda: svc.proxmox_record(body.vm, body.type, body.vf,
                                                                              actor=token.actor))
    response.status_code = 201 if made else 200
    return alloc
