"""The cordon rows: a cordoned host is one the fleet places nothing new on (see vgpumgr.ops.cordon)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from vgpumgr.db.models import Host, HostCordon, utcnow


def cordon_of(s: Session, host_id: int) -> HostCordon | None:
    return s.get(HostCordon, host_id)


def set_cordon(s: Session, host_id: int, reason: str | None, by: str) -> HostCordon:
    row = s.get(HostCordon, host_id)
    if row is None:
        row = HostCordon(host_id=host_id, reason=reason, cordoned_by=by, cordoned_at=utcnow())
        s.add(row)
    else:
        row.reason, row.cordoned_by, row.cordoned_at = reason, by, utcnow()
    s.flush()
    return row


def clear_cordon(s: Session, host_id: int) -> bool:
    return bool(s.execute(delete(HostCordon).where(HostCordon.host_id == host_id)).rowcount)


def cordoned_hosts(s: Session) -> dict[int, HostCordon]:
    return {c.host_id: c for c in s.scalars(select(HostCordon))}


def as_dict(host: str, row: HostCordon | None) -> dict[str, Any]:
    return {"host": host, "cordoned": row is not None, "reason": row.reason if row else None,
            "cordoned_by": row.cordoned_by if row else None,
            "cordoned_at": row.cordoned_at.isoformat() if row else None}


def host_row(s: Session, name: str) -> Host | None:
    return s.scalar(select(Host).where(Host.name == name))
