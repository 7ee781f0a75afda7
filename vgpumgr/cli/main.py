"""`vgpumgr` command line. Commands are functions that write to an output stream; heavy imports stay
inside the commands so `vgpumgr --help` and `vgpumgr types` start fast."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from vgpumgr.errors import VgpuError
from vgpumgr.userinput.numbers import decimal, integer

# Type checkers treat this name like typing.TYPE_CHECKING. Importing typing itself costs ~7 ms
# (python -X importtime), a tenth of `vgpumgr types`' whole start, so the start path does without it.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import TextIO

# command path -> "module:function" (imported only when that command runs)
COMMANDS: dict[tuple[str, ...], str] = {}


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("global options")
    s = argparse.SUPPRESS
    g.add_argument("--sysfs-root", metavar="DIR", default=s,
                   help="root of the sysfs tree (default / or $VGPUMGR_SYSFS_ROOT; a tree from `sim create`)")
    g.add_argument("--state-dir", metavar="DIR", default=s, help="state directory (database, locks)")
    g.add_argument("--db", metavar="URL", default=s, help="database URL (default SQLite in the state dir; $VGPUMGR_DB)")
    g.add_argument("--connect", metavar="URI", default=s, help="libvirt URI ($VGPUMGR_LIBVIRT_URI)")
    return p


# commands registered by modules outside this file, so that only the one a user runs is imported
EXTRA_MODULES = {
    "vgpumgr.cli.records": ("place", "vgpu", "release", "placements", "license", "licence", "reconcile"),
    "vgpumgr.cli.dbadmin": ("db", "upgrade"),
    "vgpumgr.cli.audit": ("audit",),
    "vgpumgr.cli.mig": ("mig",),
    "vgpumgr.cli.scheduler": ("scheduler",),
    "vgpumgr.cli.vm": ("vm",),
    "vgpumgr.cli.service": ("serve", "token", "install-units"),
    "vgpumgr.cli.restore": ("restore", "profile"),
    "vgpumgr.cli.telemetry": ("top",),
    "vgpumgr.cli.fleet": ("fleet", "host"),
    "vgpumgr.cli.gpu": ("gpu",),
    "vgpumgr.cli.vendor": ("vendor",),
    "vgpumgr.cli.guests": ("guests",),
    "vgpumgr.cli.doctor": ("doctor",),
}
_VALUE_OPTIONS = ("--sysfs-root", "--state-dir", "--db", "--connect")


def _command_word(argv: list[str]) -> str | None:
    """The top-level command in argv (skipping global options and their values), if any."""
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in _VALUE_OPTIONS:
            skip = True
        elif not a.startswith("-"):
            return a
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with `only`, just that top-level command is built (argparse is slow to build
    sixty sub-parsers, and `vgpumgr types` should start fast)."""
    # argparse asks gettext for a translation of every message of every parser it builds, probing the
    # file system each time. Measured on this project's machine: building the `types` parser took 12.8 ms
    # with those look-ups and 2.8 ms without (the whole CLI's parser: 51 ms and 22 ms). vgpumgr's messages
    # are English only, so the look-up is skipped while the parser is built, and restored afterwards.
    translate = argparse._  # type: ignore[attr-defined]
    argparse._ = lambda message: message  # type: ignore[attr-defined]
    try:
        return _build_parser(only)
    finally:
        argparse._ = translate  # type: ignore[attr-defined]


def _build_parser(only: str | None) -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="vgpumgr", parents=[common],
        description="vGPU manager for KVM/libvirt hosts: discover GPUs, create vGPUs, place them, audit.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def cmd(parent: argparse._SubParsersAction, path: tuple[str, ...], target: str, help: str,
            ) -> argparse.ArgumentParser:
        COMMANDS[path] = target
        if only is not None and path[0] != only and (only != "licence" or path[0] != "license"):
            return argparse.ArgumentParser(add_help=False)  # not asked for: a throwaway
        p = parent.add_parser(path[-1], parents=[common], help=help, description=help)
        p.set_defaults(_target=target)
        return p

    def group(name: str, help: str, aliases: tuple[str, ...] = ()) -> argparse._SubParsersAction:
        if only is not None and only != name and only not in aliases:
            return argparse.ArgumentParser(add_help=False).add_subparsers()
        g = sub.add_parser(name, parents=[common], help=help, description=help, aliases=list(aliases))
        g.set_defaults(_group=g)
        return g.add_subparsers(dest=f"{name}_command", metavar="ACTION")

    p = cmd(sub, ("gpus",), "vgpumgr.cli.devices:gpus", "list GPUs with their PCI facts")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--vfs", action="store_true", help="also list virtual functions in the table")
    p.add_argument("--no-nvml", action="store_true", help="do not ask NVML")

    p = cmd(sub, ("types",), "vgpumgr.cli.devices:types", "list vGPU types offered by mdev parents and VFs")
    p.add_argument("--parent", metavar="BDF", help="only this parent (PCI address or virtual parent)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--available", action="store_true", help="only types with instances available now")

    mdev = group("mdev", "mediated devices")
    p = cmd(mdev, ("mdev", "list"), "vgpumgr.cli.devices:mdev_list", "list active mdevs")
    p.add_argument("--json", action="store_true")
    p = cmd(mdev, ("mdev", "create"), "vgpumgr.cli.devices:mdev_create", "create an mdev")
    p.add_argument("--parent", required=True, metavar="BDF")
    p.add_argument("--type", required=True, metavar="TYPE", help="type id (nvidia-232) or name (T4-4Q)")
    p.add_argument("--uuid", metavar="UUID", help="UUID to use (default: a new one)")
    p.add_argument("--json", action="store_true")
    p = cmd(mdev, ("mdev", "remove"), "vgpumgr.cli.devices:mdev_remove", "remove an mdev")
    p.add_argument("uuid", metavar="UUID")
    p.add_argument("--grace", type=decimal(0, 600, "--grace"), default=0.0, metavar="S",
                   help="let NVIDIA's driver remove the device itself for up to S seconds first (after a VM stop)")
    p = cmd(mdev, ("mdev", "export"), "vgpumgr.cli.mdevctl:export",
            "write vgpumgr's mdev records as mdevctl definitions (<dir>/<parent>/<uuid>)")
    p.add_argument("--dir", metavar="D", help="definitions directory (default /etc/mdevctl.d under the host root)")
    p.add_argument("--json", action="store_true")
    p = cmd(mdev, ("mdev", "import"), "vgpumgr.cli.mdevctl:import_",
            "adopt mdevctl definitions as vgpumgr records (all checked first; no device is touched)")
    p.add_argument("--dir", metavar="D", help="definitions directory (default /etc/mdevctl.d under the host root)")
    p.add_argument("--json", action="store_true")

    vf = group("vf", "NVIDIA vendor-specific VF vGPUs")
    p = cmd(vf, ("vf", "list"), "vgpumgr.cli.devices:vf_list", "list VFs with their current vGPU type")
    p.add_argument("--json", action="store_true")
    p = cmd(vf, ("vf", "set"), "vgpumgr.cli.devices:vf_set", "set a VF's vGPU type (current_vgpu_type)")
    p.add_argument("vf", metavar="VF")
    p.add_argument("type", metavar="TYPE", help="nvidia-<id>, id, or type name (L40S-2Q)")
    p = cmd(vf, ("vf", "clear"), "vgpumgr.cli.devices:vf_clear", "clear a VF's vGPU type")
    p.add_argument("vf", metavar="VF")
    p.add_argument("--retries", type=integer(0, 100, "--retries"), default=10)

    sriov = group("sriov", "SR-IOV virtual functions")
    p = cmd(sriov, ("sriov", "set"), "vgpumgr.cli.devices:sriov_set", "set the number of VFs of a PF")
    p.add_argument("pf", metavar="PF")
    p.add_argument("count", type=integer(0, 65535, "the VF count"),
                   help="0 to 65535 (PCI SR-IOV); checked against the PF's sriov_totalvfs")
    p.add_argument("--allow-nvidia", action="store_true",
                   help="write sriov_numvfs on an NVIDIA GPU (normally only sriov-manage should)")

    vfio = group("vfio", "bind devices to vfio-pci and back")
    p = cmd(vfio, ("vfio", "bind"), "vgpumgr.cli.devices:vfio_bind", "bind a device to vfio-pci")
    p.add_argument("address", metavar="BDF")
    p = cmd(vfio, ("vfio", "unbind"), "vgpumgr.cli.devices:vfio_unbind", "give a device back to its previous driver")
    p.add_argument("address", metavar="BDF")

    sim = group("sim", "simulated hosts for demos, tests and benchmarks")
    p = cmd(sim, ("sim", "create"), "vgpumgr.sim.cli:create", "build a simulated sysfs tree")
    p.add_argument("dir", metavar="DIR")
    names = importlib.import_module("vgpumgr.sim.profile_names").PROFILES if only in (None, "sim") else ()
    p.add_argument("--profile", default="mixed", metavar="PROFILE",
                   help=f"one of: {', '.join(names)} (README, 'The simulated host')")
    p.add_argument("--scale", type=integer(1, 64, "--scale"), default=1, help="copies of the profile's GPUs (1-64)")
    p.add_argument("--vfs", type=integer(0, 65535, "--vfs"), default=None,
                   help="VFs to enable per SR-IOV GPU (at most its TotalVFs)")
    p.add_argument("--force", action="store_true", help="rebuild an existing simulated tree")
    p = cmd(sim, ("sim", "reboot"), "vgpumgr.sim.cli:reboot",
            "lose what a host reboot or driver reload loses: VFs, vGPU types, mdevs, MIG instances")
    p.add_argument("--json", action="store_true")
    p = cmd(sim, ("sim", "break"), "vgpumgr.sim.cli:break_",
            "make one thing fail as it fails on a host, for `vgpumgr doctor` to find (tests, demos)")
    p.add_argument("state", metavar="STATE", help="no-virt, no-kvm, iommu-off, module-missing, unit-failed, "
                                                  "no-vgpu-driver, secure-boot, nouveau, unbound, vfs-off, branch, "
                                                  "mig-pending")
    p.add_argument("--gpu", metavar="BDF", help="the GPU (default: the first NVIDIA GPU)")
    p.add_argument("--module", metavar="NAME", help="module-missing: the module (default vfio_pci)")
    p.add_argument("--unit", metavar="NAME", help="unit-failed: the unit (default nvidia-vgpu-mgr.service)")
    p.add_argument("--driver", metavar="VERSION", help="branch: the driver version to pretend")
    p = cmd(sim, ("sim", "hold"), "vgpumgr.sim.cli:hold", "pretend a process holds a device open (tests, demo)")
    p.add_argument("target", metavar="UUID|BDF")
    p.add_argument("--by", default="qemu-system-x86", help="process name")

    p = cmd(sim, ("sim", "guest"), "vgpumgr.sim.cli:guest",
            "pretend a VM runs on a vGPU (NVML then reports it), set what its guest does, or stop it")
    p.add_argument("action", choices=("start", "stop", "load", "licence", "list", "agent"))
    p.add_argument("ref", nargs="?", metavar="UUID|BDF", help="the vGPU (mdev UUID or VF), or a running VM's UUID")
    p.add_argument("--vm", metavar="NAME", help="start: the libvirt domain running it (default: its record's VM)")
    p.add_argument("--load", action="append", default=[], metavar="ENGINE=PERCENT",
                   help="load: sm, mem, enc, dec, jpg, ofa, wobble (repeat)")
    p.add_argument("--fb-used-mb", type=integer(0, 1 << 20, "--fb-used-mb"), metavar="MB")
    p.add_argument("--state", metavar="STATE", help="licence: licensed, unlicensed, unlicensed-restricted, ...")
    p.add_argument("--os", choices=("linux", "windows"),
                   help="start: the guest's OS (a Linux guest reads its fw_cfg token with the guest helper at boot)")
    p.add_argument("--licensing", choices=("token", "never"),
                   help="start: the guest licenses once a token arrived (token) or never (never)")
    p.add_argument("--no-agent", action="store_true", help="start: the guest runs no QEMU guest agent")
    p.add_argument("--driver", metavar="VERSION", help="start: the guest's NVIDIA driver (NVML's vGPU metadata); "
                   "agent: the driver its nvidia-smi names")
    p.add_argument("--exec", dest="exec_mode", metavar="MODE", default="allow",
                   help="agent: allow, block, hang, slow, huge, malformed or no-tool (how the agent treats guest-exec)")
    p.add_argument("--gpu-util", type=decimal(0, 100, "--gpu-util"), action="append", default=[], metavar="PERCENT",
                   help="agent: a GPU's utilisation as the guest's nvidia-smi reports it (repeat per GPU)")
    p.add_argument("--json", action="store_true")

    p = cmd(sub, ("demo",), "vgpumgr.sim.demo:demo", "walk through the main job on a simulated host")
    p.add_argument("--dir", metavar="DIR", help="where to build the simulated host (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the simulated host afterwards")
    p.add_argument("--profile", choices=("mixed", "all"), default="mixed",
                   help="all: every vendor (Ascend, Moore Threads, Cambricon, AMD, Intel, passthrough-only cards)")

    for extra, names in EXTRA_MODULES.items():
        if only is None or only in names:
            importlib.import_module(extra).register(sub, cmd, group)
    return parser


def _skip_last_collection() -> None:
    """At exit, after every other atexit handler, freeze what is left so that the interpreter's final full
    garbage collection passes over it: 0.2-0.5 s of every command that loaded SQLAlchemy, lxml and libvirt (the
    demo: ~0.5 s). Exit still closes what reference counting releases and flushes the standard streams; only
    objects kept alive by reference cycles are left to the operating system, as at any process exit."""
    import atexit
    import gc

    atexit.register(gc.freeze)
    if os.environ.get("VGPUMGR_CHECKPOINT_AT_EXIT", "1") != "0":
        atexit.register(_close_databases)  # runs first (atexit is last in, first out)


def _close_databases() -> None:
    """At exit, checkpoint each SQLite database's write-ahead log into the database file (PASSIVE: what no
    reader still needs), so that after a command its data is in vgpumgr.db itself and a `cp` of that file is a
    copy (`vgpumgr db backup` stays the safe one). The log file is kept for the next command: closing the last
    connection would delete it, and each command would then make it anew (measured: README, 'Backups')."""
    session = sys.modules.get("vgpumgr.db.session")
    if session is not None:
        session.checkpoint_sqlite()


def main(argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None,
         parsers: dict[str | None, argparse.ArgumentParser] | None = None) -> int:
    """`parsers`: a dict an in-process caller that runs many commands keeps across calls (the demo), so each
    command's parser is built once; its defaults are then those of the first call's environment."""
    out = out or sys.stdout
    err = err or sys.stderr
    if argv is None:  # the process's own command (the console script), not an in-process caller
        _skip_last_collection()
    argv = list(sys.argv[1:] if argv is None else argv)
    word = _command_word(argv)
    known = {"gpus", "types", "mdev", "vf", "sriov", "vfio", "sim", "demo"} | {
        n for names in EXTRA_MODULES.values() for n in names}
    only = word if word in known else None
    if parsers is None:
        parser = build_parser(only)
    elif only in parsers:
        parser = parsers[only]
    else:
        parser = parsers[only] = build_parser(only)
    args = parser.parse_args(argv)
    target = getattr(args, "_target", None)
    if target is None:
        g = getattr(args, "_group", None)
        (g or parser).print_help(out)
        return 0 if args.command is None else 2
    module, func = target.split(":")
    try:
        return int(getattr(importlib.import_module(module), func)(args, out) or 0)
    except VgpuError as e:
        err.write(f"vgpumgr: error: {e.message}\n")
        if e.hint:
            err.write(f"  hint: {e.hint}\n")
        return e.exit_code
    except BrokenPipeError:  # `vgpumgr ... | head`: the reader went away, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        err.write("vgpumgr: interrupted\n")
        return 130
    except Exception as e:  # noqa: BLE001 - a bug: say so plainly; VGPUMGR_DEBUG=1 shows the traceback
        known = _database_error(e) or _path_error(e)
        if known is not None:
            err.write(f"vgpumgr: error: {known.message}\n  hint: {known.hint}\n")
            return known.exit_code
        if os.environ.get("VGPUMGR_DEBUG"):
            raise
        err.write(f"vgpumgr: internal error: {type(e).__name__}: {e}\n"
                  "  hint: this is a bug in vgpumgr; run again with VGPUMGR_DEBUG=1 and report the traceback\n")
        return 70


def _path_error(e: Exception) -> VgpuError | None:
    """An OSError on a named path that no rule of vgpumgr.userinput caught first (a --state-dir under /proc): the
    path and what the errno means, exit 2/3/5, not a bug report."""
    if not isinstance(e, OSError) or e.filename is None or os.environ.get("VGPUMGR_DEBUG"):
        return None
    from vgpumgr.userinput.files import refusal

    return refusal(e, e.filename, "use")


def _database_error(e: Exception) -> VgpuError | None:
    """A database server that went away or refused us mid-command: Unavailable (exit 8), not a bug."""
    exc = sys.modules.get("sqlalchemy.exc")
    if exc is None or not isinstance(e, exc.OperationalError | exc.InterfaceError):
        return None
    from vgpumgr.db.session import unreachable

    return unreachable(None, e)


if __name__ == "__main__":
    sys.exit(main())
