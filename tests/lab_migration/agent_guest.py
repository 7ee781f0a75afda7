"""The lab's agent guest (tests/lab_migration/test_guest_agent.py): a nested domain on lab host a, booted from
the lab guest's own kernel (Debian 13's) and scripts/mdev-lab-trixie's initramfs with Debian 13's
qemu-guest-agent, busybox and a stand-in nvidia-smi (scripts/agent-guest/).

Emulated by an emulated CPU, it takes minutes to boot: the conftest starts it (`python agent_guest.py start`,
in the background) as soon as the tests are collected, so that it boots while the other tests run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

VM = "agent-vm"
INITRD = "/var/lib/vgpumgr-lab/agent-guest.cpio.gz"  # scripts/mdev-lab-trixie's build_agent_guest
URI = "qemu+tcp://lab-a/system"
SERIAL_LOG = f"/var/log/libvirt/qemu/{VM}-serial.log"  # in host a's namespace (its /var/log/libvirt)
AGENT_BOOT = pytest.StashKey[subprocess.Popen]()  # the conftest's `agent_guest.py start`, begun at collection


def domain_xml() -> str:
    kernel = f"/boot/vmlinuz-{os.uname().release}"
    return (f"<domain type='qemu'><name>{VM}</name><memory unit='MiB'>192</memory><vcpu>1</vcpu>"
            "<os><type arch='x86_64' machine='pc'>hvm</type>"
            f"<kernel>{kernel}</kernel><initrd>{INITRD}</initrd><cmdline>console=ttyS0 quiet panic=-1</cmdline></os>"
            "<on_reboot>destroy</on_reboot><devices>"
            f"<serial type='file'><source path='{SERIAL_LOG}'/><target port='0'/></serial>"
            "<channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>"
            "</devices></domain>")


def start() -> None:
    """Define and start the agent guest on host a, replacing one left from before."""
    import libvirt

    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    conn = libvirt.open(URI)
    try:
        try:
            old = conn.lookupByName(VM)
            if old.isActive():
                old.destroy()
            old.undefine()
        except libvirt.libvirtError:
            pass
        conn.defineXML(domain_xml()).create()
    finally:
        conn.close()


if __name__ == "__main__":
    if sys.argv[1:] != ["start"]:
        sys.exit("usage: agent_guest.py start")
    start()
