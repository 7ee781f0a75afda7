"""The fleet's placer as the pure function it is: hosts and one type's published rows in, a ranked choice and a
reason for every other host out."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from vgpumgr.errors import InvalidInput
from vgpumgr.fleet.place import FleetRequest, Migrating, place, with_gpus
from vgpumgr.fleet.store import GpuOffer, HostRow, OfferGroup
from vgpumgr.nvidia import compat
from vgpumgr.placement import ids as pid

L40S, H100_PCIE = ("NVIDIA L40S", "26b9"), ("NVIDIA H100 PCIe", "2331")


def host(i: int, name: str, *, age: float = 1.0, window: float = 90.0, cordoned: bool = False,
         driver: str = "580.95.02", reason: str | None = None) -> HostRow:
    return HostRow(i, name, f"https://{name}:8470", f"qemu+ssh://{name}/system", driver, "0.1.0", 30.0, window,
                   1.7e9, age, 1, 8, 0, cordoned, reason, "admin" if cordoned else None)


def group(i: int, free_per_gpu: list[int], board: tuple[str, str] = L40S, name: str = "NVIDIA L40S-4Q",
          tightest_mb: int | None = None) -> OfferGroup:
    return OfferGroup(i, board[0], board[1], name, len(free_per_gpu), sum(1 for f in free_per_gpu if f > 0),
                      sum(free_per_gpu), 0, tightest_mb)


def why(d) -> dict[str, tuple[str, str]]:  # noqa: ANN001
    return {r.host: (r.code, r.reason) for r in d.rejected}


def test_every_host_that_is_not_chosen_gets_its_reason() -> None:
    hosts = [host(1, "a"), host(2, "b", age=400), host(3, "c", cordoned=True, reason="BIOS update"), host(4, "d"),
             host(5, "e"), host(6, "f")]
    groups = [group(1, [2, 0]), group(2, [5]), group(3, [5]), group(5, [0, 0, 0]), group(6, [3], board=H100_PCIE)]
    d = place(hosts, groups, FleetRequest("L40S-4Q", deny_models=("NVIDIA H100 PCIe",)))
    assert d.choice.host == "a" and d.choice.free == 2 and d.choice.free_gpus == 1
    assert why(d) == {
        "b": ("stale", "stale: last heartbeat 400 s ago, its window is 90 s"),
        "c": ("cordoned", "cordoned (BIOS update)"),
        "d": ("not-offered", "offers no L40S-4Q (no GPU of a model that has it)"),
        "e": ("no-capacity", "no capacity: 0 free L40S-4Q on its 3 GPU(s)"),
        "f": ("model-denied", "model NVIDIA H100 PCIe denied by the policy"),
    }
    assert d.considered == 6 and "b: stale" in d.summary()


def test_pack_fills_the_fullest_host_and_spread_the_emptiest() -> None:
    hosts = [host(1, "a"), host(2, "b"), host(3, "c")]
    groups = [group(1, [4, 4]), group(2, [1]), group(3, [2, 2])]
    assert [c.host for c in place(hosts, groups, FleetRequest("L40S-4Q")).ranked] == ["b", "c", "a"]
    assert [c.host for c in place(hosts, groups, FleetRequest("L40S-4Q", strategy="spread")).ranked] == \
        ["a", "c", "b"]
    tied = [group(1, [2]), group(2, [2])]
    assert place(hosts[:2], tied, FleetRequest("L40S-4Q")).choice.host == "a"  # then by name


def test_pack_is_best_fit_the_host_whose_fullest_open_gpu_has_least_left() -> None:
    hosts = [host(1, "a"), host(2, "b"), host(3, "c"), host(4, "d"), host(5, "e")]
    groups = [group(1, [1], tightest_mb=8192), group(2, [5, 6], tightest_mb=4096), group(3, [2], tightest_mb=4096),
              group(4, [1]), group(5, [3], tightest_mb=40960)]
    d = place(hosts, groups, FleetRequest("L40S-4Q"))
    # least room first (b and c tie: fewer free), a room not known (d: an older release's GPU) last
    assert [c.host for c in d.ranked] == ["c", "b", "a", "e", "d"]
    assert d.choice.tightest_mb == 4096 and d.choice.why == "pack: 2 free L40S-4Q on 1 GPU(s), best fit: 4096 MB left"
    assert d.as_dict()["choice"]["tightest_mb"] == 4096
    # spread is unchanged: the most free instances
    assert place(hosts, groups, FleetRequest("L40S-4Q", strategy="spread")).choice.host == "b"
    # two boards of one host: the tightest of the GPUs the policy allows
    two = [group(1, [1], tightest_mb=1024), group(1, [1], board=H100_PCIE, name="NVIDIA H100-4Q", tightest_mb=512),
           group(2, [1], tightest_mb=2048)]
    assert place(hosts[:2], two, FleetRequest("L40S-4Q")).choice.tightest_mb == 512
    assert place(hosts[:2], two, FleetRequest("L40S-4Q", deny_models=("2331",))).choice.tightest_mb == 1024


_SPEC = importlib.util.spec_from_file_location("bench_fleet_density",
                                               Path(__file__).parent.parent / "scripts" / "bench_fleet_density.py")
assert _SPEC and _SPEC.loader
density = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(density)


@pytest.mark.parametrize("seed", range(6))
def test_the_density_benchs_row_b_ranks_hosts_as_fleet_place_does(seed: int) -> None:
    """scripts/bench_fleet_density.py replays `fleet place --policy pack` with its own host order (`host_key`): on
    random mixed-size fleets it ranks every host as the product does from the rows the hosts would publish."""
    bm, region = density.bm, density.REGION
    table = bm.slots(region)
    rnd = random.Random(seed)
    fleet = [[[] for _ in range(density.PER_HOST)] for _ in range(density.HOSTS)]
    for _ in range(rnd.randrange(20, 120)):
        size = rnd.choice(sorted(table))
        h, i = rnd.randrange(density.HOSTS), rnd.randrange(density.PER_HOST)
        p = pid.first_free(region, density._taken(fleet[h][i]), table[size], size)
        if p is not None:
            fleet[h][i].append((p, size, 0))
    hosts = [host(h + 1, f"host-{h:02d}") for h in range(density.HOSTS)]
    for size in sorted(table):
        groups = []
        for h, gpus in enumerate(fleet):
            free = [len(pid.creatable(region, table[size], size, density._taken(g))) for g in gpus]
            rooms = [(region - sum(s for _, s, _ in g)) * 1024 for f, g in zip(free, gpus, strict=True) if f]
            groups.append(OfferGroup(h + 1, *L40S, f"NVIDIA L40S-{size}Q", len(gpus), len(rooms), sum(free), 0,
                                     min(rooms, default=None)))
        ranked = [c.host for c in place(hosts, groups, FleetRequest(f"L40S-{size}Q")).ranked]
        keyed = sorted((k, h) for h, gpus in enumerate(fleet) if (k := density.host_key(gpus, size)) is not None)
        assert ranked == [f"host-{h:02d}" for _, h in keyed]
        chosen = density.vgpumgr_fleet()(fleet, size, ())
        assert (chosen is None) == (not ranked) and (chosen is None or f"host-{chosen[0]:02d}" == ranked[0])


def test_count_needs_that_many_gpus_for_nvidia_and_instances_otherwise() -> None:
    hosts = [host(1, "a"), host(2, "b")]
    d = place(hosts, [group(1, [9]), group(2, [1, 1])], FleetRequest("L40S-4Q", count=2))
    assert d.choice.host == "b"
    assert why(d)["a"] == ("no-capacity", "no capacity: 9 free on 1 GPU(s), 2 GPUs with a free L40S-4Q (one vGPU of"
                                          " a GPU per VM) needed")
    gvt = [OfferGroup(1, "UHD 630", "3e92", "i915-GVTg_V5_4", 1, 1, 3, 1)]
    d = place(hosts[:1], gvt, FleetRequest("i915-GVTg_V5_4", count=2))
    assert d.choice.host == "a"
    d = with_gpus(d, [GpuOffer(1, "0000:00:02.0", "UHD 630", "3e92", "i915-GVTg_V5_4", 3)], {1: "a"})
    assert d.choice.gpus == ("0000:00:02.0", "0000:00:02.0")


def test_with_gpus_names_the_gpus_in_the_policys_order_and_only_usable_boards() -> None:
    hosts = [host(1, "a")]
    groups = [group(1, [1, 3]), group(1, [5], board=H100_PCIE, name="NVIDIA H100-4Q")]
    rows = [GpuOffer(1, "0000:01:00.0", *L40S, "NVIDIA L40S-4Q", 1), GpuOffer(1, "0000:02:00.0", *L40S,
                                                                              "NVIDIA L40S-4Q", 3),
            GpuOffer(1, "0000:03:00.0", *H100_PCIE, "NVIDIA H100-4Q", 5)]
    d = place(hosts, groups, FleetRequest("L40S-4Q", deny_models=("2331",), count=2))
    assert with_gpus(d, rows, {1: "a"}).choice.gpus == ("0000:01:00.0", "0000:02:00.0")
    d = place(hosts, groups, FleetRequest("L40S-4Q", allow_models=("L40S",), strategy="spread"))
    assert with_gpus(d, rows, {1: "a"}).choice.gpus == ("0000:02:00.0",)
    # pack: the GPU with the least room first (best fit), then the fewest free; a room not known last
    rooms = [rows[0]._replace(room_mb=20480), rows[1]._replace(room_mb=4096),
             GpuOffer(1, "0000:04:00.0", *L40S, "NVIDIA L40S-4Q", 1)]
    d = place(hosts, groups, FleetRequest("L40S-4Q", allow_models=("L40S",), count=2))
    assert with_gpus(d, rooms, {1: "a"}).choice.gpus == ("0000:02:00.0", "0000:01:00.0")


def test_a_migrating_vm_needs_its_board_and_its_vgpu_manager() -> None:
    vgpu = compat.MigratingVgpu("NVIDIA L40S-4Q", device_id="26b9", gpu_name="NVIDIA L40S", host_driver="580.95.02")
    moving = Migrating("web1", "src", (vgpu,))
    hosts = [host(1, "src"), host(2, "old", driver="570.124.03"), host(3, "h100"), host(4, "good")]
    groups = [group(1, [3]), group(2, [3]), group(3, [3], board=H100_PCIE), group(4, [3])]
    d = place(hosts, groups, FleetRequest("L40S-4Q", vm="web1"), moving)
    assert d.choice.host == "good" and "same board and vGPU manager" in d.choice.why
    w = why(d)
    assert w["src"] == ("source", "VM web1 runs here now")
    assert w["old"][0] == "incompatible" and "vGPU manager differs: 570.124.03 on old, 580.95.02 at the source" in \
        w["old"][1]
    assert w["h100"][0] == "incompatible" and "another board" in w["h100"][1]
    assert d.as_dict()["migrating"] == {"vm": "web1", "from": "src"}


@pytest.mark.parametrize(("kw", "message"), [
    ({"type": ""}, "is not a vGPU type"), ({"type": "L40S-4Q", "count": 0}, "count 0 is out of range"),
    ({"type": "L40S-4Q", "count": 17}, "out of range"), ({"type": "L40S-4Q", "strategy": "random"}, "unknown"),
    ({"type": "L40S-4Q", "vm": "../x"}, "not a usable VM name"),
    ({"type": "L40S-4Q", "deny_models": (" ",)}, "not a model name")])
def test_bad_requests_are_refused_with_what_to_do(kw: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        FleetRequest(**kw)


def test_no_host_at_all_is_a_decision_without_a_choice() -> None:
    d = place([], [], FleetRequest("L40S-4Q"))
    assert d.choice is None and d.summary() == "no host has published anything"
    assert d.as_dict()["ranked"] == [] and d.as_dict()["request"]["type"] == "L40S-4Q"
    assert d.as_dict()["compact"] is None  # the key is always there: the hint below, when a GPU is fragmented


def test_the_fragmented_mixed_size_gpu_needing_the_fewest_moves_is_named() -> None:
    from vgpumgr.fleet.fragmented import GpuLoad, hint, suggest

    gpu, gpu2 = "0000:3d:00.0", "0000:3e:00.0"
    names = {1: "a", 2: "b", 3: "c", 4: "d", 5: "e"}

    def load(h: int, g: str = gpu, used_gb: int = 0, free: int = 0) -> GpuLoad:  # an L40S (48 GB), wanted: 24Q
        return GpuLoad(h, g, 48 * 1024, used_gb * 1024, free, 2, "NVIDIA L40S-24Q", 24 * 1024)

    def two_q(*placed: tuple[int, str | None]) -> list[tuple[int | None, int, str | None]]:
        return [(at, 2048, vm) for at, vm in placed]

    held = {
        (1, gpu): two_q((0, "a1"), (4, "a2"), (24, "a3"), (28, "a4")),  # each 24Q start: two moves
        (2, gpu): [(0, 4096, "b1"), *two_q((26, "b2"))],  # start 24: one move of 2 GB (start 0: one of 4 GB)
        (2, gpu2): two_q((0, "b3")),  # start 24 is free: its 24Q is kept out by something else (no VF)
        (3, gpu): [(None, 2048, "c1")],  # equal-size mode (no placement ID recorded): not judged
        (4, gpu): two_q((0, None), (24, None)),  # vGPUs without a VM: no migration frees a start
        (5, gpu): [(0, 24576, "e1"), (32, 16384, "e2")],  # 8 GB free: full, not fragmented
    }
    loads = [load(1, used_gb=8), load(2, used_gb=6), load(2, gpu2, used_gb=2), load(3, used_gb=2),
             load(4, used_gb=4), load(5, used_gb=40), load(6, used_gb=2, free=1)]
    c = suggest("NVIDIA L40S-24Q", loads, held, names)
    assert c == {"host": "b", "gpu": gpu, "type": "L40S-24Q", "moves": 1, "start": 24, "vms": ["b2"], "free_gb": 42}
    assert hint(c) == (f"{gpu} on b is fragmented: `vgpumgr gpu compact {gpu} --for L40S-24Q` (on b) frees a start "
                       "by moving 1 VM")
    c = suggest("L40S-24Q", [load(1, used_gb=8), load(3, used_gb=2)], held, names)
    assert (c["host"], c["moves"], c["start"], c["vms"]) == ("a", 2, 0, ["a1", "a2"])
    assert "by moving 2 VMs" in hint(c)
    assert suggest("L40S-24Q", loads[2:], held, names) is None


def test_a_placement_id_the_driver_gave_in_equal_size_mode_is_not_read_as_a_mixed_size_layout() -> None:
    from vgpumgr.fleet.fragmented import chosen_start

    assert chosen_start({"placement_id": 24, "placement_interface": "placement_id"}) == 24
    assert chosen_start({"placement_id": 0, "placement_interface": "placement_id", "placement_by": "driver"}) is None
    assert chosen_start({"gpu": "0000:3d:00.0"}) is None
