"""Applies the effects of sysfs writes to a simulated tree with the real kernel's rules and errnos.

Errnos follow the Linux 6.1 sources and what the real kernel returned in the mdev lab (docs/sources.md §1, §2) and
NVIDIA's vendor-VF driver (§4); where no source gives one, §17 says so. Writes are serialised with a lock file, as
the kernel serialises them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
from pathlib import Path
from typing import Any

from vgpumgr.hostfs.root import SIM_MARKER
from vgpumgr.sim import gpus as simgpus
from vgpumgr.sim import placements as simplace
from vgpumgr.sim import rules, vendor_gpus
from vgpumgr.sim.files import read_text, update, update_changed, write
from vgpumgr.sim.tree import SimTree

_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_READ_ONLY = {"available_instances", "name", "description", "device_api", "vendor", "device", "class",
              "subsystem_vendor", "subsystem_device", "numa_node", "sriov_totalvfs", "sriov_offset",
              "sriov_stride", "sriov_vf_device", "creatable_vgpu_types", "local_cpulist", "reset_method"}


def _err(code: int, what: str) -> OSError:
    return OSError(code, os.strerror(code), what)


def kstrto(data: str, what: str, *, base: int = 0, bits: int = 64, signed: bool = False) -> int:
    """The kernel's kstrto*() parse: an optional sign, base-0 prefixes (0x hex, 0 octal), one trailing
    newline and nothing else (no spaces, no underscores); EINVAL otherwise and when the value does not fit."""
    body = data[:-1] if data.endswith("\n") else data
    sign = -1 if signed and body.startswith("-") else 1
    digits = body[1:] if body[:1] in ("+", "-") and (signed or body[:1] == "+") else body
    if base == 10:
        ok, radix = re.fullmatch(r"[0-9]+", digits), 10
    elif re.fullmatch(r"0[xX][0-9a-fA-F]+", digits):
        ok, radix, digits = True, 16, digits[2:]
    elif digits.startswith("0"):
        ok, radix = re.fullmatch(r"0[0-7]*", digits), 8
    else:
        ok, radix = re.fullmatch(r"[1-9][0-9]*", digits), 10
    if not ok:
        raise _err(errno.EINVAL, what)
    value = sign * int(digits, radix)
    limit = 1 << (bits - 1 if signed else bits)
    if not (-limit if signed else 0) <= value < limit:
        raise _err(errno.EINVAL, what)
    return value


class KernelEmulator:
    def __init__(self, host) -> None:  # noqa: ANN001 - vgpumgr.hostfs.root.Host (import cycle)
        self.root = Path(host.root)
        self._lock_path = str(self.root / ".vgpumgr-sim.lock")
        self._state_path = str(self.root / SIM_MARKER)
        self._state: tuple[tuple[int, int, int], dict[str, Any]] | None = None
        self._real_dirs: dict[str, str] = {}

    def write(self, path: Path, data: str) -> None:
        # The lock file is opened per write, not kept open: a descriptor inherited across fork() would share
        # its flock with the child, and one kept across a rebuild of the tree would lock a deleted file.
        fd = os.open(self._lock_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            tree = SimTree(self.root, state=self._cached_state(), real_dirs=self._real_dirs)
            try:
                self._dispatch(tree, path, _locate(path), data)
            except BaseException:
                self._state = None  # whatever a failed write may have touched is read afresh next time
                raise
            if tree.dirty:
                self._state = None
            tree.save()
        finally:
            os.close(fd)  # closing drops the flock

    def _cached_state(self) -> dict[str, Any]:
        """The simulator's state file, parsed again only when it was replaced (writers replace it
        atomically, so inode, mtime and size name one version). The writes handled here only read it."""
        st = os.stat(self._state_path)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._state is None or self._state[0] != key:
            self._state = (key, json.loads(read_text(self._state_path)))
        return self._state[1]

    def _dispatch(self, tree: SimTree, path: Path, real: str, data: str) -> None:
        """`real`: `path` with its directory resolved (its last component may be a link)."""
        parent, name = os.path.split(real)
        if name in _READ_ONLY:
            raise _err(errno.EACCES, str(path))
        if name == "create" and os.path.basename(os.path.dirname(parent)) == "mdev_supported_types":
            self._create_mdev(tree, parent, data)
        elif name == "remove" and os.path.islink(f"{parent}/mdev_type"):
            self._remove_mdev(tree, parent, data)
        elif name == "sriov_numvfs":
            self._sriov_numvfs(tree, Path(parent), data)
        elif name == "current_vgpu_type" and os.path.basename(parent) == "nvidia":
            self._current_vgpu_type(tree, os.path.dirname(parent), data)
        elif name in ("placement_id", "vgpu_params") and os.path.basename(parent) == "nvidia":
            self._placement(tree, os.path.dirname(parent), name, real, data)
        elif vendor_gpus.quota_write(tree, real, data, kstrto):
            pass
        elif name == "driver_override":
            value = data.strip()
            tree.attr(real, (value or "(null)") + "\n")
        elif name in ("bind", "unbind") and os.path.basename(os.path.dirname(parent)) == "drivers":
            self._bind(tree, os.path.basename(parent), name, data)
        elif name == "drivers_probe":
            self._probe(tree, data.strip())
        elif os.path.isfile(real) and not os.path.islink(real):
            tree.attr(real, data)
        else:  # a link or a directory: as the old open(O_TRUNC), which follows links and refuses directories
            write(real, data)

    # -- mdev -----------------------------------------------------------------------------------
    def _create_mdev(self, tree: SimTree, type_dir: str, data: str) -> None:
        if len(data) == 0:
            return  # a 0-byte write never reaches the kernel's create_store
        if not 36 <= len(data) <= 37 or not _UUID.match(data[:36]):
            raise _err(errno.EINVAL, "create")
        uuid = data[:36].lower()
        if os.path.islink(f"{tree.sys}/bus/mdev/devices/{uuid}"):
            raise _err(errno.EEXIST, "create")
        pdir = os.path.dirname(os.path.dirname(type_dir))
        available = int(read_text(f"{type_dir}/available_instances"))
        if available <= 0:
            sample = tree.state["samples"].get(os.path.basename(pdir))
            code = errno.EUSERS if sample and sample["errno"] == "EUSERS" else errno.ENOSPC
            raise _err(code, "create")
        type_name = os.path.basename(type_dir)
        mdir = tree.add_mdev(pdir, uuid, type_name)
        self._placed(tree, pdir, uuid, mdir, type_name)
        vendor_gpus.after_mdev_create(tree, pdir, uuid, type_name)
        self._refresh_parent(tree, pdir, added=type_name)

    def _remove_mdev(self, tree: SimTree, mdir: str, data: str) -> None:
        if data == "":
            return  # a 0-byte write never reaches remove_store
        value = kstrto(data, "remove")
        if value == 0:
            return
        group = os.path.basename(os.readlink(f"{mdir}/iommu_group"))
        if _held(tree.root, f"/dev/vfio/{group}"):
            # The real kernel blocks the writer until the VM lets go; vgpumgr must never get here.
            raise _err(errno.EBUSY, "remove (the real kernel would block here until the VM releases it)")
        pf = simgpus.physical_gpu_of(tree, os.path.dirname(mdir))
        if pf:
            simplace.release(tree.state["gpus"][pf], os.path.basename(mdir))
            tree.dirty = True
        type_name = tree.remove_mdev(mdir, group)
        self._refresh_parent(tree, os.path.dirname(mdir), removed=type_name)

    def _refresh_parent(self, tree: SimTree, pdir: Path | str, added: str | None = None,
                        removed: str | None = None) -> None:
        """Rewrite what the parent's driver reports as creatable after one mdev of type `added` appeared
        (or of type `removed` went); with neither, after any change (every file is read and compared)."""
        pdir = os.fspath(pdir)
        if vendor_gpus.refresh_parent(tree, pdir):
            return
        sample = tree.state["samples"].get(os.path.basename(pdir))
        if sample:
            def files(existing: list[str]) -> dict[str, str]:
                pool = rules.pool_available(sample["costs"], sample["budget"], existing)
                return {f"{pdir}/mdev_supported_types/{t}/available_instances": f"{n}\n" for t, n in pool.items()}

            after = [t for _, t in tree.mdevs_of(pdir)]
            if (added is None and removed is None) or (added is not None and added not in after):
                for path, content in files(after).items():
                    update(path, content)
                return
            before = [*after, removed] if removed is not None else list(after)
            if added is not None:
                before.remove(added)
            update_changed(files(before), files(after))
            return
        pf = simgpus.physical_gpu_of(tree, pdir)
        if not pf:
            return
        if added is None and removed is None:
            simgpus.refresh(tree, pf)
        else:
            simgpus.refresh_change(tree, pf, pdir, added=added, removed=removed)

    # -- SR-IOV ---------------------------------------------------------------------------------
    def _sriov_numvfs(self, tree: SimTree, pfdir: Path, data: str) -> None:
        # the kernel's order (drivers/pci/iov.c, as measured in the lab): parse, range, no-op, driver, busy
        if data == "":
            return  # a 0-byte write never reaches sriov_numvfs_store
        n = kstrto(data, "sriov_numvfs", bits=16)
        total = int((pfdir / "sriov_totalvfs").read_text())
        current = int((pfdir / "sriov_numvfs").read_text())
        if n > total:
            raise _err(errno.ERANGE, "sriov_numvfs")
        if n == current:
            return
        if not (pfdir / "driver").is_symlink():
            raise _err(errno.ENOENT, "sriov_numvfs (no driver bound to the PF)")
        if tree.state["gpus"].get(pfdir.name, {}).get("sriov_configure") is False:
            # a PF driver without .sriov_configure (AMD's GIM): "Driver does not support SRIOV configuration via sysfs"
            raise _err(errno.ENOENT, "sriov_numvfs (the PF's driver does not support SR-IOV configuration via sysfs)")
        if n and current:
            raise _err(errno.EBUSY, "sriov_numvfs")
        if n == 0:
            simgpus.disable_vfs(tree, pfdir.name)
            vendor_gpus.after_disable(tree, pfdir.name)
        else:
            simgpus.enable_vfs(tree, pfdir.name, n)
            vendor_gpus.after_enable(tree, pfdir.name, n)
        if pfdir.name in tree.state["gpus"]:  # sriov-manage clears mixed-size mode, both ways
            simplace.lose_mode(tree.state["gpus"][pfdir.name])
            tree.dirty = True
            simgpus.refresh(tree, pfdir.name)

    # -- NVIDIA vendor-specific VF --------------------------------------------------------------
    def _current_vgpu_type(self, tree: SimTree, vfdir: str, data: str) -> None:
        value = kstrto(data, "current_vgpu_type", base=10, signed=True)
        cur_file = f"{vfdir}/nvidia/current_vgpu_type"
        current = int(read_text(cur_file))
        if value == 0:
            if current == 0:
                raise _err(errno.EPERM, "current_vgpu_type")
            group = os.path.basename(os.readlink(f"{vfdir}/iommu_group"))
            if _held(tree.root, f"/dev/vfio/{group}") or _held(tree.root, vfdir):
                raise _err(errno.EBUSY, "current_vgpu_type")
            tree.attr(cur_file, "0\n")
            pf = simgpus.physical_gpu_of(tree, vfdir)
            if pf:
                simplace.release(tree.state["gpus"][pf], os.path.basename(vfdir))
                tree.dirty = True
                if os.path.exists(f"{vfdir}/nvidia/placement_id"):
                    tree.attr(f"{vfdir}/nvidia/placement_id", simplace.NOT_APPLICABLE)
        else:
            if current != 0:
                raise _err(errno.EPERM, "current_vgpu_type")
            creatable = read_text(f"{vfdir}/nvidia/creatable_vgpu_types").splitlines()[1:]
            ids = {int(line.split(":", 1)[0]) for line in creatable if ":" in line}
            if value not in ids:
                raise _err(errno.EINVAL, "current_vgpu_type")
            tree.attr(cur_file, f"{value}\n")
            self._placed(tree, vfdir, os.path.basename(vfdir), vfdir, f"nvidia-{value}")
        pf = simgpus.physical_gpu_of(tree, vfdir)
        if pf:
            if value:
                simgpus.refresh_change(tree, pf, vfdir, added=f"nvidia-{value}")
            else:
                simgpus.refresh_change(tree, pf, vfdir, removed=f"nvidia-{current}")

    # -- placement IDs (vgpumgr.sim.placements) ------------------------------------------------------
    def _placed(self, tree: SimTree, parent_dir: str, key: str, device_dir: str, type_dir: str) -> None:
        """A vGPU was made on `device_dir` (a VF, or an mdev's directory): the driver reserves its placement."""
        pf = simgpus.physical_gpu_of(tree, parent_dir)
        if not pf or not type_dir.startswith("nvidia-"):
            return
        gpu = tree.state["gpus"][pf]
        if not gpu.get("arch"):  # a GPU without placement IDs (T4): no placement_id file is simulated
            return
        params = f"{device_dir}/nvidia/vgpu_params"
        wanted = simplace.params_placement(read_text(params)) if os.path.exists(params) else None
        try:
            place = simplace.reserve(gpu, key, int(type_dir[7:]), wanted if simplace.branch(gpu) < 570 else None)
        except OSError as e:
            raise _err(e.errno or errno.EINVAL, "create") from None
        tree.dirty = True
        if simplace.branch(gpu) >= 570:
            tree.attr(f"{device_dir}/nvidia/placement_id", simplace.NOT_APPLICABLE if place is None else f"{place}\n")

    def _placement(self, tree: SimTree, device_dir: str, name: str, real: str, data: str) -> None:
        """`placement_id` (R570+) moves a vGPU's placement; `vgpu-placement-id=` in `vgpu_params` does on R550."""
        pf = simgpus.physical_gpu_of(tree, os.path.dirname(device_dir) if not os.path.exists(
            f"{device_dir}/physfn") and os.path.islink(f"{device_dir}/mdev_type") else device_dir)
        gpu = tree.state["gpus"].get(pf or "")
        key = os.path.basename(device_dir)
        if name == "vgpu_params":
            tree.attr(real, data)
            wanted = simplace.params_placement(data)
            if gpu and wanted is not None and simplace.branch(gpu) < 570 and key in gpu.get("placements", {}):
                with contextlib.suppress(OSError):  # an ID that is not creatable fails the VM's start instead
                    simplace.move(gpu, key, wanted)
                    tree.dirty = True
                    simgpus.refresh(tree, pf)
            return
        value = kstrto(data, "placement_id", base=10, bits=16)
        if gpu is None or key not in gpu.get("placements", {}):
            raise _err(errno.ENXIO, "placement_id")  # no vGPU on this function yet
        group = os.path.basename(os.readlink(f"{device_dir}/iommu_group"))
        if _held(tree.root, f"/dev/vfio/{group}") or _held(tree.root, device_dir):
            raise _err(errno.EBUSY, "placement_id")
        try:
            simplace.move(gpu, key, value)
        except OSError as e:
            raise _err(e.errno or errno.EINVAL, "placement_id") from None
        tree.dirty = True
        tree.attr(real, f"{value}\n")
        simgpus.refresh(tree, pf)

    # -- drivers --------------------------------------------------------------------------------
    def _bind(self, tree: SimTree, driver: str, action: str, data: str) -> None:
        address = data.strip()
        d = tree.sys / "bus/pci/devices" / address
        if not d.is_symlink():
            raise _err(errno.ENODEV, action)
        if action == "unbind":
            if tree.unbind(address) != driver:
                raise _err(errno.ENODEV, action)
            return
        if (d / "driver").is_symlink():
            raise _err(errno.EBUSY, action)
        override = (d / "driver_override").read_text().strip()
        if override not in ("(null)", driver):
            raise _err(errno.ENODEV, action)
        tree.bind(address, driver)

    def _probe(self, tree: SimTree, address: str) -> None:
        d = tree.sys / "bus/pci/devices" / address
        if not d.is_symlink():
            raise _err(errno.ENODEV, "drivers_probe")
        if (d / "driver").is_symlink():
            return
        override = (d / "driver_override").read_text().strip()
        if override != "(null)":
            tree.bind(address, override)
            return
        real = d.resolve()
        pf = simgpus.physical_gpu_of(tree, real)
        gpu = tree.state["gpus"].get(pf or "", {})
        default = gpu.get("vf_driver") if (real / "physfn").is_symlink() else gpu.get("driver")
        if default:
            tree.bind(address, default)


def _locate(path: Path | str) -> str:
    """`path` with its directory resolved and its last component kept (a link stays a link); ENOENT when
    the directory or the entry is missing. The kernel resolves the directory (open(O_PATH) and the
    /proc/self/fd link name it): 4 syscalls where os.path.realpath takes an lstat per component."""
    parent, name = os.path.split(os.fspath(path) if isinstance(path, Path) else str(Path(path)))
    try:
        fd = os.open(parent or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise _err(errno.ENOENT, str(path)) from None
    try:
        try:
            os.lstat(name, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError):
            raise _err(errno.ENOENT, str(path)) from None
        try:
            real_parent = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc
            real_parent = os.path.realpath(parent or ".")
    finally:
        os.close(fd)
    return os.path.join(real_parent, name)


def _held(root: Path, target: str) -> bool:
    """Is a simulated process holding `target` open? (root/proc/<pid>/fd/<n> symlinks, as on a host)."""
    try:
        procs = list(os.scandir(f"{root}/proc"))
    except (FileNotFoundError, NotADirectoryError):
        return False
    for p in procs:
        try:
            fds = list(os.scandir(f"{p.path}/fd"))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for f in fds:
            try:
                if os.readlink(f.path) == target:
                    return True
            except OSError:
                continue
    return False

