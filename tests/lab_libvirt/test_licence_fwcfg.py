"""The licence token's fw_cfg path on the lab guest's real libvirtd, QEMU and kernel (docs/sources.md §21).

vgpumgr renders a domain whose <sysinfo type='fwcfg'> names the per-VM token copy; libvirt turns it into QEMU's
`-fw_cfg name=opt/dev.vgpumgr/nls/ft1/client_configuration_token,file=...` (the QEMU process's command line
shows it). The domain boots the lab's Debian kernel with a tiny init (tests/lab_libvirt/fwcfg_guest.py): its
kernel's qemu_fw_cfg module exposes the item, the shipped guest helper installs it, and the guest prints the
SHA-256 of the installed token and of /sys/firmware/qemu_fw_cfg/by_name/<name>/raw, which must equal the
token's. The nested guest runs under TCG inside the TCG lab: it may take minutes (VGPUMGR_LAB_NESTED_S).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time
from pathlib import Path

import pytest
from fwcfg_guest import ITEM, MARK, build_initramfs, kernel_image
from lxml import etree

from vgpumgr import domain, licence_token
from vgpumgr.config import Config
from vgpumgr.ops import licence_delivery
from vgpumgr.service import Service

pytestmark = pytest.mark.lab
LIBVIRT_URI = "qemu:///system"
DOMAIN = "fwcfg-guest"


def _direct_boot(xml: str, kernel: Path, initrd: Path, console: Path) -> str:
    """The harness's part: boot a kernel directly and log the serial console to a file (vgpumgr's own XML keeps
    its fw_cfg item unchanged)."""
    root = etree.fromstring(xml.encode())
    os_el = root.find("os")
    for tag, text in (("kernel", str(kernel)), ("initrd", str(initrd)),
                      ("cmdline", "console=ttyS0 quiet panic=-1")):
        etree.SubElement(os_el, tag).text = text
    devices = root.find("devices")
    for tag in ("serial", "console"):
        for el in devices.findall(tag):
            devices.remove(el)
    serial = etree.SubElement(devices, "serial", type="file")
    etree.SubElement(serial, "source", path=str(console))
    etree.SubElement(serial, "target", port="0")
    return etree.tostring(root, encoding="unicode")


def test_libvirt_gives_vgpumgrs_fwcfg_item_to_qemu_and_the_guest_helper_installs_the_exact_token(
        tmp_path: Path, domain_cleanup: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPUMGR_DOMAIN_TYPE", "qemu")
    cfg = Config.resolve(sysfs_root="/", state_dir=str(tmp_path / "state"), db=f"sqlite:///{tmp_path}/vgpumgr.db",
                         connect=LIBVIRT_URI)
    svc = Service(cfg, licence_mode="off")
    token = (secrets.token_urlsafe(3000) + "\n").encode()
    licence_token.store(cfg.state_dir, token)
    uuid = "6a1f7c2e-52d4-4f0e-9c51-0b6f3d2a9e11"
    entries = licence_delivery.fwcfg_for(svc, DOMAIN, uuid, [{"series": "Q"}])  # what `vm create` does
    assert entries == [(ITEM, str(licence_token.fwcfg_path(cfg.state_dir, uuid)))]
    xml = domain.render(domain.VmSpec(name=DOMAIN, uuid=uuid, memory_mib=256, vcpus=1, domain_type="qemu",
                                      fwcfg=entries))
    release = os.uname().release
    console = tmp_path / "console.log"
    booted = _direct_boot(xml, kernel_image(release), build_initramfs(tmp_path / "init.gz", release), console)
    domain.validate(booted)
    virt = svc.virt()
    domain_cleanup.append(DOMAIN)
    virt.define(booted)
    started = time.monotonic()
    virt.start(DOMAIN)

    pid = int(Path(f"/run/libvirt/qemu/{DOMAIN}.pid").read_text())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    i = argv.index(b"-fw_cfg")
    assert argv[i + 1].decode() == f"name={ITEM},file={entries[0][1]}"
    print("QEMU:", " ".join(a.decode() for a in argv[i:i + 2]))

    limit = float(os.environ.get("VGPUMGR_LAB_NESTED_S", "480"))
    text = ""
    while time.monotonic() - started < limit:
        text = console.read_text(errors="replace") if console.exists() else ""
        if f"{MARK} done" in text:
            break
        time.sleep(2)
    print(f"nested guest ran {time.monotonic() - started:.0f} s")
    lines = [line.strip() for line in text.splitlines() if MARK in line]
    print("\n".join(lines))
    assert f"{MARK} done" in text, f"the nested guest did not finish in {limit:g} s:\n{text[-3000:]}"
    want = hashlib.sha256(token).hexdigest()
    installed = [line.split() for line in lines if " installed " in line]
    assert len(installed) == 1 and re.fullmatch(r"client_configuration_token_[-0-9]+\.tok", installed[0][2])
    assert installed[0][3] == want
    assert f"{MARK} raw {want}" in lines
    assert f"{MARK} gridd FeatureType=1" in lines
