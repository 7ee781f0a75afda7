"""Why placement refuses a MIG-backed vGPU, in words (issue 30): "MIG is not enabled" only where NVML says MIG
is off; otherwise that no instance of the profile is free and one can be made, or that there is no room for
one, naming the GPU instances that hold the slices and the VMs whose vGPUs use them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from placement_fixtures import H100_MIG_TYPES, HostBuilder, vf_addresses

from vgpumgr.mig import plan as mig
from vgpumgr.mig.facts import MigFacts
from vgpumgr.model import BACKEND_NVIDIA_VF
from vgpumgr.placement.placer import Allocation, Request, explain_text, place

H100 = "0000:65:00.0"
A100 = "0000:65:00.0"  # the `a100-mig` simulated host's GPU
VFS = vf_addresses(H100, 16)
TABLE = mig.KNOWN_TABLES["h100-80gb"]
TYPE_IDS = {"1g.10gb+me": 1130, "1g.10gb": 1131, "3g.40gb": 1134, "4g.40gb": 1135}


def nvml_facts(mode: str, *gis: tuple[str, int]) -> dict[str, Any]:
    """A GPU's NVML `mig` facts as discovery attaches them: the profile table and the GPU instances."""
    profiles = [{"id": p.id, "name": p.name, "compute_slices": p.compute_slices, "max_instances": p.max_instances,
                 "memory_mb": p.memory_mb, "placements": [{"start": s, "size": p.size} for s in p.starts]}
                for p in TABLE.profiles]
    instances = [{"id": n + 1, "profile_id": TABLE.find(name).id, "profile": name, "start": start,
                  "size": TABLE.find(name).size} for n, (name, start) in enumerate(gis)]
    return {"mig": {"supported": True, "current": mode, "pending": mode, "profiles": profiles,
                    "gpu_instances": instances if mode == "enabled" else []}}


def uses(vm: str, profile: str, n: int) -> Allocation:
    """A recorded MIG-backed vGPU of `vm` on the n-th VF."""
    tid = TYPE_IDS[profile]
    name = next(f"NVIDIA {short}" for i, short, *_ in H100_MIG_TYPES if i == tid)
    return Allocation(H100, VFS[n], f"nvidia-{tid}", None, vm, BACKEND_NVIDIA_VF, VFS[n], name)


def reason(facts: dict[str, Any] | None, records: list[Allocation], wanted: str,
           free: dict[str, list[str]] | None = None) -> tuple[str | None, str]:
    inv = HostBuilder().h100_mig().build()
    inv.gpu(H100).nvml = facts
    d = place(inv, records, Request(wanted), free_gpu_instances=free)
    got = next((r.reason for r in d.rejected if r.gpu == H100 and not r.fits), None)
    return (d.choice.parent if d.choice else None), got or explain_text(d)


def test_mig_off_is_said_only_where_nvml_says_so() -> None:
    assert reason(nvml_facts("disabled"), [], "H100XM-1-10C") == (
        None, "MIG is not enabled on this GPU; H100XM-1-10C needs a free 1g.10gb GPU instance")
    # NVML said nothing (no facts) and the caller named no free instance: MIG is not known to be on
    assert "MIG is not enabled" in reason(None, [], "H100XM-1-10C")[1]


def test_mig_on_without_a_free_instance_says_one_can_be_made() -> None:
    parent, why = reason(nvml_facts("enabled"), [], "H100XM-1-10C")
    assert parent is None and why == "no free 1g.10gb GPU instance; one can be made (`vm create --mig 1g.10gb`)"
    # the caller's free-instance map says the same where it names the GPU without one
    assert reason(nvml_facts("enabled"), [], "H100XM-1-10C", free={H100: ["3g.40gb"]})[1] == why


def test_a_free_instance_nvml_reports_is_taken_without_a_map_from_the_caller() -> None:
    assert reason(nvml_facts("enabled", ("1g.10gb", 0)), [], "H100XM-1-10C")[0] == VFS[0]
    # ... unless a vGPU already uses it
    parent, why = reason(nvml_facts("enabled", ("1g.10gb", 0)), [uses("ml1", "1g.10gb", 0)], "H100XM-1-10C")
    assert parent is None and why.endswith("one can be made (`vm create --mig 1g.10gb`)")


def test_no_room_names_the_instances_that_hold_the_slices_and_their_vms() -> None:
    full = nvml_facts("enabled", ("4g.40gb", 0), ("3g.40gb", 4))
    parent, why = reason(full, [uses("a", "4g.40gb", 0), uses("b", "3g.40gb", 1)], "H100XM-1-10C")
    assert parent is None
    assert why == ("no free 1g.10gb GPU instance; no room for a 1g.10gb instance (slices 0-6 taken by "
                   "4g.40gb (GI 1), 3g.40gb (GI 2); MIG-backed vGPUs of VM a, VM b)")
    # one of them holds no vGPU: destroying it would make room
    _, why = reason(full, [uses("a", "4g.40gb", 0)], "H100XM-1-10C")
    assert why.endswith("MIG-backed vGPUs of VM a; 1 GPU instance(s) here hold no vGPU "
                        "(`vgpumgr mig destroy` frees their slices))")
    # not memory but NVIDIA's instance limit
    _, why = reason(nvml_facts("enabled", ("1g.10gb+me", 0)), [uses("m", "1g.10gb+me", 0)], "H100XM-1-10CME")
    assert why.endswith("(1g.10gb+me allows at most 1 instance(s) per GPU; MIG-backed vGPUs of VM m)")


@pytest.mark.parametrize(("layout", "wanted", "expected"), [
    ([("1g.10gb", s) for s in range(7)], "1g.10gb", "slices 0-6 taken by 7 x 1g.10gb (GIs 1-7)"),
    ([("1g.10gb", s) for s in (0, 2, 4, 6)], "2g.20gb", "slices 0, 2, 4 taken by 3 x 1g.10gb (GIs 1-3)"),
    ([("3g.40gb", 0), ("3g.40gb", 4)], "4g.40gb", "slices 0-3 taken by 3g.40gb (GI 1)"),
    ([("3g.40gb", 0)], "3g.40gb", None),
])
def test_no_room_is_pure_over_the_profile_table(layout: list[tuple[str, int]], wanted: str,
                                                 expected: str | None) -> None:
    facts = MigFacts.of(nvml_facts("enabled", *layout))
    assert facts is not None and facts.enabled
    text = mig.no_room(TABLE, list(facts.instances), TABLE.find(wanted))
    assert text == (None if expected is None else f"no room for a {wanted} instance ({expected})")
    assert facts.can_make(wanted) == (expected is None)


def test_on_a_simulated_a100_place_and_vgpu_see_the_free_instance_nvml_reports(tmp_path: Path) -> None:
    """The service's `place` (CLI and REST) asks without a free-instance map: NVML's facts decide."""
    from test_hot_path import make_service

    svc = make_service(tmp_path, "a100-mig", vfs=4)
    assert "one can be made (`vm create --mig 1g.10gb`)" in explain_text(svc.place("A100D-1-10C"))
    svc.create_vm("ml1", mig=["1g.10gb"])
    svc.delete_vm("ml1")  # its GPU instance stays, free
    assert svc.place("A100D-1-10C").choice is not None
    made = svc.allocate("A100D-1-10C", vm="x")  # `vgpumgr vgpu --type A100D-1-10C` takes it...
    assert made["mig_profile"] == "1g.10gb"  # ... and records it, so it counts as used
    assert svc.free_gpu_instances(svc.nvml()) == {"0000:65:00.0": []}
    assert svc.place("A100D-1-10C").rejected[0].reason.endswith("one can be made (`vm create --mig 1g.10gb`)")


def test_mig_placement_reads_the_live_rows_and_the_gpu_list_once(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42: choosing a GPU read the live rows twice (free instances, their VMs) and NVML's GPU list twice, and
    `vm create --mig` read both again after choosing where it reused an instance."""
    from test_hot_path import make_service

    from vgpumgr.db import store
    from vgpumgr.nvidia.nvml import NvmlLayer
    from vgpumgr.ops import mig as mig_ops

    svc = make_service(tmp_path, "a100-mig", vfs=4)
    svc.create_vm("ml1", mig=["1g.10gb"])
    svc.delete_vm("ml1")  # its GPU instance stays, free: the next one reuses it
    counts = {"rows": 0, "gpus": 0}
    real_rows, real_allocations, real_gpus = store.live_rows, store.allocations, NvmlLayer.gpus

    def rows(*args: Any, **kwargs: Any) -> Any:
        counts["rows"] += 1
        return real_rows(*args, **kwargs)

    def allocations(*args: Any, **kwargs: Any) -> Any:
        counts["rows"] += kwargs.get("live") is True
        return real_allocations(*args, **kwargs)

    def gpus(self: NvmlLayer) -> Any:
        counts["gpus"] += sys._getframe(1).f_code.co_filename == mig_ops.__file__  # asked by MIG placement
        return real_gpus(self)

    monkeypatch.setattr(mig_ops.store, "live_rows", rows)
    monkeypatch.setattr(mig_ops.store, "allocations", allocations)
    monkeypatch.setattr(NvmlLayer, "gpus", gpus)
    layer = svc.nvml()
    assert mig_ops.choose_gpu(svc, layer, "1g.10gb", None, "ml2") == (A100, False)
    assert counts == {"rows": 1, "gpus": 1}
    monkeypatch.setattr(mig_ops.alloc, "allocate", lambda *a, **kw: {"placed": kw["free_gpu_instances"]})
    counts.update(rows=0, gpus=0)
    assert mig_ops.allocate_mig(svc, "1g.10gb", vm="ml2") == {"placed": {A100: ["1g.10gb"]}}
    assert counts == {"rows": 1, "gpus": 1}
