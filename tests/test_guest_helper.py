"""The guest helper (vgpumgr/guest/) against a fake guest root: it finds the fw_cfg item by name (and by key when
the by_name link is missing), installs the exact token under NVIDIA's name, sets FeatureType, restarts
nvidia-gridd only when something changed, replaces the token it installed before, and leaves a guest without
the item, or with an empty one, alone. The cloud-init snippet carries the script and unit byte for byte."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from vgpumgr.guest import helper as guest_helper
from vgpumgr.resources import data_dir

NAME = "opt/dev.vgpumgr/nls/ft{ft}/client_configuration_token"


def fwcfg(root: Path, data: bytes, ft: int = 1, key: int = 0x25, by_name: bool = True) -> None:
    fw = root / "sys/firmware/qemu_fw_cfg"
    entry = fw / "by_key" / str(key)
    entry.mkdir(parents=True, exist_ok=True)
    (entry / "name").write_text(NAME.format(ft=ft) + "\n")  # as the kernel shows it
    (entry / "raw").write_bytes(data)
    if by_name:
        link = fw / "by_name" / NAME.format(ft=ft)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(entry, link.parent), link)
    (fw / "by_name").mkdir(exist_ok=True)


def helper(root: Path) -> tuple[int, str]:
    env = {"PATH": os.environ["PATH"], "VGPUMGR_GUEST_ROOT": str(root),
           "VGPUMGR_GUEST_RESTART_LOG": str(root / "restarts.log")}
    p = subprocess.run(["sh", str(data_dir("guest") / "vgpumgr-licence-token")], env=env, capture_output=True,
                       text=True, timeout=30)
    return p.returncode, p.stderr


def tokens(root: Path) -> list[Path]:
    return sorted((root / "etc/nvidia/ClientConfigToken").glob("*.tok"))


def restarts(root: Path) -> int:
    log = root / "restarts.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_installs_the_token_sets_featuretype_and_restarts_only_on_change(tmp_path: Path) -> None:
    root = tmp_path / "guest"
    (root / "etc/nvidia").mkdir(parents=True)
    (root / "etc/nvidia/gridd.conf").write_text("# gridd.conf\nServerPort=7070\n#FeatureType=0\nEnableUI=FALSE\n")
    fwcfg(root, b"TOKEN-ONE\x00\xffbytes")
    rc, err = helper(root)
    assert rc == 0, err
    [tok] = tokens(root)
    assert tok.read_bytes() == b"TOKEN-ONE\x00\xffbytes"
    assert tok.name.startswith("client_configuration_token_") and stat.S_IMODE(tok.stat().st_mode) == 0o744
    conf = (root / "etc/nvidia/gridd.conf").read_text().splitlines()
    assert conf == ["# gridd.conf", "ServerPort=7070", "FeatureType=1", "EnableUI=FALSE"]
    assert (root / "restarts.log").read_text() == "try-restart nvidia-gridd\n"

    assert helper(root)[0] == 0  # the next boot: nothing changed, nothing restarted
    assert tokens(root) == [tok] and restarts(root) == 1

    other = tmp_path / "other.tok"  # a token the operator put there by hand stays
    other.write_bytes(b"hand-made")
    (root / "etc/nvidia/ClientConfigToken/client_configuration_token_01-01-2026-00-00-00.tok").write_bytes(b"x")
    entry = root / "sys/firmware/qemu_fw_cfg/by_key/37"
    (entry / "raw").write_bytes(b"TOKEN-TWO")
    os.utime(tok, (0, 0))
    assert helper(root)[0] == 0
    names = [p.read_bytes() for p in tokens(root)]
    assert b"TOKEN-ONE\x00\xffbytes" not in names and b"TOKEN-TWO" in names and b"x" in names
    assert restarts(root) == 2


def test_passthrough_feature_type_and_by_key_when_by_name_is_missing(tmp_path: Path) -> None:
    root = tmp_path / "guest"
    fwcfg(root, b"VCS-TOKEN", ft=4, by_name=False)
    rc, err = helper(root)
    assert rc == 0, err
    assert [p.read_bytes() for p in tokens(root)] == [b"VCS-TOKEN"]
    assert (root / "etc/nvidia/gridd.conf").read_text() == "FeatureType=4\n"  # none before: created


@pytest.mark.parametrize("case", ["no fw_cfg", "no item", "empty item"])
def test_a_guest_without_a_token_is_left_alone(tmp_path: Path, case: str) -> None:
    root = tmp_path / "guest"
    root.mkdir()
    if case != "no fw_cfg":
        (root / "sys/firmware/qemu_fw_cfg/by_key").mkdir(parents=True)
    if case == "empty item":
        fwcfg(root, b"")
    rc, err = helper(root)
    assert rc == 0 and "nothing to do" in err
    assert tokens(root) == [] and not (root / "etc/nvidia/gridd.conf").exists() and restarts(root) == 0


def test_cloud_init_snippet_is_shipped_and_carries_the_script_and_unit() -> None:
    shipped = (data_dir("guest") / "cloud-init.yaml").read_text()
    assert shipped == guest_helper.cloud_init(), "regenerate vgpumgr/guest/cloud-init.yaml from guest_helper"
    doc = yaml.safe_load(shipped)
    files = {f["path"]: f for f in doc["write_files"]}
    assert files[guest_helper.SCRIPT_PATH]["content"] == guest_helper.script()
    assert files[guest_helper.UNIT_PATH]["content"] == guest_helper.unit()
    assert files["/etc/modules-load.d/qemu_fw_cfg.conf"]["content"] == "qemu_fw_cfg\n"
    assert ["systemctl", "enable", "--now", guest_helper.UNIT] in doc["runcmd"]
    assert guest_helper.SCRIPT_PATH in guest_helper.unit()


def test_the_unit_passes_systemd_analyze(tmp_path: Path) -> None:
    import shutil

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / guest_helper.UNIT
    unit.write_text(guest_helper.unit().replace(guest_helper.SCRIPT_PATH, "/bin/true"))
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr
