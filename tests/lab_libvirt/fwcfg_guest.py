"""A tiny guest for the licence token's fw_cfg proof: the lab's Debian kernel with an initramfs of busybox, the
kernel's qemu_fw_cfg module and vgpumgr's guest helper. Its /init loads the module, runs the helper, and prints
the SHA-256 of what the helper installed and of the fw_cfg item to the serial console, then powers off."""

from __future__ import annotations

import gzip
import io
import os
import shutil
from pathlib import Path

from vgpumgr.resources import data_dir

MARK = "VGPUMGR-GUEST:"
ITEM = "opt/dev.vgpumgr/nls/ft1/client_configuration_token"
INIT = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs dev /dev 2>/dev/null
insmod /lib/qemu_fw_cfg.ko
echo "{MARK} helper"
/usr/local/sbin/vgpumgr-licence-token 2>&1
for f in /etc/nvidia/ClientConfigToken/*.tok; do
    echo "{MARK} installed $(basename "$f") $(sha256sum < "$f" | cut -d' ' -f1)"
done
echo "{MARK} raw $(sha256sum < /sys/firmware/qemu_fw_cfg/by_name/{ITEM}/raw | cut -d' ' -f1)"
echo "{MARK} gridd $(cat /etc/nvidia/gridd.conf)"
echo "{MARK} done"
poweroff -f
"""


def _cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (path, mode, data) entries (directories have S_IFDIR in mode and no data)."""
    out = io.BytesIO()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        raw = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(raw), 0]
        out.write(b"070701" + b"".join(f"{v:08x}".encode() for v in fields) + raw)
        out.write(b"\0" * (-(110 + len(raw)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))
    return out.getvalue()


def module_path(kernel_release: str) -> Path:
    for base in (Path("/lib/modules"), Path(os.environ.get("MDEVLAB_DIR", "/var/tmp/vgpumgr-mdev-lab")) /
                 "kroot/lib/modules"):
        p = base / kernel_release / "kernel/drivers/firmware/qemu_fw_cfg.ko"
        if p.is_file():
            return p
    raise FileNotFoundError(f"qemu_fw_cfg.ko of kernel {kernel_release}")


def build_initramfs(dest: Path, kernel_release: str) -> Path:
    busybox = shutil.which("busybox") or "/bin/busybox"
    dirs = ["bin", "sbin", "proc", "sys", "dev", "tmp", "etc", "etc/nvidia", "lib", "usr", "usr/local",
            "usr/local/sbin", "var", "var/lib"]
    entries = [(d, 0o040755, b"") for d in dirs]
    entries += [("init", 0o100755, INIT.encode()),
                ("bin/busybox", 0o100755, Path(busybox).read_bytes()),
                ("lib/qemu_fw_cfg.ko", 0o100644, module_path(kernel_release).read_bytes()),
                ("usr/local/sbin/vgpumgr-licence-token", 0o100755,
                 (data_dir("guest") / "vgpumgr-licence-token").read_bytes())]
    dest.write_bytes(gzip.compress(_cpio(entries), compresslevel=1))
    return dest


def kernel_image(kernel_release: str) -> Path:
    lab = Path(os.environ.get("MDEVLAB_DIR", "/var/tmp/vgpumgr-mdev-lab"))
    for p in (Path(f"/boot/vmlinuz-{kernel_release}"), lab / f"kroot/boot/vmlinuz-{kernel_release}"):
        if p.is_file():
            return p
    raise FileNotFoundError(f"vmlinuz-{kernel_release}")
