"""Signed checkpoints of the audit chain's head, kept where someone who writes the database cannot reach.

Every N events (VGPUMGR_AUDIT_CHECKPOINT_EVERY, default 100), and at every `audit verify`, `audit
checkpoint` and `audit export`, the head (seq, hash) is signed with this host's Ed25519 key and
1. appended to <state dir>/audit-checkpoints.jsonl, made append-only (chattr +a) where allowed;
2. sent to syslog / the systemd journal through /dev/log when that socket exists;
3. POSTed as JSON to a witness (VGPUMGR_AUDIT_WITNESS_URL) when one is configured.
Each checkpoint carries the digest of the one before it, so one cut out of the file shows, and is
only written if the database still extends the previous checkpoint. `check` compares the database
with every checkpoint and names each one it contradicts: truncated (the event is gone from the end),
deleted, rewritten (the chain itself shows the change) or forked (a different, self-consistent
history: re-hashed after the checkpoint was signed).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import struct
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event, func, select
from sqlalchemy.orm import Session, sessionmaker

from vgpumgr.audit import chain as audit
from vgpumgr.audit import restore as restore_audit
from vgpumgr.audit.key import PUBLIC_KEY_FILE, HostKey, canonical, digest, load_key, signed_bytes
from vgpumgr.db.models import GENESIS_HASH, AuditEvent, AuditHead
from vgpumgr.errors import AuditBroken, InvalidInput, Unavailable

CHECKPOINT_FILE = "audit-checkpoints.jsonl"
DEFAULT_EVERY = 100
DEFAULT_SYSLOG = "/dev/log"
EXPORT_FORMAT = "vgpumgr-audit-export"
SYSLOG_TAG = "vgpumgr-audit"
_SYSLOG_PRI = 10 * 8 + 6  # facility authpriv, severity info
_WITNESS_TIMEOUT_S = 3.0
_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_APPEND_FL = 0x80086601, 0x40086602, 0x20
_RECORD_FIELDS = {"v": int, "n": int, "host": str, "seq": int, "hash": str, "at": str, "reason": str,
                  "prev": str, "key": str, "sig": str}

log = logging.getLogger("vgpumgr.audit.chain")


@dataclass
class Written:
    record: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def message(self) -> str:
        r = self.record
        return f"checkpoint {r['n']} written: event {r['seq']} {r['hash'][:16]} ({'; '.join(self.notes)})"

    def to_json(self) -> dict[str, Any]:
        return {**self.record, "notes": self.notes}


def _env_every() -> int:
    text = os.environ.get("VGPUMGR_AUDIT_CHECKPOINT_EVERY", str(DEFAULT_EVERY))
    if not text.isdigit():
        raise InvalidInput(f"VGPUMGR_AUDIT_CHECKPOINT_EVERY='{text}' is not a whole number",
                           hint=f"use e.g. {DEFAULT_EVERY} (0 turns the automatic checkpoints off)")
    return int(text)


def _env_flag(name: str, default: bool) -> bool:
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("1", "yes", "true", "on"):
        return True
    if text in ("0", "no", "false", "off"):
        return False
    raise InvalidInput(f"{name}='{text}' is neither on nor off", hint="use 1 or 0")


def _env_witness() -> str | None:
    url = os.environ.get("VGPUMGR_AUDIT_WITNESS_URL") or None
    if url is not None and not url.startswith(("http://", "https://")):
        raise InvalidInput(f"VGPUMGR_AUDIT_WITNESS_URL='{url}' is not an http(s) URL",
                           hint="give the witness's full URL, e.g. https://witness.example/checkpoints")
    return url


class Checkpointer:
    def __init__(self, state_dir: Path, host: str, *, every: int = DEFAULT_EVERY, witness_url: str | None = None,
                 syslog_socket: str | None = DEFAULT_SYSLOG, append_only: bool = True) -> None:
        self.state_dir, self.host, self.every = state_dir, host, every
        self.path = state_dir / CHECKPOINT_FILE
        self.witness_url, self.syslog_socket, self.append_only = witness_url, syslog_socket, append_only

    @classmethod
    def from_env(cls, state_dir: Path, host: str, simulated: bool = False) -> Checkpointer:
        """Settings from the environment. A simulated host's state dir is thrown away with its tree,
        so its file is only made append-only when VGPUMGR_AUDIT_APPEND_ONLY=1 asks for it."""
        return cls(state_dir, host, every=_env_every(), witness_url=_env_witness(),
                   syslog_socket=os.environ.get("VGPUMGR_AUDIT_SYSLOG_SOCKET", DEFAULT_SYSLOG) or None,
                   append_only=_env_flag("VGPUMGR_AUDIT_APPEND_ONLY", not simulated))

    def key(self, create: bool = False) -> HostKey | None:
        return load_key(self.state_dir, create)

    # -- writing -----------------------------------------------------------------------------------
    def after_commit(self, session: Session) -> None:
        """Write a checkpoint once `session` commits (never for a rolled-back append)."""
        engine = session.get_bind()

        def write_now(_session: Session) -> None:
            try:
                self.write(engine, reason=f"every {self.every} events")
            except Exception as exc:  # noqa: BLE001 - the change is committed; a checkpoint must not undo it
                log.warning("audit checkpoint not written: %s", exc)

        event.listen(session, "after_commit", write_now, once=True)

    def write(self, engine: Engine, reason: str, restore: dict[str, Any] | None = None) -> Written:
        """Sign the head and append it, if the database still extends the newest checkpoint (a restore's record:
        whatever the checkpoints before it said)."""
        try:
            return self._write(engine, reason, restore)
        except OSError as exc:
            raise Unavailable(f"cannot write the audit checkpoint in {self.state_dir}: {exc.strerror or exc}",
                              hint="run as the owner of the state directory (root on a real host)") from exc

    def write_restore(self, engine: Engine, backup: Path, kept: Path) -> Written:
        """The signed record of a `db restore` (vgpumgr.audit.restore): the chain now ends at the restored
        database's head, whatever the checkpoints before it said; the events after it are in `kept`."""
        return self.write(engine, restore_audit.RESTORE_REASON, restore=restore_audit.fact(backup, kept))

    def _write(self, engine: Engine, reason: str, restore: dict[str, Any] | None = None) -> Written:
        key = self.key(create=True)
        assert key is not None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one writer at a time: `n` and `prev` follow the last line
            last = _last_record(self.path)
            # a restore's record takes the restored head as it is (`db restore --force` may restore a broken chain)
            head_seq, head_hash = _head_row(engine) if restore else _head_extending(engine, last)
            record: dict[str, Any] = {
                "v": 1, "n": (last["n"] + 1) if last else 1, "host": self.host, "seq": head_seq, "hash": head_hash,
                "at": datetime.now(UTC).isoformat(timespec="microseconds"), "reason": reason,
                "prev": digest(last) if last else GENESIS_HASH, "key": key.key_id,
                **({"restore": restore} if restore else {})}
            record["sig"] = key.sign(signed_bytes(record))
            os.write(fd, canonical(record) + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        notes = [_make_append_only(self.path) if self.append_only else "file not made append-only (simulated host; "
                 "VGPUMGR_AUDIT_APPEND_ONLY=1 asks for it)",
                 _to_syslog(self.syslog_socket, record)]
        if self.witness_url:
            notes.append(_to_witness(self.witness_url, record))
        return Written(record, notes)

    # -- reading and checking ------------------------------------------------------------------------
    def read(self) -> tuple[list[tuple[int, dict[str, Any]]], list[audit.CheckpointProblem]]:
        """(line, record) of each checkpoint whose signature holds, and the problems with the file."""
        records: list[tuple[int, dict[str, Any]]] = []
        problems: list[audit.CheckpointProblem] = []
        try:
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return records, problems
        key = self.key(create=False) if any(line.strip() for line in lines) else None
        prev: str | None = GENESIS_HASH  # None: the line before was not trustworthy, so no link to check
        expected_n = 1
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            rec = _parse(line)
            if rec is None:
                problems.append(audit.CheckpointProblem(None, number, None, "file",
                                                        "not a checkpoint record: the file was edited"))
                prev = None
                continue
            n, seq, trusted = rec["n"], rec["seq"], False
            if key is None or rec["key"] != key.key_id:
                have = key.key_id if key else f"none ({self.state_dir / PUBLIC_KEY_FILE} is missing)"
                problems.append(audit.CheckpointProblem(n, number, seq, "signature",
                                                        f"signed by key {rec['key']}, this host's key is {have}"))
            elif not key.verifies(signed_bytes(rec), rec["sig"]):
                problems.append(audit.CheckpointProblem(
                    n, number, seq, "signature", "the signature does not match: the checkpoint file was rewritten"))
            else:
                if prev is not None and (n != expected_n or rec["prev"] != prev):
                    problems.append(audit.CheckpointProblem(
                        n, number, seq, "file", f"expected checkpoint {expected_n} linked to the line before it: "
                        "checkpoints were removed or reordered"))
                records.append((number, rec))
                trusted = True
            prev, expected_n = (digest(rec) if trusted else None), n + 1
        return records, problems

    def check(self, session: Session, result: audit.VerifyResult) -> None:
        """Add to `result` every checkpoint problem: the file's own, then each one the database contradicts."""
        all_records, problems = self.read()
        result.checkpoint_problems.extend(problems)
        result.checkpoints = len(all_records)
        routed = restore_audit.route(all_records)
        records = routed.database
        wanted = sorted({rec["seq"] for _, rec in records if rec["seq"] > 0})
        stored: dict[int, str] = {}
        for i in range(0, len(wanted), 500):
            rows = session.execute(select(AuditEvent.seq, AuditEvent.hash)
                                   .where(AuditEvent.seq.in_(wanted[i:i + 500]))).all()
            stored.update({seq: digest_ for seq, digest_ in rows})
        db_last = session.execute(select(func.max(AuditEvent.seq))).scalar() or 0
        chain_bad = min((p.seq for p in result.problems), default=None)
        _compare(records, stored, db_last, chain_bad, result, "the database")
        for line, rec, kept in routed.kept:
            restore_audit.check_kept(line, rec, kept, result, _compare)

    def verify(self, session: Session) -> audit.VerifyResult:
        """The chain walk and the checkpoint comparison together."""
        result = audit.verify(session)
        self.check(session, result)
        return result
    def export(self, session: Session) -> dict[str, Any]:
        """Events, checkpoints (as written) and the public key: all a third party needs to verify."""
        key = self.key(create=False)
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        stmt = select(*AuditEvent.__table__.c).order_by(AuditEvent.seq).execution_options(yield_per=2000)
        return {"format": EXPORT_FORMAT, "version": 1, "host": self.host,
                "exported_at": datetime.now(UTC).isoformat(timespec="microseconds"),
                "key_id": key.key_id if key else None, "public_key": key.public_pem() if key else None,
                "events": [audit.to_dict(ev) for ev in session.execute(stmt)],
                "checkpoints": [json.loads(line) for line in lines if _parse(line) is not None]}


def _compare(records: list[tuple[int, dict[str, Any]]], stored: dict[int, str], db_last: int,
             chain_bad: int | None, result: audit.VerifyResult, where: str) -> None:
    """Name each checkpoint that `stored` (seq -> hash of `where`'s events) contradicts, and how."""
    matched: dict[str, Any] | None = None  # the newest checkpoint so far that the database agrees with
    for number, rec in records:
        seq, recorded, n = rec["seq"], rec["hash"], rec["n"]
        found = stored.get(seq, GENESIS_HASH if seq == 0 else None)
        if found == recorded:
            matched = rec
            continue
        signed = f"signed {rec['at']}"
        if found is None and seq > db_last:
            kind, why = "truncated", (f"{where} ends at event {db_last}, but this checkpoint ({signed}) "
                                      f"recorded event {seq} with hash {recorded[:16]}")
        elif found is None:
            kind, why = "deleted", f"event {seq} of {where}, recorded by this checkpoint ({signed}), is gone"
        elif chain_bad is not None and chain_bad <= seq:
            kind, why = "rewritten", (f"event {seq} of {where} now hashes to {found[:16]}, not {recorded[:16]} "
                                      f"({signed}); the chain is broken from event {chain_bad}")
        else:
            since = (f"after checkpoint {matched['n']} (event {matched['seq']})" if matched
                     else "before any checkpoint that still matches")
            kind, why = "forked", (f"event {seq} of {where} now hashes to {found[:16]}, not {recorded[:16]} "
                                   f"({signed}): it holds a different, self-consistent history, re-hashed {since}")
        if len(result.checkpoint_problems) < audit.MAX_PROBLEMS:
            result.checkpoint_problems.append(audit.CheckpointProblem(n, number, seq, kind, why))


def attach(factory: sessionmaker[Session], checkpointer: Checkpointer) -> Checkpointer:
    """Make audit.append on `factory`'s sessions checkpoint every `checkpointer.every` events."""
    info = dict(factory.kw.get("info") or {})
    info[audit.CHECKPOINTER] = checkpointer
    factory.configure(info=info)
    return checkpointer


def _parse(line: str) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or any(not isinstance(rec.get(k), t) for k, t in _RECORD_FIELDS.items()):
        return None
    return rec


def _last_record(path: Path) -> dict[str, Any] | None:
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 8192))
        lines = [line for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    if not lines:
        return None
    rec = _parse(lines[-1])
    if rec is None:
        raise AuditBroken(f"the last line of {path} is not a checkpoint",
                          hint="the file was edited; run `vgpumgr audit verify` to see what else changed")
    return rec


def _head_row(engine: Engine) -> tuple[int, str]:
    with engine.connect() as conn:
        row = conn.execute(select(AuditHead.seq, AuditHead.hash).where(AuditHead.id == 1)).one_or_none()
    return (int(row[0]), str(row[1])) if row else (0, GENESIS_HASH)


def _head_extending(engine: Engine, last: dict[str, Any] | None) -> tuple[int, str]:
    """The newest event (seq, hash), after checking that the events since `last` link up to it.

    Plain DB-API reads of three text/int columns: no write lock on SQLite, no type processing."""
    start = last["seq"] if last else 0
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        cur.execute(f"SELECT seq, prev_hash, hash FROM audit_events WHERE seq >= {int(start)} ORDER BY seq")
        rows = cur.fetchall()
        cur.close()
        raw.rollback()
    finally:
        raw.close()
    seq, digest_ = 0, GENESIS_HASH
    if last and start > 0:
        if not rows or rows[0][0] != start or rows[0][2] != last["hash"]:
            raise AuditBroken(f"the database contradicts checkpoint {last['n']} (event {start}); "
                              "no new checkpoint was written", hint="run `vgpumgr audit verify` to see what changed")
        seq, digest_ = start, last["hash"]
        rows = rows[1:]
    for row_seq, prev_hash, row_hash in rows:
        if row_seq != seq + 1 or prev_hash != digest_:
            raise AuditBroken(f"event {row_seq} does not extend event {seq}; no checkpoint was written",
                              hint="run `vgpumgr audit verify` to see what changed")
        seq, digest_ = row_seq, row_hash
    return seq, digest_


def _make_append_only(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return f"file not append-only: {exc.strerror}"
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("i", 0)))[0]
        if flags & _FS_APPEND_FL:
            return "file append-only (chattr +a)"
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("i", flags | _FS_APPEND_FL))
        return "file made append-only (chattr +a)"
    except OSError as exc:
        return (f"file NOT append-only: this file system or user does not allow chattr +a "
                f"({exc.strerror}); protect {path} another way (root-owned, remote copy)")
    finally:
        os.close(fd)


def _to_syslog(path: str | None, record: dict[str, Any]) -> str:
    if not path:
        return "journal: off (VGPUMGR_AUDIT_SYSLOG_SOCKET is empty)"
    if not os.path.exists(path):
        return f"journal: no syslog socket at {path}, not sent"
    message = f"<{_SYSLOG_PRI}>{SYSLOG_TAG}: checkpoint ".encode() + canonical(record)
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        try:
            with socket.socket(socket.AF_UNIX, kind) as sock:
                sock.settimeout(1.0)
                sock.connect(path)
                sock.sendall(message if kind == socket.SOCK_DGRAM else message + b"\n")
            return f"journal: sent to {path}"
        except OSError as exc:
            error = exc
    return f"journal: not sent to {path} ({error})"


def _to_witness(url: str, record: dict[str, Any]) -> str:
    request = urllib.request.Request(url, data=canonical(record), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=_WITNESS_TIMEOUT_S) as response:
            return f"witness: {url} answered {response.status}"
    except Exception as exc:  # noqa: BLE001 - a witness that is down must not stop the checkpoint
        log.warning("audit witness %s did not take checkpoint %s: %s", url, record["n"], exc)
        return f"witness: {url} failed ({exc})"
