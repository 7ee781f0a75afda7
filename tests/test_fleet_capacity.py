"""What a host publishes per GPU and type equals what its own placement would still place there: for every
simulated profile, after a few vGPUs, each type's free count is the number of times placement, asked again
and again for that type on that GPU alone, finds room."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpumgr.config import Config
from vgpumgr.fleet import capacity
from vgpumgr.model import BACKEND_NVIDIA_VF
from vgpumgr.ops.allocate import live_records
from vgpumgr.placement.placer import Allocation, Policy, Request, mig_profile_for
from vgpumgr.service import Service
from vgpumgr.sim import profiles


def placements_left(px, records, type_id: str, gpu: str, free_gis, limit: int = 80) -> int:  # noqa: ANN001
    recs = list(records)
    for n in range(limit):
        d = px.place(recs, Request(type_id, vm=f"oracle{n}"), Policy(pin_gpu=gpu), free_gpu_instances=free_gis)
        if d.choice is None:
            return n
        c = d.choice
        info = px.info(gpu, c.type)
        ref = c.parent if c.backend == BACKEND_NVIDIA_VF else f"00000000-0000-4000-8000-{n:012d}"
        recs.append(Allocation(c.gpu, c.parent, c.type, info.framebuffer_mb if info else None, f"oracle{n}",
                               c.backend, ref, c.name))
    return limit


def _service(tmp_path: Path, profile: str, **kw: object) -> Service:
    root = profiles.create(tmp_path / "sim", profile, **kw)
    return Service(Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state")))


def _check_against_placement(svc: Service, monkeypatch: pytest.MonkeyPatch) -> int:
    # GPU instances still to be made are capacity too, but placement only ever takes existing ones
    monkeypatch.setattr(capacity, "_remaining", lambda g, profile: 0)
    snap = svc.snapshot(refresh=True)
    with svc.reads() as s:
        records = live_records(svc, s)
    caps = capacity.host_capacity(snap.placer, records)
    free_gis = capacity.free_gpu_instances(snap.inventory.gpus, records)
    checked = 0
    for g in caps:
        for t in g.types:
            expected = placements_left(snap.placer, records, t.type, g.address, free_gis)
            assert t.free == expected, (g.address, t.name, t.free, expected)
            checked += 1
    monkeypatch.undo()
    return checked


@pytest.mark.parametrize("profile", ["t4", "a40-sriov", "l40s-vfio", "a100-mig", "h100-mig", "gvtg", "mixed"])
def test_free_counts_equal_repeated_placement(tmp_path: Path, profile: str, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = _service(tmp_path, profile, vfs=8 if profile != "gvtg" else None)
    assert _check_against_placement(svc, monkeypatch) > 0
    # take a few vGPUs of the first type with room on each GPU, then count again
    for g in capacity.host_capacity(svc.snapshot().placer, []):
        t = next((t for t in g.types if t.free > 1 and (t.framebuffer_mb or 0) >= 2048), None) or next(
            (t for t in g.types if t.free > 0), None)
        if t is None:
            continue
        for vm in ("a", "b")[:t.free]:
            if mig_profile_for(t.name):
                svc.allocate_mig(mig_profile_for(t.name), vm=f"{vm}-{g.address[5:7]}")
            else:
                svc.allocate(t.type, vm=f"{vm}-{g.address[5:7]}", policy=Policy(pin_gpu=g.address))
    after = capacity.host_capacity(svc.snapshot(refresh=True).placer, live_records_of(svc))
    assert sum(g.vgpus for g in after) > 0
    _check_against_placement(svc, monkeypatch)


def live_records_of(svc: Service) -> list[Allocation]:
    with svc.reads() as s:
        return live_records(svc, s)


def test_equal_size_mode_and_counts_on_a_t4(tmp_path: Path) -> None:
    svc = _service(tmp_path, "t4")
    svc.allocate("T4-4Q", vm="web1")
    (gpu,) = capacity.host_capacity(svc.snapshot(refresh=True).placer, live_records_of(svc))
    by = {t.short: t for t in gpu.types}
    assert (by["T4-4Q"].free, by["T4-4Q"].used, by["T4-4Q"].max) == (3, 1, 4)
    assert by["T4-4C"].free == 3 and by["T4-8Q"].free == 0 and by["T4-1Q"].free == 0  # equal-size mode
    assert gpu.mode == "mdev" and gpu.vgpus == 1 and gpu.device_id == "1eb8" and gpu.subsystem_device_id == "12a2"


def test_mig_capacity_counts_instances_to_be_made_and_bound_ones(tmp_path: Path) -> None:
    svc = _service(tmp_path, "a100-mig", vfs=8)
    (gpu,) = capacity.host_capacity(svc.snapshot(refresh=True).placer, [])
    by = {t.short: t for t in gpu.types}
    assert gpu.mode == "mig" and by["A100D-1-10C"].free == 7 and by["A100D-7-80C"].free == 1
    assert by["A100D-4C"].free == 0  # time-sliced types need MIG off
    svc.allocate_mig("3g.40gb", vm="ml1")
    (gpu,) = capacity.host_capacity(svc.snapshot(refresh=True).placer, live_records_of(svc))
    by = {t.short: t for t in gpu.types}
    assert by["A100D-3-40C"].used == 1 and by["A100D-3-40C"].free == 1 and by["A100D-7-80C"].free == 0
    assert by["A100D-1-10C"].free == 4
