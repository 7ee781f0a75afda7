"""A database restore as an audit fact: the signed record `db restore` writes to the checkpoint file, and how
`audit verify` reads the checkpoints around it.

A restore cuts the chain back to the backup's head, which looks exactly like an attacker cutting the tail. The
record tells them apart: signed with the host's checkpoint key (vgpumgr.audit.key), it names the backup (its
sha256), the event the chain now ends at (the record's own `seq` and `hash`) and the file that keeps the events
after it (the replaced database) with its head. A checkpoint written before a restore whose event lies beyond
that restore's cut is then compared with the kept file, not with the database; the kept file's own chain is walked
and must end at the head the record names. Without such a signed record a cut is still "truncated".
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpumgr.audit import chain as audit

RESTORE_REASON = "restore"
_FIELDS = {"backup": str, "backup_sha256": str, "kept": str, "kept_seq": int, "kept_hash": str}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fact(backup: Path, kept: Path) -> dict[str, Any]:
    """The `restore` field of the record: which backup, and where the events after its head are kept."""
    with closing(sqlite3.connect(f"file:{kept}?mode=ro", uri=True)) as raw:
        row = raw.execute("SELECT seq, hash FROM audit_head WHERE id = 1").fetchone()
    seq, digest = row if row else (0, "0" * 64)
    return {"backup": str(backup.absolute()), "backup_sha256": file_sha256(backup), "kept": str(kept.absolute()),
            "kept_seq": int(seq), "kept_hash": str(digest)}


def of(rec: dict[str, Any]) -> dict[str, Any] | None:
    """The restore a signed record states, or None for a plain checkpoint (or a malformed restore field)."""
    r = rec.get("restore")
    if not isinstance(r, dict) or any(not isinstance(r.get(k), t) for k, t in _FIELDS.items()):
        return None
    return r


@dataclass
class Route:
    """Which checkpoints the database answers for, and which each restore's kept file does."""

    database: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    kept: list[tuple[int, dict[str, Any], list[tuple[int, dict[str, Any]]]]] = field(default_factory=list)


def route(records: Sequence[tuple[int, dict[str, Any]]]) -> Route:
    """A checkpoint's event lives on through each later restore that cut the chain at or after it; the first
    restore that cut below it holds it in its kept file."""
    restores = [(i, rec) for i, (_, rec) in enumerate(records) if of(rec) is not None]
    out = Route()
    kept: dict[int, list[tuple[int, dict[str, Any]]]] = {i: [] for i, _ in restores}
    for i, (line, rec) in enumerate(records):
        holder = next((j for j, r in restores if j > i and r["seq"] < rec["seq"]), None)
        (out.database if holder is None else kept[holder]).append((line, rec))
    out.kept = [(records[i][0], rec, kept[i]) for i, rec in restores]
    return out


def kept_chain(path: Path) -> tuple[Any, dict[int, str]] | None:
    """The kept file's chain walked (audit.verify) and its events' hashes by seq; None when the file is gone."""
    from vgpumgr.db.session import dispose_engine, session_factory

    if not path.is_file():
        return None
    url = f"sqlite:///{path}"
    try:
        with session_factory(url)() as s:
            result = audit.verify(s)
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as raw:
            hashes = dict(raw.execute("SELECT seq, hash FROM audit_events"))
    finally:
        dispose_engine(url)
    return result, hashes


def check_kept(line: int, rec: dict[str, Any], kept: list[tuple[int, dict[str, Any]]], result: Any,
               compare: Callable[..., None]) -> None:
    """A signed restore: the file it kept must still hold the cut events, chained, up to the head it named, and
    agree with the checkpoints written before the restore (`compare`: the checkpoints' own comparison)."""
    r = rec["restore"]
    path = Path(r["kept"])
    problem = _kept_problem(path, rec, kept, result, compare)
    if problem:
        result.checkpoint_problems.append(audit.CheckpointProblem(rec["n"], line, rec["seq"], "kept", problem))
    result.restores.append(describe(rec, len(kept)))


def _kept_problem(path: Path, rec: dict[str, Any], kept: list[tuple[int, dict[str, Any]]], result: Any,
                  compare: Callable[..., None]) -> str | None:
    r = rec["restore"]
    events = f"events {rec['seq'] + 1}–{r['kept_seq']}"
    try:
        walked = kept_chain(path)
    except Exception as exc:  # noqa: BLE001 - unreadable (an auditor without access, a damaged file): said, not raised
        return f"cannot read {path}, which keeps {events}: {exc}"
    if walked is None:
        return f"{path}, which keeps {events}, is gone"
    chain, hashes = walked
    if chain.problems:
        return f"the chain of {path} is broken: {chain.problems[0]}"
    if (chain.head_seq, chain.head_hash) != (r["kept_seq"], r["kept_hash"]):
        return (f"{path} ends at event {chain.head_seq} {chain.head_hash[:16]}, the restore recorded "
                f"{r['kept_seq']} {r['kept_hash'][:16]}")
    compare(kept, hashes, chain.head_seq, None, result, str(path))
    return None


def describe(rec: dict[str, Any], kept_checkpoints: int) -> dict[str, Any]:
    r = rec["restore"]
    d = {"checkpoint": rec["n"], "at": rec["at"], "backup": r["backup"], "backup_sha256": r["backup_sha256"],
         "seq": rec["seq"], "kept": r["kept"], "kept_events": [rec["seq"] + 1, r["kept_seq"]],
         "kept_checkpoints": kept_checkpoints}
    return {**d, "summary": summary(d)}


def summary(d: dict[str, Any]) -> str:
    first, last = d["kept_events"]
    kept = (f"events {first}–{last} kept in {d['kept']} (its chain verified against {d['kept_checkpoints']} "
            "checkpoint(s))" if last >= first else "no event after it")
    return (f"restored from {d['backup']} (sha256 {d['backup_sha256'][:16]}) at checkpoint {d['checkpoint']} "
            f"({d['at']}): the chain ends there at event {d['seq']}; {kept}")
