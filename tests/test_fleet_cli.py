"""`vgpumgr fleet ...` text and JSON against golden files: a fleet of hosts that exist as the rows vgpumgr's
publishing code wrote (one cordoned, one stale) beside the simulated host that runs the commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fleethosts import board_capacity, publish_synthetic
from simhost import run
from test_cli import golden

from vgpumgr.sim import profiles


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv("VGPUMGR_HOSTNAME", "gpu-here")
    root = profiles.create(tmp_path / "sim", "l40s-vfio", vfs=4)
    base = ["--sysfs-root", str(root), "--state-dir", str(tmp_path / "state")]
    url = f"sqlite:///{tmp_path / 'state' / 'vgpumgr.db'}"
    rc, _, err = run(*base, "fleet", "publish")
    assert rc == 0, err
    t4 = board_capacity(tmp_path, "t4", scale=2, fill={0: ("T4-4Q", 3)})
    l40s = board_capacity(tmp_path, "l40s-vfio", scale=2, vfs=4, fill={1: ("L40S-4Q", 4)})
    publish_synthetic(url, "gpu-a", t4)
    publish_synthetic(url, "gpu-b", l40s, cordon="BIOS update")
    publish_synthetic(url, "gpu-c", l40s, stale=True)
    publish_synthetic(url, "gpu-d", l40s)
    return base


def _steady(text: str) -> str:
    """A stale host's heartbeat age moves while the test runs."""
    return re.sub(r"last heartbeat \d+ s ago", "last heartbeat <age> s ago", text)


def test_fleet_text_golden(fleet: list[str]) -> None:
    for name, code, argv in (
            ("fleet-place-explain.txt", 0, ["fleet", "place", "--type", "L40S-4Q", "--explain"]),
            ("fleet-place-spread-count.txt", 4, ["fleet", "place", "--type", "L40S-4Q", "--count", "2", "--policy",
                                                 "spread", "--explain"]),  # no host has two L40S with room
            ("fleet-capacity-type.txt", 0, ["fleet", "capacity", "--type", "L40S-4Q"]),
            ("fleet-gpus-type.txt", 0, ["fleet", "gpus", "--type", "T4-4Q"])):
        rc, out, err = run(*fleet, *argv)
        assert rc == code, err
        golden(name, _steady(out))
    rc, out, err = run(*fleet, "fleet", "place", "--type", "L40S-4Q")
    assert rc == 0 and out == ("1 x L40S-4Q would go to host gpu-d (GPU 0000:3d:00.0; https://gpu-d.example:8470): "
                               "pack: 4 free L40S-4Q on 1 GPU(s), best fit: 49152 MB left\n")  # tied with gpu-here
    rc, out, _ = run(*fleet, "fleet", "hosts")
    states = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:]}
    assert rc == 0 and states == {"gpu-a": "ok", "gpu-b": "cordoned", "gpu-c": "stale", "gpu-d": "ok",
                                  "gpu-here": "ok"}


def test_fleet_json_shapes(fleet: list[str]) -> None:
    rc, out, _ = run(*fleet, "fleet", "place", "--type", "L40S-4Q", "--json")
    d = json.loads(out)
    assert rc == 0 and set(d) == {"choice", "ranked", "rejected", "considered", "request", "migrating", "compact",
                                  "every_host", "rejected_counts"}
    assert d["compact"] is None  # a host fits: no compaction to hint at
    assert d["every_host"] and d["rejected_counts"] == {"not-offered": 1, "cordoned": 1, "stale": 1}
    assert set(d["choice"]) == {"host", "endpoint", "migration_uri", "gpus", "free", "free_gpus", "why",
                                "tightest_mb"}
    assert {r["host"]: r["code"] for r in d["rejected"]} == {"gpu-a": "not-offered", "gpu-b": "cordoned",
                                                             "gpu-c": "stale"}
    rc, out, _ = run(*fleet, "fleet", "hosts", "--json")
    hosts = json.loads(out)
    assert [h["host"] for h in hosts] == ["gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-here"]
    assert set(hosts[0]) == {"host", "endpoint", "migration_uri", "driver_version", "vgpumgr_version", "gpus",
                             "vgpus", "heartbeat_at", "heartbeat_age_s", "heartbeat_s", "stale_after_s", "stale",
                             "cordoned", "cordon_reason", "generation"}
    rc, out, _ = run(*fleet, "fleet", "gpus", "--host", "gpu-a", "--json")
    assert rc == 0 and [g["address"] for g in json.loads(out)] == ["0000:3b:00.0", "0000:3d:00.0"]
    rc, _, err = run(*fleet, "fleet", "gpus", "--host", "gpu-z")
    assert rc == 3 and "host gpu-z has published nothing" in err
    with pytest.raises(SystemExit) as exc:  # argparse: the bounds of vgpumgr.userinput.numbers
        run(*fleet, "fleet", "place", "--type", "L40S-4Q", "--count", "0")
    assert exc.value.code == 2
    rc, _, err = run(*fleet, "fleet", "place", "--type", "A40-4Q")
    assert rc == 4 and "no host can take A40-4Q now" in err and "--explain" in err
