"""`db restore`'s look before it changes anything: the vGPUs, VMs and licence seats the host has now that a backup
does not record, and the reverse, each with what `vgpumgr reconcile` will make of it once the backup is the
database. Devices are read from sysfs (what exists); VMs and seats from the database the restore replaces (what this
host holds through vgpumgr). Both databases are only read (SQLite, read-only)."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

from vgpumgr.errors import InvalidInput

WHAT_RECONCILE_DOES = {
    ("devices", "host_only"): "a device nobody recorded: `reconcile` lists it, `reconcile --fix --remove-unknown` "
                              "removes it",
    ("devices", "backup_only"): "a recorded vGPU missing on the host: `reconcile --fix` makes it again",
    ("vms", "host_only"): "no longer recorded: reconcile leaves the VM alone; its vGPUs are devices nobody recorded",
    ("vms", "backup_only"): "recorded again: if its libvirt domain is gone, `reconcile --fix` releases its vGPUs and "
                            "seats (a stale record)",
    ("seats", "host_only"): "released by the restore: the pool counts the seat free again (reconcile takes no seat)",
    ("seats", "backup_only"): "held again: `reconcile --fix` releases it only with its VM's stale record",
}
TITLES = {
    ("devices", "host_only"): "vGPUs on the host that the backup does not record",
    ("devices", "backup_only"): "vGPUs the backup records that the host does not have",
    ("vms", "host_only"): "VMs recorded now that the backup does not know",
    ("vms", "backup_only"): "VMs the backup records that are not recorded now",
    ("seats", "host_only"): "licence seats held now that the backup does not hold",
    ("seats", "backup_only"): "licence seats the backup holds that are not held now",
}


def _records(db: Path, host: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Live vGPUs (by mdev UUID or VF address), VMs and held seats recorded in an SQLite database for `host`."""
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as raw:
            ids = [int(r[0]) for r in raw.execute("SELECT id FROM hosts WHERE name = ?", (host,))]
            mine = f"host_id IN ({','.join(map(str, ids))})" if ids else "host_id IS NOT NULL"  # unnamed: all
            devices = {ref: {"type": t, "vm": vm} for ref, t, vm in raw.execute(
                "SELECT coalesce(a.uuid, a.pci_address), coalesce(a.type_name, a.type_id), v.name FROM allocations a "
                f"LEFT JOIN vms v ON v.id = a.vm_id WHERE a.{mine} AND a.state IN ('reserved', 'active') "
                "AND a.backend IN ('mdev', 'nvidia-vf')")}
            vms = {name: {"state": state} for name, state in raw.execute(
                f"SELECT name, state FROM vms WHERE {mine} AND state != 'deleted'")}
            seats = {f"{pool}:{vm}": {"pool": pool, "vm": vm} for pool, vm in raw.execute(
                "SELECT p.name, coalesce(v.name, l.holder) FROM licence_leases l JOIN licence_pools p ON "
                f"p.id = l.pool_id LEFT JOIN vms v ON v.id = l.vm_id WHERE l.{mine} AND l.released_at IS NULL")}
    except sqlite3.Error as exc:
        raise InvalidInput(f"cannot read the records of {db} ({exc})",
                           hint="name a database written by `vgpumgr db backup`") from exc
    return {"devices": devices, "vms": vms, "seats": seats}


def compare(cfg: Any, host: str, backup: Path, current: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """{devices|vms|seats: {host_only|backup_only: [{ref, ..., reconcile}]}}."""
    from vgpumgr.discovery.inventory import scan

    inv = scan(cfg.host)
    now = _records(current, host) if current.is_file() else {"devices": {}, "vms": {}, "seats": {}}
    theirs = _records(backup, host)
    names = {t.type: t.name for t in inv.types}
    devices = {m.uuid: {"type": names.get(m.type, m.type)} for m in inv.mdevs}
    devices |= {v.address: {"type": v.name or v.type} for v in inv.vf_vgpus}
    for ref, d in devices.items():
        d["vm"] = (now["devices"].get(ref) or {}).get("vm")
    mine = {"devices": devices, "vms": now["vms"], "seats": now["seats"]}
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for kind in ("devices", "vms", "seats"):
        a, b = mine[kind], theirs[kind]
        out[kind] = {side: [{"ref": ref, **rows[ref], "reconcile": WHAT_RECONCILE_DOES[(kind, side)]}
                            for ref in sorted(set(rows) - set(other))]
                     for side, rows, other in (("host_only", a, b), ("backup_only", b, a))}
    return out


def text(diff: dict[str, dict[str, list[dict[str, Any]]]], backup: Path) -> str:
    lines = [f"the host now against {backup}:"]
    for kind, sides in diff.items():
        for side, rows in sides.items():
            lines.append(f"  {TITLES[(kind, side)]}: {len(rows)}")
            for r in rows:
                what = f" {r['type']}" if r.get("type") else ""
                vm = f" (VM {r['vm']})" if r.get("vm") and kind != "seats" else ""
                lines.append(f"    {r['ref']}{what}{vm}: {r['reconcile']}")
    return "\n".join(lines) + "\n"
