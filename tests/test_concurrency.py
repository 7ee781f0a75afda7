"""Two processes with several threads each never hand out the same device, and never more than exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vgpumgr.config import Config
from vgpumgr.discovery.mdev import discover_mdevs
from vgpumgr.service import Service
from vgpumgr.sim import profiles

WORKER = r"""
import json, sys, threading
from vgpumgr.config import Config
from vgpumgr.errors import NoCapacity
from vgpumgr.service import Service

root, state, tag = sys.argv[1:4]
got, refused, errors = [], [], []
lock = threading.Lock()

def work(i):
    svc = Service(Config.resolve(sysfs_root=root, state_dir=state, connect="test:///default"), licence_mode="off")
    for n in range(3):
        try:
            a = svc.allocate("T4-4Q", vm=f"{tag}-{i}-{n}")
            with lock:
                got.append(a["uuid"])
        except NoCapacity:
            with lock:
                refused.append(1)
        except Exception as e:  # noqa: BLE001
            with lock:
                errors.append(f"{type(e).__name__}: {e}")

threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"got": got, "refused": len(refused), "errors": errors}))
"""


def test_no_double_allocation_across_processes_and_threads(tmp_path: Path) -> None:
    root = profiles.create(tmp_path / "sim", "t4", scale=2)  # two T4s: 8 T4-4Q in all
    state = tmp_path / "state"
    Service(Config.resolve(sysfs_root=str(root), state_dir=str(state)), licence_mode="off")  # schema once
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(root), str(state), f"p{i}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    got = [u for r in results for u in r["got"]]
    assert [e for r in results for e in r["errors"]] == []
    assert len(got) == 8 and len(set(got)) == 8  # every vGPU handed out once, capacity exactly used
    assert sum(r["refused"] for r in results) == 24 - 8
    svc = Service(Config.resolve(sysfs_root=str(root), state_dir=str(state)), licence_mode="off")
    live = svc.allocations(live=True)
    assert sorted(a["uuid"] for a in live) == sorted(got)
    assert sorted(m.uuid for m in discover_mdevs(svc.host)) == sorted(got)
    per_gpu = {}
    for a in live:
        per_gpu[a["gpu"]] = per_gpu.get(a["gpu"], 0) + 1
    assert per_gpu == {"0000:3b:00.0": 4, "0000:3d:00.0": 4}
