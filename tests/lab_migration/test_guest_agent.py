"""Guest-side telemetry through a real QEMU guest agent (issue 40), in the Debian 13 lab.

Lab host a's libvirtd runs the agent guest (agent_guest.py): Debian 13's kernel and qemu-guest-agent, and a
stand-in `nvidia-smi` that prints the real tool's CSV shape. Host a's vgpumgr service reads it as it reads any VM
chosen for guest telemetry: its own libvirt connection, the domain's agent channel, `guest-info`, `guest-exec` of
`timeout ... nvidia-smi ...`, `guest-exec-status`. The guest then blocks guest-exec in its agent's RPC filter (as
RHEL's default filter does) and vgpumgr must report it as blocked, never as a zero reading.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from agent_guest import AGENT_BOOT, INITRD, SERIAL_LOG, VM
from lab_hosts import LabHost, _UnixHTTP, wait_for

BOOT_S = 900  # the agent guest is emulated by an emulated CPU: its boot takes minutes (it began at collection)
READ_S = 180  # the service plans every 10 s and reads a chosen VM every 30 s; a read under TCG takes seconds


def agent(host: LabHost, command: str, arguments: dict[str, Any] | None = None, timeout: int = 30) -> Any:
    """One agent command sent by the test itself (the guest's admin), not through vgpumgr."""
    import libvirt_qemu

    message = {"execute": command, **({"arguments": arguments} if arguments else {})}
    return json.loads(libvirt_qemu.qemuAgentCommand(host.domain(VM), json.dumps(message), timeout, 0))["return"]


def exec_enabled(host: LabHost) -> bool | None:
    """guest-exec's `enabled` in guest-info; None while the agent does not answer."""
    try:
        cmds = agent(host, "guest-info", timeout=10)["supported_commands"]
    except Exception:  # noqa: BLE001 - not connected yet, or restarting
        return None
    return {c["name"]: c["enabled"] for c in cmds}.get("guest-exec")


def metrics(host: LabHost) -> str:
    token = (host.dir / "etc-vgpumgr" / "admin.token").read_text().strip()
    conn = _UnixHTTP(str(host.dir / "run-vgpumgr" / "api.sock"), 60)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.status
        return resp.read().decode()
    finally:
        conn.close()


def guest_row(host: LabHost, state: str) -> dict[str, Any] | None:
    """The VM's guest-side reading in the service's newest telemetry (GET /v1/telemetry), once it is `state`."""
    rows = [g for g in host.ok("GET", "/v1/telemetry")["guests"] if g["vm"] == VM]
    return rows[0] if rows and rows[0]["state"] == state else None


@pytest.fixture
def agent_vm(request: pytest.FixtureRequest, hosts: tuple[LabHost, LabHost]) -> Iterator[LabHost]:
    a = hosts[0]
    boot = request.config.stash.get(AGENT_BOOT, None)
    assert boot is not None, f"the agent guest was not started at collection ({INITRD} built by mdev-lab-trixie?)"
    assert boot.wait(timeout=300) == 0, "defining or starting the agent guest failed"
    started = time.monotonic()
    try:
        wait_for("the agent guest's qemu-ga", lambda: exec_enabled(a) is True, timeout=BOOT_S, every=5)
        print(f"\n[agent guest] qemu-ga answered; waited {time.monotonic() - started:.0f} s for it here")
        yield a
    finally:
        with contextlib.suppress(OSError):
            log = (a.dir / "log-libvirt" / SERIAL_LOG.removeprefix("/var/log/libvirt/")).read_text(errors="replace")
            print(f"[agent guest] console:\n{log[-2000:]}")
        with contextlib.suppress(Exception):
            a.api("PUT", "/v1/guests/telemetry", {"vm": VM, "telemetry": "default"})
        a.remove_domain(VM)


def test_reads_a_real_agent_then_reports_its_block(agent_vm: LabHost) -> None:
    a = agent_vm
    assert a.ok("PUT", "/v1/guests/telemetry", {"vm": VM, "telemetry": "on"})["telemetry"] == "on"

    # the service's sampler: libvirt, the agent channel, guest-exec of the stand-in, its CSV parsed
    row = wait_for("the guest's reading", lambda: guest_row(a, "ok"), timeout=READ_S, every=3)
    assert row["source"] == "guest" and row["chosen"] == "vm"
    [gpu] = row["gpus"]
    assert gpu["util"] == {"gpu": 0.37, "memory": 0.12}
    assert gpu["driver"] == "580.95.05"
    assert gpu["memory_used_bytes"] == 1024 << 20 and gpu["memory_total_bytes"] == 46068 << 20
    util = re.compile(rf'vgpumgr_vgpu_utilization_ratio{{[^}}]*vm="{VM}"[^}}]*source="guest",engine="sm"}} 0\.37')
    assert util.search(metrics(a)), "/metrics lacks the guest's utilisation with source=\"guest\""

    # the guest's admin blocks guest-exec (the agent restarts with its new filter)
    agent(a, "guest-exec", {"path": "qga-policy", "arg": ["block"]})
    wait_for("the agent with guest-exec blocked", lambda: exec_enabled(a) is False, timeout=300, every=3)
    row = wait_for("the block reported", lambda: guest_row(a, "unknown"), timeout=READ_S, every=3)
    assert row["reason"] == "blocked", row
    assert row["gpus"] == [] and "blocked by the guest's agent policy" in row["why"]
    text = metrics(a)
    assert re.search(rf'vgpumgr_guest_telemetry_unknown{{[^}}]*vm="{VM}"[^}}]*reason="blocked"}} 1\.0', text)
    assert not [ln for ln in text.splitlines() if ln.startswith("vgpumgr_vgpu_utilization_ratio{")
                and f'vm="{VM}"' in ln], "a blocked guest must not keep a utilisation reading"
