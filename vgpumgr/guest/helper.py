"""The guest helper shipped with vgpumgr (vgpumgr/guest/): a script and a systemd unit that install the licence
token vgpumgr gives a Linux VM through fw_cfg, and a cloud-init snippet that installs both.

`vgpumgr license guest-helper [script|unit|cloud-init]` prints them, so an image build or a cloud-init user-data
takes them from the installed vgpumgr.
"""

from __future__ import annotations

import json

from vgpumgr.resources import data_dir

SCRIPT = "vgpumgr-licence-token"
UNIT = "vgpumgr-licence-token.service"
SCRIPT_PATH = "/usr/local/sbin/vgpumgr-licence-token"
UNIT_PATH = "/etc/systemd/system/vgpumgr-licence-token.service"
PARTS = ("script", "unit", "cloud-init")


def script() -> str:
    return (data_dir("guest") / SCRIPT).read_text(encoding="utf-8")


def unit() -> str:
    return (data_dir("guest") / UNIT).read_text(encoding="utf-8")


def _block(text: str) -> str:
    return "\n".join(("      " + line) if line else "" for line in text.splitlines())


def cloud_init() -> str:
    """A #cloud-config that installs the helper and its unit, loads qemu_fw_cfg at every boot, and runs it once
    now (YAML block literals: the files go in byte for byte)."""
    return "\n".join([
        "#cloud-config",
        "# vgpumgr's licence token helper: installs the token the host gives this VM through QEMU fw_cfg",
        "write_files:",
        f"  - path: {SCRIPT_PATH}",
        "    permissions: '0755'",
        "    content: |",
        _block(script()),
        f"  - path: {UNIT_PATH}",
        "    permissions: '0644'",
        "    content: |",
        _block(unit()),
        "  - path: /etc/modules-load.d/qemu_fw_cfg.conf",
        "    permissions: '0644'",
        "    content: |",
        "      qemu_fw_cfg",
        "runcmd:",
        "  - " + json.dumps(["systemctl", "daemon-reload"]),
        "  - " + json.dumps(["systemctl", "enable", "--now", UNIT]),
        "",
    ])


def part(name: str) -> str:
    return {"script": script, "unit": unit, "cloud-init": cloud_init}[name]()
