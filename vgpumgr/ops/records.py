"""Allocation rows as the dicts the CLI, the REST API and the domain metadata use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session, object_session

from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.db.models import LicenceLease, Vm
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF, BACKEND_PASSTHROUGH, BACKEND_VF
from vgpumgr.placement.placer import Allocation as PlacedAlloc

_LOOK_UP = object()


def placed(rows: Iterable[Any]) -> list[PlacedAlloc]:
    """Live allocation rows (`store.live_rows`) as placement reads them: the vGPUs, not whole GPUs."""
    out = []
    for a in rows:
        if a.backend == BACKEND_PASSTHROUGH:
            continue
        d = a.detail or {}
        parent = a.pci_address if a.backend in (BACKEND_NVIDIA_VF, BACKEND_VF) else a.parent
        out.append(PlacedAlloc(gpu=d.get("gpu"), parent=parent, type=a.type_id, framebuffer_mb=d.get("framebuffer_mb"),
                               vm=a.vm_name, backend=a.backend, id=a.uuid or a.pci_address or "", name=a.type_name,
                               placement_id=d.get("placement_id")))
    return out


def allocation_dict(a: AllocRow, s: Session | None = None, vm_name: str | None | object = _LOOK_UP
                    ) -> dict[str, Any]:
    """`vm_name`: the VM's name when the caller knows it already (saves a lookup)."""
    detail = a.detail or {}
    vm = None
    session = s or object_session(a)
    if vm_name is not _LOOK_UP:
        vm = vm_name
    elif a.vm_id is not None:
        row = session.get(Vm, a.vm_id) if session else None
        vm = row.name if row else None
    return {
        "id": a.id, "uuid": a.uuid, "pci_address": a.pci_address, "backend": a.backend, "parent": a.parent,
        "gpu": detail.get("gpu"), "type": a.type_id,
        "type_name": a.type_name, "series": a.series, "vm": vm,
        "state": a.state, "idempotency_key": a.idempotency_key, "kernel_owner": detail.get("kernel_owner"),
        "licence": _edition(session, a.lease_id) if session is not None and a.lease_id else None,
        **({"placement_id": detail["placement_id"]} if detail.get("placement_id") is not None else {}),
        **({"placement_by": detail["placement_by"]} if detail.get("placement_by") else {}),  # "driver": equal size
        "created_at": _iso(a.created_at), "activated_at": _iso(a.activated_at), "released_at": _iso(a.released_at),
        **({"mig_profile": detail["mig_profile"]} if detail.get("mig_profile") else {}),
        # a live migration's reservation here until the domain arrives (see ops/incoming.py)
        **({"incoming": detail["incoming"]} if detail.get("incoming") and a.owner_pid is not None else {}),
    }


def hostdev_for(a: dict[str, Any], display: bool):  # noqa: ANN201
    from vgpumgr.virt.domain import Hostdev

    if a["backend"] == BACKEND_MDEV:
        return Hostdev("mdev", uuid=a["uuid"], display=display)
    if a["backend"] == BACKEND_NVIDIA_VF:
        return Hostdev("nvidia-vf", address=a["pci_address"])
    return Hostdev("passthrough", address=a["pci_address"])  # a whole GPU, or a vendor's VF (BACKEND_VF)


def metadata_for(a: dict[str, Any]) -> dict[str, Any]:
    """What the domain's <metadata> carries so the state can be rebuilt from libvirt alone."""
    keys = ("uuid", "pci_address", "backend", "parent", "gpu", "type", "type_name", "series", "idempotency_key",
            "mig_profile")
    return {k: a[k] for k in keys if a.get(k) is not None}


def is_nvidia(a: dict[str, Any]) -> bool:
    return str(a.get("type", "")).startswith("nvidia-")



def _edition(s: Session, lease_id: int) -> str | None:
    lease = s.get(LicenceLease, lease_id)
    return lease.pool.edition if lease is not None else None


def _iso(v: Any) -> str | None:
    return v.isoformat() if v is not None else None

