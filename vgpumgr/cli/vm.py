"""`vgpumgr vm`: create VMs with GPU devices, and their lifecycle."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.userinput.numbers import integer


def register(sub: Any, cmd: Any, group: Any) -> None:
    vm = group("vm", "libvirt VMs with vGPUs, passthrough GPUs or MIG-backed vGPUs")
    p = cmd(vm, ("vm", "create"), "vgpumgr.cli.vm:create", "place and create GPU devices, define (and start) a VM")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--vgpu", action="append", default=[], metavar="TYPE", help="a vGPU type (T4-4Q, nvidia-232)")
    p.add_argument("--passthrough", action="append", default=[], metavar="BDF|MODEL",
                   help="a whole GPU or accelerator: its address, or a model (\"Ascend 910B\") for a free one")
    p.add_argument("--mig", action="append", default=[], metavar="PROFILE", help="a MIG-backed vGPU (1g.10gb)")
    p.add_argument("--memory", type=integer(16, 16 << 20, "--memory"), default=4096, metavar="MIB")
    p.add_argument("--vcpus", type=integer(1, 4096, "--vcpus"), default=2)
    p.add_argument("--disk", metavar="PATH", help="absolute path of a qcow2 or raw image")
    p.add_argument("--network", metavar="NET", help="libvirt network name, or bridge:BR")
    p.add_argument("--firmware", choices=("bios", "uefi"), default="bios")
    p.add_argument("--display", action="store_true", help="display on the first mdev vGPU (VNC + ramfb)")
    p.add_argument("--licence-delivery", "--license-delivery", choices=("fwcfg", "agent", "none"),
                   help="how the guest gets the licence token (default: its pool's, else $VGPUMGR_LICENCE_DELIVERY "
                        "or fwcfg)")
    _policy_args(p)
    p.add_argument("--start", action="store_true", help="start the VM after defining it")
    p.add_argument("--print-xml", action="store_true", help="dry run: print the XML, change nothing")
    p.add_argument("--validate", action="store_true",
                   help="with --print-xml: also check the XML against libvirt's domain.rng (a create always does)")
    p.add_argument("--json", action="store_true")
    p = cmd(vm, ("vm", "list"), "vgpumgr.cli.vm:list_", "list VMs")
    p.add_argument("--json", action="store_true")
    for action, help_ in (("show", "show a VM and its vGPUs"), ("xml", "print a VM's domain XML"),
                          ("start", "start a VM (re-creating vanished vGPUs first)"), ("stop", "stop a VM"),
                          ("delete", "stop and undefine a VM, release its vGPUs and licence seats")):
        p = cmd(vm, ("vm", action), f"vgpumgr.cli.vm:{action}", help_)
        p.add_argument("name", metavar="NAME")
        if action in ("show", "start", "stop", "delete"):
            p.add_argument("--json", action="store_true")
    p = cmd(vm, ("vm", "migrate"), "vgpumgr.cli.migrate:migrate",
            "move a VM and its vGPUs to another host (libvirt peer-to-peer, checked before it starts)")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--to", required=True, metavar="URI", help="the destination's libvirt URI (qemu+ssh://HOST/system)")
    p.add_argument("--offline", action="store_true", help="the VM is shut off: move its definition and records")
    p.add_argument("--dry-run", action="store_true", help="only the preflight: where each vGPU would land, and why not")
    p.add_argument("--to-api", metavar="URL", help="the destination's vgpumgr service for the preflight "
                                                   "(unix:/run/vgpumgr/api.sock, https://HOST:8470; $VGPUMGR_TO_API)")
    p.add_argument("--to-token-file", metavar="FILE", help="a token of the destination's service "
                                                           "(or $VGPUMGR_TO_TOKEN)")
    p.add_argument("--json", action="store_true")
    p = cmd(vm, ("vm", "attach"), "vgpumgr.cli.vm:attach", "add a vGPU to a defined VM")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--vgpu", required=True, metavar="TYPE")
    p = cmd(vm, ("vm", "detach"), "vgpumgr.cli.vm:detach", "remove a vGPU from a VM and release it")
    p.add_argument("name", metavar="NAME")
    p.add_argument("ref", metavar="UUID|BDF")


def _policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("placement policy")
    g.add_argument("--policy", choices=("pack", "spread"), default="pack")
    g.add_argument("--numa", type=integer(0, 1023, "--numa"), metavar="NODE", help="prefer GPUs on this NUMA node")
    g.add_argument("--pin-gpu", metavar="BDF", help="only this physical GPU")
    g.add_argument("--pin-parent", metavar="BDF", help="only this mdev parent or VF")
    g.add_argument("--allow-model", action="append", default=[], metavar="MODEL")
    g.add_argument("--deny-model", action="append", default=[], metavar="MODEL")
    g.add_argument("--deny-gpu", action="append", default=[], metavar="BDF")
    g.add_argument("--placement-id", type=integer(0, 1024, "--placement-id"), metavar="N",
                   help="mixed-size mode: the vGPU's placement ID (GB offset; default: the fragmentation-aware choice)")


def policy_from(args: argparse.Namespace):  # noqa: ANN201
    from vgpumgr.placement.placer import Policy

    return Policy(strategy=args.policy, numa=args.numa, pin_gpu=args.pin_gpu, pin_parent=args.pin_parent,
                  allow_models=tuple(args.allow_model), deny_models=tuple(args.deny_model),
                  deny_gpus=frozenset(args.deny_gpu), placement_id=getattr(args, "placement_id", None))


def service(args: argparse.Namespace):  # noqa: ANN201
    from vgpumgr.cli.devices import config
    from vgpumgr.service import Service

    return Service(config(args))


def create(args: argparse.Namespace, out: TextIO) -> int:
    if args.print_xml:  # a dry run needs neither the database nor libvirt
        out.write(dry_run(args))
        return 0
    svc = service(args)
    from vgpumgr.cli.fleet import warn_if_cordoned

    warn_if_cordoned(svc)
    res = svc.create_vm(args.name, vgpus=args.vgpu, passthrough=args.passthrough, mig=args.mig,
                        memory_mib=args.memory, vcpus=args.vcpus, disk=args.disk, network=args.network,
                        firmware=args.firmware, display=args.display, policy=policy_from(args), start=args.start,
                        print_xml=args.print_xml, licence_delivery=args.licence_delivery)
    if args.print_xml:
        out.write(res["xml"])
        return 0
    if args.json:
        dump_json(out, res)
        return 0
    out.write(f"VM {res['name']} {res['state']} ({res['uuid']}) with:\n")
    for a in res["allocations"]:
        out.write(f"  {a['type_name'] or a['type']:<24} {a['backend']:<12} {a.get('uuid') or a.get('pci_address')}"
                  f"  on {a['parent']}\n")
    return 0


def dry_run(args: argparse.Namespace) -> str:
    from vgpumgr import ids
    from vgpumgr.cli.devices import config
    from vgpumgr.discovery.inventory import scan
    from vgpumgr.nvidia.facts import merge_nvml
    from vgpumgr.placement.placer import Placer
    from vgpumgr.virt.domain import VmSpec, render
    from vgpumgr.virt.dryrun import plan_hostdevs

    cfg = config(args)
    name = ids.vm_name(args.name)
    spec = VmSpec(name=name, uuid=ids.new_uuid(), memory_mib=args.memory, vcpus=args.vcpus, firmware=args.firmware,
                  disk=args.disk, network=args.network, domain_type=cfg.domain_type)
    inv = scan(cfg.host)
    if args.mig:
        merge_nvml(cfg, inv.gpus, quiet=True)
    spec.hostdevs = plan_hostdevs(inv, Placer(inv), [], name, args.vgpu, args.passthrough, args.mig,
                                  policy_from(args), args.display)
    return render(spec, schema=args.validate)


def list_(args: argparse.Namespace, out: TextIO) -> int:
    vms = service(args).list_vms()
    if args.json:
        dump_json(out, vms)
        return 0
    table(out, ["NAME", "STATE", "UUID", "VGPUS"],
          [[v["name"], v["state"], v["uuid"], " ".join(v["vgpus"]) or "-"] for v in vms], empty="no VMs")
    return 0


def _show(out: TextIO, data: dict[str, Any], as_json: bool) -> int:
    if as_json:
        dump_json(out, data)
        return 0
    out.write(f"{data['name']}: {data.get('state')}\n")
    for a in data.get("allocations", []):
        out.write(f"  {a['type_name'] or a['type']:<24} {a['backend']:<12} {a.get('uuid') or a.get('pci_address')}"
                  f"  licence {a.get('licence') or '-'}\n")
    return 0


def show(args: argparse.Namespace, out: TextIO) -> int:
    return _show(out, service(args).vm(args.name), args.json)


def xml(args: argparse.Namespace, out: TextIO) -> int:
    out.write(service(args).vm_xml(args.name))
    return 0


def start(args: argparse.Namespace, out: TextIO) -> int:
    return _show(out, service(args).start_vm(args.name), args.json)


def stop(args: argparse.Namespace, out: TextIO) -> int:
    return _show(out, service(args).stop_vm(args.name), args.json)


def delete(args: argparse.Namespace, out: TextIO) -> int:
    res = service(args).delete_vm(args.name)
    if args.json:
        dump_json(out, res)
    else:
        out.write(f"VM {res['name']} deleted; released {', '.join(res['released']) or 'nothing'}\n")
    return 0


def attach(args: argparse.Namespace, out: TextIO) -> int:
    a = service(args).attach_vgpu(args.name, args.vgpu)
    out.write(f"attached {a['type_name']} {a.get('uuid') or a.get('pci_address')} to {args.name}\n")
    return 0


def detach(args: argparse.Namespace, out: TextIO) -> int:
    a = service(args).detach_vgpu(args.name, args.ref)
    out.write(f"detached and released {a.get('uuid') or a.get('pci_address')} from {args.name}\n")
    return 0
