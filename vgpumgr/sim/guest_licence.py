"""How a simulated guest licenses (docs/sources.md §19, §23): the state NVML reports for its vGPU.

A guest started with `vgpumgr sim guest start --licensing token` behaves like NVIDIA's guest driver with a
licence server it can reach: unlicensed until a client configuration token is in its token directory
(`/etc/nvidia/ClientConfigToken/*.tok`, or the Windows directory) and its licensing service was (re)started
after it arrived, then licensed, unless the token has expired. `--licensing never` models a guest that never
licenses (no licensing service, a server it cannot reach). Either way NVIDIA's driver runs unrestricted for
about 20 minutes (`unlicensed-unrestricted`), then `unlicensed-restricted`. A state set with `sim guest licence`
overrides the model (tests that seed one state).

A Linux guest "boots" at `sim guest start`: the fw_cfg items its domain XML names appear under its
/sys/firmware/qemu_fw_cfg/by_name/ and the shipped guest helper (vgpumgr/guest/) runs against its file system.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from vgpumgr.sim import guest_agent

UNRESTRICTED_S = 20 * 60  # NVIDIA's guest driver: about 20 minutes before it restricts an unlicensed vGPU
LEASE_S = 24 * 3600
LICENSING = ("token", "never")
STATE = {"uninitialized": 1, "unlicensed-unrestricted": 2, "unlicensed-restricted": 3, "licensed": 5}


def token_dir(d: Path, windows: bool) -> Path:
    from vgpumgr.guest import agent as host_agent

    return guest_agent.host_path(d, host_agent.WINDOWS_DIR if windows else host_agent.LINUX_DIR, windows)


def _restarts(d: Path) -> list[float]:
    try:
        return [float(line.split()[0]) for line in (d / "services.log").read_text().splitlines() if line.strip()]
    except (OSError, ValueError, IndexError):
        return []


def _token_valid(data: bytes, now: float) -> bool:
    from vgpumgr.licensing import token as licence_token

    info = licence_token.describe(data)
    return info.expires is None or info.expires.timestamp() > now


def licence_of(inst: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """{"state": NVML_GRID_LICENSE_STATE_*, "expiry": epoch s or None} for a running simulated vGPU."""
    if inst.get("licence"):
        return inst["licence"]
    d = inst.get("guest_dir")
    info = guest_agent.describe(Path(d)) if d else None
    if info is None:
        return {}
    now = now or time.time()
    started = float(inst.get("booted") or inst.get("started") or now)
    unlicensed = STATE["unlicensed-unrestricted"] if now - started < UNRESTRICTED_S else STATE["unlicensed-restricted"]
    if info.get("licensing") != "token":
        return {"state": unlicensed, "expiry": None}
    tdir = token_dir(Path(d), guest_agent.is_windows(info))
    tokens = sorted(tdir.glob("*.tok"), key=lambda p: p.stat().st_mtime) if tdir.is_dir() else []
    tokens = [t for t in tokens if t.stat().st_size > 0]
    if not tokens:
        return {"state": unlicensed, "expiry": None}
    newest = tokens[-1]
    # the licensing service reads the token when it starts: at boot (the helper runs before it) or a restart
    read_at = max([started, *_restarts(Path(d))])
    if read_at + 1e-3 < newest.stat().st_mtime:
        return {"state": unlicensed, "expiry": None}
    if not _token_valid(newest.read_bytes(), now):
        return {"state": unlicensed, "expiry": None}
    return {"state": STATE["licensed"], "expiry": read_at + LEASE_S}


def boot(d: Path, fwcfg: list[tuple[str, bytes]]) -> bool:
    """A Linux guest boots: QEMU's fw_cfg items appear in its sysfs and the guest helper runs. True when a token
    was installed at this boot."""
    fw = d / "fs" / "sys" / "firmware" / "qemu_fw_cfg"
    for key, (name, data) in enumerate(fwcfg, start=0x20):  # FW_CFG_FILE_FIRST: user items come after QEMU's own
        by_key = fw / "by_key" / str(key)
        by_key.mkdir(parents=True, exist_ok=True)
        (by_key / "name").write_text(f"{name}\n")  # the kernel's attributes end in a newline
        (by_key / "size").write_text(f"{len(data)}\n")
        (by_key / "raw").write_bytes(data)
        link = fw / "by_name" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            os.symlink(os.path.relpath(by_key, link.parent), link)
    fw.mkdir(parents=True, exist_ok=True)
    from vgpumgr.resources import data_dir

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "VGPUMGR_GUEST_ROOT": str(d / "fs"),
           "VGPUMGR_GUEST_RESTART_LOG": str(d / "helper-restarts.log")}
    before = set((d / "fs" / "etc" / "nvidia" / "ClientConfigToken").glob("*.tok"))
    subprocess.run(["sh", str(data_dir("guest") / "vgpumgr-licence-token")], env=env, check=True,
                   capture_output=True, timeout=30)
    return set((d / "fs" / "etc" / "nvidia" / "ClientConfigToken").glob("*.tok")) != before
