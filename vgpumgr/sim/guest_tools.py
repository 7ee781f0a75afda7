"""What a simulated guest's vendor tools print, and how its guest agent behaves towards guest-side telemetry
(docs/sources.md §17, the simulator's own choices).

Set per VM (`vgpumgr sim guest agent VM ...`, or `configure` in tests) in the simulated guest's `guest.json`,
key "tools": {"exec": how the agent treats guest-exec, "gpus": [{"util", "mem_util", "mem_used", "mem_total"}],
"driver": the guest driver nvidia-smi names, "slow_s": how long the tool runs, "output": raw text printed
instead}. `exec` is one of EXEC:

* allow: nvidia-smi (or npu-smi) prints the CSV (the "Key : value" lines) of the real tool's shape;
* block: the agent's policy blocks guest-exec (guest-info says so; guest-exec fails as QEMU's does);
* hang: the agent answers nothing (each command waits for its timeout, or for `release` to be called);
* slow: the tool runs `slow_s` seconds; huge: it prints 2 MiB; malformed: it prints what no tool prints;
* no-tool: the tool is not installed (exit 127, as coreutils' `timeout` reports it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

EXEC = ("allow", "block", "hang", "slow", "huge", "malformed", "no-tool")
HANG_FILE = "agent.hung"  # present while a command waits in a hung agent (tests look for it)
RELEASE_FILE = "agent.release"
MALFORMED = ("0, 580.65.06, 250, 5, 1024, 24576\n"  # 250 %: out of range
             "1, 580.65.06, nan, 5, 1024, 24576\n"
             "0, 580.65.06, 7, 5\n"
             "00000000-0000-0000-0000-000000000001, ', 1e308, \x1b[2J\n")


def configure(guest_dir: Path, *, exec_mode: str = "allow", gpus: list[dict[str, Any]] | None = None,
              driver: str = "580.65.06", slow_s: float = 3.0, output: str | None = None) -> dict[str, Any]:
    if exec_mode not in EXEC:
        raise ValueError(f"unknown agent behaviour {exec_mode!r}; known: {', '.join(EXEC)}")
    path = guest_dir / "guest.json"
    info = json.loads(path.read_text()) if path.is_file() else {"os": "debian", "licensing": "token", "agent": True}
    info["tools"] = {"exec": exec_mode, "gpus": gpus if gpus is not None else [{"util": 0}], "driver": driver,
                     "slow_s": float(slow_s), "output": output}
    guest_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info))
    return info["tools"]


def tools(info: dict[str, Any]) -> dict[str, Any]:
    return info.get("tools") or {"exec": "allow", "gpus": [], "driver": None, "slow_s": 0.0, "output": None}


def release(guest_dir: Path) -> None:
    """End a hang: the commands waiting return (as timed out) at once."""
    (guest_dir / RELEASE_FILE).write_text("")


def hang(guest_dir: Path, timeout: float) -> None:
    """A hung agent: no answer until the caller's timeout (libvirt's), or a release."""
    marker = guest_dir / HANG_FILE
    marker.write_text(str(time.time()))
    end = time.monotonic() + max(timeout, 0.0)
    try:
        while time.monotonic() < end and not (guest_dir / RELEASE_FILE).exists():
            time.sleep(0.02)
    finally:
        marker.unlink(missing_ok=True)


def run(info: dict[str, Any], argv: list[str]) -> tuple[int, bytes] | None:
    """(exit status, stdout) of a vendor tool in the guest; None when `argv` runs none."""
    if argv and Path(argv[0]).name == "timeout" and len(argv) > 4:
        argv = argv[4:]  # timeout -s KILL N tool args...
    tool = argv[0].replace("\\", "/").rsplit("/", 1)[-1].lower().removesuffix(".exe") if argv else ""
    if tool not in ("nvidia-smi", "npu-smi"):
        return None
    t = tools(info)
    mode = t["exec"]
    if mode == "no-tool":
        return 127, b""
    if t.get("output") is not None:
        return 0, t["output"].encode("utf-8", "surrogateescape")
    if mode == "huge":
        return 0, b"0, 580.65.06, 7, 5, 1024, 24576\n" * (2 * 1024 * 1024 // 32)
    if mode == "malformed":
        return 0, MALFORMED.encode()
    if tool == "npu-smi":
        g = (t["gpus"] or [{}])[0]
        return 0, (f"        NPU Utilization(%)             : {g.get('util', 0)}\n"
                   f"        Aicore Usage Rate(%)           : {g.get('util', 0)}\n"
                   f"        HBM Usage Rate(%)              : {g.get('mem_util', 0)}\n").encode()
    lines = [f"{i}, {t.get('driver') or '[N/A]'}, {g.get('util', '[N/A]')}, {g.get('mem_util', '[N/A]')}, "
             f"{g.get('mem_used', '[N/A]')}, {g.get('mem_total', '[N/A]')}" for i, g in enumerate(t["gpus"])]
    if not lines:  # nvidia-smi without a GPU: "No devices were found", exit 6 [unverified]
        return 6, b"No devices were found\n"
    return 0, ("\n".join(lines) + "\n").encode()
