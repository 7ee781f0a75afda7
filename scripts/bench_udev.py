#!/usr/bin/env python3
"""What a udev event costs `vgpumgr serve`'s next request: the inventory re-read after an mdev is made on a
simulated host, when the watcher (api/watch.py) re-reads the whole host (as it did for every event) and when
it re-reads that mdev's parent only (what it does now for an mdev on a parent it knows). Median and max over the
runs, per simulated host (sysfs under /dev/shm where there is one).

    .venv/bin/python scripts/bench_udev.py [--runs 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HOSTS = (("t4", 8, None), ("a40-sriov", 8, 16))  # mdevs on the GPU itself, and on its SR-IOV VFs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=40)
    a = ap.parse_args()
    os.environ.setdefault("VGPUMGR_FLEET_PUBLISH", "0")
    from api.watch import InventoryWatcher
    from vgpumgr.config import Config
    from vgpumgr.service import Service
    from vgpumgr.sim import profiles

    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    print(f"{'simulated host':28} {'whole host (before)':>22} {'the parent only (now)':>22}")
    for profile, scale, vfs in HOSTS:
        with tempfile.TemporaryDirectory(dir=shm, prefix="vgpumgr-bench-udev-") as tmp:
            kw = {"scale": scale} | ({"vfs": vfs} if vfs else {})
            root = profiles.create(Path(tmp) / "sim", profile, **kw)
            svc = Service(Config.resolve(sysfs_root=str(root), state_dir=f"{tmp}/state"), licence_mode="off")
            watcher = InventoryWatcher(svc)
            inv = svc.snapshot().inventory
            parent = next(t.parent for t in inv.types)
            event = SimpleNamespace(subsystem="mdev", parent=SimpleNamespace(sys_name=parent))
            took = {}
            for label, handle in (("whole", svc.invalidate), ("parent", partial(watcher._on_event, event))):
                ms = []
                for _ in range(a.runs):
                    handle()
                    t = time.perf_counter()
                    svc.snapshot()
                    ms.append((time.perf_counter() - t) * 1000)
                took[label] = ms
            name = f"{scale} x {profile}" + (f" ({vfs} VFs each)" if vfs else "")
            print(f"{name:28} " + " ".join(f"{statistics.median(took[k]):>10.1f} ms (max {max(took[k]):6.1f})"
                                             for k in ("whole", "parent")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
