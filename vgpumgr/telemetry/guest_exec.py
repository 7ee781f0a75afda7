"""One guest-side reading of a VM's GPUs through the QEMU guest agent (docs/sources.md §25).

Steps, each with its own deadline (libvirt's agent timeout, in whole seconds): `guest-info` says whether the
agent allows `guest-exec` (a guest whose policy blocks it is not asked); `guest-get-osinfo` picks the command
(Linux: the tool under coreutils' `timeout`, as qemu-ga has no timeout of its own; Windows: the tool's absolute
path); `guest-exec` starts it with its output captured; `guest-exec-status` is polled until it exits or the
reading's deadline passes. The output is decoded only if its base64 is within the bound, and parsed as untrusted
input (vgpumgr.telemetry.guest_parse). Nothing but fixed argument vectors is ever sent: no shell, nothing from
the guest, nothing from the VM's name.

Every failure becomes "unknown" with one of REASONS, never 0.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Callable
from typing import Any

from vgpumgr.errors import GuestNotReady, Timeout, Unavailable, VgpuError
from vgpumgr.telemetry import guest_parse

REASONS = {  # reason -> what the operator reads
    "no-agent": "no guest agent answers",
    "blocked": "guest-exec is blocked by the guest's agent policy",
    "tool-missing": "the vendor tool is not installed in the guest",
    "timed-out": "the guest did not answer in time",
    "refused": "the guest's output was refused",
    "failed": "the vendor tool failed in the guest",
    "not-running": "the VM is not running",
    "pending": "not read yet",
}
MAX_OUTPUT = 64 * 1024  # bytes of tool output read; a CSV line per GPU is < 1 KiB (libvirt allows 10 MiB)
TOOL_TIMEOUT_S = 5  # the guest's own `timeout` for the tool
LINUX_TOOLS = {"nvidia": ("nvidia-smi", guest_parse.NVIDIA_ARGS, guest_parse.nvidia_smi),
               "ascend": ("npu-smi", guest_parse.NPU_ARGS, guest_parse.npu_smi)}
WINDOWS_NVIDIA_SMI = "C:\\Windows\\System32\\nvidia-smi.exe"
_MISSING = ("no such file", "not found", "cannot find", "failed to execute child process")


class Unknown(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def unknown(reason: str, detail: str = "") -> dict[str, Any]:
    return {"state": "unknown", "reason": reason, "why": REASONS[reason] + (f" ({detail})" if detail else ""),
            "gpus": []}


def read(agent: Callable[..., Any], vendor: str = "nvidia", *, deadline_s: float = 10.0, os_id: str | None = None,
         left_pid: int | None = None, sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """`agent(command, arguments, timeout)` sends one agent command (vgpumgr.virt.driver's agent, bound to one VM).
    Returns {"state": "ok", "gpus": [...], "os": ...} or unknown(reason); "left_pid": a tool still running when the
    deadline passed, whose record the agent keeps until it is polled (`left_pid` of the next read polls it once)."""
    end = time.monotonic() + deadline_s
    pid = None
    try:
        _allowed(_call(agent, "guest-info", None, end))
        if left_pid is not None:
            try:  # qemu-ga frees an exec record only once its exit was reported
                _call(agent, "guest-exec-status", {"pid": left_pid}, end)
            except Unknown:
                pass
        if os_id is None:
            os_id = str((_call(agent, "guest-get-osinfo", None, end) or {}).get("id", ""))
        path, args, parse = _command(vendor, os_id)
        started = _call(agent, "guest-exec", {"path": path, "arg": list(args), "capture-output": True}, end)
        pid = started.get("pid") if isinstance(started, dict) else None
        if not isinstance(pid, int):
            pid = None
            raise Unknown("refused", "guest-exec gave no pid")
        status = _wait(agent, pid, end, sleep)
        pid = None  # reported as exited: the agent freed its record
        out = _output(status)
        return {"state": "ok", "gpus": parse(out), "os": os_id, "reason": None, "why": ""}
    except Unknown as u:
        return {**unknown(u.reason, u.detail), "os": os_id, "left_pid": pid}
    except guest_parse.Refused as r:
        return {**unknown("refused", str(r)), "os": os_id}


def _budget(end: float) -> int:
    left = end - time.monotonic()
    if left <= 0:
        raise Unknown("timed-out")
    return max(1, int(left))


def _call(agent: Callable[..., Any], command: str, arguments: dict[str, Any] | None, end: float) -> Any:
    try:
        return agent(command, arguments, _budget(end))
    except Timeout:
        raise Unknown("timed-out") from None
    except (Unavailable, GuestNotReady) as e:  # "Guest agent is not responding: ... is not connected" (none)
        text = e.message.lower()  # or "...: Guest agent not available for now" (no answer in time)
        raise Unknown("no-agent" if "not connected" in text or "not configured" in text else "timed-out") from None
    except VgpuError as e:
        text = e.message.lower()
        if "not configured" in text or "not connected" in text:
            raise Unknown("no-agent") from None
        if "not running" in text:
            raise Unknown("not-running") from None
        if "disabled" in text:  # QEMU: "Command guest-exec has been disabled" (the code is a generic error)
            raise Unknown("blocked") from None
        if command == "guest-exec" and any(m in text for m in _MISSING):
            raise Unknown("tool-missing") from None
        if "timed out" in text or "timeout" in text:
            raise Unknown("timed-out") from None
        raise Unknown("failed", command) from None


def _allowed(info: Any) -> None:
    cmds = info.get("supported_commands") if isinstance(info, dict) else None
    if not isinstance(cmds, list):
        raise Unknown("refused", "guest-info lists no commands")
    enabled = {c.get("name"): c.get("enabled") for c in cmds if isinstance(c, dict)}
    for name in ("guest-exec", "guest-exec-status"):
        if enabled.get(name) is not True:
            raise Unknown("blocked", f"{name} not enabled")


def _command(vendor: str, os_id: str) -> tuple[str, tuple[str, ...], Callable[[bytes], list[dict[str, Any]]]]:
    tool = LINUX_TOOLS.get(vendor)
    if tool is None:
        raise Unknown("tool-missing", f"vgpumgr has no guest reader for {vendor} slices yet")
    name, args, parse = tool
    if os_id == "mswindows":
        if vendor != "nvidia":
            raise Unknown("tool-missing", f"no {name} for Windows")
        return WINDOWS_NVIDIA_SMI, args, parse
    return "timeout", ("-s", "KILL", str(TOOL_TIMEOUT_S), name, *args), parse


def _wait(agent: Callable[..., Any], pid: int, end: float, sleep: Callable[[float], None]) -> dict[str, Any]:
    pause = 0.05
    while True:
        status = _call(agent, "guest-exec-status", {"pid": pid}, end)
        if not isinstance(status, dict):
            raise Unknown("refused", "guest-exec-status is not an object")
        if status.get("exited") is True:
            return status
        if time.monotonic() + pause >= end:
            raise Unknown("timed-out", "the tool was still running")
        sleep(pause)
        pause = min(pause * 2, 0.5)


def _output(status: dict[str, Any]) -> bytes:
    code = status.get("exitcode")
    if code in (124, 137) or status.get("signal") == 9:
        raise Unknown("timed-out", f"the tool ran past {TOOL_TIMEOUT_S} s in the guest")
    if code in (126, 127):
        raise Unknown("tool-missing")
    if status.get("out-truncated") is True:
        raise Unknown("refused", "the guest's agent truncated the output")
    data = status.get("out-data", "")
    if not isinstance(data, str):
        raise Unknown("refused", "out-data is not text")
    if len(data) > (MAX_OUTPUT * 4) // 3 + 4:
        raise Unknown("refused", f"more than {MAX_OUTPUT // 1024} KiB of output")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise Unknown("refused", "out-data is not base64") from None
    if code != 0:
        raise Unknown("failed", f"exit status {code}" if isinstance(code, int) else "no exit status")
    return raw
