"""Append-only, hash-chained audit events.

Each event stores the previous event's hash and its own: sha256(prev_hash + canonical JSON of the
event). Appending advances one head row (seq, hash) under its lock, so it costs two or three
statements however long the chain is, and two writers can never both extend the same head.
`verify` walks the chain and names the first event that was altered, deleted or inserted.
Someone who can write the database can still cut the tail and rewrite the head to match; signed
checkpoints kept outside the database (vgpumgr.audit.checkpoints) catch that.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, bindparam, insert, select, update
from sqlalchemy.orm import Session

from vgpumgr.db.models import GENESIS_HASH, OUTCOMES, AuditEvent, AuditHead, utcnow
from vgpumgr.db.prepared import Prepared
from vgpumgr.errors import InvalidInput

# Action names used across vgpumgr (free text is allowed; these keep reports greppable).
VGPU_CREATE = "vgpu.create"
VGPU_REMOVE = "vgpu.remove"
PLACEMENT = "placement"
VM_DEFINE = "vm.define"
VM_UNDEFINE = "vm.undefine"
VM_START = "vm.start"
VM_STOP = "vm.stop"
LICENCE_POOL_ADD = "licence.pool.add"
LICENCE_POOL_CHANGE = "licence.pool.change"
LICENCE_POOL_REMOVE = "licence.pool.remove"
LICENCE_ACQUIRE = "licence.acquire"
LICENCE_RELEASE = "licence.release"
RECONCILE = "reconcile"

FIELDS = ("seq", "at", "host", "actor", "action", "outcome", "gpu", "vm", "vgpu", "error", "detail",
          "prev_hash", "hash")
MAX_PROBLEMS = 100


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat(timespec="microseconds")


def _canonical_detail(detail: Any) -> Any:
    """What the database will give back: plain JSON types only (others become strings)."""
    if detail is None:
        return None
    try:
        return json.loads(json.dumps(detail, default=str, allow_nan=False))
    except ValueError as exc:
        raise InvalidInput("audit detail is not valid JSON", hint=str(exc)) from exc


def event_hash(prev_hash: str, *, seq: int, at: datetime, host: str, actor: str, action: str, outcome: str,
               gpu: str | None, vm: str | None, vgpu: str | None, error: str | None, detail: Any) -> str:
    body = {
        "seq": seq, "at": _iso(at), "host": host, "actor": actor, "action": action, "outcome": outcome,
        "gpu": gpu, "vm": vm, "vgpu": vgpu, "error": error, "detail": detail,
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256((prev_hash + canonical).encode()).hexdigest()


def _hash_of(ev: Any) -> str:
    return event_hash(ev.prev_hash, seq=ev.seq, at=ev.at, host=ev.host, actor=ev.actor,
                      action=ev.action, outcome=ev.outcome, gpu=ev.gpu, vm=ev.vm, vgpu=ev.vgpu,
                      error=ev.error, detail=ev.detail)


_HEAD_FOR_UPDATE = select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == 1).with_for_update()
_INSERT_EVENT = insert(AuditEvent.__table__)
_HEAD = AuditHead.__table__
_UPDATE_HEAD = update(_HEAD).where(_HEAD.c.id == 1).values(seq=bindparam("seq"), hash=bindparam("hash"))
_ADVANCE_HEAD = Prepared(update(_HEAD)
                         .where(_HEAD.c.id == 1, _HEAD.c.seq == bindparam("old_seq"),
                                _HEAD.c.hash == bindparam("old_hash"))
                         .values(seq=bindparam("seq"), hash=bindparam("hash")))
_EVENT_COLUMNS = ("seq", "at", "host", "actor", "action", "outcome", "gpu", "vm", "vgpu", "error", "detail",
                  "prev_hash", "hash")
_APPEND_EVENT = Prepared(_INSERT_EVENT, _EVENT_COLUMNS)


def _advance_and_append() -> Prepared:
    """PostgreSQL: the conditional head UPDATE and the event INSERT as one statement (a data-modifying CTE):
    one round trip instead of two; the event is written only if the head moved."""
    events = AuditEvent.__table__
    old_hash = bindparam("old_hash", type_=events.c.prev_hash.type)
    moved = (update(_HEAD).where(_HEAD.c.id == 1, _HEAD.c.seq == bindparam("old_seq"), _HEAD.c.hash == old_hash)
             .values(seq=bindparam("seq"), hash=bindparam("hash")).returning(_HEAD.c.seq, _HEAD.c.hash)
             .cte("moved"))
    fields = [bindparam(c, type_=events.c[c].type) for c in _EVENT_COLUMNS[1:-2]]
    return Prepared(insert(events).from_select(list(_EVENT_COLUMNS),
                                               select(moved.c.seq, *fields, old_hash, moved.c.hash)))


_ADVANCE_AND_APPEND = _advance_and_append()
# Session.info key of the checkpointer (vgpumgr.audit.checkpoints) that a session's factory was given.
CHECKPOINTER = "vgpumgr.audit.chain.checkpointer"
# Per engine, the head this process last wrote: usually still the head, which saves a read per append.
_last_head: weakref.WeakKeyDictionary[Engine, tuple[int, str]] = weakref.WeakKeyDictionary()


def _link(values: dict[str, Any], head_seq: int, head_hash: str) -> None:
    values["seq"] = head_seq + 1
    values["prev_hash"] = head_hash
    fields = {k: v for k, v in values.items() if k not in ("prev_hash", "hash")}
    values["hash"] = event_hash(head_hash, **fields)


def append(session: Session, *, actor: str, action: str, outcome: str, host: str, gpu: str | None = None,
           vm: str | None = None, vgpu: str | None = None, error: str | BaseException | None = None,
           detail: dict[str, Any] | None = None, at: datetime | None = None) -> AuditEvent:
    """Add one event to the chain inside the caller's transaction (it commits with the change it records).

    The head row stays locked until that transaction ends (row lock on PostgreSQL, the BEGIN IMMEDIATE
    write lock on SQLite), so concurrent appends queue up instead of forking the chain."""
    return AuditEvent(**record(session, actor=actor, action=action, outcome=outcome, host=host, gpu=gpu, vm=vm,
                               vgpu=vgpu, error=error, detail=detail, at=at))  # a detached copy of what was written


def record(session: Session, *, actor: str, action: str, outcome: str, host: str, gpu: str | None = None,
           vm: str | None = None, vgpu: str | None = None, error: str | BaseException | None = None,
           detail: dict[str, Any] | None = None, at: datetime | None = None) -> dict[str, Any]:
    """`append` for callers that need no AuditEvent object: the written columns as a dict."""
    if outcome not in OUTCOMES:
        raise InvalidInput(f"audit outcome '{outcome}' is not one of {', '.join(OUTCOMES)}")
    if not actor or not action or not host:
        raise InvalidInput("an audit event needs an actor, an action and a host")
    if isinstance(error, BaseException):
        error = str(error)
    at = (at or utcnow()).astimezone(UTC)
    detail = _canonical_detail(detail)
    # Core statements on the session's connection: same transaction, none of the ORM's per-call cost.
    conn = session.connection()
    values = {"at": at, "host": host, "actor": actor, "action": action, "outcome": outcome, "gpu": gpu,
              "vm": vm, "vgpu": vgpu, "error": error, "detail": detail}
    cached = _last_head.get(conn.engine)
    appended = False
    if cached is not None:
        # Optimistic: assume the head is still the one this process wrote last. The conditional UPDATE
        # takes the head's lock and only succeeds if no one else appended (or rolled back) since.
        _link(values, *cached)
        moved = {"seq": values["seq"], "hash": values["hash"], "old_seq": cached[0], "old_hash": cached[1]}
        if conn.dialect.name == "postgresql":
            appended = _ADVANCE_AND_APPEND.execute(conn, values | moved).rowcount == 1
            cached = cached if appended else None
        elif _ADVANCE_HEAD.execute(conn, moved).rowcount != 1:
            cached = None
    if cached is None:
        head_seq, head_hash = conn.execute(_HEAD_FOR_UPDATE).one()
        _link(values, head_seq, head_hash)
        conn.execute(_UPDATE_HEAD, {"seq": values["seq"], "hash": values["hash"]})
    if not appended:
        _APPEND_EVENT.execute(conn, values)
    _last_head[conn.engine] = (values["seq"], values["hash"])
    checkpointer = session.info.get(CHECKPOINTER)
    if checkpointer is not None and checkpointer.every and values["seq"] % checkpointer.every == 0:
        checkpointer.after_commit(session)  # a file write every N events, none on the others
    return values


def head(session: Session) -> tuple[int, str]:
    """(seq, hash) of the newest event; write it somewhere else to detect a rewrite of the whole chain."""
    seq, digest = session.execute(select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == 1)).one()
    return seq, digest


@dataclass
class Problem:
    seq: int
    reason: str

    def __str__(self) -> str:
        return f"event {self.seq}: {self.reason}"


@dataclass
class CheckpointProblem:
    """A checkpoint that is unreadable or badly signed, or that the database contradicts."""

    n: int | None  # the checkpoint's number; None when the line is not even a checkpoint
    line: int
    seq: int | None
    kind: str  # truncated, rewritten, forked, deleted, signature, file
    reason: str

    def __str__(self) -> str:
        name = f"checkpoint {self.n}" if self.n is not None else "checkpoint file"
        where = f"line {self.line}" + (f", event {self.seq}" if self.seq is not None else "")
        return f"{name} ({where}): {self.kind}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.n, "line": self.line, "seq": self.seq, "kind": self.kind, "reason": self.reason}


@dataclass
class VerifyResult:
    checked: int
    head_seq: int
    head_hash: str
    problems: list[Problem] = field(default_factory=list)
    checkpoints: int | None = None  # how many checkpoints were compared; None: none were consulted
    checkpoint_problems: list[CheckpointProblem] = field(default_factory=list)
    restores: list[dict[str, Any]] = field(default_factory=list)  # signed `db restore` records (audit.restore)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.checkpoint_problems

    @property
    def first_bad_seq(self) -> int | None:
        return self.problems[0].seq if self.problems else None

    def __bool__(self) -> bool:
        return self.ok

    def message(self) -> str:
        against = f", consistent with {self.checkpoints} checkpoint(s)" if self.checkpoints is not None else ""
        if self.ok:
            return (f"audit chain intact: {self.checked} events, head {self.head_seq} {self.head_hash[:16]}"
                    f"{against}" + "".join(f"; {r['summary']}" for r in self.restores))
        return "audit chain broken: " + "; ".join(str(p) for p in [*self.checkpoint_problems, *self.problems])

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"ok": self.ok, "checked": self.checked, "head_seq": self.head_seq,
                             "head_hash": self.head_hash,
                             "problems": [{"seq": p.seq, "reason": p.reason} for p in self.problems]}
        if self.checkpoints is not None:
            d["checkpoints"] = {"checked": self.checkpoints,
                                "problems": [p.to_json() for p in self.checkpoint_problems],
                                **({"restores": self.restores} if self.restores else {})}
        return d


def verify(session: Session) -> VerifyResult:
    """Walk the whole chain. Names each event that was altered, deleted or slipped in."""
    head_row = session.execute(select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == 1)).one_or_none()
    head_seq, head_hash = head_row if head_row else (-1, "")
    result = VerifyResult(checked=0, head_seq=head_seq, head_hash=head_hash)
    problems = result.problems

    def report(seq: int, reason: str) -> None:
        if len(problems) < MAX_PROBLEMS:
            problems.append(Problem(seq, reason))

    if head_row is None:
        report(0, "the chain head row is missing (audit_head was emptied)")
    expected_seq, expected_prev = 1, GENESIS_HASH
    # Plain rows, not ORM objects: the session's identity map must not hide what is really stored.
    stmt = select(*AuditEvent.__table__.c).order_by(AuditEvent.seq).execution_options(yield_per=2000)
    for ev in session.execute(stmt):
        result.checked += 1
        own_ok = _hash_of(ev) == ev.hash
        if ev.seq > expected_seq:
            gap = f"{expected_seq}" if ev.seq == expected_seq + 1 else f"{expected_seq}..{ev.seq - 1}"
            report(expected_seq, f"missing: event(s) {gap} were deleted")
        elif ev.prev_hash != expected_prev and own_ok:
            # This event is intact, so the one before it was rewritten (content and hash both changed).
            report(ev.seq - 1, f"altered: its hash no longer matches what event {ev.seq} recorded")
        if not own_ok:
            report(ev.seq, "altered: its content does not match its hash")
        expected_seq, expected_prev = ev.seq + 1, ev.hash
    last_seq = expected_seq - 1
    if head_row is not None:
        if head_seq > last_seq:
            gap = f"{last_seq + 1}" if head_seq == last_seq + 1 else f"{last_seq + 1}..{head_seq}"
            report(last_seq + 1, f"missing: event(s) {gap} were deleted from the end of the chain")
        elif head_seq < last_seq:
            report(head_seq + 1, "inserted: events after the recorded head were added outside vgpumgr")
        elif head_hash != expected_prev:
            report(last_seq, "altered: the newest event's hash differs from the recorded head")
    return result


def _aware(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def query(session: Session, *, vm: str | None = None, gpu: str | None = None, vgpu: str | None = None,
          host: str | None = None, actor: str | None = None, action: str | None = None,
          outcome: str | None = None, since: datetime | None = None, until: datetime | None = None,
          limit: int | None = None, newest_first: bool = False) -> list[AuditEvent]:
    """Events matching every given filter; `since` inclusive, `until` exclusive (naive times are UTC)."""
    stmt = select(AuditEvent)
    for column, value in ((AuditEvent.vm, vm), (AuditEvent.gpu, gpu), (AuditEvent.vgpu, vgpu),
                          (AuditEvent.host, host), (AuditEvent.actor, actor), (AuditEvent.action, action),
                          (AuditEvent.outcome, outcome)):
        if value is not None:
            stmt = stmt.where(column == value)
    if since is not None:
        stmt = stmt.where(AuditEvent.at >= _aware(since))
    if until is not None:
        stmt = stmt.where(AuditEvent.at < _aware(until))
    stmt = stmt.order_by(AuditEvent.seq.desc() if newest_first else AuditEvent.seq)
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(session.scalars(stmt))


def to_dict(ev: AuditEvent) -> dict[str, Any]:
    return {
        "seq": ev.seq, "at": _iso(ev.at), "host": ev.host, "actor": ev.actor, "action": ev.action,
        "outcome": ev.outcome, "gpu": ev.gpu, "vm": ev.vm, "vgpu": ev.vgpu, "error": ev.error,
        "detail": ev.detail, "prev_hash": ev.prev_hash, "hash": ev.hash,
    }


def to_json(events: Iterable[AuditEvent], indent: int | None = 2) -> str:
    return json.dumps([to_dict(ev) for ev in events], indent=indent, ensure_ascii=False)


def to_csv(events: Iterable[AuditEvent], fields: Sequence[str] = FIELDS) -> str:
    """One row per event; `detail` as compact JSON, empty cells for missing values."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(fields)
    for ev in events:
        d = to_dict(ev)
        if d["detail"] is not None:
            d["detail"] = json.dumps(d["detail"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        writer.writerow(["" if d[f] is None else d[f] for f in fields])
    return out.getvalue()
