"""Guests in the simulator: a VM "opens" a vGPU that exists in the simulated sysfs, and the simulated NVML
reports it as an active vGPU instance (see vgpumgr.sim.nvml_vgpus) until the guest stops or the host reboots.
"""

from __future__ import annotations

import time
import uuid as uuidlib
from pathlib import Path
from typing import Any

from vgpumgr import ids
from vgpumgr.sim.nvml import SimNvml
from vgpumgr.sim.paths import nvml_state_path


def _layer(root: Path) -> SimNvml:
    path = nvml_state_path(root)
    if not path.is_file():
        raise ValueError(f"the simulated host at {root} has no simulated NVML (profiles with one: l40s-vfio, "
                         "a100-mig, h100-mig, mixed)")
    nvml = SimNvml(path)
    nvml.nvmlInit()
    return nvml


def _device(root: Path, ref: str) -> tuple[str, str, str | None, str | None]:
    """(physical GPU address, type dir, mdev UUID, VF address) of the vGPU `ref` in the simulated sysfs."""
    from vgpumgr.discovery.inventory import scan
    from vgpumgr.hostfs.root import Host

    inv = scan(Host(root))
    if ids.is_pci_address(ref):
        address = ids.pci_address(ref)
        vf = next((v for v in inv.vf_vgpus if v.address == address), None)
        if vf is not None:
            return vf.gpu, vf.type, None, address
        raise ValueError(f"{address} holds no vGPU type (a guest can only start on an existing vGPU)")
    uuid = ids.mdev_uuid(ref)
    mdev = next((m for m in inv.mdevs if m.uuid == uuid), None)
    if mdev is None or mdev.gpu is None:
        raise ValueError(f"no NVIDIA mdev {uuid} on the simulated host (a guest can only start on an existing vGPU)")
    vf = mdev.parent if mdev.parent != mdev.gpu else None
    return mdev.gpu, mdev.type, uuid, vf


def start_many(root: str | Path, guests: list[tuple[str, str, str | None]]) -> int:
    """Start many guests at once ((ref, VM UUID, VM name) each): one read of the host, one state write
    (benchmarks with hundreds of vGPUs). Returns how many started."""
    from vgpumgr.discovery.inventory import scan
    from vgpumgr.hostfs.root import Host

    root = Path(root)
    inv = scan(Host(root))
    mdevs = {m.uuid: m for m in inv.mdevs}
    vfs = {v.address: v for v in inv.vf_vgpus}
    nvml = _layer(root)
    with nvml._mutate() as state:
        by_gpu = {g["address"]: g for g in state["gpus"]}
        next_id = state.get("next_vgpu_instance", 1)
        for ref, vm_uuid, vm_name in guests:
            m, v = mdevs.get(ref), vfs.get(ref)
            gpu, type_dir = (m.gpu, m.type) if m else (v.gpu, v.type) if v else (None, None)
            if gpu not in by_gpu or type_dir is None:
                raise ValueError(f"{ref} is no vGPU of a GPU with a simulated NVML")
            by_gpu[gpu].setdefault("vgpu_instances", []).append({
                "id": next_id, "uuid": str(uuidlib.uuid4()), "vm_uuid": ids.mdev_uuid(vm_uuid), "vm_name": vm_name,
                "mdev_uuid": ref if m else None, "vf": (m.parent if m and m.parent != m.gpu else None) if m else ref,
                "type_id": ids.nvidia_type_id(type_dir), "gi_id": None, "guest_driver": None,
                "guest_vgpu_version": nvml._range()[1], "started": time.time()})
            next_id += 1
        state["next_vgpu_instance"] = next_id
    return len(guests)


def start(root: str | Path, ref: str, *, vm_uuid: str, vm_name: str | None = None,
          guest_driver: str | None = None, guest_vgpu_version: int | None = None,
          guest_dir: str | Path | None = None, again: bool = True) -> dict[str, Any]:
    """A VM opens the vGPU `ref` (mdev UUID or VF address): it becomes an active vGPU instance. `guest_dir`:
    its simulated guest OS (vgpumgr.sim.guest_agent), whose licensing vgpumgr.sim.guest_licence models. The same
    VM's guest already running there is returned as it is (`again`: a VM started through vgpumgr runs as its guest
    already); with `again` False that is refused too."""
    root = Path(root)
    vm_uuid = ids.mdev_uuid(vm_uuid)  # a domain UUID has the same form
    gpu_address, type_dir, mdev_uuid, vf = _device(root, ref)
    type_id = ids.nvidia_type_id(type_dir)
    nvml = _layer(root)
    with nvml._mutate() as state:
        gpu = next((g for g in state["gpus"] if g["address"] == gpu_address), None)
        if gpu is None:
            raise ValueError(f"GPU {gpu_address} has no simulated NVML")
        actives = gpu.setdefault("vgpu_instances", [])
        same = [i for i in actives
                if (mdev_uuid and i["mdev_uuid"] == mdev_uuid) or (vf and not mdev_uuid and i["vf"] == vf)]
        if same and same[0]["vm_uuid"] == vm_uuid and again:
            if guest_driver is not None:  # the guest's driver loaded (or changed) now
                same[0]["guest_driver"] = guest_driver
            if guest_dir is not None:  # its guest OS, given now (`sim guest start --os ...` after `vm start`)
                same[0]["guest_dir"] = str(guest_dir)
                same[0]["booted"] = time.time()  # the guest's services start now: they read the token from here on
            return dict(same[0], gpu=gpu_address)  # this VM's guest runs there already (started with its VM)
        if same:
            raise ValueError(f"a guest already runs on {ref}")
        spec_type = nvml._type(type_id)
        inst = {"id": state.get("next_vgpu_instance", 1), "uuid": str(uuidlib.uuid4()), "vm_uuid": vm_uuid,
                "vm_name": vm_name, "mdev_uuid": mdev_uuid, "vf": vf, "type_id": type_id,
                "gi_id": _free_gpu_instance(gpu, actives, spec_type.gi_profile_id), "guest_driver": guest_driver,
                # the version the guest's driver negotiates: the newest this host's vGPU manager offers
                "guest_vgpu_version": guest_vgpu_version or nvml._range()[1], "started": time.time()}
        if guest_dir is not None:
            inst["guest_dir"] = str(guest_dir)
        state["next_vgpu_instance"] = inst["id"] + 1
        actives.append(inst)
    return dict(inst, gpu=gpu_address)


def _free_gpu_instance(gpu: dict[str, Any], actives: list[dict[str, Any]], profile_id: int | None) -> int | None:
    """A MIG-backed vGPU runs on a GPU instance of its profile that no other running vGPU uses."""
    if profile_id is None:
        return None
    taken = {i["gi_id"] for i in actives}
    for gi in gpu["gpu_instances"]:
        if gi["profile_id"] == profile_id and gi["id"] not in taken:
            return gi["id"]
    raise ValueError(f"no free GPU instance of profile {profile_id} on {gpu['address']} for this MIG-backed vGPU")


def stop(root: str | Path, ref: str | int) -> dict[str, Any]:
    """The VM lets the vGPU go (shut down, migrated away): its instance ends. `ref`: mdev UUID, VF address,
    VM UUID or instance id."""
    nvml = _layer(Path(root))
    with nvml._mutate() as state:
        inst = _find(state, ref)
        for gpu in state["gpus"]:
            if inst in gpu.get("vgpu_instances", ()):
                gpu["vgpu_instances"].remove(inst)
                return dict(inst, gpu=gpu["address"])
    raise ValueError(f"no running guest on {ref}")


def running(root: str | Path) -> list[dict[str, Any]]:
    """Every active vGPU instance, with its GPU's address."""
    state = _layer(Path(root))._load()
    return [dict(inst, gpu=gpu["address"]) for gpu in state["gpus"] for inst in gpu.get("vgpu_instances", ())]


def _find(state: dict[str, Any], ref: str | int) -> dict[str, Any]:
    key = str(ref).strip().lower()
    for gpu in state["gpus"]:
        for inst in gpu.get("vgpu_instances", ()):
            if key in (str(inst["id"]), inst["mdev_uuid"], inst["vf"], inst["vm_uuid"]):
                return inst
    raise ValueError(f"no running guest on {ref}")


LOAD_KEYS = ("sm", "mem", "enc", "dec", "jpg", "ofa", "wobble")


def set_load(root: str | Path, ref: str | int, *, fb_used_mb: int | None = None,
             encoder: dict[str, int] | None = None, fbc: dict[str, int] | None = None,
             frame_rate_limit: int | None = None, **load: float) -> dict[str, Any]:
    """What the guest on `ref` does: per engine a base percentage (sm, mem, enc, dec, jpg, ofa) and `wobble`,
    the framebuffer it uses, its encoder and FBC sessions ({"sessions", "fps", "latency_us"}), its frame rate
    limit (see vgpumgr.sim.nvml_telemetry for how NVML answers from these)."""
    bad = set(load) - set(LOAD_KEYS)
    if bad:
        raise ValueError(f"unknown load {sorted(bad)}; known: {', '.join(LOAD_KEYS)}")
    nvml = _layer(Path(root))
    with nvml._mutate() as state:
        inst = _find(state, ref)
        inst["load"] = {**(inst.get("load") or {}), **{k: float(v) for k, v in load.items()}}
        if fb_used_mb is not None:
            inst["fb_used_mb"] = int(fb_used_mb)
        if encoder is not None:
            inst["encoder"] = dict(encoder)
        if fbc is not None:
            inst["fbc"] = dict(fbc)
        if frame_rate_limit is not None:
            inst["frame_rate_limit"] = int(frame_rate_limit)
        return dict(inst)


LICENCE_STATES = {"unknown": 0, "uninitialized": 1, "unlicensed-unrestricted": 2, "unlicensed-restricted": 3,
                  "unlicensed": 4, "licensed": 5}  # NVML_GRID_LICENSE_STATE_*


def set_licence(root: str | Path, ref: str | int, state: str, *, expiry: float | None = None) -> dict[str, Any]:
    """The licence state the guest's driver reports (`licensed`, `unlicensed`, ...), with an expiry (epoch s)."""
    if state not in LICENCE_STATES:
        raise ValueError(f"unknown licence state {state!r}; known: {', '.join(LICENCE_STATES)}")
    nvml = _layer(Path(root))
    with nvml._mutate() as st:
        inst = _find(st, ref)
        inst["licence"] = {"state": LICENCE_STATES[state], "expiry": expiry}
        return dict(inst)
