"""NVIDIA mixed-size vGPU mode end to end on the simulator: `gpu mode`, placement by placement ID with the
fragmentation named, `--placement-id`, and `restore` after a reboot giving the mode and every placement back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from simhost import run
from test_cli import golden

from vgpumgr.sim import profiles

L40S = "0000:3d:00.0"


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setenv("VGPUMGR_LICENCE_MODE", "off")
    root = profiles.create(tmp_path / "sim", "l40s-vfio", vfs=8)
    args = ["--sysfs-root", str(root), "--state-dir", str(tmp_path / "state"), "--connect", "test:///default"]

    def call(*argv: str) -> tuple[int, str, str]:
        return run(*args, *argv)

    call.root = root  # type: ignore[attr-defined]
    return call


@pytest.fixture(autouse=True)
def _forget_test_domains() -> Iterator[None]:
    """libvirt's test:///default keeps its domains while any connection of this process is open: the next test
    starts without this one's VMs."""
    yield
    import libvirt

    conn = libvirt.open("test:///default")
    try:
        for d in conn.listAllDomains():
            if d.name() != "test":
                if d.isActive():
                    d.destroy()
                d.undefine()
    finally:
        conn.close()


def placement_files(root: Path) -> dict[str, str]:
    out = {}
    for d in sorted((root / "sys/bus/pci/devices").iterdir()):
        f = d / "nvidia/placement_id"
        if f.exists() and f.read_text().strip() != "Not Applicable":
            out[d.name] = f.read_text().strip()
    return out


def records(cli) -> dict[str, tuple[str, int | None, str]]:  # noqa: ANN001
    rc, out, err = cli("placements", "--json")
    assert rc == 0, err
    return {a["vm"]: (a["type_name"].split()[-1], a.get("placement_id"), a["pci_address"]) for a in json.loads(out)}


def test_acceptance_mixed_sizes_on_one_l40s_then_reboot_and_restore(cli) -> None:  # noqa: ANN001
    rc, out, err = cli("vm", "create", "vm0", "--vgpu", "L40S-24Q")
    rc, out, err = cli("vm", "create", "vm0b", "--vgpu", "L40S-12Q")
    assert rc == 4 and "equal-size mode" in err  # the default mode refuses a second size
    assert cli("vm", "delete", "vm0")[0] == 0
    rc, out, err = cli("gpu", "mode", L40S, "--mixed")
    assert rc == 0 and "mixed-size vGPU mode (was equal)" in out, err
    for vm, t in (("vm1", "L40S-24Q"), ("vm2", "L40S-12Q"), ("vm3", "L40S-4Q"), ("vm4", "L40S-2Q")):
        rc, out, err = cli("vm", "create", vm, "--vgpu", t)
        assert rc == 0, err
    placed = records(cli)
    assert {vm: p[:2] for vm, p in placed.items()} == {
        "vm1": ("L40S-24Q", 0), "vm2": ("L40S-12Q", 24), "vm3": ("L40S-4Q", 36), "vm4": ("L40S-2Q", 40)}
    # the driver holds what the records say
    assert placement_files(cli.root) == {p[2]: str(p[1]) for p in placed.values()}
    # a pinned placement, then the next 4Q is refused with the fragmentation named
    assert cli("vm", "create", "vm5", "--vgpu", "L40S-2Q", "--placement-id", "46")[0] == 0
    rc, out, err = cli("vm", "create", "vm6", "--vgpu", "L40S-4Q")
    assert rc == 4
    assert ("4 GB free on 0000:3d:00.0 but no 4Q start free (0: L40S-24Q of vm1, 8: L40S-24Q of vm1, "
            "12: L40S-24Q of vm1, 20: L40S-24Q of vm1, 24: L40S-12Q of vm2, 32: L40S-12Q of vm2, "
            "36: L40S-4Q of vm3, 44: L40S-2Q of vm5)") in err
    before = placement_files(cli.root)
    assert before[records(cli)["vm5"][2]] == "46"

    rc, out, err = cli("sim", "reboot")
    assert rc == 0 and "mixed-size vGPU mode is off again" in out
    assert placement_files(cli.root) == {}
    rc, out, err = cli("reconcile", "--json")  # the mode the driver forgot is drift until restore sets it again
    assert rc == 10 and json.loads(out)["vgpu_mode_drift"] == [
        {"gpu": L40S, "recorded": "mixed", "actual": "equal", "why": json.loads(out)["vgpu_mode_drift"][0]["why"]}]
    # --fix makes no vGPU there (one would keep the mode from being set again) and still says the mode is drift
    rc, out, err = cli("reconcile", "--fix")
    assert rc != 0 and "lost its recorded vGPU mode" in out + err and "`vgpumgr restore` sets the mode" in out + err
    assert placement_files(cli.root) == {}
    rc, _, err = cli("vm", "start", "vm1")  # a start would make its vGPU before the mode: refused, saying why
    assert rc == 4 and "lost its recorded vGPU mode" in err and "`vgpumgr restore`" in err, err
    rc, out, err = cli("restore")
    assert rc == 0, out + err
    lines = out.splitlines()
    order = [next(i for i, line in enumerate(lines) if step in line) for step in ("vfs ", "vgpu-mode", "vf-type")]
    assert order == sorted(order)  # VFs, then the mode, then the VF types (then placements)
    assert "give 0000:3d:01.0 placement ID 46 (records)" in out
    assert placement_files(cli.root) == before
    rc, out, err = cli("restore")
    assert rc == 0 and "done" not in out  # nothing left to do
    assert json.loads(cli("reconcile", "--json")[1])["vgpu_mode_drift"] == []
    # a vGPU gone by itself comes back through reconcile --fix at its recorded placement (first free would be 42)
    from vgpumgr.backends import nvidia_vf
    from vgpumgr.hostfs.root import Host

    vf5 = records(cli)["vm5"][2]
    nvidia_vf.clear_type(Host(cli.root), vf5, retries=1)
    assert vf5 not in placement_files(cli.root)
    rc, out, err = cli("reconcile", "--fix")
    assert rc == 0 and vf5 in out, out + err
    assert placement_files(cli.root) == before
    nvidia_vf.clear_type(Host(cli.root), vf5, retries=1)  # and so through the VM's start
    rc, out, err = cli("vm", "start", "vm5")
    assert rc == 0, err
    assert placement_files(cli.root) == before


def test_explain_names_the_fragmentation_golden(cli) -> None:  # noqa: ANN001
    assert cli("gpu", "mode", L40S, "--mixed")[0] == 0
    for vm, t, at in (("vm7", "L40S-2Q", "0"), ("vm9", "L40S-2Q", "24"), ("vm8", "L40S-16Q", "32"),
                      ("vm6", "L40S-4Q", "12")):
        rc, _, err = cli("vm", "create", vm, "--vgpu", t, "--placement-id", at)
        assert rc == 0, err
    rc, out, err = cli("place", "--type", "L40S-24Q", "--explain")
    assert rc == 4
    assert "24 GB free on 0000:3d:00.0 but no 24Q start free (0: L40S-2Q of vm7, 24: L40S-2Q of vm9)" in out
    golden("mixed-size-explain.txt", out)


def test_gpu_mode_refusals_are_reasons_and_audited(cli) -> None:  # noqa: ANN001
    assert cli("vm", "create", "a", "--vgpu", "L40S-2Q")[0] == 0
    rc, out, err = cli("gpu", "mode", L40S, "--mixed")
    assert rc == 4 and "holds 1 vGPU(s) (0000:3d:00.4)" in err and "release its vGPUs first" in err
    rc, out, err = cli("gpu", "mode", "0000:3e:00.0", "--mixed")
    assert rc == 3
    rc, out, err = cli("gpu", "mode", "bogus", "--mixed")
    assert rc == 2
    assert cli("vm", "delete", "a")[0] == 0
    assert cli("sriov", "set", L40S, "0", "--allow-nvidia")[0] == 0  # without VFs, no HETEROGENEOUS_TIMESLICE_SIZES
    rc, out, err = cli("gpu", "mode", L40S, "--mixed")
    assert rc == 4 and "HETEROGENEOUS_TIMESLICE_SIZES" in err and "sriov-manage -e" in err
    rc, out, err = cli("audit", "--json")
    events = [e for e in json.loads(out) if e["action"] == "gpu.mode"]
    # the refusals on the GPU (a vGPU held, no capability) are audited; an unknown address is only bad input
    assert [e["outcome"] for e in events] == ["failed", "failed"]
    assert any("HETEROGENEOUS_TIMESLICE_SIZES" in (e["error"] or "") for e in events)


def test_pinned_placement_refusals(cli) -> None:  # noqa: ANN001
    assert cli("gpu", "mode", L40S, "--mixed")[0] == 0
    rc, _, err = cli("vm", "create", "a", "--vgpu", "L40S-24Q", "--placement-id", "12")
    assert rc == 4 and "placement ID 12 is not a start of L40S-24Q (its IDs: 0, 24)" in err
    assert cli("vm", "create", "a", "--vgpu", "L40S-24Q", "--placement-id", "24")[0] == 0
    rc, _, err = cli("vm", "create", "b", "--vgpu", "L40S-12Q", "--placement-id", "36")
    assert rc == 4 and "placement ID 36 of L40S-12Q is taken (36: L40S-24Q of a)" in err
    rc, _, err = cli("vm", "create", "b", "--vgpu", "L40S-12Q", "--placement-id", "300")
    assert rc == 2 and "not a placement ID" in err


def test_capacity_and_slot_map_count_creatable_placements(cli) -> None:  # noqa: ANN001
    assert cli("gpu", "mode", L40S, "--mixed")[0] == 0
    for vm, at in (("vm7", "0"), ("vm9", "24")):
        assert cli("vm", "create", vm, "--vgpu", "L40S-2Q", "--placement-id", at)[0] == 0
    rc, out, err = cli("gpu", "slots", L40S, "--json")
    assert rc == 0, err
    m = json.loads(out)
    assert m["mode"] == "mixed" and m["used_gb"] == 4
    assert [(v["placement_id"], v["vgpu"]) for v in m["vgpus"]] == [(0, "L40S-2Q of vm7"), (24, "L40S-2Q of vm9")]
    by_name = {t["name"].split()[-1]: t for t in m["types"]}
    assert by_name["L40S-24Q"]["creatable"] == [] and by_name["L40S-16Q"]["creatable"] == [32]
    assert by_name["L40S-12Q"]["creatable"] == [12, 36]
    rc, out, err = cli("gpu", "slots", L40S)
    assert "map  AA" in out and "L40S-24Q" in out
    # the fleet's capacity rows: 44 GB free, yet no 24Q and one 16Q
    from vgpumgr.config import Config
    from vgpumgr.fleet.capacity import host_capacity
    from vgpumgr.ops.allocate import live_records
    from vgpumgr.service import Service

    svc = Service(Config.resolve(sysfs_root=str(cli.root), state_dir=str(cli.root.parent / "state"),
                                 connect="test:///default"), licence_mode="off")
    with svc.reads() as s:
        rows = host_capacity(svc.snapshot().placer, live_records(svc, s), only=[L40S])
    free = {t.short: t.free for t in rows[0].types}
    assert free["L40S-24Q"] == 0 and free["L40S-16Q"] == 1 and free["L40S-12Q"] == 2
    assert free["L40S-2Q"] == 6  # 14 creatable placements, but 6 free VFs


def test_rest_sets_the_mode_and_shows_the_slots(tmp_path: Path) -> None:
    from test_api import make_env, problem

    env, client = make_env(tmp_path, "l40s-vfio")
    with client:
        url = f"/v1/gpus/{L40S}/vgpu-mode"
        assert client.put(url, json={"mode": "mixed"}, headers=env.as_("operator")).status_code == 403
        problem(client.put(url, json={"mode": "odd"}, headers=env.as_("admin")), 422)
        problem(client.put("/v1/gpus/zz/vgpu-mode", json={"mode": "mixed"}, headers=env.as_("admin")), 422)
        r = client.put(url, json={"mode": "mixed"}, headers=env.as_("admin"))
        assert r.status_code == 200 and r.json() == {"gpu": L40S, "mode": "mixed", "before": "equal", "changed": True}
        slots = client.get(f"/v1/gpus/{L40S}/slots", headers=env.as_("auditor")).json()
        assert slots["mode"] == "mixed" and slots["vgpus"] == [] and slots["region_gb"] == 48
        env.service.allocate("L40S-2Q", vm="a")
        body = problem(client.put(url, json={"mode": "equal"}, headers=env.as_("admin")), 409)
        assert "release its vGPUs first" in json.dumps(body)


def test_compact_plans_the_fewest_moves(cli) -> None:  # noqa: ANN001
    assert cli("gpu", "mode", L40S, "--mixed")[0] == 0
    for vm, t, at in (("vm7", "L40S-2Q", "0"), ("vm9", "L40S-2Q", "24"), ("vm8", "L40S-2Q", "28")):
        assert cli("vm", "create", vm, "--vgpu", t, "--placement-id", at)[0] == 0
    rc, out, err = cli("gpu", "compact", L40S, "--for", "L40S-24Q", "--json")
    p = json.loads(out)
    # start 0 needs one move (vm7), start 24 two (vm9, vm8): the plan takes 0; no fleet, so no destination
    assert p["start"] == 0 and [mv["vm"] for mv in p["moves"]] == ["vm7"]
    assert rc == 4 and not p["feasible"] and "no destination for vm7" in p["why"]
    rc, out, _ = cli("gpu", "compact", L40S, "--for", "L40S-12Q")
    assert rc == 0 and "placement ID 12 is free already" in out


def _cli_for(tmp_path: Path, root: Path):  # noqa: ANN202
    args = ["--sysfs-root", str(root), "--state-dir", str(tmp_path / "state"), "--connect", "test:///default"]
    return lambda *argv: run(*args, *argv)


def test_mdev_backend_a40_mixed_sizes_and_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpumgr.sim.nvml import create_state
    from vgpumgr.sim.paths import nvml_state_path

    monkeypatch.setenv("VGPUMGR_LICENCE_MODE", "off")
    root = profiles.create(tmp_path / "sim", "a40-sriov", vfs=4)
    create_state(nvml_state_path(root), [("a40", "0000:41:00.0")])
    cli = _cli_for(tmp_path, root)
    assert cli("gpu", "mode", "0000:41:00.0", "--mixed")[0] == 0
    for vm, t in (("a", "A40-16Q"), ("b", "A40-8Q"), ("c", "A40-1Q")):
        rc, _, err = cli("vm", "create", vm, "--vgpu", t)
        assert rc == 0, err
    placed = {a["vm"]: (a["uuid"], a["placement_id"]) for a in json.loads(cli("placements", "--json")[1])}
    held = {u: (root / "sys/bus/mdev/devices" / u / "nvidia/placement_id").read_text().strip()
            for u, _ in placed.values()}
    assert held == {u: str(p) for u, p in placed.values()}
    ids = {vm: p for vm, (_, p) in placed.items()}
    assert ids["a"] in (0, 32) and ids["b"] in (0, 16, 24, 40)
    assert cli("sim", "reboot")[0] == 0
    rc, out, err = cli("restore")
    assert rc == 0 and "set mixed-size vGPU mode" in out, out + err
    assert {u: (root / "sys/bus/mdev/devices" / u / "nvidia/placement_id").read_text().strip()
            for u, _ in placed.values()} == held


def test_r550_asks_through_vgpu_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json as _json

    from vgpumgr.hostfs.root import SIM_MARKER

    monkeypatch.setenv("VGPUMGR_LICENCE_MODE", "off")
    root = profiles.create(tmp_path / "sim", "l40s-vfio", vfs=0)
    state = _json.loads((root / SIM_MARKER).read_text())
    state["gpus"][L40S]["driver_branch"] = 550  # vGPU 17: no placement_id file
    (root / SIM_MARKER).write_text(_json.dumps(state))
    cli = _cli_for(tmp_path, root)
    assert cli("sriov", "set", L40S, "4", "--allow-nvidia")[0] == 0
    vf = root / "sys/bus/pci/devices/0000:3d:00.4"
    assert not (vf / "nvidia/placement_id").exists()
    assert cli("gpu", "mode", L40S, "--mixed")[0] == 0
    assert cli("vm", "create", "a", "--vgpu", "L40S-2Q", "--placement-id", "22")[0] == 0
    assert (vf / "nvidia/vgpu_params").read_text().strip() == "vgpu-placement-id=22"
    rc, out, _ = cli("place", "--type", "L40S-24Q", "--explain")  # the record says where it is: 24Q only at 24
    assert "placement 24" in out
    assert cli("sim", "reboot")[0] == 0
    rc, out, err = cli("restore")
    assert rc == 0 and "give 0000:3d:00.4 placement ID 22" in out, out + err
    assert (vf / "nvidia/vgpu_params").read_text().strip() == "vgpu-placement-id=22"


def test_real_h100_without_a_vgpu_manager_is_unknown_not_an_error() -> None:
    """Replays what NVML answered on the lent H100 (driver 580.159.04, passthrough, MIG off;
    tests/fixtures/nvml/h100-mixed.json, from scripts/nvml_mixed_check.py): every mixed-size call NotSupported."""
    import pynvml

    from vgpumgr.errors import Conflict
    from vgpumgr.nvidia import mixed as nvml_mixed
    from vgpumgr.nvidia.nvml import nvml_error

    rec = json.loads((Path(__file__).parent / "fixtures/nvml/h100-mixed.json").read_text())
    [(_bus, gpu)] = rec["gpus"].items()
    raw = gpu["raw"]

    class Replay:
        NVMLError = pynvml.NVMLError

        def _answer(self, key: str) -> object:
            a = raw[key]
            if "error" in a:
                raise pynvml.NVMLError(a["error"])
            return a["value"]

        def nvmlDeviceGetVgpuCapabilities(self, _h: object, cap: int) -> object:  # noqa: N802
            return self._answer(f"nvmlDeviceGetVgpuCapabilities({cap})")

        def nvmlDeviceGetVgpuHeterogeneousMode(self, _h: object) -> object:  # noqa: N802
            return self._answer("nvmlDeviceGetVgpuHeterogeneousMode")

        def nvmlDeviceSetVgpuHeterogeneousMode(self, _h: object, _mode: int) -> object:  # noqa: N802
            raise pynvml.NVMLError(raw["nvmlDeviceGetVgpuHeterogeneousMode"]["error"])

        def nvmlVgpuInstanceGetPlacementId(self, _i: object) -> object:  # noqa: N802
            return self._answer("nvmlVgpuInstanceGetPlacementId(1)")

    n = Replay()
    assert {k for k, a in raw.items() if a.get("error") == pynvml.NVML_ERROR_NOT_SUPPORTED} >= {
        "nvmlDeviceGetVgpuCapabilities(2)", "nvmlDeviceGetVgpuCapabilities(9)", "nvmlDeviceGetVgpuHeterogeneousMode",
        "nvmlDeviceGetVgpuTypeSupportedPlacements(1131, mode=1, version=2)"}
    got = nvml_mixed.read(n, object(), [1131])
    assert got == {"capable": None, "mode": None, "types": {}, "homogeneous_capable": None, "placements": None}
    assert got == gpu["vgpumgr"]  # what vgpumgr read on the H100 itself
    assert nvml_mixed.instance_placement(n, 1) is None
    try:
        nvml_mixed.set_mode(n, object(), True)
    except pynvml.NVMLError as exc:
        err = nvml_error(exc, "setting the vGPU mode of 0000:00:06.0")
    assert isinstance(err, Conflict) and "does not support it" in (err.hint or "")


def test_a_pinned_placement_needs_mixed_size_mode(cli) -> None:  # noqa: ANN001
    rc, _, err = cli("vm", "create", "a", "--vgpu", "L40S-2Q", "--placement-id", "4")
    assert rc == 4 and "placement ID 4 asked for, but 0000:3d:00.0 is not in mixed-size mode" in err


def test_discovery_reads_types_and_running_placements_in_mixed_mode(cli) -> None:  # noqa: ANN001
    from vgpumgr.sim import guests

    assert cli("gpu", "mode", L40S, "--mixed")[0] == 0
    assert cli("vm", "create", "a", "--vgpu", "L40S-12Q", "--placement-id", "36")[0] == 0
    guests.start(cli.root, "0000:3d:00.4", vm_uuid="5a0a9d57-3f57-4c55-9a3f-8e1f1d3f4b11", vm_name="a")
    rc, out, _ = cli("gpus", "--json")
    facts = next(g for g in json.loads(out) if g["address"] == L40S)["nvml"]["vgpu"]["mixed_size"]
    assert facts["capable"] is True and facts["mode"] == "mixed"
    assert facts["types"]["1155"] == {"placement_size": 24, "supported": [0, 24], "creatable": [0]}
    assert facts["running"] == [{"mdev_uuid": None, "type_id": 1153, "placement_id": 36}]


# -- equal-size mode: homogeneous placement IDs (Ada and newer, R570+) ------------------------------

def _facts(cli) -> dict:  # noqa: ANN001
    rc, out, err = cli("gpus", "--json")
    assert rc == 0, err
    return next(g for g in json.loads(out) if g["address"] == L40S)["nvml"]["vgpu"]["mixed_size"]


def test_equal_mode_on_ada_r570_shows_homogeneous_placements(cli) -> None:  # noqa: ANN001
    f = _facts(cli)
    assert (f["mode"], f["homogeneous_capable"], f["placements"]) == ("equal", True, "homogeneous")
    # j * size for j < max_instance, not the mixed-size lists (16Q: 0, 32 there; 12Q is the same in both)
    assert f["types"]["1153"] == {"placement_size": 12, "supported": [0, 12, 24, 36], "creatable": [0, 12, 24, 36]}
    assert f["types"]["1154"]["supported"] == [0, 16, 32] and f["types"]["1152"]["supported"] == [0, 8, 16, 24, 32, 40]
    for vm in ("a", "b"):
        rc, _, err = cli("vm", "create", vm, "--vgpu", "L40S-12Q")
        assert rc == 0, err
    # the driver reserved the first creatable ID of each at creation; the records say so, as the driver's
    placed = {a["vm"]: a for a in json.loads(cli("placements", "--json")[1])}
    assert {vm: (a["placement_id"], a["placement_by"]) for vm, a in placed.items()} == {
        "a": (0, "driver"), "b": (12, "driver")}
    assert placement_files(cli.root) == {placed["a"]["pci_address"]: "0", placed["b"]["pci_address"]: "12"}
    f = _facts(cli)  # creatable shrink; every other size has none while a 12 GB vGPU exists
    assert f["types"]["1153"]["creatable"] == [24, 36] and f["types"]["1163"]["creatable"] == [24, 36]
    assert f["types"]["1155"]["creatable"] == [] and f["types"]["1150"]["creatable"] == []
    assert f["running"] == []  # no VM started: NVML has no active vGPU to ask
    rc, out, err = cli("gpu", "slots", L40S, "--json")
    assert rc == 0, err
    m = json.loads(out)
    assert (m["mode"], m["placements"], m["used_gb"]) == ("equal", "homogeneous", 24)
    assert [(v["placement_id"], v["size"], v["vgpu"]) for v in m["vgpus"]] == [
        (0, 12, "L40S-12Q of a"), (12, 12, "L40S-12Q of b")]
    by_name = {t["name"].split()[-1]: t for t in m["types"]}
    assert by_name["L40S-12Q"]["supported"] == [0, 12, 24, 36] and by_name["L40S-12Q"]["creatable"] == [24, 36]
    assert by_name["L40S-16Q"]["supported"] == [0, 16, 32] and by_name["L40S-16Q"]["creatable"] == []
    rc, out, _ = cli("gpu", "slots", L40S)
    assert "equal-size vGPU mode (homogeneous placement IDs), 24 of 48 GB placed" in out and "map  AAAAAAAAAAAAB" in out
    assert cli("vm", "delete", "a")[0] == 0
    assert _facts(cli)["types"]["1153"]["creatable"] == [0, 24, 36]
    rc, out, err = cli("vgpu", "--type", "L40S-12Q", "--vm", "c", "--json")  # the answer names it at once
    assert rc == 0 and (json.loads(out)["placement_id"], json.loads(out)["placement_by"]) == (0, "driver"), err
    assert {a["vm"]: a["placement_id"] for a in json.loads(cli("placements", "--json")[1])} == {"b": 12, "c": 0}


def test_restore_reads_the_driver_given_ids_again_without_asking(cli) -> None:  # noqa: ANN001
    for vm in ("a", "b"):
        assert cli("vm", "create", vm, "--vgpu", "L40S-12Q")[0] == 0
    assert cli("vm", "delete", "a")[0] == 0  # b holds 12, 0 is free
    assert cli("sim", "reboot")[0] == 0
    rc, out, err = cli("restore")
    assert rc == 0, out + err
    assert "placement ID" not in out  # an equal-size ID is the driver's choice: never written
    [b] = json.loads(cli("placements", "--json")[1])
    held = placement_files(cli.root)
    assert held == {b["pci_address"]: "0"}  # made again alone, it got the first creatable ID
    assert (b["placement_id"], b["placement_by"]) == (0, "driver")  # and its record follows the driver


def _r550(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    from vgpumgr.hostfs.root import SIM_MARKER

    monkeypatch.setenv("VGPUMGR_LICENCE_MODE", "off")
    root = profiles.create(tmp_path / "sim", "l40s-vfio", vfs=4)
    state = json.loads((root / SIM_MARKER).read_text())
    state["gpus"][L40S]["driver_branch"] = 550
    (root / SIM_MARKER).write_text(json.dumps(state))
    return root, _cli_for(tmp_path, root)


def test_r550_and_ampere_have_no_equal_mode_placements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpumgr.sim.nvml import create_state
    from vgpumgr.sim.paths import nvml_state_path

    root, cli = _r550(tmp_path / "r550", monkeypatch)
    f = _facts(cli)
    assert (f["mode"], f["homogeneous_capable"], f["placements"], f["types"]) == ("equal", False, None, {})
    assert cli("vm", "create", "a", "--vgpu", "L40S-12Q")[0] == 0
    [a] = json.loads(cli("placements", "--json")[1])
    assert "placement_id" not in a and "placement_by" not in a
    rc, out, _ = cli("gpu", "slots", L40S, "--json")
    m = json.loads(out)
    assert rc == 0 and (m["placements"], m["vgpus"], m["types"]) == (None, [], [])
    assert "no placement IDs" in cli("gpu", "slots", L40S)[1]

    a40 = "0000:41:00.0"  # Ampere: HETEROGENEOUS_TIMESLICE_SIZES, but no HOMOGENEOUS_PLACEMENTS
    root = profiles.create(tmp_path / "a40/sim", "a40-sriov", vfs=4)
    create_state(nvml_state_path(root), [("a40", a40)])
    cli = _cli_for(tmp_path / "a40", root)
    rc, out, _ = cli("gpus", "--json")
    f = next(g for g in json.loads(out) if g["address"] == a40)["nvml"]["vgpu"]["mixed_size"]
    assert (f["capable"], f["mode"], f["homogeneous_capable"], f["placements"], f["types"]) == (
        True, "equal", False, None, {})


def _l40s_nvml(tmp_path: Path, cls: type):  # noqa: ANN202
    from vgpumgr.nvidia.nvml import NvmlLayer
    from vgpumgr.sim.paths import nvml_state_path

    root = profiles.create(tmp_path / "sim", "l40s-vfio", vfs=4)
    n = cls(nvml_state_path(root))
    layer = NvmlLayer(n)
    assert L40S in layer.gpus()
    return n, layer._handle(L40S)


def test_an_old_nvidia_ml_py_or_a_refusing_driver_gives_unknown_not_the_mixed_list(tmp_path: Path) -> None:
    import pynvml

    from vgpumgr.nvidia import mixed as nvml_mixed
    from vgpumgr.sim.nvml import SimNvml

    class Pynvml12550(SimNvml):
        """nvidia-ml-py 12.550-12.560: the placement calls take (handle, type id) only; v1 = heterogeneous list."""

        def nvmlDeviceGetVgpuTypeSupportedPlacements(self, handle, type_id):  # noqa: ANN001, ANN202, N802
            return super().nvmlDeviceGetVgpuTypeSupportedPlacements(handle, type_id)

        def nvmlDeviceGetVgpuTypeCreatablePlacements(self, handle, type_id):  # noqa: ANN001, ANN202, N802
            return super().nvmlDeviceGetVgpuTypeCreatablePlacements(handle, type_id)

    n, h = _l40s_nvml(tmp_path / "new", SimNvml)
    assert nvml_mixed.read(n, h, [1154])["types"] == {
        "1154": {"placement_size": 16, "supported": [0, 16, 32], "creatable": [0, 16, 32]}}
    n, h = _l40s_nvml(tmp_path / "old", Pynvml12550)
    with pytest.raises(TypeError):  # the library really lacks the v2 call
        n.nvmlDeviceGetVgpuTypeSupportedPlacements(h, 1154, mode=1, version=2)
    assert _ids(n.nvmlDeviceGetVgpuTypeSupportedPlacements(h, 1154)) == [0, 32]  # v1: the mixed-size list
    f = nvml_mixed.read(n, h, [1154])
    assert f["placements"] == "homogeneous"
    # supported unknown, never the v1 (heterogeneous) list; creatable is the driver's own answer in this mode
    assert f["types"] == {"1154": {"placement_size": 16, "supported": None, "creatable": [0, 16, 32]}}

    class RefusesHomogeneous(SimNvml):
        def nvmlDeviceGetVgpuTypeSupportedPlacements(self, handle, type_id, mode=0, version=1):  # noqa: ANN001, ANN202, N802
            if mode == 1:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return super().nvmlDeviceGetVgpuTypeSupportedPlacements(handle, type_id, mode, version)

        def nvmlDeviceGetVgpuTypeCreatablePlacements(self, handle, type_id, version=1):  # noqa: ANN001, ANN202, N802
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    class WrongPolarity(SimNvml):  # answers the heterogeneous list whatever mode is asked for
        def nvmlDeviceGetVgpuTypeSupportedPlacements(self, handle, type_id, mode=0, version=1):  # noqa: ANN001, ANN202, N802
            return super().nvmlDeviceGetVgpuTypeSupportedPlacements(handle, type_id, 0, version)

    n, h = _l40s_nvml(tmp_path / "refuses", RefusesHomogeneous)
    assert nvml_mixed.read(n, h, [1154])["types"] == {}  # neither list: the type is left out, nothing guessed
    n, h = _l40s_nvml(tmp_path / "polarity", WrongPolarity)
    assert nvml_mixed.read(n, h, [1154])["types"]["1154"]["supported"] is None


def _ids(lst) -> list[int]:  # noqa: ANN001
    return [lst.placementIds[i] for i in range(lst.count)]


def test_a_record_that_cannot_be_written_after_the_vgpu_is_made_takes_the_vgpu_with_it(
        cli, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from vgpumgr.errors import Unavailable
    from vgpumgr.ops import placement_apply

    def fails(*_a: object, **_k: object) -> None:
        raise Unavailable("the database went away")

    monkeypatch.setattr(placement_apply, "record", fails)  # equal size on Ada/R570+: the driver's ID is recorded
    rc, _, err = cli("vm", "create", "a", "--vgpu", "L40S-12Q")
    assert rc == 8 and "the database went away" in err, err
    assert placement_files(cli.root) == {}  # no VF keeps a type (and so a placement) behind
    typed = [d.name for d in (cli.root / "sys/bus/pci/devices").iterdir()
             if (d / "nvidia/current_vgpu_type").exists() and (d / "nvidia/current_vgpu_type").read_text().strip()
             not in ("", "0")]
    assert typed == [] and json.loads(cli("placements", "--json")[1]) == []
