"""Section "services": NVIDIA's vGPU units (a healthy `nvidia-vgpud` is inactive with exit status 0) and
vgpumgr's own, enabled and ordered after NVIDIA's (docs/sources.md §26; causes N9, N10 of the facts)."""

from __future__ import annotations

from vgpumgr.ops.doctor.driver import INSTALL
from vgpumgr.ops.doctor.facts import Facts
from vgpumgr.ops.doctor.report import Section

TITLE = "services"
NO_SYSTEMD = "run doctor on the host itself (it asks `systemctl show`)"


def vgpu_mgr(s: Section, f: Facts) -> None:
    if not f.nvidia:
        return
    name, check = "nvidia-vgpu-mgr.service", "nvidia-vgpu-mgr running"
    u = f.unit(name)
    if not u:
        s.warn("unit.vgpu_mgr", check, "systemd cannot be asked", hint=NO_SYSTEMD)
    elif u.get("LoadState") == "not-found":
        s.fail("unit.vgpu_mgr", check, f"no {name}: only NVIDIA's vGPU host driver ships it", hint=INSTALL)
    elif u.get("ActiveState") == "active":
        s.pass_("unit.vgpu_mgr", check, f"active ({u.get('SubState', 'running')})")
    else:
        s.fail("unit.vgpu_mgr", check, f"{u.get('ActiveState')} (result {u.get('Result', '?')}): no vGPU VM can "
                                       "start", hint="`journalctl -u nvidia-vgpu-mgr` says why (fix the driver "
                                                     "and GPU checks first), then `systemctl enable --now "
                                                     "nvidia-vgpu-mgr`")


def vgpud(s: Section, f: Facts) -> None:
    if not f.nvidia:
        return
    name, check = "nvidia-vgpud.service", "nvidia-vgpud ran"
    u = f.unit(name)
    if not u:
        return
    status = u.get("ExecMainStatus", "0")
    if u.get("LoadState") == "not-found":
        s.note("unit.vgpud", check, f"no {name}", hint="shipped with the vGPU host driver; mdev-era hosts need it "
                                                       "to run at boot before any type appears")
    elif u.get("ActiveState") == "failed" or status not in ("0", ""):
        why = " (6: NOTCONFIGURED, the GPU is not supported by vGPU)" if status == "6" else ""
        s.fail("unit.vgpud", check, f"{u.get('ActiveState')}, exit status {status}{why}",
               hint="`journalctl -u nvidia-vgpud` says why; then `systemctl restart nvidia-vgpud`")
    elif u.get("ActiveState") == "active":
        s.pass_("unit.vgpud", check, "active")
    else:
        s.pass_("unit.vgpud", check, "inactive with exit status 0 (it sends the type table and exits: healthy)")


def restore_unit(s: Section, f: Facts) -> None:
    name, check = "vgpumgr-restore.service", "vgpumgr-restore enabled and ordered"
    u = f.unit(name)
    if not u:
        s.warn("unit.restore", check, "systemd cannot be asked", hint=NO_SYSTEMD)
        return
    if u.get("LoadState") == "not-found":
        s.warn("unit.restore", check, "not installed: VFs, MIG and vGPUs are not brought back at boot",
               hint="`vgpumgr install-units` then `systemctl enable vgpumgr-restore.service`")
        return
    if u.get("UnitFileState") != "enabled":
        s.warn("unit.restore", check, f"{u.get('UnitFileState', 'disabled')}: nothing brings the host back at boot",
               hint="`systemctl enable vgpumgr-restore.service`")
        return
    after = set(u.get("After", "").split())
    if f.nvidia and "nvidia-vgpu-mgr.service" not in after:
        s.warn("unit.restore", check, "enabled, but not ordered after nvidia-vgpu-mgr.service",
               hint="`vgpumgr install-units` rewrites the unit with its After= lines; `systemctl daemon-reload`")
        return
    s.pass_("unit.restore", check, "enabled" + (", after nvidia-vgpu-mgr.service" if f.nvidia else ""))


def api_socket(s: Section, f: Facts) -> None:
    u = f.unit("vgpumgr.socket")
    if not u:
        return
    check = "vgpumgr.socket enabled"
    if u.get("UnitFileState") == "enabled":
        s.pass_("unit.socket", check, f"{u.get('ActiveState', '?')}")
    else:
        s.note("unit.socket", check, f"{u.get('LoadState') if u.get('LoadState') == 'not-found' else 'not enabled'}"
                                     ": no REST API for hooks and the web view",
               hint="`vgpumgr install-units` then `systemctl enable --now vgpumgr.socket`")


def guest_driver_on_host(s: Section, f: Facts) -> None:
    u = f.unit("nvidia-gridd.service")
    if u and u.get("LoadState") not in (None, "not-found"):
        s.warn("unit.gridd", "no guest driver on the host", "nvidia-gridd.service exists: a guest (GRID) driver is "
                                                            "installed on this host",
               hint="uninstall it (`nvidia-uninstall`) and install the -vgpu-kvm host package instead")


CHECKS = (vgpu_mgr, vgpud, restore_unit, api_socket, guest_driver_on_host)
