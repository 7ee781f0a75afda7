"""`vgpumgr restore` (after a reboot) and `vgpumgr profile` (the boot profile of a Nova compute node)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json, table
from vgpumgr.cli.vm import service

EXIT_BLOCKED, EXIT_FAILED = 4, 7  # something in the way or a GPU reset pending; a step failed


def register(sub: Any, cmd: Any, group: Any) -> None:
    p = cmd(sub, ("restore",), "vgpumgr.cli.restore:restore",
            "after a reboot: bring back VFs, MIG mode, GPU instances, VF vGPU types and mdevs from the records")
    _restore_args(p)
    p.add_argument("--profile", metavar="FILE", default=os.environ.get("VGPUMGR_PROFILE"),
                   help="also apply this boot profile (.toml or .json; default $VGPUMGR_PROFILE)")

    prof = group("profile", "the boot profile of a host whose vGPUs Nova assigns (VFs, VF types, MIG)")
    p = cmd(prof, ("profile", "show"), "vgpumgr.cli.restore:profile_show", "print a profile as vgpumgr reads it")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true")
    p = cmd(prof, ("profile", "check"), "vgpumgr.cli.restore:profile_check", "check a profile against this host")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true")
    p = cmd(prof, ("profile", "apply"), "vgpumgr.cli.restore:profile_apply",
            "restore with this profile (the same as `vgpumgr restore --profile FILE`)")
    p.add_argument("file", metavar="FILE")
    _restore_args(p)
    p = cmd(prof, ("profile", "nova"), "vgpumgr.cli.restore:profile_nova",
            "print Nova's [pci] device_spec and alias lines for the profile's VF vGPUs")
    p.add_argument("file", metavar="FILE")


def _restore_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="say what would be done, change nothing")
    p.add_argument("--force", action="store_true", help="remove what is in the way (devices nobody recorded)")
    p.add_argument("--json", action="store_true", help="the report as JSON (progress goes to stderr)")


def _load(path: str) -> Any:
    from vgpumgr.platforms.boot_profile import load

    return load(path)


def restore(args: argparse.Namespace, out: TextIO) -> int:
    profile = _load(args.profile) if args.profile else None
    progress = sys.stderr if args.json else out
    if args.dry_run:
        progress.write("dry run: nothing is changed\n")
    r = service(args).restore(dry_run=args.dry_run, force=args.force, profile=profile,
                              progress=lambda g: _print_gpu(progress, g, brief=args.json))
    counts = r["counts"]
    if args.json:
        dump_json(out, r)
    else:
        out.write("restore: " + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "nothing recorded")
                  + (" (dry run)" if args.dry_run else "") + "\n")
    if counts.get("failed"):
        return EXIT_FAILED
    return EXIT_BLOCKED if counts.get("blocked") or counts.get("pending") else 0


def profile_apply(args: argparse.Namespace, out: TextIO) -> int:
    args.profile = args.file
    return restore(args, out)


def _print_gpu(out: TextIO, report: dict[str, Any], brief: bool) -> None:
    steps = report["steps"]
    if brief:
        counts: dict[str, int] = {}
        for st in steps:
            counts[st["status"]] = counts.get(st["status"], 0) + 1
        out.write(f"{report['gpu']}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + "\n")
        out.flush()
        return
    out.write(f"{report['gpu']}\n")
    for st in steps:
        out.write(f"  {st['status']:<8} {st['step']:<12} {st['message']}\n")
        if st.get("hint") and st["status"] not in ("ok", "done", "planned"):
            out.write(f"  {'':<8} {'':<12} hint: {st['hint']}\n")
    out.flush()


def profile_show(args: argparse.Namespace, out: TextIO) -> int:
    p = _load(args.file)
    if args.json:
        dump_json(out, p.to_json())
        return 0
    rows = []
    for g in p.gpus:
        gis = ", ".join(f"{i.profile}@{i.start}" for i in g.gpu_instances) or "-"
        rows.append([g.address, g.vfs, {True: "on", False: "off"}.get(g.mig, "-") if g.mig is not None else "-",
                     gis, len(g.vf_types)])
        rows += [[f"  {v.address}", "", "", v.type, v.resource_class] for v in g.vf_types]
    table(out, ["GPU / VF", "VFS", "MIG", "GPU INSTANCES / TYPE", "VF TYPES / RESOURCE CLASS"], rows,
          empty="the profile names no GPUs")
    return 0


def profile_check(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.errors import InvalidInput
    from vgpumgr.ops.restore import check_profile

    problems = check_profile(service(args), _load(args.file))
    if args.json:
        dump_json(out, {"file": args.file, "ok": not problems, "problems": problems})
        return 2 if problems else 0
    if problems:
        raise InvalidInput(f"{args.file} does not fit this host: " + "; ".join(problems),
                           hint="fix the profile; `vgpumgr gpus --vfs` and `vgpumgr mig list` show the host")
    out.write(f"{args.file}: fits this host\n")
    return 0


def profile_nova(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.devices import config
    from vgpumgr.ops.restore import vf_pci_ids
    from vgpumgr.platforms.boot_profile import nova_lines

    p = _load(args.file)
    out.write(nova_lines(p, vf_pci_ids(config(args).host, p)))
    return 0
