"""Pushing the licence token into a running guest through the QEMU guest agent (docs/sources.md §23).

The agent's own commands, sent with libvirt's qemuAgentCommand: `guest-get-osinfo` tells Windows (`mswindows`)
from Linux; `guest-file-open` / `guest-file-write` (base64, in chunks) / `guest-file-close` write the token
under NVIDIA's name into the guest's token directory; `guest-exec` restarts the licensing service
(`systemctl restart nvidia-gridd` on Linux, PowerShell's `Restart-Service NVDisplay.ContainerLocalSystem` on
Windows) and `guest-exec-status` waits for it. The token's bytes only ever travel inside the agent channel.
"""

from __future__ import annotations

import base64
import time
from typing import Any

from vgpumgr.errors import Conflict, Timeout, VgpuError

CHUNK = 48 * 1024  # raw bytes per guest-file-write (QGA reads at most 48 MiB a command; a token is a few KiB)
LINUX_DIR = "/etc/nvidia/ClientConfigToken"
WINDOWS_DIR = "C:\\Program Files\\NVIDIA Corporation\\vGPU Licensing\\ClientConfigToken"
LINUX_SERVICE = "nvidia-gridd"
WINDOWS_SERVICE = "NVDisplay.ContainerLocalSystem"


def target(os_id: str, file_name: str) -> tuple[str, str, str, list[str]]:
    """(os, token path, service, restart command) for a guest whose agent reports `os_id`."""
    if os_id == "mswindows":
        return ("windows", f"{WINDOWS_DIR}\\{file_name}", WINDOWS_SERVICE,
                ["powershell.exe", "-NoProfile", "-NonInteractive", "-Command",
                 f"Restart-Service -Name {WINDOWS_SERVICE} -Force"])
    return "linux", f"{LINUX_DIR}/{file_name}", LINUX_SERVICE, ["systemctl", "restart", LINUX_SERVICE]


def push_token(virt: Any, vm: str, data: bytes, file_name: str, *, wait_s: float = 30.0) -> dict[str, Any]:
    try:
        return _push(virt, vm, data, file_name, wait_s)
    except VgpuError as e:
        if type(e) is not VgpuError:  # not found, unavailable (no agent), ...: already precise
            raise
        raise Conflict(e.message, hint="the guest refused: is NVIDIA's guest driver installed (it creates the token "
                                       "directory) and the agent allowed to write files and run commands?") from e


def _push(virt: Any, vm: str, data: bytes, file_name: str, wait_s: float) -> dict[str, Any]:
    osinfo = virt.agent(vm, "guest-get-osinfo") or {}
    os_name, path, service, restart = target(str(osinfo.get("id", "")), file_name)
    handle = virt.agent(vm, "guest-file-open", {"path": path, "mode": "wb"})
    try:
        for i in range(0, len(data), CHUNK):
            virt.agent(vm, "guest-file-write", {"handle": handle,
                                                "buf-b64": base64.b64encode(data[i:i + CHUNK]).decode()})
    finally:
        virt.agent(vm, "guest-file-close", {"handle": handle})
    pid = virt.agent(vm, "guest-exec", {"path": restart[0], "arg": restart[1:], "capture-output": True})["pid"]
    deadline = time.monotonic() + wait_s
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = virt.agent(vm, "guest-exec-status", {"pid": pid}) or {}
        if status.get("exited"):
            break
        time.sleep(0.2)
    if not status.get("exited"):
        raise Timeout(f"VM {vm}: the token is in {path}, but restarting {service} did not finish in {wait_s:g} s",
                        hint=f"restart {service} in the guest, or run `vgpumgr license deliver {vm}` again")
    code = status.get("exitcode")
    if code != 0:
        raise Conflict(f"VM {vm}: the token is in {path}, but restarting {service} exited with {code}",
                        hint=f"is NVIDIA's guest driver installed in the guest? ({service} restarts the licensing)")
    return {"os": os_name, "path": path, "service": service, "restarted": True}
