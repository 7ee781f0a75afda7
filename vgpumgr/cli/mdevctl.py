"""`vgpumgr mdev export` / `vgpumgr mdev import`: mdevctl's definitions from and into vgpumgr's records."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json
from vgpumgr.cli.vm import service
from vgpumgr.model import BACKEND_MDEV
from vgpumgr.platforms import mdevctl


def _directory(args: argparse.Namespace, svc: Any) -> Path:
    """--dir (a directory, or a new one in a directory), else mdevctl's own place under the host root (a simulated
    root keeps its own)."""
    from vgpumgr.errors import InvalidInput
    from vgpumgr.userinput import files

    if args.dir is None:
        return svc.host.root / "etc/mdevctl.d"
    path = files.checked_path(args.dir, "--dir").absolute()
    if not files.is_dir(path, "--dir") and (os.path.lexists(path) or not files.is_dir(path.parent, "--dir")):
        raise InvalidInput(f"--dir {path} is not a directory (nor a new one in a directory)",
                           hint="name the definitions directory, such as /etc/mdevctl.d")
    return path


def _live_mdev_records(svc: Any) -> list[dict[str, Any]]:
    from vgpumgr.db import store
    from vgpumgr.ops.records import allocation_dict

    with svc.sessions() as s:
        rows = store.allocations(s, svc.host_id(s), live=True)
        return [{**allocation_dict(r, s), "mdevctl": (r.detail or {}).get("mdevctl")}
                for r in rows if r.backend == BACKEND_MDEV]


def export(args: argparse.Namespace, out: TextIO) -> int:
    svc = service(args)
    directory = _directory(args, svc)
    result = mdevctl.export(mdevctl.definitions_of(_live_mdev_records(svc)), directory)
    if args.json:
        dump_json(out, {"dir": str(directory), **result})
    else:
        out.write(f"{len(result['written'])} definition(s) written, {len(result['unchanged'])} unchanged "
                  f"in {directory}\n")
    return 0


def import_(args: argparse.Namespace, out: TextIO) -> int:
    svc = service(args)
    directory = _directory(args, svc)
    found = mdevctl.read_all(directory)
    mdevctl.check_importable(found, {a["uuid"]: a for a in svc.allocations(live=True) if a.get("uuid")})
    adopted, known = [], []
    for d in found:
        _, new = svc.adopt(backend=BACKEND_MDEV, uuid=d.uuid, parent=d.parent, type_id=d.mdev_type,
                           source="mdevctl", detail={"mdevctl": {"start": d.start, "attrs": d.attrs}})
        (adopted if new else known).append(d.uuid)
    if args.json:
        dump_json(out, {"dir": str(directory), "adopted": adopted, "already_recorded": known})
    else:
        out.write(f"{len(adopted)} definition(s) adopted as records, {len(known)} already recorded "
                  f"(from {directory})\n")
    return 0
