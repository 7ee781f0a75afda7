"""After a vGPU is made on a GPU in mixed-size mode: give it the placement ID placement chose, read back what the
driver holds, and record that (the allocation's detail["placement_id"]), so `restore` can give it again.
A placement the driver refuses undoes the device (the caller rolls the record back)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update

from vgpumgr.backends import mdev as mdev_backend
from vgpumgr.backends import nvidia_vf
from vgpumgr.backends import placement_id as pid_backend
from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.model import BACKEND_MDEV
from vgpumgr.ops.context import Context, suppress


def give(svc: Context, row_id: int, choice: Any, uuid: str | None) -> int | None:
    """Apply `choice.placement_id` to the new vGPU; returns what the driver holds (None: R550, at VM start)."""
    d = pid_backend.device_dir(svc.host, uuid=uuid if choice.backend == BACKEND_MDEV else None,
                               vf=None if choice.backend == BACKEND_MDEV else choice.parent)
    try:
        got = pid_backend.apply(svc.host, d, choice.placement_id)
    except BaseException:
        with suppress():  # nothing half-made: the vGPU goes with its refused placement
            if choice.backend == BACKEND_MDEV and uuid:
                mdev_backend.remove(svc.host, uuid)
            else:
                nvidia_vf.clear_type(svc.host, choice.parent, retries=1)
        raise
    held = got.placement_id if got.placement_id is not None else choice.placement_id
    if held != choice.placement_id:
        record(svc, row_id, held, got.interface)
    return got.placement_id


def record(svc: Context, row_id: int, placement_id: int | None, interface: str) -> None:
    with svc.tx() as s:
        row = s.get(AllocRow, row_id)
        detail = dict(row.detail or {}) | {"placement_id": placement_id, "placement_interface": interface}
        s.execute(update(AllocRow).where(AllocRow.id == row_id).values(detail=detail))
