"""Discovery and device lifecycle commands: gpus, types, mdev, vf, sriov, vfio."""

from __future__ import annotations

import argparse
import sys

from vgpumgr import ids
from vgpumgr.cli.output import dump_json, table
from vgpumgr.config import Config
from vgpumgr.errors import NotFound

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (~7 ms): see cli/main.py
if TYPE_CHECKING:
    from typing import Any, TextIO

    from vgpumgr.model import VgpuType


def config(args: argparse.Namespace) -> Config:
    return Config.resolve(sysfs_root=getattr(args, "sysfs_root", None), state_dir=getattr(args, "state_dir", None),
                          db=getattr(args, "db", None), connect=getattr(args, "connect", None))


def _note_simulated(cfg: Config) -> None:
    if cfg.host.simulated:
        sys.stderr.write(f"(simulated host: {cfg.host.root})\n")


def gpus(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.discovery.pci import discover_gpus

    cfg = config(args)
    found = discover_gpus(cfg.host)
    if not args.no_nvml:
        try:
            from vgpumgr.nvidia.facts import merge_nvml
        except ImportError:
            pass
        else:
            merge_nvml(cfg, found)
    if args.json:
        dump_json(out, [g.to_json() for g in found])
        return 0
    _note_simulated(cfg)
    rows = []
    for g in found:
        if g.is_vf and not args.vfs:
            continue
        vfs = f"{g.sriov.numvfs}/{g.sriov.totalvfs}" if g.sriov else ("VF of " + g.physfn if g.physfn else "-")
        mig_state = ((g.nvml or {}).get("mig") or {})
        mig = {"enabled": "on", "disabled": "off"}.get(mig_state.get("current") or "", "-")
        if mig_state.get("pending") and mig_state.get("pending") != mig_state.get("current"):
            mig += f" (pending {mig_state['pending']})"
        rows.append([g.address, f"{g.vendor_id}:{g.device_id}", g.name, g.driver, g.numa_node, g.iommu_group, vfs,
                     ",".join(g.backends) or "-", mig])
    table(out, ["ADDRESS", "ID", "NAME", "DRIVER", "NUMA", "IOMMU", "SR-IOV", "BACKENDS", "MIG"], rows,
          empty="no GPUs found")
    return 0


def resolve_type(types: list[VgpuType], wanted: str, parent: str | None = None) -> VgpuType:
    candidates = [t for t in types if (parent is None or t.parent == parent) and t.matches(wanted)]
    if not candidates:
        where = f" on {parent}" if parent else ""
        raise NotFound(f"no vGPU type '{wanted}'{where}",
                       hint=f"`vgpumgr types{' --parent ' + parent if parent else ''}` lists the types; "
                            "give an id (nvidia-232) or a name (T4-4Q)")
    return candidates[0]


def types(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.discovery.inventory import discover_types, types_json

    cfg = config(args)
    parent = ids.parent_name(args.parent) if args.parent else None
    cache = str(cfg.state_dir / "cache" / "mdev-types.json")
    if args.json:
        found_json = types_json(cfg.host, parent, cache_path=cache, available_only=args.available)
        if parent and not found_json:
            _check_parent(cfg, parent)
        if '"nvidia-vf"' in "".join(found_json):
            found_json = _with_gpu_available(cfg, found_json)
        out.write("[\n" + ",\n".join("  " + o for o in found_json) + ("\n]\n" if found_json else "]\n"))
        return 0
    found = discover_types(cfg.host, parent, cache_path=cache)
    if parent and not found:
        _check_parent(cfg, parent)
    if args.available:
        found = [t for t in found if t.available_instances > 0]
    _note_simulated(cfg)
    rows = [[t.parent, t.type, t.name or "-", t.backend, t.available_instances,
             f"{t.framebuffer_mb}M" if t.framebuffer_mb else "-", t.max_instance, t.description or "-"]
            for t in found]
    table(out, ["PARENT", "TYPE", "NAME", "BACKEND", "AVAIL", "FB", "MAX", "DESCRIPTION"], rows,
          empty="no vGPU types found")
    vf_gpus = {t.gpu for t in found if t.backend == "nvidia-vf" and t.gpu}
    if vf_gpus:
        _mixed_size_table(out, cfg, vf_gpus, args.available)
    return 0


def _mixed_size_counts(cfg: Config, gpus: set[str] | None = None) -> tuple[Any, dict[str, dict[str, int]]]:
    """Placement's counts for the GPUs in mixed-size mode; the records (the database) are opened only when NVML
    says one is, so `types` elsewhere needs no state directory."""
    from vgpumgr.discovery.pci import discover_gpus
    from vgpumgr.ops.slot_map import mixed_size_free
    from vgpumgr.placement.mixed import is_mixed
    from vgpumgr.service import Service

    try:
        from vgpumgr.nvidia.facts import merge_nvml
    except ImportError:
        return None, {}
    found = [g for g in discover_gpus(cfg.host) if not g.is_vf and (gpus is None or g.address in gpus)]
    merge_nvml(cfg, found)
    if not any(is_mixed(g) for g in found):
        return None, {}
    svc = Service(cfg)
    snap = svc.snapshot()
    return snap.placer, mixed_size_free(svc, snap, gpus)


def _with_gpu_available(cfg: Config, found_json: list[str]) -> list[str]:
    import json

    from vgpumgr.ops.slot_map import with_gpu_available

    _px, counts = _mixed_size_counts(cfg)
    if not counts:
        return found_json
    return [json.dumps(r) for r in with_gpu_available([json.loads(o) for o in found_json], counts)]


def _mixed_size_table(out: TextIO, cfg: Config, gpus: set[str], available_only: bool) -> None:
    px, counts = _mixed_size_counts(cfg, gpus)
    rows = []
    for gpu, by_type in sorted(counts.items()):
        infos = sorted((i for i in (px.info(gpu, t) for t in by_type) if i is not None),
                       key=lambda i: (i.framebuffer_mb or 0, i.name))
        rows += [[gpu, i.type, i.name, by_type[i.type]] for i in infos if by_type[i.type] or not available_only]
    if not counts:
        return
    out.write("\nAVAIL above is per VF, as the driver lists it: each free VF of a GPU in mixed-size mode lists every "
              "type that fits somewhere.\nWhat such a GPU can make now, one vGPU after the other (as `vgpumgr fleet "
              "capacity` counts):\n")
    table(out, ["GPU", "TYPE", "NAME", "FREE"], rows, empty="no type can be made now")


def _check_parent(cfg: Config, parent: str) -> None:
    if not cfg.host.parent(parent).exists() and not (ids.is_pci_address(parent) and cfg.host.pci(parent).exists()):
        raise NotFound(f"no mdev parent or vGPU VF {parent}", hint="`vgpumgr types` lists all parents")


def mdev_list(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.discovery.mdev import discover_mdevs

    cfg = config(args)
    found = discover_mdevs(cfg.host)
    if args.json:
        dump_json(out, [m.to_json() for m in found])
        return 0
    backed = any(m.backing_vf for m in found)  # Ascend vNPUs: the VF behind each, as its driver shows it
    table(out, ["UUID", "PARENT", "TYPE", "IOMMU", "GPU"] + (["BACKING VF"] if backed else []),
          [[m.uuid, m.parent, m.type, m.iommu_group, m.gpu] + ([m.backing_vf] if backed else []) for m in found],
          empty="no mdevs")
    return 0


def mdev_create(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.discovery.inventory import discover_types
    from vgpumgr.ops import manual

    cfg = config(args)
    parent = ids.parent_name(args.parent)
    uuid = ids.mdev_uuid(args.uuid) if args.uuid else None
    t = resolve_type([t for t in discover_types(cfg.host, parent) if t.backend == "mdev"], args.type, parent)
    dev = manual.mdev_create(cfg, parent, t, uuid)
    if args.json:
        dump_json(out, dev.to_json())
    else:
        out.write(f"created mdev {dev.uuid} ({t.type} {t.name}) on {parent}\n")
    return 0


def mdev_remove(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import manual

    dev = manual.mdev_remove(config(args), args.uuid, grace=args.grace)
    out.write(f"removed mdev {dev.uuid}\n")
    return 0


def vf_list(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.backends import nvidia_vf
    from vgpumgr.discovery.fs import link_name
    from vgpumgr.discovery.nvidia_vf import vendor_vfs

    cfg = config(args)
    rows = []
    for vf in vendor_vfs(cfg.host):
        cur = nvidia_vf.current(cfg.host, vf)
        rows.append({"address": vf, "physfn": link_name(f"{cfg.host.pci(vf)}/physfn"),
                     "current_vgpu_type": f"nvidia-{cur}" if cur else None,
                     "creatable": len(nvidia_vf.creatable(cfg.host, vf))})
    if args.json:
        dump_json(out, rows)
        return 0
    table(out, ["VF", "PHYSFN", "CURRENT", "CREATABLE TYPES"],
          [[r["address"], r["physfn"], r["current_vgpu_type"], r["creatable"]] for r in rows],
          empty="no VFs with NVIDIA's vendor-specific vGPU interface")
    return 0


def vf_set(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import manual

    tid = manual.vf_set(config(args), args.vf, args.type)
    out.write(f"VF {ids.pci_address(args.vf)} now holds vGPU type nvidia-{tid}\n")
    return 0


def vf_clear(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import manual

    changed = manual.vf_clear(config(args), args.vf, retries=args.retries)
    out.write(f"VF {ids.pci_address(args.vf)} {'cleared' if changed else 'had no vGPU type'}\n")
    return 0


def sriov_set(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import manual

    vfs = manual.sriov_set(config(args), args.pf, args.count, allow_nvidia=args.allow_nvidia)
    out.write(f"{ids.pci_address(args.pf)}: {len(vfs)} VFs{': ' + ' '.join(vfs) if vfs else ''}\n")
    return 0


def vfio_bind(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import manual

    prev = manual.vfio_bind(config(args), args.address)
    out.write(f"{ids.pci_address(args.address)} bound to vfio-pci (was {prev or 'unbound or already vfio-pci'})\n")
    return 0


def vfio_unbind(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.ops import manual

    prev = manual.vfio_unbind(config(args), args.address)
    out.write(f"{ids.pci_address(args.address)} released from vfio-pci (back to {prev or 'no driver'})\n")
    return 0
