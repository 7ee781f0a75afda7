"""The host's half of the lab's licence-token proof (scripts/lab-tests runs it before the libvirt boot):

    python tests/lab_libvirt/fwcfg_token.py DIR     -> prints QEMU's -fw_cfg value for the lab VM

It writes a random token to DIR/token.tok and a vgpumgr-rendered domain (schema-validated) whose
<sysinfo type='fwcfg'> names it to DIR/domain.xml, and prints the item as libvirt gives it to QEMU
(`name=<entry name>,file=<entry file>`; tests/lab_libvirt/test_licence_fwcfg.py shows the guest's libvirtd
doing exactly that). mdev-lab boots the lab VM with it (MDEVLAB_FWCFG), so its real kernel exposes the item
and the guest helper is run there against the real /sys/firmware/qemu_fw_cfg.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

from vgpumgr.ops.licence_delivery import fwcfg_name
from vgpumgr.virt import domain

UUID = "6a1f7c2e-52d4-4f0e-9c51-0b6f3d2a9e11"


def qemu_value(xml: str) -> str:
    [(name, path)] = domain.fwcfg_entries(xml)
    return f"name={name},file={path}"


def prepare(d: Path) -> str:
    d.mkdir(parents=True, exist_ok=True)
    token = d / "token.tok"
    token.write_bytes((secrets.token_urlsafe(3000) + "\n").encode())
    xml = domain.render(domain.VmSpec(name="fwcfg-lab", uuid=UUID, memory_mib=256, vcpus=1, domain_type="qemu",
                                      fwcfg=[(fwcfg_name(1), str(token))]))
    (d / "domain.xml").write_text(xml)
    return qemu_value(xml)


if __name__ == "__main__":
    print(prepare(Path(sys.argv[1]).resolve()))
