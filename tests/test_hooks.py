"""The hook scripts run as their callers run them, against the real server on a unix socket.

Proxmox: `proxmox-vgpumgr <vmid> <phase>`; libvirt: `qemu <domain> <op> <sub-op> -` with the domain XML on
stdin. The server is `python -m api.server --uds ...` on a simulated two-T4 host with a temp SQLite DB.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hookserver import LIBVIRT, PROXMOX, Server, run, running_server
from lxml import etree

from vgpumgr.virt import domain

GPU_A, GPU_B = "0000:3b:00.0", "0000:3d:00.0"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("hooks"), "t4", scale=2) as srv:
        yield srv


def pve_uuid(index: int, vmid: int) -> str:
    return f"{index:08d}-0000-0000-0000-{vmid:012d}"


def test_hooks_are_executable_and_stdlib_only() -> None:
    for script in (PROXMOX, LIBVIRT):
        assert os.access(script, os.X_OK)
        text = script.read_text()
        # Debian's python3 without site packages: nothing outside the standard library can be imported
        assert text.startswith("#!/usr/bin/python3 -S\n")
        assert "import vgpumgr" not in text and "from vgpumgr" not in text
        assert "import http" not in text  # its import alone cost more than the rest of a hook run


def test_proxmox_pre_start_and_post_stop(server: Server) -> None:
    (server.conf_dir / "8006.conf").write_text(
        "boot: order=scsi0\n"
        "hostpci0: 0000:3b:00.0,mdev=nvidia-232,pcie=1\n"
        "hostpci1: 0000:5e:00.0,pcie=1\n"  # plain passthrough: not a vGPU
        "hostpci2: 0000:3b:00.0;0000:3d:00.0,mdev=nvidia-231\n"  # candidates, tried in order
        "memory: 4096\n\n"
        "[before-upgrade]\nhostpci5: 0000:3b:00.0,mdev=nvidia-234\n")  # a snapshot: not the current config
    env = server.env()
    for _ in range(2):  # a second pre-start (retry, or a new start) finds the same vGPUs
        r = run([str(PROXMOX), "8006", "pre-start"], env)
        assert r.returncode == 0, r.stderr
        mdevs = server.mdevs()
        assert mdevs[pve_uuid(0, 8006)] == (GPU_A, "nvidia-232")
        assert mdevs[pve_uuid(2, 8006)] == (GPU_B, "nvidia-231")  # one vGPU per GPU per VM: the other GPU
        assert pve_uuid(5, 8006) not in mdevs and len(mdevs) == 2
    assert "00000000-0000-0000-0000-000000008006" in r.stdout
    assert run([str(PROXMOX), "8006", "post-start"], env).returncode == 0
    r = run([str(PROXMOX), "8006", "post-stop"], env)
    assert r.returncode == 0, r.stderr
    assert "released" in r.stdout and server.mdevs() == {}
    r = run([str(PROXMOX), "8006", "pre-start"], env)  # the next start of the same VM
    assert r.returncode == 0, r.stderr
    assert set(server.mdevs()) == {pve_uuid(0, 8006), pve_uuid(2, 8006)}
    assert run([str(PROXMOX), "8006", "post-stop"], env).returncode == 0
    assert server.mdevs() == {}


def test_proxmox_pre_start_failure_aborts_with_a_clear_message(server: Server) -> None:
    (server.conf_dir / "200.conf").write_text("hostpci0: 0000:3b:00.0,mdev=nvidia-9999\n")
    r = run([str(PROXMOX), "200", "pre-start"], server.env())
    assert r.returncode == 1
    assert "VM 200 pre-start" in r.stderr and "vgpumgr refused (404)" in r.stderr and "nvidia-9999" in r.stderr
    r = run([str(PROXMOX), "404", "pre-start"], server.env())
    assert r.returncode == 1 and "cannot read the VM config" in r.stderr


def test_proxmox_hook_when_the_service_is_down_or_no_token(server: Server, tmp_path: Path) -> None:
    (server.conf_dir / "300.conf").write_text("hostpci0: 0000:3b:00.0,mdev=nvidia-232\n")
    down = server.env(VGPUMGR_SOCKET=str(tmp_path / "none.sock"))
    r = run([str(PROXMOX), "300", "pre-start"], down)
    assert r.returncode == 1 and "service is not running" in r.stderr and "none.sock" in r.stderr
    no_token = server.env(VGPUMGR_TOKEN="", VGPUMGR_TOKEN_FILE=str(tmp_path / "missing.token"))
    r = run([str(PROXMOX), "300", "pre-start"], no_token)
    assert r.returncode == 1 and "no hook token" in r.stderr
    (tmp_path / "bad.token").write_text("vgm_wrong\n")
    r = run([str(PROXMOX), "300", "pre-start"], server.env(VGPUMGR_TOKEN="", VGPUMGR_TOKEN_FILE=str(
        tmp_path / "bad.token")))
    assert r.returncode == 1 and "(401)" in r.stderr
    assert run([str(PROXMOX), "300", "pre-stop"], down).returncode == 0  # phases it does not handle
    assert run([str(PROXMOX), "abc", "pre-start"], down).returncode == 2
    assert server.mdevs() == {}


def _xml(name: str, uuid: str, meta: dict | None) -> str:
    d = domain.build(domain.VmSpec(name, hostdevs=[domain.Hostdev("mdev", uuid=uuid)]))
    if meta:
        d.set_allocations([meta])
    return etree.tostring(d.element, encoding="unicode")


def test_libvirt_hook_prepare_and_release(server: Server) -> None:
    uuid = "8f7c3c52-1d6e-4a3c-9f1e-2b0d7d5a9c10"
    xml = _xml("lv1", uuid, {"uuid": uuid, "backend": "mdev", "parent": GPU_B, "type": "nvidia-233"})
    env = server.env()
    r = run([str(LIBVIRT), "lv1", "prepare", "begin", "-"], env, xml)
    assert r.returncode == 0, r.stderr
    assert server.mdevs() == {uuid: (GPU_B, "nvidia-233")} and "re-created" in r.stdout
    assert run([str(LIBVIRT), "lv1", "start", "begin", "-"], env, xml).returncode == 0
    r = run([str(LIBVIRT), "lv1", "release", "end", "-"], env, xml)
    assert r.returncode == 0, r.stderr
    assert server.mdevs() == {}
    # A host reboot: the device is gone; the domain's metadata says what to make again.
    assert run([str(LIBVIRT), "lv1", "prepare", "begin", "-"], env, xml).returncode == 0
    assert server.mdevs() == {uuid: (GPU_B, "nvidia-233")}
    assert run([str(LIBVIRT), "lv1", "release", "end", "-"], env, xml).returncode == 0


def test_libvirt_hook_refuses_unknown_mdevs_and_ignores_plain_domains(server: Server, tmp_path: Path) -> None:
    stranger = _xml("lv2", "11111111-2222-3333-4444-555555555555", None)
    r = run([str(LIBVIRT), "lv2", "prepare", "begin", "-"], server.env(), stranger)
    assert r.returncode == 1 and "domain lv2 prepare begin" in r.stderr and "metadata" in r.stderr
    plain = domain.render(domain.VmSpec("plain", hostdevs=[domain.Hostdev("passthrough", address=GPU_A)]))
    down = server.env(VGPUMGR_SOCKET=str(tmp_path / "none.sock"))
    assert run([str(LIBVIRT), "plain", "prepare", "begin", "-"], down, plain).returncode == 0
    r = run([str(LIBVIRT), "lv2", "prepare", "begin", "-"], down, stranger)
    assert r.returncode == 1 and "service is not running" in r.stderr
    assert run([str(LIBVIRT), "lv2"], down).returncode == 2
