"""The licence token's fw_cfg path on the lab's real libvirtd, QEMU and kernel (docs/sources.md §23).

1. vgpumgr renders a domain whose <sysinfo type='fwcfg'> names the per-VM token copy; the guest's libvirtd turns
   it into QEMU's `-fw_cfg name=opt/dev.vgpumgr/nls/ft1/client_configuration_token,file=...` (the running QEMU
   process's command line shows it) and QEMU starts with the file.
2. The lab VM itself (the lab's Debian kernel and init, a real QEMU) was booted by scripts/lab-tests with the
   same item from a vgpumgr-rendered domain (tests/lab_libvirt/fwcfg_token.py, MDEVLAB_FWCFG): the shipped
   guest helper, run for real (modprobe qemu_fw_cfg, /sys/firmware/qemu_fw_cfg, /etc/nvidia on the guest's
   overlay root), installs exactly the token's bytes. Skipped when the boot carried no item.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from vgpumgr.config import Config
from vgpumgr.licensing import token as licence_token
from vgpumgr.ops import licence_delivery
from vgpumgr.resources import data_dir
from vgpumgr.service import Service
from vgpumgr.virt import domain

pytestmark = pytest.mark.lab
LIBVIRT_URI = "qemu:///system"
DOMAIN = "fwcfg-guest"
ITEM = "opt/dev.vgpumgr/nls/ft1/client_configuration_token"


def test_libvirt_gives_vgpumgrs_fwcfg_item_to_qemu(tmp_path: Path, domain_cleanup: list[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPUMGR_DOMAIN_TYPE", "qemu")
    cfg = Config.resolve(sysfs_root="/", state_dir=str(tmp_path / "state"), db=f"sqlite:///{tmp_path}/vgpumgr.db",
                         connect=LIBVIRT_URI)
    svc = Service(cfg, licence_mode="off")
    licence_token.store(cfg.state_dir, os.urandom(2048))
    uuid = "6a1f7c2e-52d4-4f0e-9c51-0b6f3d2a9e12"
    entries = licence_delivery.fwcfg_for(svc, DOMAIN, uuid, [{"series": "Q"}])  # what `vm create` does
    copy = licence_token.fwcfg_path(cfg.state_dir, uuid)
    assert entries == [(ITEM, str(copy))]
    xml = domain.render(domain.VmSpec(name=DOMAIN, uuid=uuid, memory_mib=128, vcpus=1, domain_type="qemu",
                                      fwcfg=entries))
    virt = svc.virt()
    domain_cleanup.append(DOMAIN)
    virt.define(xml)
    virt.start(DOMAIN)
    pid = int(Path(f"/run/libvirt/qemu/{DOMAIN}.pid").read_text())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    i = argv.index(b"-fw_cfg")
    print("QEMU:", b" ".join(argv[i:i + 2]).decode())
    assert argv[i + 1].decode() == f"name={ITEM},file={copy}"
    assert argv.count(b"-fw_cfg") == 1
    assert virt.state(DOMAIN) == "running"  # QEMU opened the copy (a missing file stops it from starting)
    # the persistent definition keeps the item (libvirt's own formatting of it)
    assert domain.fwcfg_entries(virt.xml(DOMAIN, inactive=True)) == entries


@pytest.mark.skipif(not os.environ.get("VGPUMGR_LAB_FWCFG_DIR"),
                    reason="the lab VM was booted without a fw_cfg token (scripts/lab-tests sets MDEVLAB_FWCFG)")
def test_the_guest_helper_installs_the_exact_token_from_this_vms_fw_cfg() -> None:
    d = Path(os.environ["VGPUMGR_LAB_FWCFG_DIR"])
    token = (d / "token.tok").read_bytes()
    [(name, path)] = domain.fwcfg_entries((d / "domain.xml").read_text())
    assert (name, path) == (ITEM, str(d / "token.tok"))
    p = subprocess.run(["sh", str(data_dir("guest") / "vgpumgr-licence-token")], capture_output=True, text=True,
                       timeout=120)
    print(p.stderr)
    assert p.returncode == 0, p.stderr
    raw = Path("/sys/firmware/qemu_fw_cfg/by_name") / ITEM / "raw"
    assert raw.read_bytes() == token  # the real kernel's view of QEMU's item
    by_key = [k for k in Path("/sys/firmware/qemu_fw_cfg/by_key").iterdir() if (k / "name").read_text() == ITEM + "\n"]
    assert len(by_key) == 1 and int((by_key[0] / "size").read_text()) == len(token)
    [installed] = Path("/etc/nvidia/ClientConfigToken").glob("client_configuration_token_*.tok")
    assert re.fullmatch(r"client_configuration_token_\d\d-\d\d-\d{4}-\d\d-\d\d-\d\d\.tok", installed.name)
    assert installed.read_bytes() == token
    assert "FeatureType=1" in Path("/etc/nvidia/gridd.conf").read_text().splitlines()
    print(f"installed {installed} ({len(token)} bytes) from {raw}")
