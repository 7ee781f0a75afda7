"""The simulated host beyond its PCI devices, as a healthy vGPU host has it: /proc/cpuinfo, /proc/modules,
/proc/cmdline, the kernel release, /dev/kvm, the ACPI DMAR table, and systemd's units (UNITS_FILE, answered
through `SimKernel.unit_state`). `vgpumgr sim break STATE` makes one thing fail the way it fails on a host, so that
`vgpumgr doctor` can be shown to name it with its fix. The values are the simulator's choices (docs/sources.md §17).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vgpumgr.errors import InvalidInput
from vgpumgr.sim.files import write

KERNEL = "6.8.0-49-generic"
UNITS_FILE = ".vgpumgr-sim-units.json"
SECURE_BOOT_VAR = "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
BASE_MODULES = ("kvm_intel", "kvm", "vfio_pci", "vfio_pci_core", "vfio_iommu_type1", "vfio", "mdev")
NVIDIA_MODULES = ("nvidia_vgpu_vfio", "nvidia")
CPU_FLAGS = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht " \
            "syscall nx lm constant_tsc nopl xtopology pni pclmulqdq vmx ssse3 fma cx16 sse4_1 sse4_2 x2apic popcnt " \
            "aes xsave avx f16c rdrand hypervisor lahf_lm abm ept vpid avx2 smep erms"
RESTORE_AFTER = "systemd-modules-load.service nvidia-persistenced.service nvidia-vgpud.service nvidia-vgpu-mgr.service"


def _unit(active: str, sub: str, enabled: str = "enabled", status: str = "0", after: str = "") -> dict[str, str]:
    return {"LoadState": "loaded", "ActiveState": active, "SubState": sub, "Result": "success",
            "ExecMainStatus": status, "UnitFileState": enabled, "After": after}


def populate(root: Path, nvidia: bool) -> None:
    root = Path(root)
    write(root / "proc/cpuinfo", "".join(f"processor\t: {n}\nvendor_id\t: GenuineIntel\nflags\t\t: {CPU_FLAGS}\n\n"
                                         for n in range(4)))
    modules = BASE_MODULES + (NVIDIA_MODULES if nvidia else ())
    write(root / "proc/modules", "".join(f"{m} 16384 0 - Live 0x0000000000000000\n" for m in modules))
    write(root / "proc/cmdline", f"BOOT_IMAGE=/boot/vmlinuz-{KERNEL} root=/dev/mapper/vg-root ro intel_iommu=on "
                                 "iommu=pt\n")
    write(root / "proc/sys/kernel/osrelease", KERNEL + "\n")
    write(root / "dev/kvm", "")
    write(root / "sys/firmware/acpi/tables/DMAR", "DMAR")
    units = {"vgpumgr-restore.service": _unit("active", "exited", after=RESTORE_AFTER),
             "vgpumgr.socket": _unit("active", "listening")}
    if nvidia:
        units["nvidia-vgpu-mgr.service"] = _unit("active", "running")
        units["nvidia-vgpud.service"] = _unit("inactive", "dead")
    (root / UNITS_FILE).write_text(json.dumps(units, indent=1))


def unit_state(root: Path, name: str) -> dict[str, str]:
    try:
        units = json.loads((Path(root) / UNITS_FILE).read_text())
    except (OSError, ValueError):
        return {}  # a tree from before the units were simulated: as a host where systemd cannot be asked
    return dict(units.get(name) or {"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead",
                                    "UnitFileState": ""})


def _set_unit(root: Path, name: str, **props: str) -> None:
    path = Path(root) / UNITS_FILE
    units = json.loads(path.read_text()) if path.exists() else {}
    units[name] = {**unit_state(root, name), "LoadState": "loaded", **props}
    path.write_text(json.dumps(units, indent=1))


def _drop_module(root: Path, name: str) -> None:
    path = Path(root) / "proc/modules"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    kept = [line for line in lines if line.split()[0] != name]
    if len(kept) == len(lines):
        raise InvalidInput(f"module {name} is not loaded on this simulated host",
                           hint="`cat " + str(path) + "` lists the loaded ones")
    write(path, "".join(kept))


# -- `vgpumgr sim break STATE` ---------------------------------------------------------------------------------

STATES = {
    "no-virt": "the CPU shows no vmx/svm flag (virtualisation off in the BIOS)",
    "no-kvm": "/dev/kvm is gone (kvm_intel not loaded)",
    "iommu-off": "no IOMMU: no ACPI DMAR table, no IOMMU groups, no intel_iommu=on",
    "module-missing": "a kernel module is not loaded (--module, default vfio_pci)",
    "unit-failed": "a systemd unit failed (--unit, default nvidia-vgpu-mgr.service)",
    "no-vgpu-driver": "a data-center driver instead of the vGPU host driver (no nvidia_vgpu_vfio, no vGPU units)",
    "secure-boot": "Secure Boot on and the unsigned nvidia module refused",
    "nouveau": "nouveau owns the GPU (--gpu)",
    "unbound": "no driver is bound to the GPU (--gpu)",
    "vfs-off": "the GPU's SR-IOV VFs are disabled (--gpu)",
    "branch": "the driver is of a branch that does not support the GPU (--gpu; --driver VERSION to choose)",
    "mig-pending": "a MIG mode change waits for a GPU reset (--gpu)",
}


def break_state(root: Path, state: str, gpu: str | None = None, module: str | None = None,
                unit: str | None = None, driver: str | None = None) -> str:
    """Make `state` true on the simulated host at `root`; returns what was done, in words."""
    from vgpumgr.sim.tree import SimTree

    root = Path(root)
    if state not in STATES:
        raise InvalidInput(f"unknown state '{state}'", hint="one of: " + ", ".join(STATES))
    if state == "no-virt":
        cpuinfo = root / "proc/cpuinfo"
        write(cpuinfo, cpuinfo.read_text().replace(" vmx", "").replace(" svm", ""))
    elif state == "no-kvm":
        (root / "dev/kvm").unlink(missing_ok=True)
        _drop_module(root, "kvm_intel")
    elif state == "iommu-off":
        _iommu_off(root)
    elif state == "module-missing":
        _drop_module(root, module or "vfio_pci")
    elif state == "unit-failed":
        _set_unit(root, unit or "nvidia-vgpu-mgr.service", ActiveState="failed", SubState="failed",
                  Result="exit-code", ExecMainStatus="1")
    elif state == "no-vgpu-driver":
        _drop_module(root, "nvidia_vgpu_vfio")
        path = root / UNITS_FILE
        units = json.loads(path.read_text())
        for name in ("nvidia-vgpu-mgr.service", "nvidia-vgpud.service"):
            units.pop(name, None)
        path.write_text(json.dumps(units, indent=1))
    elif state == "secure-boot":
        for m in ("nvidia_vgpu_vfio", "nvidia"):
            _drop_module(root, m)
        (root / SECURE_BOOT_VAR).parent.mkdir(parents=True, exist_ok=True)
        (root / SECURE_BOOT_VAR).write_bytes(b"\x06\x00\x00\x00\x01")
    else:
        tree = SimTree(root)
        address = _gpu(tree, gpu)
        _gpu_state(tree, state, address, driver)
        tree.save(force=True)
        return f"{address}: {STATES[state]}"
    return STATES[state]


def _iommu_off(root: Path) -> None:
    groups = root / "sys/kernel/iommu_groups"
    parked = root / ".vgpumgr-sim-iommu-off"
    if groups.is_dir() and not parked.exists():
        os.rename(groups, parked)
    groups.mkdir(parents=True, exist_ok=True)
    (root / "sys/firmware/acpi/tables/DMAR").unlink(missing_ok=True)
    cmdline = root / "proc/cmdline"
    write(cmdline, cmdline.read_text().replace(" intel_iommu=on", "").replace(" iommu=pt", ""))
    for d in (root / "sys/bus/pci/devices").iterdir():  # no IOMMU: no device has a group
        link = d.resolve() / "iommu_group"
        if link.is_symlink():
            link.unlink()


def _gpu(tree: Any, gpu: str | None) -> str:
    nvidia = sorted(a for a, g in tree.state["gpus"].items() if g.get("vendor") == "10de")
    if gpu is None:
        if not nvidia:
            raise InvalidInput("this simulated host has no NVIDIA GPU", hint="build one with --profile mixed")
        return nvidia[0]
    if gpu not in tree.state["gpus"]:
        raise InvalidInput(f"no simulated GPU {gpu}", hint="`vgpumgr gpus` lists them")
    return gpu


def _gpu_state(tree: Any, state: str, address: str, driver: str | None) -> None:
    from vgpumgr.sim import gpus as simgpus

    spec = tree.state["gpus"][address]
    if state in ("nouveau", "unbound"):
        tree.unbind(address)
        if state == "nouveau":
            tree.bind(address, "nouveau")
        spec["driver"] = "nouveau" if state == "nouveau" else None  # what a boot binds it to again
    elif state == "vfs-off":
        if not spec.get("totalvfs"):
            raise InvalidInput(f"{address} has no SR-IOV VFs", hint="pick an SR-IOV GPU (L40S, A100, H100)")
        simgpus.disable_vfs(tree, address)
    elif state == "branch":
        version = driver or _refusing_version(spec["device"], address)
        _nvml(tree, lambda s: s.update(driver_version=version))
    elif state == "mig-pending":
        if not spec.get("mig"):
            raise InvalidInput(f"{address} has no MIG", hint="pick a MIG GPU (A100, H100)")

        def flip(s: dict[str, Any]) -> None:
            entry = next(e for e in s["gpus"] if e["address"] == address)
            entry["mig_mode"] = [entry["mig_mode"][0], 1 - entry["mig_mode"][0]]
        _nvml(tree, flip)


def _nvml(tree: Any, change: Any) -> None:
    from vgpumgr.sim.nvml import write_state
    from vgpumgr.sim.paths import nvml_state_path

    path = nvml_state_path(tree.root)
    if not path.exists():
        raise InvalidInput("this simulated host has no NVML (its driver version lives there)",
                           hint="build it with --profile mixed, a100-mig, h100-mig or l40s-vfio")
    state = json.loads(path.read_text())
    change(state)
    write_state(path, state)


def _refusing_version(device: str, address: str) -> str:
    from vgpumgr.ops import support_matrix

    for branch in support_matrix.data()["branches"]:
        if support_matrix.support(device, branch["branch"]).answer == support_matrix.NO:
            return branch["versions"][-1]
    raise InvalidInput(f"no branch in the support matrix refuses {address} (10de:{device})",
                       hint="give --driver VERSION, or pick another GPU (the H100 SXM of --profile h100-mig)")

