"""Placement: policy x host profile x existing load -> expected choice and reasons."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
from placement_fixtures import HostBuilder, vf_addresses

from vgpumgr.errors import InvalidInput, NotFound
from vgpumgr.model import BACKEND_MDEV, BACKEND_NVIDIA_VF, Inventory
from vgpumgr.placement.placer import (
    Allocation,
    Decision,
    Placer,
    Policy,
    Request,
    allocations_from_inventory,
    explain_text,
    mig_profile_for,
    mixed_size_placements,
    place,
)

T4A, T4B = "0000:3b:00.0", "0000:af:00.0"  # two-socket host: NUMA 0 and 1
A40, L40S, H100, IGPU = "0000:41:00.0", "0000:3d:00.0", "0000:65:00.0", "0000:00:02.0"
A40_VFS, L40S_VFS, H100_VFS = vf_addresses(A40, 32), vf_addresses(L40S, 32), vf_addresses(H100, 16)


def reserved(gpu: str | None, parent: str, type_id: str, gb: float | None, vm: str | None = None,
             backend: str = BACKEND_MDEV, id: str | None = None, name: str | None = None) -> Allocation:
    fb = int(gb * 1024) if gb is not None else None
    return Allocation(gpu, parent, type_id, fb, vm, backend, id or f"{parent}-{type_id}-{vm}", name)


@dataclass
class Case:
    id: str
    host: Callable[[], tuple[Inventory, list[Allocation]]]
    type: str
    vm: str | None = None
    policy: Policy = field(default_factory=Policy)
    gis: dict[str, list[str]] | None = None
    parent: str | None = None  # expected chosen parent; None = no choice
    reasons: dict[str, str] = field(default_factory=dict)  # gpu or parent -> substring of its rejection
    free_vfs: int | None = None


def host(build: Callable[[HostBuilder], object] = lambda b: None, records: list[Allocation] | None = None,
         gpus: str = "t4") -> Callable[[], tuple[Inventory, list[Allocation]]]:
    def make() -> tuple[Inventory, list[Allocation]]:
        b = HostBuilder()
        for kind in gpus.split(","):
            {"t4": lambda: b.t4(), "2t4": lambda: b.t4(T4A, 0).t4(T4B, 1), "a40": lambda: b.a40(),
             "l40s": lambda: b.l40s(), "l40s4": lambda: b.l40s(vfs=4),
             "l40s-mixed": lambda: b.l40s(mixed=True), "h100": lambda: b.h100_mig(),
             "gvtg": lambda: b.gvtg(), "mtty": lambda: b.mtty()}[kind]()
        build(b)
        return b.build(), list(records or [])
    return make


def fill(gpu: str, short: str, n: int) -> Callable[[HostBuilder], None]:
    return lambda b: [b.vgpu(gpu, short) for _ in range(n)] and None


def both(*fns: Callable[[HostBuilder], object]) -> Callable[[HostBuilder], None]:
    return lambda b: [f(b) for f in fns] and None


CASES = [
    # -- T4: legacy mdev on the PF
    Case("t4-empty", host(), "T4-4Q", parent=T4A),
    Case("t4-by-id", host(), "nvidia-232", parent=T4A),
    Case("t4-by-full-name", host(), "GRID T4-4Q", parent=T4A),
    Case("t4-equal-size", host(fill(T4A, "T4-4Q", 1)), "T4-2Q",
         reasons={T4A: "equal-size mode: GPU holds 4096 MB vGPUs, T4-2Q is 2048 MB"}),
    Case("t4-same-size-other-series", host(fill(T4A, "T4-4Q", 1)), "T4-4A", parent=T4A),
    Case("t4-max-instance", host(fill(T4A, "T4-4Q", 4)), "T4-4Q",
         reasons={T4A: "max_instance 4 of T4-4Q reached on 0000:3b:00.0"}),
    Case("t4-reserved-counts", host(fill(T4A, "T4-4Q", 3), [reserved(T4A, T4A, "nvidia-232", 4, "vm9")]),
         "T4-4Q", reasons={T4A: "max_instance 4 of T4-4Q reached"}),
    Case("t4-reserved-other-size", host(records=[reserved(T4A, T4A, "nvidia-233", 8, "vm9")]), "T4-4Q",
         reasons={T4A: "equal-size mode: GPU holds 8192 MB vGPUs, T4-4Q is 4096 MB"}),
    # -- two T4s on NUMA 0 and 1
    Case("2t4-pack", host(fill(T4B, "T4-4Q", 1), gpus="2t4"), "T4-4Q", parent=T4B,
         reasons={T4A: "fits, ranked 2 of 2"}),
    Case("2t4-spread", host(fill(T4B, "T4-4Q", 1), gpus="2t4"), "T4-4Q", policy=Policy("spread"), parent=T4A),
    Case("2t4-spread-numa-preferred", host(fill(T4B, "T4-4Q", 1), gpus="2t4"), "T4-4Q",
         policy=Policy("spread", numa=1), parent=T4B, reasons={T4A: "not the preferred node"}),
    Case("2t4-numa-is-not-a-filter", host(fill(T4B, "T4-2Q", 1), gpus="2t4"), "T4-4Q",
         policy=Policy("pack", numa=1), parent=T4A, reasons={T4B: "equal-size mode"}),
    Case("2t4-pin-gpu", host(gpus="2t4"), "T4-4Q", policy=Policy(pin_gpu="af:00.0"), parent=T4B,
         reasons={T4A: "not the pinned GPU 0000:af:00.0"}),
    Case("2t4-pin-parent", host(gpus="2t4"), "T4-4Q", policy=Policy(pin_parent=T4B), parent=T4B,
         reasons={T4A: "not the pinned parent 0000:af:00.0"}),
    Case("2t4-deny-gpu", host(gpus="2t4"), "T4-4Q", policy=Policy(deny_gpus=[T4A]), parent=T4B,
         reasons={T4A: "denied by policy (GPU 0000:3b:00.0)"}),
    Case("2t4-deny-model", host(gpus="2t4"), "T4-4Q", policy=Policy(deny_models=["t4"]),
         reasons={T4A: "denied by policy (model T4)", T4B: "denied by policy (model T4)"}),
    Case("t4-allow-other-model", host(gpus="t4,a40"), "nvidia-232", policy=Policy(allow_models=["A40"]),
         reasons={T4A: "not in the allowed models (A40)"}),
    Case("2t4-vm-once-per-gpu", host(gpus="2t4", records=[reserved(T4A, T4A, "nvidia-232", 4, "web1")]),
         "T4-4Q", vm="web1", parent=T4B, reasons={T4A: "VM web1 already has a vGPU on this GPU"}),
    Case("2t4-other-vm-packs", host(gpus="2t4", records=[reserved(T4A, T4A, "nvidia-232", 4, "web1")]),
         "T4-4Q", vm="web2", parent=T4A),
    # -- A40: SR-IOV, mdev on the VFs
    Case("a40-empty", host(gpus="a40"), "A40-2Q", parent=A40_VFS[0], free_vfs=32),
    Case("a40-lowest-free-vf", host(fill(A40, "A40-2Q", 2), gpus="a40"), "A40-2Q", parent=A40_VFS[2],
         free_vfs=30),
    Case("a40-reserved-vf-skipped",
         host(fill(A40, "A40-2Q", 2), [reserved(A40, A40_VFS[2], "nvidia-558", 2, "vm3")], gpus="a40"),
         "A40-2Q", parent=A40_VFS[3], free_vfs=29),
    Case("a40-equal-size", host(fill(A40, "A40-2Q", 1), gpus="a40"), "A40-4Q",
         reasons={A40: "equal-size mode: GPU holds 2048 MB vGPUs, A40-4Q is 4096 MB"}),
    Case("a40-max-instance-not-vf-count", host(fill(A40, "A40-2Q", 24), gpus="a40"), "A40-2Q",
         reasons={A40: "max_instance 24 of A40-2Q reached on 0000:41:00.0"}),
    Case("a40-pinned-busy-vf", host(fill(A40, "A40-2Q", 1), gpus="a40"), "A40-2Q",
         policy=Policy(pin_parent=A40_VFS[0]), reasons={A40: f"VF {A40_VFS[0]} already holds a vGPU"}),
    Case("a40-pinned-free-vf", host(fill(A40, "A40-2Q", 1), gpus="a40"), "A40-2Q",
         policy=Policy(pin_parent=A40_VFS[7]), parent=A40_VFS[7]),
    # -- L40S: vendor-specific VF interface
    Case("l40s-empty", host(gpus="l40s"), "L40S-2Q", parent=L40S_VFS[0], free_vfs=32),
    Case("l40s-equal-size-type-not-listed", host(fill(L40S, "L40S-1Q", 1), gpus="l40s"), "L40S-2Q",
         reasons={L40S: "equal-size mode: GPU holds 1024 MB vGPUs, L40S-2Q is 2048 MB"}),
    Case("l40s-full-type-known-from-vgpus", host(fill(L40S, "L40S-1Q", 32), gpus="l40s"), "L40S-1Q",
         reasons={L40S: "max_instance 32 of L40S-1Q reached"}),
    Case("l40s-full-other-type-by-model-name", host(fill(L40S, "L40S-1Q", 32), gpus="l40s"), "L40S-4Q",
         reasons={L40S: "equal-size mode"}),
    Case("l40s-no-free-vf", host(fill(L40S, "L40S-1Q", 4), gpus="l40s4"), "L40S-1Q",
         reasons={L40S: "no free VF (4 of 4 VFs hold a vGPU)"}),
    Case("l40s-mixed-size", host(fill(L40S, "L40S-4Q", 1), gpus="l40s-mixed"), "L40S-2Q",
         policy=Policy(mixed_size_gpus=[L40S]), parent=L40S_VFS[1]),
    Case("l40s-mixed-size-full", host(both(fill(L40S, "L40S-24Q", 1), fill(L40S, "L40S-16Q", 1),
                                           fill(L40S, "L40S-8Q", 1)), gpus="l40s-mixed"), "L40S-1Q",
         policy=Policy(mixed_size_gpus=[L40S]), reasons={L40S: "mixed-size mode: 48 of 48 GB in use"}),
    # 16Q may only sit at 0 or 32: both taken, although 16 GB (16..32) are still free
    Case("l40s-mixed-size-no-placement", host(fill(L40S, "L40S-16Q", 2), gpus="l40s-mixed"), "L40S-16Q",
         policy=Policy(mixed_size_gpus=[L40S]),
         reasons={L40S: "16 GB free on 0000:3d:00.0 but no 16Q start free (0: L40S-16Q"}),
    Case("l40s-mixed-size-placement-left", host(fill(L40S, "L40S-16Q", 2), gpus="l40s-mixed"), "L40S-8Q",
         policy=Policy(mixed_size_gpus=[L40S]), parent=L40S_VFS[2]),
    # -- H100 with MIG-backed types
    Case("h100-mig", host(gpus="h100"), "H100XM-1-10C", gis={H100: ["1g.10gb", "3g.40gb"]}, parent=H100_VFS[0]),
    Case("h100-mig-me-needs-me-gi", host(gpus="h100"), "H100XM-1-10CME", gis={H100: ["1g.10gb", "3g.40gb"]},
         reasons={H100: "no free 1g.10gb+me GPU instance"}),
    Case("h100-mig-reserved-takes-gi",
         host(gpus="h100", records=[reserved(H100, H100_VFS[0], "nvidia-1131", 10, "vm1", BACKEND_NVIDIA_VF,
                                             H100_VFS[0], "NVIDIA H100XM-1-10C")]),
         "H100XM-1-10C", gis={H100: ["1g.10gb", "3g.40gb"]}, reasons={H100: "no free 1g.10gb GPU instance"}),
    Case("h100-mig-off", host(gpus="h100"), "H100XM-3-40C",
         reasons={H100: "MIG is not enabled on this GPU; H100XM-3-40C needs a free 3g.40gb GPU instance"}),
    Case("h100-gi-map-names-other-gpu", host(gpus="h100,l40s"), "H100XM-1-10C", gis={L40S: []},
         reasons={H100: "MIG is not enabled"}),
    Case("l40s-time-sliced-on-mig-gpu", host(gpus="l40s"), "L40S-2Q", gis={L40S: ["1g.12gb"]},
         reasons={L40S: "MIG is enabled on this GPU; time-sliced L40S-2Q needs MIG off"}),
    # -- Intel GVT-g and mtty: available_instances
    Case("gvtg", host(gpus="gvtg"), "GVTg_V5_4", vm="web1", parent=IGPU),
    Case("gvtg-by-id-reserved", host(gpus="gvtg", records=[reserved(IGPU, IGPU, "i915-GVTg_V5_4", None, "a")]),
         "i915-GVTg_V5_4", reasons={IGPU: "available_instances 1 on 0000:00:02.0, 1 reserved"}),
    Case("gvtg-no-per-vm-limit", host(gpus="gvtg", records=[reserved(IGPU, IGPU, "i915-GVTg_V5_8", None, "web1",
                                                                     id="11111111-2222-3333-4444-555555555555")],
                                      build=lambda b: b.generic_mdev(IGPU, "i915-GVTg_V5_8",
                                                                     "11111111-2222-3333-4444-555555555555")),
         "i915-GVTg_V5_8", vm="web1", parent=IGPU),
    Case("gvtg-driver-says-zero", host(lambda b: b.gvtg({"i915-GVTg_V5_1": 0}) and None, gpus="mtty"),
         "i915-GVTg_V5_1", reasons={IGPU: "available_instances 0 on 0000:00:02.0"}),
    Case("mtty", host(gpus="mtty,t4"), "mtty-2", vm="web1", parent="mtty"),
    # -- mixed host: models are separate candidates
    Case("mixed-host-deny-t4", host(gpus="2t4,a40"), "nvidia-232", policy=Policy(deny_models=["Tesla T4"]),
         reasons={T4A: "denied by policy (model Tesla T4)", T4B: "denied by policy"}),
]


def _rejections(d: Decision) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in d.rejected:
        for key in {r.gpu, r.parent} - {None}:
            out.setdefault(key, r.reason)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_placement_table(case: Case) -> None:
    inv, records = case.host()
    d = place(inv, records, Request(case.type, case.vm), case.policy, free_gpu_instances=case.gis)
    assert (d.choice.parent if d.choice else None) == case.parent, explain_text(d)
    if case.free_vfs is not None:
        assert d.choice and d.choice.free_vfs == case.free_vfs
    got = _rejections(d)
    for where, reason in case.reasons.items():
        assert where in got, explain_text(d)
        assert reason in got[where], explain_text(d)
    assert d.considered == len(d.rejected) + (1 if d.choice else 0)


def test_choice_names_the_type_and_backend_to_create() -> None:
    inv, _ = host(gpus="t4,l40s")()
    t4 = place(inv, [], Request("T4-4Q"))
    assert (t4.choice.gpu, t4.choice.type, t4.choice.name, t4.choice.backend) == (
        T4A, "nvidia-232", "GRID T4-4Q", BACKEND_MDEV)
    l40s = place(inv, [], Request("NVIDIA L40S-2Q"))
    assert (l40s.choice.gpu, l40s.choice.type, l40s.choice.backend) == (L40S, "nvidia-1148", BACKEND_NVIDIA_VF)


def test_driver_listing_vetoes_what_the_rules_allow() -> None:
    inv, _ = host()()
    inv.types = [replace(t, available_instances=0) if t.type == "nvidia-232" else t for t in inv.types]
    d = place(inv, [], Request("T4-4Q"))
    assert d.choice is None
    assert "driver reports available_instances 0 for T4-4Q" in d.rejected[0].reason


def test_vendor_vf_not_listing_the_type_is_refused() -> None:
    inv, _ = host(gpus="l40s")()
    inv.types = [t for t in inv.types if not (t.type == "nvidia-1150" and t.parent in L40S_VFS[:31])]
    d = place(inv, [], Request("L40S-4Q"), Policy(pin_parent=L40S_VFS[3]))
    assert d.choice is None
    assert "creatable on none of the 1 free VF" in d.rejected[0].reason
    assert place(inv, [], Request("L40S-4Q")).choice.parent == L40S_VFS[31]


def test_unknown_type_raises_not_found_with_close_names() -> None:
    inv, _ = host(gpus="2t4,a40")()
    with pytest.raises(NotFound) as e:
        place(inv, [], Request("T4-5Q"))
    assert "T4-4Q" in (e.value.hint or "")
    with pytest.raises(NotFound):
        place(inv, [], Request("L40S-2Q"))  # no L40S on this host


def test_invalid_inputs_are_refused() -> None:
    with pytest.raises(InvalidInput):
        Request("")
    with pytest.raises(InvalidInput):
        Request("T4-4Q", vm="bad name/..")
    with pytest.raises(InvalidInput):
        Policy("random")
    with pytest.raises(InvalidInput):
        Policy(pin_gpu="../../etc")
    assert Policy(deny_gpus=["3b:00.0"]).deny_gpus == frozenset({T4A})


def test_existing_and_reserved_are_merged_by_parent_and_id() -> None:
    b = HostBuilder().t4()
    uuids = [b.vgpu(T4A, "T4-4Q") for _ in range(3)]
    inv = b.build()
    same = reserved(T4A, T4A, "nvidia-232", 4, "web1", id=uuids[0])
    d = place(inv, [same], Request("T4-4Q", "web2"))
    assert d.choice and d.choice.parent == T4A  # 3 of 4, the record did not count twice
    d = place(inv, [same], Request("T4-4Q", "web1"))
    assert d.choice is None and "VM web1 already has a vGPU" in d.rejected[0].reason


def test_allocations_from_inventory() -> None:
    b = HostBuilder().t4().a40().l40s(vfs=2)
    u = b.vgpu(T4A, "T4-8Q")
    a40 = b.vgpu(A40, "A40-2Q")
    vfs = [b.vgpu(L40S, "L40S-24Q"), b.vgpu(L40S, "L40S-24Q")]  # L40S full: 24Q no longer listed
    m = b.generic_mdev("mtty", "mtty-1")
    inv = b.mtty().build()
    assert not [t for t in inv.types if t.type == "nvidia-1155"]
    got = {a.id: a for a in allocations_from_inventory(inv)}
    assert got[u] == Allocation(T4A, T4A, "nvidia-233", 8192, None, BACKEND_MDEV, u, "GRID T4-8Q")
    assert (got[a40].gpu, got[a40].parent, got[a40].framebuffer_mb) == (A40, A40_VFS[0], 2048)
    assert got[vfs[1]] == Allocation(L40S, L40S_VFS[1], "nvidia-1155", 24576, None, BACKEND_NVIDIA_VF,
                                     L40S_VFS[1], "NVIDIA L40S-24Q")
    assert (got[m].gpu, got[m].parent, got[m].framebuffer_mb) == (None, "mtty", None)


def test_decision_is_deterministic_whatever_the_listing_order() -> None:
    make = host(fill(T4B, "T4-4Q", 1), gpus="2t4,a40,gvtg,mtty")
    inv, _ = make()
    first = place(inv, [], Request("nvidia-232"), Policy("spread"))
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(inv.types)
        rng.shuffle(inv.gpus)
        assert place(inv, [], Request("nvidia-232"), Policy("spread")) == first


def test_placer_reuse_matches_fresh_place_and_does_not_keep_allocations() -> None:
    inv, _ = host(gpus="a40")()
    px = Placer(inv)
    taken: list[Allocation] = []
    for n in range(3):
        d = px.place(taken, Request("A40-2Q"))
        assert d == place(inv, taken, Request("A40-2Q"))
        assert d.choice.parent == A40_VFS[n]
        taken.append(reserved(A40, d.choice.parent, d.choice.type, 2, f"vm{n}"))
    assert px.place([], Request("A40-2Q")).choice.parent == A40_VFS[0]


@pytest.mark.parametrize(("region", "size", "maxi", "expected"), [
    (48, 4, 12, (0, 8, 12, 20, 24, 32, 36, 44)),
    (48, 8, 6, (0, 16, 24, 40)),
    (48, 16, 3, (0, 32)),
    (48, 24, 2, (0, 24)),
    (48, 48, 1, (0,)),
    (48, 2, 24, (0, 4, 6, 10, 12, 16, 18, 22, 24, 28, 30, 34, 36, 40, 42, 46)),
    (48, 3, 16, tuple(range(0, 48, 3))),
    (80, 16, 5, (0, 24, 40, 64)),
    (24, 8, 3, (0, 16)),
])
def test_mixed_size_placements_match_the_facts_tables(region: int, size: int, maxi: int,
                                                      expected: tuple[int, ...]) -> None:
    assert mixed_size_placements(region, size, maxi) == expected


@pytest.mark.parametrize(("name", "profile"), [
    ("NVIDIA H100XM-1-10C", "1g.10gb"), ("NVIDIA H100XM-1-10CME", "1g.10gb+me"),
    ("GRID A100-3-20C", "3g.20gb"), ("NVIDIA H200X-7-141C", "7g.141gb"), ("GRID T4-4Q", None),
    ("GVTg_V5_4", None),
])
def test_mig_profile_for(name: str, profile: str | None) -> None:
    assert mig_profile_for(name) == profile


def test_explain_text_shows_choice_and_every_reason() -> None:
    inv, records = host(fill(T4A, "T4-4Q", 1), gpus="2t4,a40")()
    d = place(inv, records, Request("nvidia-232", "web1"), Policy("spread", numa=1, deny_gpus=[A40]))
    text = explain_text(d)
    lines = text.splitlines()
    assert "nvidia-232" in lines[0] and "web1" in lines[0] and "spread" in lines[0]
    assert lines[1].split()[:5] == ["RESULT", "GPU", "PARENT", "TYPE", "REASON"]
    assert lines[2].startswith("chosen") and T4B in lines[2]
    assert any(line.startswith("fits") and T4A in line for line in lines)
    assert len(lines) == 2 + d.considered
    none = place(inv, records, Request("T4-2Q"), Policy(pin_gpu=T4A))
    assert "no parent can take this vGPU now" in explain_text(none)
    assert "equal-size mode" in none.summary()
    assert none.as_dict()["choice"] is None and none.as_dict()["rejected"]
