"""`vgpumgr mdev export` / `mdev import`, and Debian's mdevctl reading what export wrote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from simhost import run

from vgpumgr.config import Config
from vgpumgr.service import Service
from vgpumgr.sim import profiles

T4A, T4B = "0000:3b:00.0", "0000:3c:00.0"
U1, U2 = "11111111-2222-4333-8444-555555555501", "11111111-2222-4333-8444-555555555502"


def host(tmp_path: Path, name: str) -> tuple[Service, list[str]]:
    root = profiles.create(tmp_path / "sim", "t4", scale=2) if not (tmp_path / "sim").exists() else tmp_path / "sim"
    state = tmp_path / name
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(state), connect="test:///default")
    return Service(cfg, licence_mode="off"), ["--sysfs-root", str(root), "--state-dir", str(state)]


def recorded(svc: Service) -> dict[str, tuple[str, str]]:
    return {a["uuid"]: (a["parent"], a["type"]) for a in svc.allocations(live=True) if a["uuid"]}


def test_export_writes_mdevctl_definitions_and_import_adopts_them(tmp_path: Path) -> None:
    svc, cli = host(tmp_path, "old-host")
    svc.allocate("nvidia-232", vm="a", uuid=U1)
    svc.allocate("nvidia-231", vm="b", uuid=U2)
    out_dir = tmp_path / "mdevctl.d"
    rc, out, err = run(*cli, "mdev", "export", "--dir", str(out_dir), "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert len(result["written"]) == 2 and result["unchanged"] == []
    files = {p.relative_to(out_dir).as_posix(): json.loads(p.read_text()) for p in out_dir.glob("*/*")}
    parents = {u: p for u, (p, _) in recorded(svc).items()}
    assert files == {f"{parents[U1]}/{U1}": {"mdev_type": "nvidia-232", "start": "auto", "attrs": []},
                     f"{parents[U2]}/{U2}": {"mdev_type": "nvidia-231", "start": "auto", "attrs": []}}
    rc, out, _ = run(*cli, "mdev", "export", "--dir", str(out_dir), "--json")
    assert rc == 0 and len(json.loads(out)["unchanged"]) == 2  # nothing rewritten

    fresh, cli2 = host(tmp_path, "new-host")  # a host that switches to vgpumgr: empty records
    rc, out, err = run(*cli2, "mdev", "import", "--dir", str(out_dir), "--json")
    assert rc == 0, err
    assert sorted(json.loads(out)["adopted"]) == [U1, U2]
    assert recorded(fresh) == recorded(svc)
    assert all(a["vm"] is None for a in fresh.allocations(live=True))  # mdevctl names no VM
    rc, out, _ = run(*cli2, "mdev", "import", "--dir", str(out_dir), "--json")
    assert rc == 0 and json.loads(out)["adopted"] == [] and len(json.loads(out)["already_recorded"]) == 2


def test_import_keeps_start_and_attrs_for_the_next_export(tmp_path: Path) -> None:
    svc, cli = host(tmp_path, "h")
    src = tmp_path / "etc-mdevctl.d"
    (src / T4B).mkdir(parents=True)
    (src / "scripts.d/callouts").mkdir(parents=True)  # mdevctl's own folder is skipped
    definition = {"mdev_type": "nvidia-233", "start": "manual", "attrs": [{"frame_rate_limiter": "0"}]}
    (src / T4B / U1).write_text(json.dumps(definition))
    assert run(*cli, "mdev", "import", "--dir", str(src))[0] == 0
    assert recorded(svc) == {U1: (T4B, "nvidia-233")}
    out_dir = tmp_path / "again"
    assert run(*cli, "mdev", "export", "--dir", str(out_dir))[0] == 0
    assert json.loads((out_dir / T4B / U1).read_text()) == definition


@pytest.mark.parametrize(("content", "name", "code", "words"), [
    ('{"mdev_type": "nvidia-232", "start": "sometimes", "attrs": []}', U1, 2, '"start" is'),
    ('{"start": "auto"}', U1, 2, "mdev_type"),
    ("not json", U1, 2, "is not JSON"),
    ('{"mdev_type": "nvidia-232", "start": "auto", "attrs": {"a": "b"}}', U1, 2, "one-key objects"),
    ('{"mdev_type": "nvidia-232", "start": "auto"}', "not-a-uuid", 2, "not named after an mdev UUID"),
])
def test_bad_definitions_are_refused_and_nothing_is_adopted(tmp_path: Path, content: str, name: str, code: int,
                                                            words: str) -> None:
    svc, cli = host(tmp_path, "h")
    src = tmp_path / "defs"
    (src / T4A).mkdir(parents=True)
    (src / T4A / U2).write_text('{"mdev_type": "nvidia-232", "start": "auto", "attrs": []}')  # a good one
    (src / T4B).mkdir()
    (src / T4B / name).write_text(content)
    rc, _, err = run(*cli, "mdev", "import", "--dir", str(src))
    assert rc == code and words in err
    assert recorded(svc) == {}


def test_a_definition_that_contradicts_a_record_stops_the_import(tmp_path: Path) -> None:
    svc, cli = host(tmp_path, "h")
    svc.allocate("nvidia-232", vm="a", uuid=U1)
    src = tmp_path / "defs"
    (src / T4B).mkdir(parents=True)
    (src / T4B / U1).write_text('{"mdev_type": "nvidia-231", "start": "auto", "attrs": []}')
    (src / T4B / U2).write_text('{"mdev_type": "nvidia-231", "start": "auto", "attrs": []}')
    rc, _, err = run(*cli, "mdev", "import", "--dir", str(src))
    assert rc == 4 and U1 in err and "contradict" in err
    assert set(recorded(svc)) == {U1}
    assert run(*cli, "mdev", "import", "--dir", str(tmp_path / "nowhere"))[0] == 3


def _mdevctl_list(config_dir: Path) -> list:
    """Debian's mdevctl (1.2.0 has no option or variable for another config dir): run it in a private mount
    namespace with `config_dir` bind-mounted over /etc/mdevctl.d; the host's mounts stay untouched."""
    for d in ("scripts.d/callouts", "scripts.d/notifiers"):  # mdevctl insists on its own folders
        (config_dir / d).mkdir(parents=True, exist_ok=True)
    script = 'mount --bind "$0" /etc/mdevctl.d && exec mdevctl list --defined --dumpjson'
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(config_dir)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout or "[]")


@pytest.mark.skipif(shutil.which("mdevctl") is None, reason="Debian's mdevctl is not installed "
                    "(scripts/setup installs it: apt-get install mdevctl)")
def test_debian_mdevctl_reads_what_export_wrote(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mdevctl 1.2.0 only reads /etc/mdevctl.d: pointing it elsewhere needs a mount namespace (root)")
    svc, cli = host(tmp_path, "h")
    svc.allocate("nvidia-232", vm="a", uuid=U1)
    svc.allocate("nvidia-231", vm="b", uuid=U2)
    out_dir = tmp_path / "mdevctl.d"
    (out_dir / T4B).mkdir(parents=True)
    extra = "11111111-2222-4333-8444-555555555503"
    (out_dir / T4B / extra).write_text(json.dumps(
        {"mdev_type": "nvidia-233", "start": "manual", "attrs": [{"frame_rate_limiter": "0"}]}))
    assert run(*cli, "mdev", "export", "--dir", str(out_dir))[0] == 0
    listed = {uuid: (parent, d) for group in _mdevctl_list(out_dir) for parent, devs in group.items()
              for dev in devs for uuid, d in dev.items()}
    want = {u: (p, {"mdev_type": t, "start": "auto", "attrs": []}) for u, (p, t) in recorded(svc).items()}
    want[extra] = (T4B, {"mdev_type": "nvidia-233", "start": "manual", "attrs": [{"frame_rate_limiter": "0"}]})
    assert listed == want
    # and back: what mdevctl lists is what a fresh host adopts
    fresh, cli2 = host(tmp_path, "fresh")
    assert run(*cli2, "mdev", "import", "--dir", str(out_dir))[0] == 0
    assert recorded(fresh) == {u: (p, d["mdev_type"]) for u, (p, d) in listed.items()}
