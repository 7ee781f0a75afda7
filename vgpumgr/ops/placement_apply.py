"""After a vGPU is made on a GPU in mixed-size mode: give it the placement ID placement chose, read back what the
driver holds, and record that (the allocation's detail["placement_id"]), so `restore` can give it again.
A placement the driver refuses undoes the device (the caller rolls the record back).

In equal-size mode on Ada and newer with R570+ the driver gives the vGPU its first creatable homogeneous ID when
it is made; `observe` records that ID as the driver's (detail["placement_by"] = "driver"): reported, never asked
for (restore reads it again instead of writing it)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.orm.attributes import set_committed_value

from vgpumgr.backends import placement_id as pid_backend
from vgpumgr.db.models import Allocation as AllocRow
from vgpumgr.discovery.placement_id import placement_id as read_placement
from vgpumgr.model import BACKEND_MDEV
from vgpumgr.ops.context import Context


def give(svc: Context, row_id: int, choice: Any, uuid: str | None) -> int | None:
    """Apply `choice.placement_id` to the new vGPU; returns what the driver holds (None: R550, at VM start)."""
    d = pid_backend.device_dir(svc.host, uuid=uuid if choice.backend == BACKEND_MDEV else None,
                               vf=None if choice.backend == BACKEND_MDEV else choice.parent)
    got = pid_backend.apply(svc.host, d, choice.placement_id)  # refused: the caller removes the vGPU
    held = got.placement_id if got.placement_id is not None else choice.placement_id
    if held != choice.placement_id:
        record(svc, row_id, held, got.interface)
    return got.placement_id


def observe(svc: Context, row: AllocRow, choice: Any, uuid: str | None) -> int | None:
    """A vGPU made without a placement ID asked for: the one the driver gave it (`nvidia/placement_id`), recorded
    as the driver's (on `row` too); None (nothing recorded) where the driver shows none (pre-Ada or R550 in
    equal-size mode, another vendor's device)."""
    d = pid_backend.device_dir(svc.host, uuid=uuid if choice.backend == BACKEND_MDEV else None,
                               vf=None if choice.backend == BACKEND_MDEV else choice.parent)
    got = read_placement(d)
    if got is not None:
        set_committed_value(row, "detail", record(svc, row.id, got, "placement_id", by_driver=True))
    return got


def record(svc: Context, row_id: int, placement_id: int | None, interface: str, *, by_driver: bool = False
           ) -> dict[str, Any]:
    with svc.tx() as s:
        row = s.get(AllocRow, row_id)
        detail = dict(row.detail or {}) | {"placement_id": placement_id, "placement_interface": interface}
        if by_driver:
            detail["placement_by"] = "driver"
        s.execute(update(AllocRow).where(AllocRow.id == row_id).values(detail=detail))
    return detail
