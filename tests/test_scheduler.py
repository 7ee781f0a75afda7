"""The vGPU scheduler as recorded, restored and measured state (issue 32), on the simulator end to end: a set on a
GPU with running guests is deferred and says so, applied once the GPU is empty, lost by `sim reboot` and brought
back by `restore`; three busy guests each get ~1/3 (top, /metrics, `scheduler check`), a starved one makes
`check` exit 10; fixed share in mixed-size mode is refused with the reason; `persist` writes NVIDIA's documented
RmPVMRL values; the old NVML calls, the `_v2` ones and a driver without `_v2` (the real H100's recording); with MIG
on, the scheduler of each GPU instance on a simulated Blackwell GB20x, and why there is none before GB20x."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fastapi.testclient import TestClient
from simhost import run
from sqlalchemy import text

from api.app import create_app
from vgpumgr.config import Config
from vgpumgr.nvidia import gi_scheduler as nvml_gi_scheduler
from vgpumgr.nvidia import rmpvmrl
from vgpumgr.nvidia import scheduler as nvml_scheduler
from vgpumgr.nvidia.nvml import NvmlLayer
from vgpumgr.ops import scheduler as scheduler_ops
from vgpumgr.service import Service
from vgpumgr.sim import guests, profiles
from vgpumgr.sim.nvml import SimNvml, create_state, write_state
from vgpumgr.sim.paths import nvml_state_path
from vgpumgr.telemetry.sched_share import ShareTracker, shortfalls

T4, L40S, A100 = "0000:3b:00.0", "0000:3d:00.0", "0000:65:00.0"
FIXTURE = Path(__file__).parent / "fixtures/nvml/h100-scheduler.json"


@pytest.fixture
def sim(tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    root = profiles.create(tmp_path / "sim", "mixed", vfs=8)
    return root, ("--sysfs-root", str(root), "--state-dir", str(tmp_path / "state"), "--connect", "test:///default")


def ok(*argv: str) -> str:
    rc, out, err = run(*argv)
    assert rc == 0, err
    return out


def graphics(g: tuple[str, ...], gpu: str) -> dict[str, Any]:
    return json.loads(ok(*g, "scheduler", "show", gpu))


def nvml_state(root: Path) -> dict[str, Any]:
    return json.loads(nvml_state_path(root).read_text())


def set_state(root: Path, gpu: str, **changes: Any) -> None:
    state = nvml_state(root)
    entry = next(x for x in state["gpus"] if x["address"] == gpu)
    entry.update(changes)
    write_state(nvml_state_path(root), state)


def busy_vms(g: tuple[str, ...], root: Path, names: tuple[str, ...] = ("a", "b", "c"), sm: int = 100) -> None:
    for vm in names:
        ok(*g, "vm", "create", vm, "--vgpu", "L40S-4Q", "--start")
    for inst in guests.running(root):
        guests.set_load(root, inst["id"], sm=sm)


# -- acceptance ---------------------------------------------------------------------------------------
def test_set_with_guests_is_deferred_then_applied_when_empty_lost_by_reboot_restored(
        sim: tuple[Path, tuple[str, ...]], capsys: pytest.CaptureFixture[str]) -> None:
    root, g = sim
    busy_vms(g, root)  # vm create --start: the VMs run as guests of the simulated NVML
    assert sorted(i["vm_name"] for i in guests.running(root)) == ["a", "b", "c"]
    res = json.loads(ok(*g, "scheduler", "set", L40S, "equal-share"))
    assert res["status"] == "deferred"
    assert "3 vGPU(s) run on 0000:3d:00.0" in res["reason"] and "restore" in res["applies"]
    assert "recorded, not applied yet" in capsys.readouterr().err
    shown = graphics(g, L40S)
    assert shown["policy"] == "best-effort" and shown["recorded"]["policy"] == "equal-share"
    assert shown["in_effect"] is False and shown["recorded"]["applied"] is False
    rc, out, _ = run(*g, "reconcile")
    assert rc == 10 and "recorded equal-share, driver best-effort" in out

    for vm in ("a", "b"):
        ok(*g, "vm", "stop", vm)
        assert graphics(g, L40S)["policy"] == "best-effort"  # a vGPU still runs: NVML would refuse
    ok(*g, "vm", "stop", "c")  # the GPU is empty now
    assert guests.running(root) == []
    shown = graphics(g, L40S)
    assert shown["policy"] == "equal-share" and shown["in_effect"] is True and shown["recorded"]["applied"]
    audits = [e for e in json.loads(ok(*g, "audit", "--json")) if e["action"] == "vgpu.scheduler"]
    assert [e["detail"]["status"] for e in audits] == ["deferred", "applied"]

    out = ok(*g, "sim", "reboot")
    assert "0000:3d:00.0: vGPU scheduler back to best effort" in out
    assert graphics(g, L40S)["policy"] == "best-effort"
    rc, out, _ = run(*g, "reconcile")
    assert rc == 10 and "a reboot, a driver reload" in out
    report = json.loads(ok(*g, "restore", "--json"))
    steps = [s for r in report["gpus"] if r["gpu"] == L40S for s in r["steps"]]
    kinds = [s["step"] for s in steps]
    assert kinds.index("vfs") < kinds.index("scheduler") < kinds.index("vf-type")  # before the first vGPU
    assert next(s for s in steps if s["step"] == "scheduler")["status"] == "done"
    assert graphics(g, L40S)["policy"] == "equal-share"
    again = json.loads(ok(*g, "restore", "--json"))
    assert [s["status"] for r in again["gpus"] for s in r["steps"] if s["step"] == "scheduler"] == ["ok"]
    assert run(*g, "reconcile")[0] == 0


def test_three_busy_guests_each_get_a_third(sim: tuple[Path, tuple[str, ...]]) -> None:
    root, g = sim
    ok(*g, "scheduler", "set", L40S, "equal-share")
    busy_vms(g, root)
    top = json.loads(ok(*g, "top", "--json"))
    assert len(top["vgpus"]) == 3
    for r in top["vgpus"]:
        assert r["scheduler"]["policy"] == "equal-share"
        assert r["scheduler"]["share"] == pytest.approx(1 / 3, abs=0.02)
        assert r["scheduler"]["expected"] == pytest.approx(1 / 3)
        assert r["scheduler"]["busy"] is True
    assert "SHARE%/PROMISED" in ok(*g, "top", "--once")
    rc, out, _ = run(*g, "scheduler", "check", "--seconds", "0.4")
    assert rc == 0 and out.count("equal-share") == 3

    svc = Service(Config.resolve(sysfs_root=str(root), state_dir=str(Path(g[3])), connect="test:///default"))
    client = TestClient(create_app(svc.cfg, service=svc, watch=False, metrics_public=True))
    text = client.get("/metrics").text
    shares = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("vgpumgr_vgpu_scheduler_share_ratio{")]
    promised = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("vgpumgr_vgpu_scheduler_expected_share_ratio{")]
    assert len(shares) == 3 and all(abs(s - 1 / 3) < 0.02 for s in shares)
    assert promised == pytest.approx([1 / 3] * 3)

    # the scheduler shortens one VM's slices: it gets clearly less than promised, check says so
    victim = guests.running(root)[0]
    set_state(root, L40S, scheduler_fault={str(victim["id"]): 0.4})
    rc, out, _ = run(*g, "scheduler", "check", "--seconds", "0.4")
    assert rc == 10 and f"LESS THAN PROMISED: {victim['vm_name']} on {L40S}" in out


def test_rest_and_web_view_show_each_vms_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from test_api import make_env
    from test_ui import login

    monkeypatch.setenv("VGPUMGR_TELEMETRY_INTERVAL", "0.2")  # the newest sample is at most 0.2 s old
    env, client = make_env(tmp_path, "mixed")
    with client:
        scheduler_ops.set_scheduler(env.cfg, L40S, scheduler_ops.setting("equal-share"))
        for vm in ("a", "b", "c"):
            env.service.create_vm(vm, vgpus=["L40S-4Q"], start=True)
        root = Path(env.cfg.host.root)
        for inst in guests.running(root):
            guests.set_load(root, inst["id"], sm=100)
        # the sampler thread runs every 0.2 s, later on a loaded machine: wait for samples taken under load
        deadline = time.monotonic() + 15
        while True:
            rows = client.get("/v1/telemetry", headers=env.headers["auditor"]).json()["vgpus"]
            shares = [r["scheduler"]["share"] for r in rows]
            # every VM's sample (all() of no sample at all is true: the first read may come before one)
            if len(shares) == 3 and all(s == pytest.approx(1 / 3, abs=0.02) for s in shares):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted(r["vm"] for r in rows) == ["a", "b", "c"]
        assert all(s == pytest.approx(1 / 3, abs=0.02) for s in shares), shares
        page = login(env, "auditor").get("/ui/telemetry")
        assert page.status_code == 200
        assert 'class="share-chart" data-gpu="0000:3d:00.0"' in page.text
        assert page.text.count("data-expected=") == 3 and page.text.count('data-share="0.33') == 3


def test_fixed_share_in_mixed_size_mode_is_refused_with_the_reason(sim: tuple[Path, tuple[str, ...]]) -> None:
    root, g = sim
    ok(*g, "gpu", "mode", L40S, "--mixed")
    rc, _, err = run(*g, "scheduler", "set", L40S, "fixed-share")
    assert rc == 4 and "fixed share is not supported in mixed-size mode" in err
    assert graphics(g, L40S)["recorded"] is None  # nothing recorded
    # NVML itself refuses it too (the simulated driver)
    n = SimNvml(nvml_state_path(root))
    n.nvmlInit()
    st = pynvml.c_nvmlVgpuSchedulerSetState_t()
    st.schedulerPolicy = 3
    with pytest.raises(pynvml.NVMLError) as e:
        n.nvmlDeviceSetVgpuSchedulerState(n.nvmlDeviceGetHandleByIndex(1), st)
    assert e.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert json.loads(ok(*g, "scheduler", "set", L40S, "equal-share"))["status"] == "applied"  # equal share is fine
    rc, _, err = run(*g, "scheduler", "set", A100, "equal-share")  # MIG is on there
    assert rc == 4 and "MIG mode is on" in err
    with pytest.raises(SystemExit) as exc:  # argparse: the bounds of vgpumgr.userinput.numbers
        run(*g, "scheduler", "set", L40S, "equal-share", "--timeslice", "31")
    assert exc.value.code == 2
    # after a reboot the driver has forgotten the mode, but restore will set it again: still refused
    ok(*g, "sim", "reboot")
    rc, _, err = run(*g, "scheduler", "set", L40S, "fixed-share")
    assert rc == 4 and "recorded in mixed-size mode" in err, err
    rc, _, err = run(*g, "scheduler", "set", L40S, "round-robin")
    assert rc == 2 and "not a vGPU scheduler policy" in err


def test_persist_writes_the_documented_values(sim: tuple[Path, tuple[str, ...]], tmp_path: Path) -> None:
    root, g = sim
    ok(*g, "scheduler", "set", L40S, "fixed-share", "--timeslice", "24")
    ok(*g, "scheduler", "set", T4, "equal-share", "--frequency", "960", "--avg-factor", "60")
    assert graphics(g, L40S)["engines"]["graphics"]["policy"] == "fixed-share"
    out = ok(*g, "scheduler", "persist")
    path = root / "etc/modprobe.d/vgpumgr-scheduler.conf"
    assert f"wrote {path}" in out and "reload the NVIDIA driver or reboot" in out
    assert path.read_text().splitlines()[-1] == (
        'options nvidia NVreg_RegistryDwordsPerDevice="pci=0000:3b:00.0;RmPVMRL=0x3c3c0001;'
        'pci=0000:3d:00.0;RmPVMRL=0x00180011"')
    other = tmp_path / "elsewhere.conf"
    res = json.loads(ok(*g, "scheduler", "persist", "--file", str(other), "--json"))
    assert res["values"] == {T4: "0x3c3c0001", L40S: "0x00180011"} and other.is_file()
    mine = tmp_path / "mine.conf"  # a file vgpumgr did not write is neither replaced nor removed
    mine.write_text("options nvidia NVreg_Something=1\n")
    rc, _, err = run(*g, "scheduler", "persist", "--file", str(mine))
    assert rc == 4 and "not written by `vgpumgr scheduler persist`" in err and mine.read_text().startswith("options")
    rc, _, err = run(*g, "scheduler", "persist", "--file", "/proc/no-such/dir/x.conf")
    assert rc not in (0, 70) and "cannot write into /proc/no-such/dir" in err, (rc, err)


# -- the RmPVMRL encoder against every value NVIDIA documents --------------------------------------------
@pytest.mark.parametrize(("value", "setting"), [
    (0x01, rmpvmrl.Setting("equal-share")),
    (0x00030003, rmpvmrl.Setting("equal-share", timeslice_ms=3, arr=False)),
    (0x11, rmpvmrl.Setting("fixed-share")),
    (0x00180011, rmpvmrl.Setting("fixed-share", timeslice_ms=24)),
    (0x3C3C0001, rmpvmrl.Setting("equal-share", frequency_hz=960, avg_factor=60)),
    (0x3C3C0011, rmpvmrl.Setting("fixed-share", frequency_hz=960, avg_factor=60)),
    (0x00030001, rmpvmrl.Setting("equal-share", timeslice_ms=3)),
    (0x00, rmpvmrl.Setting("best-effort")),
])
def test_rmpvmrl_encodes_and_decodes_every_documented_value(value: int, setting: rmpvmrl.Setting) -> None:
    assert rmpvmrl.encode(setting) == value
    assert rmpvmrl.decode(value) == setting


def test_rmpvmrl_refuses_what_the_layout_cannot_hold() -> None:
    from vgpumgr.errors import InvalidInput

    for bad in (rmpvmrl.Setting("equal-share", timeslice_ms=31), rmpvmrl.Setting("fixed-share", frequency_hz=62),
                rmpvmrl.Setting("equal-share", frequency_hz=480, avg_factor=61),
                rmpvmrl.Setting("equal-share", timeslice_ms=2, frequency_hz=480),
                rmpvmrl.Setting("best-effort", timeslice_ms=2)):
        with pytest.raises(InvalidInput):
            rmpvmrl.encode(bad)
    assert rmpvmrl.options_line({"0000:86:00.0": 0x11}) == \
        'options nvidia NVreg_RegistryDwordsPerDevice="pci=0000:86:00.0;RmPVMRL=0x11"'


# -- the simulated scheduler's log follows the policy and the loads ----------------------------------------
def _shares(root: Path, gpu: str = L40S) -> dict[int, float]:
    layer = NvmlLayer(SimNvml(nvml_state_path(root)))
    tracker = ShareTracker()
    tracker.feed(gpu, nvml_scheduler.read_log(layer, gpu)["entries"])
    seen = tracker.shares(gpu) or {"runlists": {}}
    return {rl: v["share"] for rl, v in seen["runlists"].items()}


@pytest.mark.parametrize(("policy", "loads", "expected"), [
    ("equal-share", (100, 100, 100), (1 / 3, 1 / 3, 1 / 3)),
    ("equal-share", (100, 100, 0), (1 / 2, 1 / 2, 0)),  # divides among the busy vGPUs
    ("fixed-share", (100, 100, 100), (1 / 12, 1 / 12, 1 / 12)),  # L40S-4Q: 12 per GPU, capped by type
    ("best-effort", (100, 0, 0), (1.0, 0, 0)),  # idle time given away
    ("best-effort", (80, 80, 0), (1 / 2, 1 / 2, 0)),
])
def test_log_follows_policy_and_loads(sim: tuple[Path, tuple[str, ...]], policy: str, loads: tuple[int, ...],
                                      expected: tuple[float, ...]) -> None:
    root, g = sim
    ok(*g, "scheduler", "set", L40S, policy)
    busy_vms(g, root)
    ids = sorted(i["id"] for i in guests.running(root))
    for inst, load in zip(ids, loads, strict=True):
        guests.set_load(root, inst, sm=load)
    got = _shares(root)
    for inst, want in zip(ids, expected, strict=True):
        assert got.get(inst, 0.0) == pytest.approx(want, abs=0.02)


def test_nvml_refuses_a_change_while_a_vgpu_exists_and_reboot_forgets(sim: tuple[Path, tuple[str, ...]]) -> None:
    root, g = sim
    busy_vms(g, root, ("a",))
    layer = NvmlLayer(SimNvml(nvml_state_path(root)))
    from vgpumgr.errors import Conflict

    with pytest.raises(Conflict):
        nvml_scheduler.apply(layer, L40S, "equal-share")
    ok(*g, "vm", "stop", "a")
    assert nvml_scheduler.apply(layer, L40S, "equal-share")["api"] == "v2"
    assert nvml_scheduler.read(layer, L40S)["engines"]["graphics"]["policy"] == "equal-share"
    ok(*g, "sim", "reboot")
    assert nvml_scheduler.read(layer, L40S)["engines"]["graphics"]["policy"] == "best-effort"


# -- across nvidia-ml-py versions and drivers -------------------------------------------------------------
class OldBindings(SimNvml):
    """nvidia-ml-py before 13.595.45: no `_v2` scheduler calls or structs."""

    def __getattribute__(self, name: str) -> Any:
        if "Sched" in name and "_v2" in name:
            raise AttributeError(name)
        return super().__getattribute__(name)


class DriverWithoutV2(SimNvml):
    """New bindings on an older driver: the library has no `_v2` symbol (FunctionNotFound), as on the real H100."""

    def nvmlDeviceGetVgpuSchedulerState_v2(self, *_a: Any) -> Any:  # noqa: N802
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    nvmlDeviceGetVgpuSchedulerLog_v2 = nvmlDeviceSetVgpuSchedulerState_v2 = nvmlDeviceGetVgpuSchedulerState_v2


@pytest.mark.parametrize("module", [OldBindings, DriverWithoutV2])
def test_old_calls_serve_where_v2_is_missing(sim: tuple[Path, tuple[str, ...]], module: type) -> None:
    root, g = sim
    layer = NvmlLayer(module(nvml_state_path(root)))
    assert nvml_scheduler.read(layer, L40S)["api"] == "v1"
    assert nvml_scheduler.apply(layer, L40S, "equal-share", timeslice_ms=3)["api"] == "v1"
    state = nvml_scheduler.read(layer, L40S)
    assert state["engines"] == {"graphics": {"policy": "equal-share", "arr": False, "timeslice_ns": None,
                                             "avg_factor": None}}  # parameters read 0 while no vGPU runs
    busy_vms(g, root)
    log = nvml_scheduler.read_log(layer, L40S)
    assert log["api"] == "v1" and log["timeslice_ns"] == 3_000_000 and len(log["entries"]) == 200
    assert {e["target_ns"] for e in log["entries"]} == {3_000_000}


def test_the_real_h100_without_a_vgpu_manager_has_no_scheduler() -> None:
    """Replays what the lent H100 answered (driver 580.159.04, nvidia-ml-py 13.610.43): NotSupported for every
    scheduler call, FunctionNotFound for the `_v2` ones."""
    rec = json.loads(FIXTURE.read_text())
    [(bus, raw)] = rec["gpus"].items()

    class Replay:
        NVMLError = pynvml.NVMLError
        c_nvmlVgpuSchedulerStateInfo_v2_t = pynvml.c_nvmlVgpuSchedulerStateInfo_v2_t
        c_nvmlVgpuSchedulerLogInfo_v2_t = pynvml.c_nvmlVgpuSchedulerLogInfo_v2_t

        def nvmlInit(self) -> None:  # noqa: N802
            pass

        def nvmlDeviceGetCount(self) -> int:  # noqa: N802
            return 1

        def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
            return 1

        def nvmlDeviceGetPciInfo(self, h: int) -> Any:  # noqa: N802
            info = pynvml.nvmlPciInfo_t()
            info.busId = bus.encode()
            return info

        def __getattr__(self, name: str) -> Any:
            def answer(*args: Any) -> Any:
                key = name if name in raw else f"{name}/{args[1].engineId}"
                got = raw[key]
                if "error" in got:
                    raise pynvml.NVMLError(got["error"])
                return eval(got["value"])  # noqa: S307 - the fixture's repr of ints, lists and strings
            if name in raw or f"{name}/1" in raw:
                return answer
            raise AttributeError(name)

    layer = NvmlLayer(Replay())
    address = "0000:00:06.0"
    state = nvml_scheduler.read(layer, address)
    assert state["api"] == "v1"  # _v2 answers FunctionNotFound: the old calls are used
    assert state["engines"] == {} and state["capabilities"] is None
    assert {"capabilities", "state", "active_vgpus"} <= set(state["not_supported"])
    assert state["mig"] is False and state["name"] == "NVIDIA H100 80GB HBM3"
    assert state["gpu_instances"] is None and state["mig_note"] is None  # MIG off: no GPU instance to ask
    log = nvml_scheduler.read_log(layer, address)
    assert log["entries"] == [] and log["not_supported"] == ["log"]
    why = scheduler_ops._refusal(state, rmpvmrl.Setting("equal-share"))
    assert why and "has no vGPU scheduler: NVML answers NotSupported" in why


# -- the share tracker -----------------------------------------------------------------------------------
def _entry(ts_ms: int, rl: int, run_ms: int, target_ms: int = 1000) -> dict[str, int]:
    ms = 1_000_000
    return {"timestamp_ns": ts_ms * ms, "run_ns": run_ms * ms, "runlist": rl, "target_ns": target_ms * ms,
            "total_ns": 0, "preemption_ns": 0}


def test_share_tracker_joins_overlapping_reads_and_notices_lost_entries() -> None:
    t = ShareTracker()
    t.feed("g", [_entry(1000, 1, 1000), _entry(2000, 2, 1000)])
    t.feed("g", [_entry(2000, 2, 1000), _entry(3000, 1, 1000), _entry(4000, 2, 1000)])  # overlaps: no loss
    seen = t.shares("g")
    assert seen is not None and seen["lost_reads"] == 0 and seen["window_s"] == pytest.approx(4.0)
    assert seen["runlists"][1]["share"] == pytest.approx(0.5) and seen["runlists"][2]["busy"] is True
    t.feed("g", [_entry(9000, 1, 500)])  # entries between 4000 and 8500 were never read
    assert t.shares("g")["lost_reads"] == 1  # type: ignore[index]
    snap = {"vgpus": [{"vm": "a", "vm_uuid": None, "vgpu": "x", "gpu": "g", "type": "t",
                       "scheduler": {"policy": "equal-share", "share": 0.2, "expected": 0.5, "busy": True,
                                     "window_s": 1}},
                      {"vm": "idle", "vm_uuid": None, "vgpu": "y", "gpu": "g", "type": "t",
                       "scheduler": {"policy": "equal-share", "share": 0.0, "expected": 0.5, "busy": False,
                                     "window_s": 1}}]}
    assert [f["vm"] for f in shortfalls(snap)] == ["a"]  # an idle VM asked for nothing: not short-changed


# -- started VMs run as guests ----------------------------------------------------------------------------
def test_hook_prepare_and_release_start_and_stop_the_guest(sim: tuple[Path, tuple[str, ...]]) -> None:
    root, g = sim
    svc = Service(Config.resolve(sysfs_root=str(root), state_dir=g[3], connect="test:///default"))
    svc.create_vm("h", vgpus=["L40S-4Q"])
    assert guests.running(root) == []
    xml = svc.vm_xml("h")
    svc.libvirt_prepare("h", xml)
    assert [i["vm_name"] for i in guests.running(root)] == ["h"]
    svc.libvirt_release("h", xml)
    assert guests.running(root) == []  # and its vGPU released
    ok(*g, "vm", "create", "k", "--vgpu", "L40S-4Q")
    assert guests.running(root) == []
    ok(*g, "vm", "start", "k")
    assert [i["vm_name"] for i in guests.running(root)] == ["k"]
    ok(*g, "vm", "delete", "k")
    assert guests.running(root) == []


def test_the_mixed_profiles_t4_has_a_simulated_nvml(sim: tuple[Path, tuple[str, ...]]) -> None:
    root, g = sim
    layer = NvmlLayer(SimNvml(nvml_state_path(root)))
    facts = layer.gpu(T4)
    assert facts["name"] == "Tesla T4" and facts["host_vgpu_mode"] == "non-sriov"
    assert any(t["name"] == "GRID T4-4Q" for t in facts["vgpu"]["supported_types"])
    ok(*g, "vm", "create", "t", "--vgpu", "T4-4Q", "--start")
    assert [(i["gpu"], i["vm_name"]) for i in guests.running(root)] == [(T4, "t")]
    assert json.loads(ok(*g, "top", "--json"))["vgpus"][0]["type"] == "T4-4Q"


def test_the_service_reads_the_log_often_enough_to_miss_nothing(sim: tuple[Path, tuple[str, ...]]) -> None:
    """NVML keeps 200 slices: the service's sampler reads each GPU's log more than 5 times a second, so its
    minute-long window grows from read to read without gaps."""
    import time

    from vgpumgr.telemetry.sampler import Sampler

    root, g = sim
    # 10 ms slices: the 200 entries span 2 s, so a loaded test machine cannot make the polls come too late
    ok(*g, "scheduler", "set", L40S, "equal-share", "--timeslice", "10")
    busy_vms(g, root)
    svc = Service(Config.resolve(sysfs_root=str(root), state_dir=g[3], connect="test:///default"))
    sampler = Sampler(svc, interval=30)
    sampler.sample()  # the first pass finds the GPU's running vGPUs
    sampler.start()
    try:
        time.sleep(1.6)
    finally:
        sampler.stop()
    seen = sampler.reader.shares.shares(L40S)
    assert seen is not None and seen["lost_reads"] == 0 and seen["window_s"] >= 1.2
    assert all(v["share"] == pytest.approx(1 / 3, abs=0.02) for v in seen["runlists"].values())


# -- per MIG GPU instance (Blackwell GB20x) -----------------------------------------------------------------
BW = "0000:81:00.0"  # a simulated RTX PRO 6000 Blackwell Server Edition (GB202) added to the `mixed` host


def blackwell(root: Path) -> SimNvml:
    """The `mixed` host's NVML plus a GB202 with MIG on, a 2g.48gb (GPU instance 1) and a 1g.24gb (2)."""
    extra = root / "bw-state.json"
    create_state(extra, [("rtx-pro-6000", BW)])
    state = nvml_state(root)
    state["gpus"].append(json.loads(extra.read_text())["gpus"][0])
    write_state(nvml_state_path(root), state)
    n = SimNvml(nvml_state_path(root))
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByPciBusId(BW)
    n.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE)
    n.nvmlDeviceCreateGpuInstance(h, 5)  # 2g.48gb
    n.nvmlDeviceCreateGpuInstance(h, 14)  # 1g.24gb
    return n


def on_gi(root: Path, gi: int, vm: str, sm: int, vgpu_id: int) -> None:
    """A VM's time-sliced vGPU runs on GPU instance `gi` (Blackwell MIG time-slicing: several per instance)."""
    state = nvml_state(root)
    gpu = next(g for g in state["gpus"] if g["address"] == BW)
    gpu.setdefault("vgpu_instances", []).append({
        "id": vgpu_id, "uuid": f"00000000-0000-0000-0000-00000000000{vgpu_id}", "vm_uuid": f"vm-{vm}",
        "vm_name": vm, "mdev_uuid": None, "vf": None, "type_id": 90111, "gi_id": gi, "guest_driver": None,
        "started": time.time() - 60, "load": {"sm": sm}})
    write_state(nvml_state_path(root), state)


def gi_scheduler(root: Path, gi: int, **sched: Any) -> None:
    state = nvml_state(root)
    gpu = next(g for g in state["gpus"] if g["address"] == BW)
    next(x for x in gpu["gpu_instances"] if x["id"] == gi)["scheduler"] = sched
    write_state(nvml_state_path(root), state)


def test_gb20x_shows_each_gpu_instances_scheduler_and_log(sim: tuple[Path, tuple[str, ...]]) -> None:
    root, g = sim
    blackwell(root)
    gi_scheduler(root, 1, policy=2)  # equal share on GPU instance 1 (set by hand, e.g. nvidia-smi)
    on_gi(root, 1, "a", 100, 901)
    on_gi(root, 1, "b", 100, 902)
    on_gi(root, 2, "c", 100, 903)
    shown = json.loads(ok(*g, "scheduler", "show", BW))
    assert shown["mig"] is True and shown["mig_note"] is None
    assert [(x["id"], x["profile"], x["api"]) for x in shown["gpu_instances"]] == [(1, "2g.48gb", "v2"),
                                                                                  (2, "1g.24gb", "v2")]
    first, second = (x["engines"] for x in shown["gpu_instances"])
    assert first["graphics"] == {"policy": "equal-share", "arr": True, "timeslice_ns": 2_000_000, "avg_factor": 33}
    assert first["nvenc0"]["policy"] == "best-effort"  # other engines: best effort (NVML's header)
    assert second["graphics"]["policy"] == "best-effort"
    assert not [x for x in shown["not_supported"] if "GPU instance" in x]
    assert json.loads(ok(*g, "scheduler", "show", "--json"))[BW]["gpu_instances"] == shown["gpu_instances"]
    text = ok(*g, "scheduler", "show").split("\n\n")[1].splitlines()
    assert text[0].split() == ["GPU", "GPU_INSTANCE", "PROFILE", "POLICY", "SLICE_MS", "AVG_FACTOR", "API"]
    assert text[1].split() == [BW, "1", "2g.48gb", "equal-share", "2", "33", "v2"]
    assert text[2].split() == [BW, "2", "1g.24gb", "best-effort", "-", "-", "v2"]
    # the log of GPU instance 1 follows its two busy guests: equal share, half each; GPU instance 2's guest is
    # not in it
    log = json.loads(ok(*g, "scheduler", "log", BW, "--gpu-instance", "1", "--json"))
    assert log["gpu_instance"] == 1 and log["policy"] == "equal-share" and log["api"] == "v2"
    assert len(log["entries"]) == 200 and {e["runlist"] for e in log["entries"]} == {901, 902}
    ran = {rl: sum(e["run_ns"] for e in log["entries"] if e["runlist"] == rl) for rl in (901, 902)}
    assert ran[901] == pytest.approx(ran[902], rel=0.02)
    other = json.loads(ok(*g, "scheduler", "log", BW, "--gpu-instance", "2", "--json"))
    assert {e["runlist"] for e in other["entries"]} == {903} and other["policy"] == "best-effort"
    assert "GPU instance 1: policy equal-share, time slice 2 ms" in ok(*g, "scheduler", "log", BW,
                                                                        "--gpu-instance", "1")
    rc, _, err = run(*g, "scheduler", "log", BW, "--gpu-instance", "7")
    assert rc == 3 and "no GPU instance 7" in err
    rc, _, err = run(*g, "scheduler", "log", L40S, "--gpu-instance", "1")
    assert rc == 4 and "MIG is off" in err
    rc, _, err = run(*g, "scheduler", "set", BW, "equal-share")  # read only: no per-GPU-instance set
    assert rc == 4 and "each GPU instance has a scheduler of its own (GB20x)" in err


def test_before_gb20x_gpu_instances_have_no_scheduler_and_get_fixed_share(
        sim: tuple[Path, tuple[str, ...]]) -> None:
    root, g = sim
    n = SimNvml(nvml_state_path(root))
    n.nvmlInit()
    info = n.nvmlGpuInstanceGetInfo(n.nvmlDeviceCreateGpuInstance(n.nvmlDeviceGetHandleByPciBusId(A100), 19))
    gi = info.id
    shown = json.loads(ok(*g, "scheduler", "show", A100))  # the A100 has MIG on
    assert shown["gpu_instances"] == [{"id": gi, "profile": "1g.10gb", "start": info.placement.start, "size": 1,
                                       "api": None, "engines": {}}]
    assert f"GPU instance state (GPU instance {gi}: NotSupported" in " ".join(shown["not_supported"])
    assert "MIG-backed vGPUs get fixed share" in shown["mig_note"]
    out = ok(*g, "scheduler", "show")
    assert f"{A100}: MIG-backed vGPUs get fixed share on this GPU: before GB20x" in out
    assert any(line.split()[:4] == [A100, str(gi), "1g.10gb", "not"] for line in out.splitlines())
    log = json.loads(ok(*g, "scheduler", "log", A100, "--gpu-instance", str(gi), "--json"))
    assert log["entries"] == [] and "NotSupported" in log["not_supported"][0]
    # the driver's own answer, call by call
    gi_handle = n.nvmlDeviceGetGpuInstanceById(n.nvmlDeviceGetHandleByPciBusId(A100), gi)
    with pytest.raises(pynvml.NVMLError) as e:
        n.nvmlGpuInstanceGetVgpuSchedulerState_v2(gi_handle, pynvml.c_nvmlVgpuSchedulerStateInfo_v2_t())
    assert e.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    # the H100 (Hopper) with MIG on and no GPU instance yet: fixed share, known from its architecture
    layer = NvmlLayer(n)
    h100 = root / "h100-state.json"
    create_state(h100, [("h100", "0000:19:00.0")])
    hn = SimNvml(h100)
    hn.nvmlInit()
    hn.nvmlDeviceSetMigMode(hn.nvmlDeviceGetHandleByIndex(0), 1)
    state = nvml_scheduler.read(NvmlLayer(hn), "0000:19:00.0")
    assert state["gpu_instances"] == [] and "before GB20x" in state["mig_note"]
    assert nvml_scheduler.read(layer, L40S)["gpu_instances"] is None  # MIG off: nothing to ask
    # without a vGPU manager (no scheduler capabilities) NotSupported tells nothing of GB20x: no note
    state = nvml_scheduler.read(layer, A100)
    assert state["mig_note"] and state["capabilities"]
    set_state(root, A100, not_supported=["nvmlDeviceGetVgpuSchedulerCapabilities"])
    state = nvml_scheduler.read(layer, A100)
    assert state["capabilities"] is None and state["mig_note"] is None and state["gpu_instances"][0]["engines"] == {}


class NoGiBindings(SimNvml):
    """nvidia-ml-py before 12.575.51: no per-GPU-instance scheduler calls or structs."""

    @staticmethod
    def _lacks(name: str) -> bool:
        return "GpuInstanceGetVgpuScheduler" in name or name.startswith("c_nvmlVgpuSchedulerStateInfo_v")

    def __getattribute__(self, name: str) -> Any:
        if NoGiBindings._lacks(name):
            raise AttributeError(name)
        return super().__getattribute__(name)

    def __getattr__(self, name: str) -> Any:  # not pynvml's either
        if NoGiBindings._lacks(name):
            raise AttributeError(name)
        return super().__getattr__(name)


class DriverWithoutGiV2(SimNvml):
    """Bindings with `_v2` on a driver before R595: the GPU-instance `_v2` calls are FunctionNotFound."""

    def nvmlGpuInstanceGetVgpuSchedulerState_v2(self, *_a: Any) -> Any:  # noqa: N802
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    nvmlGpuInstanceGetVgpuSchedulerLog_v2 = nvmlGpuInstanceGetVgpuSchedulerState_v2


def test_bindings_without_the_gpu_instance_calls_say_so(sim: tuple[Path, tuple[str, ...]]) -> None:
    root, _g = sim
    blackwell(root)
    gi_scheduler(root, 1, policy=3)
    on_gi(root, 1, "a", 100, 901)
    state = nvml_scheduler.read(NvmlLayer(NoGiBindings(nvml_state_path(root))), BW)
    assert [x["engines"] for x in state["gpu_instances"]] == [{}, {}]  # listed, not guessed
    assert nvml_gi_scheduler.NO_BINDINGS in state["not_supported"] and state["mig_note"] is None
    assert "12.575.51" in nvml_gi_scheduler.NO_BINDINGS
    log = nvml_gi_scheduler.read_log(NvmlLayer(NoGiBindings(nvml_state_path(root))), BW, 1)
    assert log["entries"] == [] and log["not_supported"] == [nvml_gi_scheduler.NO_LOG_BINDINGS]
    # a driver without the _v2 ones: the old versioned calls answer
    old = NvmlLayer(DriverWithoutGiV2(nvml_state_path(root)))
    first = nvml_scheduler.read(old, BW)["gpu_instances"][0]
    assert first["api"] == "v1" and first["engines"]["graphics"]["policy"] == "fixed-share"
    log = nvml_gi_scheduler.read_log(old, BW, 1)
    assert log["api"] == "v1" and log["policy"] == "fixed-share" and {e["runlist"] for e in log["entries"]} == {901}
    # the old call checks its struct's version, as NVML does
    n = SimNvml(nvml_state_path(root))
    n.nvmlInit()
    gi = n.nvmlDeviceGetGpuInstanceById(n.nvmlDeviceGetHandleByPciBusId(BW), 1)
    with pytest.raises(pynvml.NVMLError) as e:
        n.nvmlGpuInstanceGetVgpuSchedulerState(gi, pynvml.c_nvmlVgpuSchedulerStateInfo_v1_t())
    assert e.value.value == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def counting(module: type) -> Any:
    """A simulated NVML of `module`'s kind that counts the calls asked of it, by name."""
    class Counting(module):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any) -> None:
            object.__setattr__(self, "asked", Counter())
            super().__init__(*args)

        def __getattribute__(self, name: str) -> Any:
            found = super().__getattribute__(name)
            if not name.startswith("nvml") or not callable(found):
                return found
            asked = object.__getattribute__(self, "asked")

            def counted(*args: Any, **kwargs: Any) -> Any:
                asked[name] += 1
                return found(*args, **kwargs)
            return counted
    return Counting


def test_the_v2_generation_a_driver_lacks_is_asked_once_per_driver(sim: tuple[Path, tuple[str, ...]]) -> None:
    """Issue 42: the log is read 5 times a second; a driver whose library lacks `_v2` (FunctionNotFound, as on the
    real H100) was asked `_v2` first on every read. The answer is remembered per NvmlLayer (per driver)."""
    root, g = sim
    busy_vms(g, root)
    n = counting(DriverWithoutV2)(nvml_state_path(root))
    layer = NvmlLayer(n)
    first = nvml_scheduler.read_log(layer, L40S)
    assert first["api"] == "v1" and len(first["entries"]) == 200
    assert n.asked["nvmlDeviceGetVgpuSchedulerLog_v2"] == 1
    for _ in range(3):
        assert nvml_scheduler.read_log(layer, L40S)["entries"]
    assert n.asked["nvmlDeviceGetVgpuSchedulerLog_v2"] == 1 and n.asked["nvmlDeviceGetVgpuSchedulerLog"] == 4
    assert nvml_scheduler.read(layer, L40S)["api"] == nvml_scheduler.read(layer, L40S)["api"] == "v1"
    assert n.asked["nvmlDeviceGetVgpuSchedulerState_v2"] == 1
    layer.close()  # a driver reload needs NVML opened again: the next driver is asked afresh
    assert nvml_scheduler.read_log(layer, L40S)["api"] == "v1"
    assert n.asked["nvmlDeviceGetVgpuSchedulerLog_v2"] == 2


def test_a_driver_answering_v2_is_asked_each_engine_once(sim: tuple[Path, tuple[str, ...]]) -> None:
    """No probe before the read: the old reader asked the graphics engine's `_v2` state twice per read."""
    root, _g = sim
    n = counting(SimNvml)(nvml_state_path(root))
    state = nvml_scheduler.read(NvmlLayer(n), L40S)
    assert state["api"] == "v2" and set(state["engines"]) == set(nvml_scheduler.ENGINES.values())
    assert n.asked["nvmlDeviceGetVgpuSchedulerState_v2"] == len(nvml_scheduler.ENGINES)
    assert n.asked["nvmlDeviceGetVgpuSchedulerState"] == 0


def test_the_gpu_instance_v2_a_driver_lacks_is_asked_once(sim: tuple[Path, tuple[str, ...]]) -> None:
    root, _g = sim
    blackwell(root)
    gi_scheduler(root, 1, policy=3)
    n = counting(DriverWithoutGiV2)(nvml_state_path(root))
    layer = NvmlLayer(n)
    for _ in range(2):
        assert nvml_scheduler.read(layer, BW)["gpu_instances"][0]["api"] == "v1"
        assert nvml_gi_scheduler.read_log(layer, BW, 1)["api"] == "v1"
    assert n.asked[nvml_gi_scheduler.V2] == 1 and n.asked[nvml_gi_scheduler.LOG_V2] == 1


def test_a_vm_stop_reads_the_intents_without_writing(sim: tuple[Path, tuple[str, ...]], tmp_path: Path) -> None:
    from vgpumgr.config import Config
    from vgpumgr.db.session import session_factory
    from vgpumgr.ops import scheduler as scheduler_ops

    root, _ = sim
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "fresh"))
    assert scheduler_ops.intents(cfg) == {} and scheduler_ops.apply_pending(cfg, actor="hook:test") == []
    with session_factory(cfg.db_url)() as s:  # nothing was written: not even this host's row
        assert s.execute(text("SELECT count(*) FROM hosts")).scalar() == 0
