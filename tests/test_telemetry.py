"""Per-VM vGPU telemetry on the simulator: /metrics equals what the simulated NVML reports per VM, renamed VMs
and released vGPUs disappear, `top --once --json` matches /metrics, `license check` finds each seeded drift
and nothing else, and a GPU without a vGPU manager (the real H100's recording) has no data, said once."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from simhost import run

from api import tokens
from api.app import create_app
from vgpumgr.audit import chain as audit
from vgpumgr.config import Config
from vgpumgr.db.session import session_factory
from vgpumgr.licensing import seats as licensing
from vgpumgr.service import Service
from vgpumgr.sim import guests, profiles
from vgpumgr.sim.nvml_telemetry import engine_value


def host(tmp_path: Path, licence_mode: str = "warn") -> tuple[Service, Path]:
    root = profiles.create(tmp_path / "sim", "mixed", vfs=8)
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state"), connect="test:///default")
    return Service(cfg, licence_mode=licence_mode), root


def run_guest(svc: Service, root: Path, vm: str, **load: Any) -> dict[str, Any]:
    [a] = svc.allocations(vm=vm, live=True)
    uuid = next(d["uuid"] for d in svc.list_vms() if d["name"] == vm)
    ref = a["uuid"] or a["pci_address"]
    guests.start(root, ref, vm_uuid=uuid, vm_name=vm)
    guests.set_load(root, ref, **load)
    return {**a, "ref": ref, "vm_uuid": uuid}


def scrape(svc: Service) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    client = TestClient(create_app(svc.cfg, service=svc, watch=False, metrics_public=True))
    text = client.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def of(metrics: dict[Any, float], name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {k[1]: v for k, v in metrics.items()
            if k[0] == name and all(dict(k[1]).get(lk) == lv for lk, lv in labels.items())}


@pytest.fixture
def busy(tmp_path: Path) -> tuple[Service, Path, dict[str, dict[str, Any]]]:
    svc, root = host(tmp_path)
    svc.create_vm("cad", vgpus=["L40S-4Q"], start=True)
    svc.create_vm("ml", mig=["1g.10gb"], start=True)
    running = {
        "cad": run_guest(svc, root, "cad", sm=40, mem=25, enc=12, dec=3, jpg=1, ofa=0, fb_used_mb=1500,
                         encoder={"sessions": 2, "fps": 58, "latency_us": 9000}, fbc={"sessions": 1, "fps": 30,
                                                                                    "latency_us": 4000}),
        "ml": run_guest(svc, root, "ml", sm=85, mem=60, fb_used_mb=8000),
    }
    guests.set_licence(root, running["cad"]["vm_uuid"], "licensed", expiry=2_000_000_000)
    return svc, root, running


def test_metrics_equal_what_nvml_reports_for_each_vm(busy: tuple[Service, Path, dict[str, Any]]) -> None:
    svc, root, running = busy
    m = scrape(svc)
    nvml = svc.host.kernel.nvml_library()
    nvml.nvmlInit()
    for vm, a in running.items():
        [inst] = [i for i in guests.running(root) if i["vm_uuid"] == a["vm_uuid"]]
        util = of(m, "vgpumgr_vgpu_utilization_ratio", vm=vm)
        assert util, vm
        for labels, value in util.items():
            engine = dict(labels)["engine"]
            assert value == pytest.approx(engine_value(inst["load"], engine, inst["id"], 0) / 100)
        [fb] = of(m, "vgpumgr_vgpu_framebuffer_used_bytes", vm=vm).values()
        assert fb == nvml.nvmlVgpuInstanceGetFbUsage(inst["id"])
        [total] = of(m, "vgpumgr_vgpu_framebuffer_total_bytes", vm=vm).values()
        assert total == nvml.nvmlVgpuTypeGetFramebufferSize(inst["type_id"])
        labels = dict(next(iter(util)))
        assert labels["vm_uuid"] == a["vm_uuid"] and labels["gpu"] == a["gpu"] and labels["host"] == svc.hostname
        assert labels["type"] == a["type_name"].split()[-1]
    assert of(m, "vgpumgr_vgpu_encoder_sessions", vm="cad").popitem()[1] == 2
    assert of(m, "vgpumgr_vgpu_encoder_latency_seconds", vm="cad").popitem()[1] == pytest.approx(0.009)
    assert of(m, "vgpumgr_vgpu_fbc_fps", vm="cad").popitem()[1] == 30
    states = {dict(k)["state"]: v for k, v in of(m, "vgpumgr_vgpu_licence_state", vm="cad").items()}
    assert states["licensed"] == 1 and sum(states.values()) == 1
    assert of(m, "vgpumgr_vgpu_licence_expiry_timestamp_seconds", vm="cad").popitem()[1] == 2_000_000_000
    assert {dict(k)["state"] for k, v in of(m, "vgpumgr_vgpu_licence_state", vm="ml").items() if v} == \
        {"uninitialized"}
    # per GPU: the sum of its vGPUs, and its free slots per type
    [cad_gpu] = {dict(k)["gpu"] for k in of(m, "vgpumgr_vgpu_utilization_ratio", vm="cad")}
    assert of(m, "vgpumgr_gpu_vgpu_utilization_ratio", gpu=cad_gpu, engine="sm").popitem()[1] == pytest.approx(0.4)
    assert of(m, "vgpumgr_gpu_vgpus_running", gpu=cad_gpu).popitem()[1] == 1
    assert of(m, "vgpumgr_gpu_free_slots", gpu=cad_gpu, type="L40S-4Q")


def test_values_move_over_time_as_the_simulator_says(tmp_path: Path) -> None:
    svc, root = host(tmp_path)
    svc.create_vm("w", vgpus=["L40S-2Q"], start=True)
    a = run_guest(svc, root, "w", sm=50, wobble=20)
    seen = set()
    # the sine stays on one rounded value for up to 4.3 s at its peak and trough: six reads 1.1 s apart leave it
    for _ in range(6):
        snap = svc.telemetry()
        [row] = snap["vgpus"]
        [inst] = guests.running(root)
        # NVML was asked a moment after the snapshot's time stamp
        expected = {engine_value(inst["load"], "sm", inst["id"], snap["taken"] + dt / 100) / 100 for dt in range(50)}
        assert row["util"]["sm"] in expected
        seen.add(row["util"]["sm"])
        if len(seen) > 1:
            break
        time.sleep(1.1)
    assert len(seen) > 1 and a["ref"]


def test_renamed_vms_and_released_vgpus_disappear(busy: tuple[Service, Path, dict[str, Any]]) -> None:
    svc, root, running = busy
    assert of(scrape(svc), "vgpumgr_vgpu_utilization_ratio", vm="ml")
    guests.stop(root, running["ml"]["ref"])  # the VM stops: its vGPU is no longer running
    svc.stop_vm("ml")
    svc.release(running["ml"]["ref"])
    # rename "cad" in libvirt: the same domain (UUID) under a new name, as `virsh domrename` leaves it
    with svc.virt() as v:
        xml = v.xml("cad", inactive=True).replace("<name>cad</name>", "<name>cad-renamed</name>")
        v.stop("cad")
        v.undefine("cad")
        v.define(xml, validate=False)
        v.start("cad-renamed")
    m = scrape(svc)
    names = {dict(k)["vm"] for k in of(m, "vgpumgr_vgpu_utilization_ratio")}
    assert names == {"cad-renamed"}
    assert not [k for k in m if dict(k[1]).get("vm") in ("cad", "ml")]


def test_top_once_json_matches_metrics(busy: tuple[Service, Path, dict[str, Any]]) -> None:
    svc, root, _ = busy
    args = ("--sysfs-root", str(root), "--state-dir", str(svc.cfg.state_dir), "--connect", "test:///default")
    rc, out, _ = run(*args, "top", "--once", "--json")
    assert rc == 0
    snap = json.loads(out)
    m = scrape(svc)
    for row in snap["vgpus"]:
        for engine, value in row["util"].items():
            assert of(m, "vgpumgr_vgpu_utilization_ratio", vm=row["vm"], engine=engine).popitem()[1] == \
                pytest.approx(value)
        assert of(m, "vgpumgr_vgpu_framebuffer_used_bytes", vm=row["vm"]).popitem()[1] == row["fb_used_bytes"]
    assert [r["vm"] for r in snap["vgpus"]] == ["ml", "cad"]  # busiest first
    rc, text, _ = run(*args, "top", "--once")
    assert rc == 0 and text.splitlines()[0].split()[:3] == ["VM", "TYPE", "GPU"] and "licensed" in text


def test_sim_guest_cli_starts_loads_lists_and_stops_a_guest(tmp_path: Path) -> None:
    svc, root = host(tmp_path)
    svc.create_vm("web", vgpus=["L40S-4Q"])
    [a] = svc.allocations(vm="web", live=True)
    ref = a["uuid"] or a["pci_address"]
    args = ("--sysfs-root", str(root), "--state-dir", str(svc.cfg.state_dir), "--connect", "test:///default")
    rc, out, _ = run(*args, "sim", "guest", "list")
    assert rc == 0 and out.startswith("no simulated guest runs")
    rc, out, err = run(*args, "sim", "guest", "start", ref)  # the VM from the vGPU's record
    assert rc == 0, err
    rc, _, _ = run(*args, "sim", "guest", "load", ref, "--load", "sm=40", "--fb-used-mb", "300")
    assert rc == 0
    rc, out, _ = run(*args, "sim", "guest", "list", "--json")
    [g] = json.loads(out)
    assert (g["mdev_uuid"] or g["vf"], g["vm_name"], g["load"], g["fb_used_mb"]) == (ref, "web", {"sm": 40.0}, 300)
    assert [i["vm_name"] for i in guests.running(root)] == ["web"]  # what NVML now reports
    rc, out, _ = run(*args, "sim", "guest", "list")
    assert out.splitlines()[0].split() == ["ID", "GPU", "VGPU", "VM", "LOAD"] and "sm=40" in out
    rc, _, err = run(*args, "sim", "guest", "load", ref, "--load", "sm=lots")
    assert rc == 2 and "'sm=lots' is not ENGINE=PERCENT" in err
    rc, _, err = run(*args, "sim", "guest", "start", ref)
    assert rc == 2 and "already runs" in err
    rc, _, _ = run(*args, "sim", "guest", "stop", ref)
    assert rc == 0 and guests.running(root) == []
    (tmp_path / "real").mkdir()  # a tree that is no simulated host
    rc, _, err = run("--sysfs-root", str(tmp_path / "real"), "--state-dir", str(tmp_path / "s2"),
                     "--connect", "test:///default", "sim", "guest", "list")
    assert rc != 0 and "only works on a simulated root" in err


def test_licence_check_finds_each_seeded_drift_and_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    svc, root = host(tmp_path)
    with session_factory(svc.cfg.db_url).begin() as s:
        licensing.add_pool(s, name="ws", edition_name="vWS", seats=10)
        licensing.add_pool(s, name="pc", edition_name="vPC", seats=10)
    for vm, t in (("good", "L40S-2Q"), ("lapsed", "L40S-2Q"), ("young", "L40S-2Q"), ("wrong", "L40S-2B")):
        svc.create_vm(vm, vgpus=[t], start=True)
    # seeded: a guest licensed without a seat (its vGPU made while licences were off)
    svc.licence_mode = "off"
    svc.create_vm("free", vgpus=["L40S-2Q"], start=True)
    svc.licence_mode = "warn"
    state = {"good": "licensed", "lapsed": "unlicensed-restricted", "young": "uninitialized", "wrong": "licensed",
             "free": "licensed"}
    for vm, st in state.items():
        g = run_guest(svc, root, vm)
        guests.set_licence(root, g["vm_uuid"], st)
    # seeded: the B-series vGPU took a vPC seat; the pool is re-labelled vApps after the fact (an admin's
    # mistake), so its seat no longer covers a B-series vGPU
    with session_factory(svc.cfg.db_url).begin() as s:
        s.execute(licensing.LicencePool.__table__.update().where(licensing.LicencePool.name == "pc")
                  .values(edition="vApps"))
    args = ("--sysfs-root", str(root), "--state-dir", str(svc.cfg.state_dir), "--connect", "test:///default")
    rc, out, _ = run(*args, "license", "check", "--json")
    res = json.loads(out)
    assert rc == 10
    assert sorted((f["kind"], f["vm"]) for f in res["findings"]) == [
        ("edition-mismatch", "wrong"), ("licensed-without-seat", "free"), ("unlicensed-with-seat", "lapsed")]
    # the young guest has its grace period; past it, never licensed is a finding too
    monkeypatch.setenv("VGPUMGR_LICENCE_GRACE", "0")
    rc, out, _ = run(*args, "license", "check", "--json")
    assert ("unlicensed-with-seat", "young") in {(f["kind"], f["vm"]) for f in json.loads(out)["findings"]}
    rc, out, _ = run(*args, "license", "check", "--json")
    with session_factory(svc.cfg.db_url)() as s:
        drifts = [e.detail["key"] for e in audit.query(s, action="licence.drift")]
    assert sorted(drifts) == sorted(set(drifts)) and len(drifts) == 4  # each finding audited once


def test_no_vgpu_manager_means_no_data_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The real H100 (passthrough, driver 580.159.04) answered NotSupported to every vGPU call."""
    from test_nvml import REAL, ReplayNvml

    from vgpumgr.nvidia.nvml import NvmlLayer
    from vgpumgr.telemetry.read import Reader

    gpus, notices = Reader(NvmlLayer(ReplayNvml(REAL))).read()
    [gpu] = gpus
    assert gpu.vgpus == [] and "Not Supported" in (gpu.absent or "") and notices == []
    # and on the real H100 itself (scripts/nvml_vgpu_check.py ran the reader there, read-only)
    there = json.loads((Path(__file__).parent / "fixtures/nvml/h100-vgpu.json").read_text())["telemetry_reader"]
    assert there == {"notices": [], "gpus": [{"gpu": gpu.address, "vgpus": 0, "absent": gpu.absent}]}
    svc, _root = host(tmp_path)
    from vgpumgr.telemetry.sampler import Sampler

    sampler = Sampler(svc)
    sampler.reader = Reader(NvmlLayer(ReplayNvml(REAL)))
    caplog.set_level(logging.INFO, logger="vgpumgr.telemetry")
    for _ in range(3):
        snap = sampler.sample()
    assert snap["absent"][0]["gpu"] == gpu.address and snap["vgpus"] == []
    assert sum("no vGPU data" in r.message for r in caplog.records) == 1
    app = create_app(svc.cfg, service=svc, watch=False, metrics_public=True)
    assert "vgpumgr_gpu_vgpu_telemetry_absent" in TestClient(app).get("/metrics").text


def test_the_web_views_need_a_token(tmp_path: Path) -> None:
    svc, _ = host(tmp_path)
    tokens.create_token(svc.cfg, "reader", "auditor")
    assert TestClient(create_app(svc.cfg, service=svc, watch=False)).get("/v1/telemetry").status_code == 401


def test_the_grafana_dashboard_uses_only_metrics_the_service_exports(busy: tuple[Service, Path, dict[str, Any]]
                                                                     ) -> None:
    import re

    dashboard = json.loads((Path(__file__).resolve().parents[1] / "scripts/grafana/vgpumgr-vgpus.json").read_text())
    text = json.dumps(dashboard)
    client = TestClient(create_app(busy[0].cfg, service=busy[0], watch=False, metrics_public=True))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)", client.get("/metrics").text, re.M))  # guest ones when none read
    exported = set(types) | {f"{n}_{part}" for n, kind in types.items() if kind == "histogram"
                             for part in ("bucket", "count", "sum")}
    used = set(re.findall(r"vgpumgr_[a-z_]+", text))
    assert used and used <= exported, used - exported
    assert {"vgpumgr_fleet_place_seconds_bucket", "vgpumgr_fleet_publish_seconds_bucket"} <= used  # the fleet's p99s
    assert {p["type"] for p in dashboard["panels"]} == {"timeseries", "table"}
    assert any("vm" in json.dumps(p["targets"]) for p in dashboard["panels"])  # per VM
    assert any("vgpumgr_gpu_" in json.dumps(p["targets"]) for p in dashboard["panels"])  # per GPU
