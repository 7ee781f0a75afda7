"""VMs: create (with their vGPUs), delete, start, stop, XML, attach/detach a vGPU."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Path, Request, Response

from api.auth import READ, VM_WRITE, require
from api.deps import idempotency_key, service
from api.idempotent import idempotent
from api.schemas import VmAttach, VmCreate, VmMigrate, policy_of
from api.tokens import Token
from vgpumgr.service import Service

router = APIRouter(prefix="/v1/vms", tags=["vms"])
VM = Path(min_length=1, max_length=64)


@router.get("")
def list_vms(svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> list[dict[str, Any]]:
    return svc.list_vms()


@router.post("", status_code=201)
def create_vm(body: VmCreate, request: Request, key: str | None = Depends(idempotency_key),
              svc: Service = Depends(service), token: Token = Depends(require(*VM_WRITE))) -> dict[str, Any]:
    """Place and create the VM's GPU devices, define it (and start it). `print_xml` only renders the XML."""
    def run(alloc_key: str | None) -> tuple[int, Any]:
        result = svc.create_vm(body.name, vgpus=body.vgpus, passthrough=body.passthrough, mig=body.mig,
                               memory_mib=body.memory_mib, vcpus=body.vcpus, disk=body.disk, network=body.network,
                               firmware=body.firmware, display=body.display, policy=policy_of(body.policy),
                               start=body.start, print_xml=body.print_xml, idempotency_key=alloc_key,
                               actor=token.actor)
        return (200 if body.print_xml else 201), result

    return idempotent(request, svc, token, key, body, run)


@router.get("/{name}")
def get_vm(name: str = VM, svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> dict[str, Any]:
    return svc.vm(name)


@router.get("/{name}/xml", response_class=Response,
            responses={200: {"content": {"application/xml": {"schema": {"type": "string"}}}}})
def get_vm_xml(name: str = VM, svc: Service = Depends(service), _: Token = Depends(require(*READ))) -> Response:
    return Response(svc.vm_xml(name), media_type="application/xml")


@router.delete("/{name}")
def delete_vm(name: str = VM, svc: Service = Depends(service), token: Token = Depends(require(*VM_WRITE))
              ) -> dict[str, Any]:
    """Stop and undefine the VM, then release its vGPUs and licence seats."""
    return svc.delete_vm(name, actor=token.actor)


@router.post("/{name}/start")
def start_vm(name: str = VM, svc: Service = Depends(service), token: Token = Depends(require(*VM_WRITE))
             ) -> dict[str, Any]:
    return svc.start_vm(name, actor=token.actor)


@router.post("/{name}/stop")
def stop_vm(name: str = VM, svc: Service = Depends(service), token: Token = Depends(require(*VM_WRITE))
            ) -> dict[str, Any]:
    return svc.stop_vm(name, actor=token.actor)


@router.post("/{name}/vgpus", status_code=201)
def attach_vgpu(body: VmAttach, name: str = VM, svc: Service = Depends(service),
                token: Token = Depends(require(*VM_WRITE))) -> dict[str, Any]:
    return svc.attach_vgpu(name, body.type, actor=token.actor)


@router.delete("/{name}/vgpus/{ref}")
def detach_vgpu(name: str = VM, ref: str = Path(min_length=1, max_length=64), svc: Service = Depends(service),
                token: Token = Depends(require(*VM_WRITE))) -> dict[str, Any]:
    return svc.detach_vgpu(name, ref, actor=token.actor)


@router.post("/{name}/migrate")
def migrate_vm(body: VmMigrate, name: str = VM, svc: Service = Depends(service),
               token: Token = Depends(require(*VM_WRITE))) -> dict[str, Any]:
    """Move the VM and its vGPUs to the host `to` names (libvirt peer-to-peer, live unless `offline`). With
    `to_api` (and `to_token`) the destination's vgpumgr is asked first where each vGPU would land; `dry_run`
    stops there. A refusal is a 409 naming every reason; nothing is changed on either host then."""
    from vgpumgr.fleet.remote import Remote

    dest = Remote(body.to_api, body.to_token or "") if body.to_api else None
    return svc.migrate_vm(name, body.to, offline=body.offline, dry_run=body.dry_run, dest=dest, actor=token.actor)
