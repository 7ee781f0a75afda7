"""`vgpumgr sim`: build simulated hosts and fake device holders."""

from __future__ import annotations

import argparse
import os
from typing import TextIO

from vgpumgr import ids
from vgpumgr.cli.devices import config
from vgpumgr.config import Config
from vgpumgr.errors import InvalidInput, NotFound


def simulated_config(args: argparse.Namespace, command: str) -> Config:
    cfg = config(args)
    if not cfg.host.simulated:
        raise InvalidInput(f"`sim {command}` only works on a simulated root",
                           hint="pass --sysfs-root DIR of a simulated host")
    return cfg


def create(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.sim import profiles

    root = profiles.create(args.dir, args.profile, scale=args.scale, vfs=args.vfs, force=args.force)
    out.write(f"simulated host '{args.profile}' (scale {args.scale}) built at {root}\n"
              f"use it with: vgpumgr --sysfs-root {root} gpus   (or export VGPUMGR_SYSFS_ROOT={root})\n")
    return 0


def hold(args: argparse.Namespace, out: TextIO) -> int:
    """Make a fake process in the simulated /proc hold a device's /dev/vfio group open."""
    from vgpumgr.discovery.fs import link_name

    cfg = simulated_config(args, "hold")
    target = args.target
    path = cfg.host.mdev(target) if not ids.is_pci_address(target) else cfg.host.pci(target)
    if not path.exists():
        raise NotFound(f"no device {target}")
    group = link_name(f"{path}/iommu_group")
    pid = 4000 + len(os.listdir(cfg.host.proc))
    fd_dir = cfg.host.proc / str(pid) / "fd"
    fd_dir.mkdir(parents=True)
    (cfg.host.proc / str(pid) / "comm").write_text(args.by + "\n")
    os.symlink(f"/dev/vfio/{group}", fd_dir / "20")
    out.write(f"{args.by}[{pid}] now holds /dev/vfio/{group} ({target}); remove {cfg.host.proc / str(pid)} to let go\n")
    return 0


def reboot(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.sim.reboot import reboot as sim_reboot

    cfg = simulated_config(args, "reboot")
    lost = sim_reboot(cfg.host.root)
    if args.json:
        from vgpumgr.cli.output import dump_json

        dump_json(out, lost)
        return 0
    out.write(f"simulated reboot: {lost['mdevs']} mdev(s) and {lost['vf_vgpus']} VF vGPU type(s) are gone\n")
    for pf, n in lost["vfs"].items():
        out.write(f"  {pf}: {n} VF(s) disabled (the driver does not enable them again; "
                  "sriov-manage -e or `vgpumgr restore` does)\n")
    for gpu, n in lost["gpu_instances"].items():
        out.write(f"  {gpu}: {n} MIG GPU instance(s) gone\n")
    for gpu in lost["mig_off"]:
        out.write(f"  {gpu}: MIG mode is off again (Hopper and newer do not keep it across a reboot)\n")
    for gpu in lost["heterogeneous_off"]:
        out.write(f"  {gpu}: mixed-size vGPU mode is off again\n")
    for gpu in lost.get("scheduler_reset", []):
        out.write(f"  {gpu}: vGPU scheduler back to best effort (NVML's setting does not persist)\n")
    for dev, (before, after) in lost["drivers"].items():
        out.write(f"  {dev}: back on its default driver ({before or 'none'} -> {after or 'none'})\n")
    for dev, what in lost.get("vendor", {}).items():
        out.write(f"  {dev}: {what}\n")
    if lost["iommu_groups"]:
        out.write(f"  IOMMU groups renumbered in bus order for {len(lost['iommu_groups'])} function(s)\n")
    return 0


def break_(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.sim.host_platform import break_state

    cfg = simulated_config(args, "break")
    gpu = ids.pci_address(args.gpu) if args.gpu else None
    what = break_state(cfg.host.root, args.state, gpu, args.module, args.unit, args.driver)
    out.write(f"simulated host broken: {what}\n`vgpumgr doctor` should name it with its fix\n")
    return 0


def guest(args: argparse.Namespace, out: TextIO) -> int:
    """`vgpumgr sim guest start|stop|load|licence|list`: the simulated NVML's running vGPUs."""
    from vgpumgr.sim import guests

    cfg = simulated_config(args, "guest")
    root = cfg.host.root
    try:
        if args.action == "list":
            res: object = guests.running(root)
        elif args.action == "agent":
            res = _agent(cfg, args)
        elif not args.ref:
            raise InvalidInput(f"`sim guest {args.action}` needs the vGPU", hint="give its mdev UUID or VF address")
        elif args.action == "start":
            vm = _vm_of(cfg, args)
            # a VM vgpumgr started runs as its guest already: --os/--licensing then give that guest its OS
            res = guests.start(root, args.ref, **vm, guest_dir=_boot_guest(cfg, args, vm), guest_driver=args.driver,
                               again=args.os is not None or args.licensing is not None or args.driver is not None)
        elif args.action == "stop":
            res = guests.stop(root, args.ref)
        elif args.action == "load":
            load = {}
            for item in args.load:
                key, _, value = item.partition("=")
                try:
                    load[key.strip()] = float(value)
                except ValueError:
                    raise InvalidInput(f"'{item}' is not ENGINE=PERCENT", hint="e.g. --load sm=60") from None
            res = guests.set_load(root, args.ref, fb_used_mb=args.fb_used_mb, **load)
        else:
            res = guests.set_licence(root, args.ref, args.state or "licensed")
    except ValueError as e:
        raise InvalidInput(str(e), hint="`vgpumgr sim guest list` shows the running guests") from None
    if args.json:
        from vgpumgr.cli.output import dump_json

        dump_json(out, res)
    elif args.action == "list":
        from vgpumgr.cli.output import table

        table(out, ("ID", "GPU", "VGPU", "VM", "LOAD"),
              [(g["id"], g["gpu"], g["mdev_uuid"] or g["vf"], g["vm_name"] or g["vm_uuid"],
                " ".join(f"{k}={v:g}" for k, v in (g.get("load") or {}).items()) or "-")
               for g in res],  # type: ignore[attr-defined]
              empty="no simulated guest runs (`vgpumgr sim guest start UUID|BDF` starts one)")
    else:
        out.write(f"guest {args.action}: {args.ref or args.vm}\n")
    return 0


def _agent(cfg: Config, args: argparse.Namespace) -> dict[str, object]:
    """`sim guest agent --vm NAME`: how the VM's guest agent and vendor tool answer guest-side telemetry (any VM:
    a passthrough GPU's guest too, which NVML does not see)."""
    from vgpumgr.service import Service
    from vgpumgr.sim import guest_agent, guest_tools

    if not args.vm:
        raise InvalidInput("`sim guest agent` needs --vm NAME", hint="the libvirt domain whose guest this is")
    uuid = next((d["uuid"] for d in Service(cfg).list_vms() if d["name"] == args.vm), None)
    if uuid is None:
        raise NotFound(f"no libvirt domain {args.vm}", hint="give --vm NAME of a defined VM")
    d = guest_agent.guest_dir(cfg.state_dir / "libvirt-test", uuid.lower())
    if guest_agent.describe(d) is None:
        guest_agent.define(cfg.state_dir / "libvirt-test", uuid.lower(),
                           os_id={"linux": "debian", "windows": "mswindows"}[args.os or "linux"],
                           agent=not args.no_agent)
    gpus = [{"util": u, "mem_util": 1, "mem_used": 1024, "mem_total": 24576} for u in args.gpu_util] or None
    return guest_tools.configure(d, exec_mode=args.exec_mode, gpus=gpus, driver=args.driver or "580.65.06")


def _boot_guest(cfg: Config, args: argparse.Namespace, vm: dict[str, str | None]) -> object:
    """The VM's simulated guest OS (--os, --licensing): a Linux guest reads the fw_cfg items its domain names
    and runs the guest helper. None when neither option is given (NVML's licence is then set by hand)."""
    if args.os is None and args.licensing is None:
        return None
    from pathlib import Path

    from vgpumgr.service import Service
    from vgpumgr.sim import guest_agent, guest_licence
    from vgpumgr.virt.domain import fwcfg_entries

    os_id = {"linux": "debian", "windows": "mswindows"}[args.os or "linux"]
    d = guest_agent.define(cfg.state_dir / "libvirt-test", vm["vm_uuid"], os_id=os_id,
                           licensing=args.licensing or "token", agent=not args.no_agent)
    if os_id != "mswindows":  # Windows has no user-space reader of fw_cfg blobs
        items = []
        for name, path in fwcfg_entries(Service(cfg).vm_xml(vm["vm_name"])):
            if path:
                items.append((name, Path(path).read_bytes()))
        guest_licence.boot(d, items)
    return d


def _vm_of(cfg: object, args: argparse.Namespace) -> dict[str, str | None]:
    """The VM a started guest belongs to: its libvirt domain's UUID (by --vm, else the vGPU's record)."""
    from vgpumgr.service import Service

    svc = Service(cfg)  # type: ignore[arg-type]
    name = args.vm
    if name is None:
        rec = svc.find_allocation(args.ref)
        name = rec["vm"]
    uuid = next((d["uuid"] for d in svc.list_vms() if d["name"] == name), None)
    if uuid is None:
        raise NotFound(f"no libvirt domain {name}", hint="give --vm NAME of a defined VM")
    return {"vm_uuid": uuid, "vm_name": name}
