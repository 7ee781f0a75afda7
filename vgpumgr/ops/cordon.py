"""Cordoning a host, as `kubectl cordon` does a node: nothing new is scheduled onto it, what runs there stays.

A cordoned host is never chosen by `vgpumgr fleet place` and refuses incoming live migrations (the migration's
destination asks `host_status`). Work on the host itself is not refused: a VM that already lives there must
still start (its hook re-creates its vGPUs), get a vGPU attached, release one and be moved away while the host
is drained, and refusing those would turn a drain into an outage. A local `vgpumgr vgpu` or `vm create` on a
cordoned host therefore goes ahead, and the CLI warns that the host is cordoned. Any host sharing the database
may cordon any other (an administrator drains a host from wherever they are); each change is audited as
`host.cordon` / `host.uncordon` with the host it was about.
"""

from __future__ import annotations

from typing import Any

from vgpumgr import ids
from vgpumgr.errors import InvalidInput, NotFound
from vgpumgr.fleet import cordon as rows
from vgpumgr.ops.context import Context

HOST_CORDON = "host.cordon"
HOST_UNCORDON = "host.uncordon"
MAX_REASON = 500


def _target(svc: Context, s: Any, host: str | None) -> tuple[int, str]:
    if host is None or host.strip() == svc.hostname:
        return svc.host_id(s), svc.hostname
    name = ids.host_name(host)
    row = rows.host_row(s, name)
    if row is None:
        raise NotFound(f"no host {name} shares this database",
                       hint="`vgpumgr fleet hosts` lists the hosts; a host joins when its vgpumgr first runs")
    return row.id, name


def _reason(reason: str | None) -> str | None:
    if reason is None or not reason.strip():
        return None
    r = reason.strip()
    if len(r) > MAX_REASON or not r.isprintable():
        raise InvalidInput(f"the cordon reason is longer than {MAX_REASON} characters or not printable",
                           hint="say in a line why the host is cordoned, e.g. 'BIOS update'")
    return r


def cordon_host(svc: Context, host: str | None = None, reason: str | None = None, actor: str | None = None
                ) -> dict[str, Any]:
    """Cordon `host` (default: this one). Cordoning a cordoned host again only replaces its reason."""
    why = _reason(reason)
    with svc.tx() as s:
        host_id, name = _target(svc, s, host)
        before = rows.cordon_of(s, host_id)
        if before is not None and before.reason == why:
            return {**rows.as_dict(name, before), "changed": False}
        detail = {"host": name, "reason": why} | ({"was": before.reason} if before else {})
        row = rows.set_cordon(s, host_id, why, actor or svc.cfg.actor)
        svc.event(s, HOST_CORDON, actor=actor, detail=detail)
        return {**rows.as_dict(name, row), "changed": True}


def uncordon_host(svc: Context, host: str | None = None, actor: str | None = None) -> dict[str, Any]:
    with svc.tx() as s:
        host_id, name = _target(svc, s, host)
        before = rows.cordon_of(s, host_id)
        if before is None:
            return {**rows.as_dict(name, None), "changed": False}
        reason = before.reason
        rows.clear_cordon(s, host_id)
        svc.event(s, HOST_UNCORDON, actor=actor, detail={"host": name, "reason": reason})
        return {**rows.as_dict(name, None), "changed": True}


def host_status(svc: Context, host: str | None = None) -> dict[str, Any]:
    """Whether `host` (default: this one) is cordoned, why, since when and by whom."""
    with svc.reads() as s:
        host_id, name = _target(svc, s, host)
        return rows.as_dict(name, rows.cordon_of(s, host_id))


def is_cordoned(svc: Context, host: str | None = None) -> bool:
    return bool(host_status(svc, host)["cordoned"])
