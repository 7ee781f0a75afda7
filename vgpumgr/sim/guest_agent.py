"""The simulated guest OS of a test-driver VM and its QEMU guest agent (docs/sources.md §23).

libvirt's test driver has no guest agent; vgpumgr.virt.driver answers `test:///` agent commands from here. A simulated
guest lives in `<state>/libvirt-test/guests/<vm-uuid>/`: `guest.json` (its OS and how it licenses, written by
`vgpumgr sim guest start`), `fs/` (its file system: `/etc/x` is `fs/etc/x`, `C:\\x` is `fs/C/x`) and
`services.log` (each service restart, with its time).

The commands and their JSON are QEMU's guest agent protocol (qga/qapi-schema.json): `guest-info`,
`guest-get-osinfo` (`id` is `mswindows` on Windows, the os-release ID on Linux), `guest-file-open` (a handle),
`guest-file-write` (`buf-b64`, answers `count`), `guest-file-close`, `guest-exec` (answers `pid`) and
`guest-exec-status` (`exited`, `exitcode`). Errors read as libvirt reports a failing agent command; a VM
without a simulated guest answers as libvirt does when no agent is connected.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import time
from collections.abc import Iterator
from pathlib import Path, PureWindowsPath
from typing import Any

from vgpumgr.errors import GuestNotReady, Unavailable, VgpuError
from vgpumgr.sim import guest_tools

GUEST_FILE = "guest.json"
WINDOWS_IDS = ("mswindows",)
SERVICES = {"linux": "nvidia-gridd", "windows": "NVDisplay.ContainerLocalSystem"}


def guest_dir(libvirt_state: Path, vm_uuid: str) -> Path:
    return Path(libvirt_state) / "guests" / vm_uuid


def define(libvirt_state: Path, vm_uuid: str, *, os_id: str = "debian", licensing: str = "token",
           agent: bool = True) -> Path:
    """Create (or update) the simulated guest of a VM: its OS (`debian`, `mswindows`, ...), whether it licenses
    once a token arrived (`token`) or never (`never`), and whether its guest agent runs."""
    from vgpumgr.guest import agent as host_agent

    d = guest_dir(libvirt_state, vm_uuid)
    windows = os_id in WINDOWS_IDS
    # NVIDIA's guest driver is installed: its token directory exists
    host_path(d, host_agent.WINDOWS_DIR if windows else host_agent.LINUX_DIR, windows).mkdir(parents=True,
                                                                                             exist_ok=True)
    (d / GUEST_FILE).write_text(json.dumps({"os": os_id, "licensing": licensing, "agent": agent}))
    from vgpumgr.virt.driver import TEST_AGENT_FILE

    (d.parent / TEST_AGENT_FILE).write_text(f"{__name__}:SimAgent\n")  # vgpumgr.virt.driver loads it for test:///
    return d


def describe(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / GUEST_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_windows(info: dict[str, Any]) -> bool:
    return info.get("os") in WINDOWS_IDS


def host_path(d: Path, guest_path: str, windows: bool) -> Path:
    """Where a guest path lives in the simulated guest's file system."""
    if windows:
        p = PureWindowsPath(guest_path)
        if not p.drive:
            raise ValueError(f"{guest_path} is not an absolute Windows path")
        return d / "fs" / p.drive.rstrip(":") / Path(*p.parts[1:])
    if not guest_path.startswith("/") or ".." in guest_path.split("/"):
        raise ValueError(f"{guest_path} is not an absolute path")
    return d / "fs" / guest_path.lstrip("/")


class SimAgent:
    def __init__(self, libvirt_state: Path, vm_uuid: str) -> None:
        self.dir = guest_dir(libvirt_state, vm_uuid)

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict[str, Any]]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".agent.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.dir / "agent.json"
            state = json.loads(path.read_text()) if path.is_file() else {"handles": {}, "next": 1000, "exec": {}}
            yield state
            path.write_text(json.dumps(state))

    def execute(self, vm: str, message: dict[str, Any], timeout: float = 10) -> Any:
        info = describe(self.dir)
        if info is None or not info.get("agent", True):
            raise GuestNotReady(f"guest agent of VM '{vm}' ({message.get('execute')}): Guest agent is not responding: "
                              "QEMU guest agent is not connected",
                              hint="install and start the QEMU guest agent in the guest (qemu-guest-agent)")
        command, args = message.get("execute"), message.get("arguments") or {}
        if guest_tools.tools(info)["exec"] == "hang":
            guest_tools.hang(self.dir, timeout)
            raise Unavailable(f"guest agent of VM '{vm}' ({command}): Guest agent is not responding: Guest agent not "
                              "available for now", hint="the guest's agent does not answer")
        handler = getattr(self, "_" + str(command).replace("-", "_"), None)
        if handler is None:
            self._fail(vm, command, f"The command {command} has not been found")
        if command in ("guest-exec", "guest-exec-status") and guest_tools.tools(info)["exec"] == "block":
            self._fail(vm, command, f"Command {command} has been disabled")
        try:
            return handler(info, args)
        except (OSError, ValueError, KeyError) as exc:
            self._fail(vm, command, str(exc))

    @staticmethod
    def _fail(vm: str, command: Any, desc: str) -> None:
        raise VgpuError(f"guest agent of VM '{vm}' ({command}): internal error: unable to execute QEMU agent "
                        f"command '{command}': {desc}", hint="the guest's agent refused; see its message")

    def _guest_info(self, info: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        blocked = ("guest-exec", "guest-exec-status") if guest_tools.tools(info)["exec"] == "block" else ()
        return {"version": "7.2.0", "supported_commands": [
            {"name": n, "enabled": n not in blocked, "success-response": True}
            for n in ("guest-info", "guest-get-osinfo", "guest-file-open", "guest-file-write", "guest-file-close",
                      "guest-exec", "guest-exec-status")]}

    def _guest_get_osinfo(self, info: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        if is_windows(info):
            return {"id": "mswindows", "name": "Microsoft Windows", "pretty-name": "Windows Server 2022 Datacenter",
                    "kernel-release": "20348", "machine": "x86_64", "version": "Microsoft Windows Server 2022"}
        return {"id": info.get("os", "debian"), "name": "Debian GNU/Linux", "pretty-name": "Debian GNU/Linux 12",
                "kernel-release": "6.1.0-28-amd64", "machine": "x86_64", "version-id": "12"}

    def _guest_file_open(self, info: dict[str, Any], args: dict[str, Any]) -> int:
        path = host_path(self.dir, args["path"], is_windows(info))
        mode = args.get("mode", "r")
        if not path.parent.is_dir():
            raise OSError(f"failed to open file '{args['path']}' (mode: '{mode}'): No such file or directory")
        if "w" in mode:
            path.write_bytes(b"")
        with self._state() as st:
            handle = st["next"]
            st["next"] += 1
            st["handles"][str(handle)] = {"path": str(path), "mode": mode}
        return handle

    def _guest_file_write(self, info: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        data = base64.b64decode(args["buf-b64"])
        with self._state() as st:
            h = st["handles"].get(str(args["handle"]))
            if h is None:
                raise ValueError(f"handle '{args['handle']}' has not been found")
            with open(h["path"], "ab") as f:
                f.write(data)
        return {"count": len(data), "eof": False}

    def _guest_file_close(self, info: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        with self._state() as st:
            if st["handles"].pop(str(args["handle"]), None) is None:
                raise ValueError(f"handle '{args['handle']}' has not been found")
        return {}

    def _guest_exec(self, info: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        """Only what a licence delivery runs: a service restart (systemctl on Linux, PowerShell's Restart-Service
        on Windows). Anything else exits 127 as a shell would for an unknown command."""
        argv = [args["path"], *args.get("arg", [])]
        tool = guest_tools.run(info, argv)
        if tool is not None:
            return self._started(tool, guest_tools.tools(info))
        code, service = 127, None
        if not is_windows(info) and Path(argv[0]).name == "systemctl" and len(argv) == 3 \
                and argv[1] in ("restart", "try-restart"):
            service = argv[2]
        elif is_windows(info) and Path(PureWindowsPath(argv[0]).name).stem.lower() == "powershell":
            cmd = " ".join(argv[1:])
            if "Restart-Service" in cmd:
                service = cmd.split("-Name", 1)[1].split()[0].strip("'\"") if "-Name" in cmd else None
        if service:
            code = 0 if service == SERVICES["windows" if is_windows(info) else "linux"] else 5
            if code == 0:
                with open(self.dir / "services.log", "a") as f:
                    f.write(f"{time.time():.3f} restart {service}\n")
        with self._state() as st:
            pid = st["next"]
            st["next"] += 1
            st["exec"][str(pid)] = code
        return {"pid": pid}

    def _started(self, tool: tuple[int, bytes], tools: dict[str, Any]) -> dict[str, Any]:
        code, out = tool
        ends = time.time() + (tools["slow_s"] if tools["exec"] == "slow" else 0.0)
        with self._state() as st:
            pid = st["next"]
            st["next"] += 1
            st["exec"][str(pid)] = {"code": code, "out": base64.b64encode(out).decode(), "ends": ends}
        return {"pid": pid}

    def _guest_exec_status(self, info: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        with self._state() as st:
            rec = st["exec"].get(str(args["pid"]))
            if isinstance(rec, dict) and rec["ends"] > time.time():
                return {"exited": False}
            st["exec"].pop(str(args["pid"]), None)  # QEMU frees the record once it reported the exit
        if rec is None:
            raise ValueError(f"Invalid parameter 'pid' ({args['pid']})")
        if isinstance(rec, dict):
            return {"exited": True, "exitcode": rec["code"], "out-data": rec["out"], "out-truncated": False}
        return {"exited": True, "exitcode": rec}
