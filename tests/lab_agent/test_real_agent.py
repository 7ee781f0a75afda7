"""Guest-side telemetry through a real QEMU guest agent (issue 40), run by scripts/agent-lab.

The agent guest boots Debian 13's kernel with Debian 13's qemu-guest-agent and a stand-in `nvidia-smi` that prints
the real tool's CSV shape (scripts/agent-guest/), under a libvirtd of its own. vgpumgr reads it as it reads any VM
chosen for guest telemetry: its own libvirt connection, the domain's org.qemu.guest_agent.0 channel, `guest-info`,
`guest-exec` of `timeout ... nvidia-smi ...`, `guest-exec-status`. The guest's admin then blocks guest-exec in the
agent's RPC filter (as RHEL's default filter does): vgpumgr must report it as blocked, never as a zero reading.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

VM = "agent-vm"
VGPUMGR = str(Path(sys.executable).parent / "vgpumgr")


def wait_for(what: str, check: Any, timeout: float, every: float = 1.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


def domain_xml(serial_log: str) -> str:
    return (f"<domain type='qemu'><name>{VM}</name><memory unit='MiB'>192</memory><vcpu>1</vcpu>"
            "<os><type arch='x86_64' machine='pc'>hvm</type>"
            f"<kernel>{os.environ['AGENT_KERNEL']}</kernel><initrd>{os.environ['AGENT_INITRD']}</initrd>"
            "<cmdline>console=ttyS0 quiet panic=-1</cmdline></os><on_reboot>destroy</on_reboot><devices>"
            f"<serial type='file'><source path='{serial_log}'/><target port='0'/></serial>"
            "<channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>"
            "</devices></domain>")


class Lab:
    def __init__(self, root: Path) -> None:
        import libvirt

        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        self.conn = libvirt.open("qemu:///system")  # scripts/agent-lab's own libvirtd
        self.state = root / "state"
        self.serial = root / "agent-vm.serial.log"
        self.sock = root / "api.sock"

    def agent(self, command: str, arguments: dict[str, Any] | None = None, timeout: int = 30) -> Any:
        """One agent command sent by the test itself (the guest's admin), not through vgpumgr."""
        import libvirt_qemu

        message = {"execute": command, **({"arguments": arguments} if arguments else {})}
        dom = self.conn.lookupByName(VM)
        return json.loads(libvirt_qemu.qemuAgentCommand(dom, json.dumps(message), timeout, 0))["return"]

    def exec_enabled(self) -> bool | None:
        try:
            cmds = self.agent("guest-info", timeout=10)["supported_commands"]
        except Exception:  # noqa: BLE001 - not connected yet, or restarting
            return None
        return {c["name"]: c["enabled"] for c in cmds}.get("guest-exec")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([VGPUMGR, "--state-dir", str(self.state), "--connect", "qemu:///system", *args],
                              capture_output=True, text=True, timeout=120)

    def row(self) -> dict[str, Any]:
        """The VM's guest-side reading as a one-shot `vgpumgr top --json` gives it (a fresh process, a fresh read)."""
        r = self.cli("top", "--json")
        assert r.returncode == 0, r.stderr
        rows = [g for g in json.loads(r.stdout)["guests"] if g["vm"] == VM]
        assert len(rows) == 1, f"no guest reading for {VM}: {r.stdout[:2000]}"
        return rows[0]

    def metrics(self) -> str:
        from vgpumgr.fleet.remote import UnixHTTPConnection

        conn = UnixHTTPConnection(str(self.sock))
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            body = resp.read().decode()
            assert resp.status == 200, (resp.status, body[:500])
            return body
        finally:
            conn.close()


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    root = Path(os.environ["AGENT_LAB_DIR"])
    lab = Lab(root)
    dom = lab.conn.defineXML(domain_xml(str(lab.serial)))
    started = time.monotonic()
    dom.create()
    service = None
    try:
        wait_for("the agent guest's qemu-ga", lambda: lab.exec_enabled() is True, timeout=600, every=1)
        print(f"\n[agent lab] qemu-ga answered {time.monotonic() - started:.1f} s after the domain started")
        env = dict(os.environ, VGPUMGR_GUEST_TELEMETRY_INTERVAL="5")
        service = subprocess.Popen([VGPUMGR, "--state-dir", str(lab.state), "--connect", "qemu:///system", "serve",
                                    "--socket", str(lab.sock)], env=env, stdout=subprocess.DEVNULL,
                                   stderr=open(root / "serve.log", "wb"))  # noqa: SIM115 - the child keeps it
        wait_for("vgpumgr serve's socket", lambda: lab.sock.exists(), timeout=60, every=0.2)
        yield lab
    finally:
        if service is not None:
            service.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                service.wait(timeout=30)
        with contextlib.suppress(OSError):
            print(f"[agent lab] console:\n{lab.serial.read_text(errors='replace')[-2000:]}")
        with contextlib.suppress(Exception):
            dom.destroy()
        with contextlib.suppress(Exception):
            dom.undefine()


def test_a_real_agent_is_read_then_its_block_is_reported(lab: Lab) -> None:
    r = lab.cli("guests", "telemetry", VM, "on")
    assert r.returncode == 0, r.stderr

    # the one-shot CLI: libvirt, the agent channel, guest-exec of the stand-in, its CSV parsed
    row = lab.row()
    assert row["state"] == "ok", row
    assert row["source"] == "guest" and row["chosen"] == "vm"
    [gpu] = row["gpus"]
    assert gpu["util"] == {"gpu": 0.37, "memory": 0.12}
    assert gpu["driver"] == "580.95.05"
    assert gpu["memory_used_bytes"] == 1024 << 20 and gpu["memory_total_bytes"] == 46068 << 20
    text = lab.cli("top", "--once").stdout
    assert re.search(rf"^{VM}\s.*\s37%?\s.*\bguest\s*$", text, re.M), text

    # the service's sampler, then /metrics with the source named
    util = re.compile(rf'vgpumgr_vgpu_utilization_ratio{{[^}}]*vm="{VM}"[^}}]*source="guest",engine="sm"}} 0\.37')
    wait_for("/metrics with the guest's utilisation", lambda: util.search(lab.metrics()), timeout=120, every=2)

    # the guest's admin blocks guest-exec: the agent restarts with its new filter
    lab.agent("guest-exec", {"path": "qga-policy", "arg": ["block"]})
    wait_for("the agent with guest-exec blocked", lambda: lab.exec_enabled() is False, timeout=120, every=1)
    row = lab.row()
    assert row["state"] == "unknown" and row["reason"] == "blocked", row
    assert row["gpus"] == [] and "blocked by the guest's agent policy" in row["why"]
    blocked = re.compile(rf'vgpumgr_guest_telemetry_unknown{{[^}}]*vm="{VM}"[^}}]*reason="blocked"}} 1\.0')
    wait_for("/metrics naming the block", lambda: blocked.search(lab.metrics()), timeout=120, every=2)
    assert not [ln for ln in lab.metrics().splitlines() if ln.startswith("vgpumgr_vgpu_utilization_ratio{")
                and f'vm="{VM}"' in ln], "a blocked guest must not keep a utilisation reading"
