"""Guest-side telemetry through the QEMU guest agent: opt-in per VM or pool, read by the vendor tool inside the
guest, parsed as untrusted input, cached by a sampler that no hung or lying agent can hold up. On the simulator:
a passthrough GPU whose guest reports utilisation shows in /metrics and `top` with source="guest"; blocked,
missing, hung, slow, huge and malformed answers are "unknown" with their reason, never 0, and change nothing but
that VM's row."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from simhost import run

from api import tokens
from api.app import create_app
from vgpumgr.config import Config
from vgpumgr.ops import guest_watch
from vgpumgr.service import Service
from vgpumgr.sim import guest_agent, guest_tools, profiles
from vgpumgr.telemetry import guest_exec, guest_parse
from vgpumgr.telemetry.guest_sampler import GuestSampler

T4 = "0000:3b:00.0"


# -- parsing: the guest's output is untrusted ------------------------------------------------------
def test_nvidia_smi_csv_is_read_and_na_is_unknown_not_zero() -> None:
    out = guest_parse.nvidia_smi(b"0, 580.65.06, 37, 5, 1024, 15360\n1, 580.65.06, [N/A], [Not Supported], "
                                 b"[N/A], 15360\n")
    assert out[0] == {"index": 0, "driver": "580.65.06", "util": {"gpu": 0.37, "memory": 0.05},
                      "memory_used_bytes": 1024 << 20, "memory_total_bytes": 15360 << 20}
    assert out[1]["util"] == {"gpu": None, "memory": None} and out[1]["memory_used_bytes"] is None


@pytest.mark.parametrize(("raw", "why"), [
    (b"0, 580.65.06, 250, 5, 1024, 15360\n", "outside 0..100"),
    (b"0, 580.65.06, nan, 5, 1024, 15360\n", "outside"),
    (b"0, 580.65.06, 1e400, 5, 1024, 15360\n", "outside"),
    (b"0, 580.65.06, 7, 5\n", "4 fields"),
    (b"0, 580.65.06, 7, 5, 2048, 1024\n", "2048 MiB used of 1024"),
    (b"0, 580.65.06, 7, 5, 1, 2\n0, 580.65.06, 7, 5, 1, 2\n", "given twice"),
    (b"0, $(reboot), 7, 5, 1, 2\n", "not a version"),
    (b"\xff\xfe, 1, 2\n", "not UTF-8"),
    (b"0, 580.65.06, 7, 5, 1, 2\x1b[2J\n", "control characters"),
    (b"".join(b"%d, 580.65.06, 7, 5, 1, 2\n" % i for i in range(17)), "more than the 16"),
    (b"\n\n", "no GPU"),
])
def test_output_that_is_not_a_reading_is_refused_whole(raw: bytes, why: str) -> None:
    with pytest.raises(guest_parse.Refused, match=why.replace("(", r"\(").replace("$", r"\$")):
        guest_parse.nvidia_smi(raw)


def test_npu_smi_usage_lines_are_read() -> None:
    out = guest_parse.npu_smi(b"  NPU Utilization(%)   : 42\n  Aicore Usage Rate(%) : 0\n  HBM Usage Rate(%) : 12\n")
    assert out[0]["util"] == {"gpu": 0.42, "memory": 0.12}
    with pytest.raises(guest_parse.Refused):
        guest_parse.npu_smi(b"NPU Utilization(%) : 42\nNPU Utilization(%) : 43\n")


# -- one read, against a scripted agent ------------------------------------------------------------
class Agent:
    def __init__(self, *, exec_enabled: bool = True, code: int = 0, out: bytes = b"0, 580.65.06, 9, 1, 1, 2\n",
                 truncated: bool | None = None, os_id: str = "debian") -> None:
        self.sent: list[tuple[str, Any]] = []
        self.exec_enabled, self.code, self.out, self.truncated, self.os_id = exec_enabled, code, out, truncated, os_id

    def __call__(self, command: str, arguments: dict[str, Any] | None, timeout: int) -> Any:
        self.sent.append((command, arguments))
        if command == "guest-info":
            return {"supported_commands": [{"name": n, "enabled": self.exec_enabled}
                                           for n in ("guest-exec", "guest-exec-status")]}
        if command == "guest-get-osinfo":
            return {"id": self.os_id}
        if command == "guest-exec":
            return {"pid": 7}
        status = {"exited": True, "exitcode": self.code, "out-data": base64.b64encode(self.out).decode()}
        return status if self.truncated is None else {**status, "out-truncated": self.truncated}


def test_a_read_runs_a_fixed_command_under_timeout_and_never_a_shell() -> None:
    agent = Agent()
    res = guest_exec.read(agent)
    assert res["state"] == "ok" and res["gpus"][0]["util"]["gpu"] == 0.09
    [(_, started)] = [s for s in agent.sent if s[0] == "guest-exec"]
    assert started["path"] == "timeout" and started["arg"][:4] == ["-s", "KILL", "5", "nvidia-smi"]
    assert started["arg"][4:] == list(guest_parse.NVIDIA_ARGS)
    windows = Agent(os_id="mswindows")
    guest_exec.read(windows)
    assert [s[1]["path"] for s in windows.sent if s[0] == "guest-exec"] == [guest_exec.WINDOWS_NVIDIA_SMI]


@pytest.mark.parametrize(("agent", "reason"), [
    (Agent(exec_enabled=False), "blocked"),
    (Agent(code=127, out=b""), "tool-missing"),
    (Agent(code=124, out=b""), "timed-out"),
    (Agent(code=3, out=b"NVIDIA-SMI has failed\n"), "failed"),
    (Agent(truncated=True), "refused"),
    (Agent(out=b"0, 580.65.06, 9, 1, 1, 2\n" * 4000), "refused"),
])
def test_each_failure_is_unknown_with_its_reason(agent: Agent, reason: str) -> None:
    res = guest_exec.read(agent)
    assert res["state"] == "unknown" and res["reason"] == reason and res["gpus"] == []
    if reason == "blocked":
        assert [c for c, _ in agent.sent] == ["guest-info"]  # a blocked guest-exec is not even tried


def test_a_tool_past_the_deadline_is_polled_once_at_the_next_read_so_the_agent_frees_it() -> None:
    class Stuck(Agent):
        def __call__(self, command: str, arguments: dict[str, Any] | None, timeout: int) -> Any:
            if command == "guest-exec-status" and self.stuck:
                self.sent.append((command, arguments))
                return {"exited": False}
            return super().__call__(command, arguments, timeout)

    agent = Stuck()
    agent.stuck = True
    res = guest_exec.read(agent, deadline_s=0.3, sleep=lambda s: None)
    assert (res["reason"], res["left_pid"]) == ("timed-out", 7) and res["gpus"] == []
    agent.stuck, agent.sent = False, []
    assert guest_exec.read(agent, left_pid=7)["state"] == "ok"
    assert agent.sent[:2] == [("guest-info", None), ("guest-exec-status", {"pid": 7})]


# -- the simulator: a passthrough GPU read from its guest --------------------------------------------
def host(tmp_path: Path) -> tuple[Service, Path]:
    root = profiles.create(tmp_path / "sim", "mixed", vfs=8)
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state"), connect="test:///default")
    return Service(cfg, licence_mode="warn"), root


def guest_of(svc: Service, vm: str) -> Path:
    uuid = next(d["uuid"] for d in svc.list_vms() if d["name"] == vm).lower()
    d = guest_agent.guest_dir(svc.cfg.state_dir / "libvirt-test", uuid)
    if guest_agent.describe(d) is None:
        guest_agent.define(svc.cfg.state_dir / "libvirt-test", uuid)
    return d


def settle(sampler: GuestSampler, client: TestClient | None = None) -> None:
    sampler.settle(30)
    assert not sampler.busy()
    if client is not None:  # the service's next sample (it takes one every few seconds) holds the readings
        client.app.state.sampler.sample()  # type: ignore[attr-defined]


def metrics(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def of(m: dict[Any, float], name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {k[1]: v for k, v in m.items() if k[0] == name and all(dict(k[1]).get(a) == b for a, b in labels.items())}


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[Service, TestClient]]:
    svc, _root = host(tmp_path)
    svc.create_vm("pt", passthrough=[T4], start=True)
    guest_tools.configure(guest_of(svc, "pt"), gpus=[{"util": 37, "mem_util": 4, "mem_used": 2048,
                                                      "mem_total": 15360}])
    app = create_app(svc.cfg, service=svc, watch=False, metrics_public=True)
    yield svc, TestClient(app)
    app.state.sampler.guests.stop()  # its libvirt connections would keep this test's domains alive


def test_guest_telemetry_is_off_until_chosen_then_a_passthrough_vm_shows_with_source_guest(
        lab: tuple[Service, TestClient]) -> None:
    svc, client = lab
    sampler = client.app.state.sampler.guests  # type: ignore[attr-defined]
    assert sampler.plan() == 0  # off by default: nothing is run in any guest
    assert not (guest_of(svc, "pt") / "agent.json").exists()
    guest_watch.set_vm(svc, "pt", "on")
    settle(sampler)
    m = metrics(client)
    assert of(m, "vgpumgr_vgpu_utilization_ratio", vm="pt", source="guest", engine="sm") == {
        tuple(sorted({"host": svc.hostname, "gpu": T4, "vm": "pt", "vm_uuid": sampler.readings()[0]["vm_uuid"],
                      "type": "Tesla T4", "vgpu": T4, "engine": "sm", "source": "guest"}.items())): 0.37}
    assert list(of(m, "vgpumgr_vgpu_framebuffer_used_bytes", vm="pt", source="guest").values()) == [2048 << 20]
    assert not of(m, "vgpumgr_guest_telemetry_unknown", vm="pt")
    guest_watch.set_vm(svc, "pt", "off")
    sampler.plan()
    assert sampler.readings() == []


def test_top_shows_the_guest_reading_with_its_source(tmp_path: Path) -> None:
    g = ("--sysfs-root", str(profiles.create(tmp_path / "sim", "mixed")), "--state-dir", str(tmp_path / "st"),
         "--connect", "test:///default")

    def ok(*argv: str) -> str:
        rc, out, err = run(*g, *argv)
        assert rc == 0, (argv, out, err)
        return out

    ok("vm", "create", "pt", "--passthrough", T4, "--start")
    ok("guests", "telemetry", "pt", "on")
    ok("sim", "guest", "agent", "--vm", "pt", "--gpu-util", "61")
    row = next(line.split() for line in ok("top", "--once").splitlines() if line.startswith("pt "))
    assert row[-1] == "guest" and "61" in row
    ok("sim", "guest", "agent", "--vm", "pt", "--exec", "block")
    assert "pt: guest reading unknown: guest-exec is blocked" in ok("top", "--once")
    snap = json.loads(ok("top", "--json"))
    assert snap["guests"][0]["reason"] == "blocked" and snap["guests"][0]["gpus"] == []


def test_a_pool_chooses_for_the_vms_holding_its_seats_and_a_vm_may_say_no(tmp_path: Path) -> None:
    svc, _root = host(tmp_path)
    with svc.tx() as s:
        from vgpumgr.licensing import seats as licensing

        licensing.add_pool(s, name="vws", edition_name="vWS", seats=4)
    svc.create_vm("a", passthrough=[T4], start=True)
    guest_watch.set_pool(svc, "vws", "on")
    assert guest_watch.enabled_vms(svc, ["a", "other"]) == {"a": "pool vws"}
    guest_watch.set_vm(svc, "a", "off")
    assert guest_watch.enabled_vms(svc, ["a"]) == {}


@pytest.mark.parametrize(("mode", "reason"), [("block", "blocked"), ("no-tool", "tool-missing"),
                                              ("huge", "refused"), ("malformed", "refused")])
def test_an_unusable_guest_is_unknown_with_its_reason_in_metrics(lab: tuple[Service, TestClient], mode: str,
                                                                  reason: str) -> None:
    svc, client = lab
    guest_tools.configure(guest_of(svc, "pt"), exec_mode=mode)
    guest_watch.set_vm(svc, "pt", "on")
    settle(client.app.state.sampler.guests)  # type: ignore[attr-defined]
    m = metrics(client)
    assert [dict(k)["reason"] for k in of(m, "vgpumgr_guest_telemetry_unknown", vm="pt")] == [reason]
    assert not of(m, "vgpumgr_vgpu_utilization_ratio", vm="pt")  # unknown is no sample, never 0


def test_hostile_output_changes_nothing_but_that_vms_readings(lab: tuple[Service, TestClient]) -> None:
    svc, client = lab
    svc.create_vm("vg", vgpus=["L40S-4Q"], start=True)
    guest_tools.configure(guest_of(svc, "vg"), gpus=[{"util": 12, "mem_util": 3, "mem_used": 100, "mem_total": 4096}])
    for vm in ("pt", "vg"):
        guest_watch.set_vm(svc, vm, "on")
    sampler = client.app.state.sampler.guests  # type: ignore[attr-defined]
    settle(sampler)
    before = {k: v for k, v in metrics(client).items() if dict(k[1]).get("vm") != "pt" and "timestamp" not in k[0]}
    other_uuid = sampler.readings()[1]["vm_uuid"]
    for hostile in (f'0, 580.65.06, 99, 99, 1, 2\n1, 580.65.06, 99, 99, 1, 2\nvm="vg",{other_uuid}\n',
                    '0, 580.65.06, 99, 99, 1, 2"} 1\nvgpumgr_vgpu_utilization_ratio{vm="vg"} 99\n'):
        guest_tools.configure(guest_of(svc, "pt"), output=hostile)
        sampler._due.clear()
        settle(sampler, client)
        m = metrics(client)
        after = {k: v for k, v in m.items() if dict(k[1]).get("vm") != "pt" and "timestamp" not in k[0]}
        assert after == before
        assert [dict(k)["reason"] for k in of(m, "vgpumgr_guest_telemetry_unknown", vm="pt")] == ["refused"]
        assert other_uuid not in client.get("/metrics").text.split('vm="vg"')[0]


def test_a_hung_agent_does_not_delay_metrics(lab: tuple[Service, TestClient]) -> None:
    svc, client = lab
    d = guest_of(svc, "pt")
    guest_tools.configure(d, exec_mode="hang")
    guest_watch.set_vm(svc, "pt", "on")
    sampler = client.app.state.sampler.guests  # type: ignore[attr-defined]
    sampler.deadline_s = 60.0  # the agent would keep the reader for a minute
    try:
        assert sampler.plan() == 1
        end = time.monotonic() + 30
        while not (d / guest_tools.HANG_FILE).exists() and time.monotonic() < end:
            time.sleep(0.01)
        assert (d / guest_tools.HANG_FILE).exists()  # the read is stuck in the agent
        reply = client.get("/metrics")
        assert reply.status_code == 200 and (d / guest_tools.HANG_FILE).exists()  # answered while still stuck
        m = metrics(client)
        assert [dict(k)["reason"] for k in of(m, "vgpumgr_guest_telemetry_unknown", vm="pt")] == ["pending"]
        assert sampler.plan() == 0  # a VM being read is not handed out again
    finally:
        guest_tools.release(d)
    settle(sampler)
    assert sampler.readings()[0]["reason"] == "timed-out"


def test_a_slow_tool_past_the_deadline_is_timed_out(lab: tuple[Service, TestClient]) -> None:
    svc, client = lab
    guest_tools.configure(guest_of(svc, "pt"), exec_mode="slow", slow_s=30)
    guest_watch.set_vm(svc, "pt", "on")
    sampler = client.app.state.sampler.guests  # type: ignore[attr-defined]
    sampler.deadline_s = 1.0
    settle(sampler)
    assert sampler.readings()[0]["reason"] == "timed-out"


def test_rest_chooses_per_vm_and_pool_and_checks_the_guests(lab: tuple[Service, TestClient]) -> None:
    svc, client = lab
    client.headers["Authorization"] = f"Bearer {tokens.create_token(svc.cfg, 'op', 'admin')}"
    assert client.put("/v1/guests/telemetry", json={"vm": "pt", "telemetry": "on"}).json() == {
        "vm": "pt", "telemetry": "on"}
    assert client.get("/v1/guests/telemetry").json() == {"vms": {"pt": True}, "pools": {}}
    both = client.put("/v1/guests/telemetry", json={"vm": "pt", "pool": "p", "telemetry": "on"})
    assert both.status_code == 400 and "either a VM or a pool" in both.text
    assert client.put("/v1/guests/telemetry", json={"vm": "pt", "telemetry": "yes"}).status_code == 422
    assert client.put("/v1/guests/telemetry", json={"pool": "nope", "telemetry": "on"}).status_code == 404
    res = client.post("/v1/guests/check", params={"driver": "595.58.02"})
    assert res.status_code == 200 and res.json()["findings"] == []  # a passthrough VM has no vGPU metadata
    assert client.post("/v1/guests/check", params={"driver": "x"}).status_code == 400
