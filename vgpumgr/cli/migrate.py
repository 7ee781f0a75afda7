"""`vgpumgr vm migrate`: move a VM with its vGPUs to another host."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO

from vgpumgr.cli.output import dump_json
from vgpumgr.errors import InvalidInput


def _remote(args: argparse.Namespace, url: str | None = None, token_file: str | None = None) -> Any:
    from vgpumgr.fleet.remote import Remote

    url = url or (args.to_api if isinstance(args.to_api, str) else None) or os.environ.get("VGPUMGR_TO_API")
    if not url:
        return None
    token = os.environ.get("VGPUMGR_TO_TOKEN", "")
    token_file = token_file or (args.to_token_file if isinstance(args.to_token_file, str) else None)
    if token_file:
        from vgpumgr.userinput import files

        hint = "give a file holding a token of the destination's vgpumgr service"
        data = files.read(token_file, what="--to-token-file", limit=4096, hint=hint)
        try:
            token = data.decode("ascii").strip()
        except UnicodeDecodeError:
            raise InvalidInput(f"--to-token-file: {token_file} is not a token (not ASCII text)", hint=hint) from None
    return Remote(url, token)


class Bar:
    """libvirt's job statistics as one line on stderr, redrawn in place."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.drawn = False

    def __call__(self, stats: dict[str, Any]) -> None:
        total, left = stats.get("data_total") or 0, stats.get("data_remaining")
        if not total or left is None:
            return
        done = max(0.0, min(1.0, 1 - left / total))
        bar = "#" * int(done * 30)
        self.stream.write(f"\r  [{bar:<30}] {done:4.0%}  {left / 2**20:8.1f} of {total / 2**20:.1f} MiB to copy")
        self.stream.flush()
        self.drawn = True

    def end(self) -> None:
        if self.drawn:
            self.stream.write("\n")


def migrate(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.vm import service

    svc = service(args)
    dest = _remote(args)
    bar = Bar(sys.stderr)
    try:
        res = svc.migrate_vm(args.name, args.to, offline=args.offline, dry_run=args.dry_run, dest=dest,
                             progress=None if args.json or args.dry_run else bar)
    finally:
        bar.end()
    if args.json:
        dump_json(out, res)
        return 0 if res.get("ok", True) else 4
    pre = res.get("preflight") or {}
    if pre.get("note"):
        out.write(f"preflight: {pre['note']}\n")
    for v in pre.get("vgpus", []):
        where = v.get("parent") or v.get("gpu")
        line = f"  {v['ref']} ({v.get('type_name') or v.get('type')}): "
        line += f"would go to {where}" if v.get("ok") else f"refused: {v.get('reason')}"
        out.write(line + "\n")
    if args.dry_run:
        out.write(f"{'ok' if res['ok'] else 'would be refused'}: VM {res['vm']} -> {res['to']}\n")
        return 0 if res["ok"] else 4
    down = (res.get("stats") or {}).get("downtime")
    out.write(f"migrated VM {res['vm']} to {res['to']} in {res['seconds']:.1f} s"
              + (f" (downtime {down} ms)" if down is not None else "") + f", migration {res['migration']}\n")
    for ref in res["released"]:
        out.write(f"  released {ref} here\n")
    for e in res["errors"]:
        out.write(f"  warning: {e['error']}" + (f" ({e['hint']})" if e.get("hint") else "") + "\n")
    return 0


def drain(args: argparse.Namespace, out: TextIO) -> int:
    from vgpumgr.cli.vm import service

    if len(args.to_api) > len(args.to):
        raise InvalidInput("more --to-api than --to", hint="give each --to-api after the --to it belongs to")
    files = args.to_token_file
    if len(files) > 1 and len(files) != len(args.to_api):
        raise InvalidInput("give one --to-token-file for all destinations, or one per --to-api",
                           hint="each token file belongs to the --to-api of the same position")
    dests = [(uri, _remote(args, args.to_api[n], files[n] if len(files) > 1 else (files[0] if files else None))
              if n < len(args.to_api) else None) for n, uri in enumerate(args.to)]
    res = service(args).drain_host(dests or None, reason=args.reason,
                                   say=None if args.json else lambda line: sys.stderr.write(line + "\n"))
    if args.json:
        dump_json(out, res)
        return 0 if not res["stayed"] else 4
    out.write(f"host {res['host']} is cordoned (`vgpumgr host uncordon` when it may take VMs again)\n")
    for m in res["moved"]:
        out.write(f"  moved {m['vm']} to {m['to']} in {m['seconds']:.1f} s (migration {m['migration']})\n")
    for s in res["stayed"]:
        out.write(f"  {s['vm']} stays: " + "; ".join(f"{uri}: {why}" for uri, why in s["reasons"].items()) + "\n")
    out.write(f"{len(res['moved'])} moved, {len(res['stayed'])} could not move\n")
    return 0 if not res["stayed"] else 4
