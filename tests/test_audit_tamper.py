"""An attacker who can write the database: every rewrite is caught, by the chain or by a signed checkpoint
kept outside the database, and named; the export verifies with the standalone script."""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from vgpumgr.audit import chain as audit
from vgpumgr.audit import checkpoints
from vgpumgr.audit import key as audit_key
from vgpumgr.audit.checkpoints import Checkpointer
from vgpumgr.db.session import get_engine, make_engine, session_factory
from vgpumgr.errors import AuditBroken, InvalidInput

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
VERIFIER = Path(__file__).resolve().parents[1] / "scripts" / "verify-audit-export"


def _checkpointer(state: Path, every: int = 5, host: str = "h1", **kw: object) -> Checkpointer:
    kw.setdefault("syslog_socket", None)
    kw.setdefault("append_only", False)
    return Checkpointer(state, host, every=every, **kw)  # type: ignore[arg-type]


def _fill(url: str, cp: Checkpointer | None, n: int, host: str = "h1", engine: object = None) -> None:
    factory = session_factory(engine or url)  # type: ignore[arg-type]
    if cp is not None:
        checkpoints.attach(factory, cp)
    for i in range(n):
        with factory.begin() as s:
            audit.append(s, actor="alice", action=audit.VGPU_CREATE, outcome="ok", host=host, vm=f"vm{i}",
                         detail={"i": i}, at=T0 + timedelta(minutes=i))


def _exec(url: str, sql: str, **params: object) -> None:
    with get_engine(url).begin() as conn:
        conn.execute(text(sql), params)


def _verify(url: str, cp: Checkpointer) -> audit.VerifyResult:
    with session_factory(url)() as s:
        return cp.verify(s)


def _events(url: str) -> list[audit.AuditEvent]:
    with session_factory(url)() as s:
        return audit.query(s)


def _lines(cp: Checkpointer) -> list[dict]:
    return [json.loads(line) for line in cp.path.read_text().splitlines()]


@pytest.fixture
def chain(fresh_db_url: str, tmp_path: Path) -> tuple[str, Checkpointer]:
    """Ten events with a checkpoint after every fifth: at events 5 and 10."""
    cp = _checkpointer(tmp_path / "state")
    _fill(fresh_db_url, cp, 10)
    return fresh_db_url, cp


def test_checkpoints_every_n_events_and_only_after_commit(fresh_db_url: str, tmp_path: Path) -> None:
    cp = _checkpointer(tmp_path / "state", every=3)
    _fill(fresh_db_url, cp, 7)
    assert [(r["n"], r["seq"]) for r in _lines(cp)] == [(1, 3), (2, 6)]  # no write for the other five
    factory = session_factory(fresh_db_url)
    checkpoints.attach(factory, cp)
    with factory() as s:
        audit.append(s, actor="bob", action=audit.VM_START, outcome="ok", host="h1")
        audit.append(s, actor="bob", action=audit.VM_START, outcome="ok", host="h1")  # seq 9: a multiple of 3
        s.rollback()
    assert len(_lines(cp)) == 2  # the rolled-back event 9 was never checkpointed
    _fill(fresh_db_url, cp, 2)
    assert [r["seq"] for r in _lines(cp)] == [3, 6, 9]
    result = _verify(fresh_db_url, cp)
    assert result.ok and result.checkpoints == 3
    assert (cp.state_dir / audit_key.KEY_FILE).stat().st_mode & 0o777 == 0o600


def test_untouched_chain_is_consistent_with_its_checkpoints(chain: tuple[str, Checkpointer]) -> None:
    url, cp = chain
    result = _verify(url, cp)
    assert result.ok, result.message()
    assert result.checkpoints == 2 and "consistent with 2 checkpoint(s)" in result.message()
    assert result.to_json()["checkpoints"] == {"checked": 2, "problems": []}


def test_edited_event_is_named(chain: tuple[str, Checkpointer]) -> None:
    url, cp = chain
    _exec(url, "UPDATE audit_events SET actor = 'mallory' WHERE seq = 3")
    result = _verify(url, cp)
    assert not result.ok and result.first_bad_seq == 3 and "event 3: altered" in result.message()


def test_deleted_middle_event_is_named(chain: tuple[str, Checkpointer]) -> None:
    url, cp = chain
    _exec(url, "DELETE FROM audit_events WHERE seq = 5")  # also the first checkpoint's event
    result = _verify(url, cp)
    assert result.first_bad_seq == 5 and "deleted" in result.problems[0].reason
    first = result.checkpoint_problems[0]
    assert (first.n, first.seq, first.kind) == (1, 5, "deleted")


def test_deleted_last_event_is_named(chain: tuple[str, Checkpointer]) -> None:
    url, cp = chain
    _exec(url, "DELETE FROM audit_events WHERE seq = 10")
    result = _verify(url, cp)
    assert result.first_bad_seq == 10 and "deleted from the end" in result.problems[0].reason
    assert [(p.n, p.kind) for p in result.checkpoint_problems] == [(2, "truncated")]


def test_emptied_head_is_named(chain: tuple[str, Checkpointer]) -> None:
    url, cp = chain
    _exec(url, "DELETE FROM audit_head")
    result = _verify(url, cp)
    assert not result.ok and "audit_head was emptied" in result.message()


def test_truncated_tail_with_rewritten_head_is_caught_by_a_checkpoint(chain: tuple[str, Checkpointer]) -> None:
    url, cp = chain
    seventh = _events(url)[6]
    _exec(url, "DELETE FROM audit_events WHERE seq > 7")
    _exec(url, "UPDATE audit_head SET seq = 7, hash = :h", h=seventh.hash)
    with session_factory(url)() as s:
        assert audit.verify(s).ok  # the chain alone cannot tell
    result = _verify(url, cp)
    assert not result.ok and result.problems == []
    first = result.checkpoint_problems[0]
    assert (first.n, first.seq, first.kind) == (2, 10, "truncated")
    assert "the database ends at event 7" in first.reason
    assert result.message().startswith("audit chain broken: checkpoint 2 (line 2, event 10): truncated")
    with pytest.raises(AuditBroken, match="contradicts checkpoint 2"):
        cp.write(get_engine(url), reason="test")  # nothing signs the truncated history
    assert len(_lines(cp)) == 2


def test_forged_event_rehashed_to_the_end_is_a_fork(chain: tuple[str, Checkpointer]) -> None:
    url, cp = chain
    prev = None
    for ev in _events(url)[2:]:  # forge event 3, then re-hash every event after it and the head
        prev = prev or ev.prev_hash
        actor = "mallory" if ev.seq == 3 else ev.actor
        forged = audit.event_hash(prev, seq=ev.seq, at=ev.at, host=ev.host, actor=actor, action=ev.action,
                                  outcome=ev.outcome, gpu=ev.gpu, vm=ev.vm, vgpu=ev.vgpu, error=ev.error,
                                  detail=ev.detail)
        _exec(url, "UPDATE audit_events SET actor = :a, prev_hash = :p, hash = :h WHERE seq = :s",
              a=actor, p=prev, h=forged, s=ev.seq)
        prev = forged
    _exec(url, "UPDATE audit_head SET hash = :h", h=prev)
    with session_factory(url)() as s:
        assert audit.verify(s).ok
    result = _verify(url, cp)
    assert [(p.n, p.seq, p.kind) for p in result.checkpoint_problems] == [(1, 5, "forked"), (2, 10, "forked")]
    assert "re-hashed before any checkpoint that still matches" in result.checkpoint_problems[0].reason


def test_rewritten_checkpoint_file_fails_its_signature(chain: tuple[str, Checkpointer]) -> None:
    url, cp = chain
    records = _lines(cp)
    records[1]["seq"], records[1]["hash"] = 7, _events(url)[6].hash  # as if the truncation were legitimate
    cp.path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = _verify(url, cp)
    assert [(p.n, p.line, p.kind) for p in result.checkpoint_problems] == [(2, 2, "signature")]
    assert "checkpoint file was rewritten" in result.message() and result.checkpoints == 1


def test_removed_or_garbled_checkpoint_lines_are_named(chain: tuple[str, Checkpointer]) -> None:
    url, cp = chain
    _fill(url, cp, 5)  # a third checkpoint, at event 15
    lines = cp.path.read_text().splitlines()
    cp.path.write_text(lines[0] + "\n" + lines[2] + "\n")
    result = _verify(url, cp)
    assert [(p.n, p.kind) for p in result.checkpoint_problems] == [(3, "file")]
    assert "removed or reordered" in result.checkpoint_problems[0].reason
    cp.path.write_text(lines[0] + "\nnot json\n")
    assert [(p.n, p.line, p.kind) for p in _verify(url, cp).checkpoint_problems] == [(None, 2, "file")]


def test_checkpoint_signed_by_another_key_is_refused(chain: tuple[str, Checkpointer], tmp_path: Path) -> None:
    url, cp = chain
    other = _checkpointer(tmp_path / "other")
    other.write(get_engine(url), reason="test")
    cp.path.write_text(cp.path.read_text() + other.path.read_text())
    problems = _verify(url, cp).checkpoint_problems
    assert [(p.n, p.kind) for p in problems] == [(1, "signature")] and "signed by key" in problems[0].reason


def test_export_verifies_with_the_standalone_script(chain: tuple[str, Checkpointer], tmp_path: Path) -> None:
    url, cp = chain
    with session_factory(url)() as s:
        bundle = cp.export(s)
    path = tmp_path / "export.json"

    def verifier(data: dict, *extra: str) -> subprocess.CompletedProcess[str]:
        path.write_text(json.dumps(data))
        return subprocess.run([sys.executable, str(VERIFIER), str(path), *extra], capture_output=True, text=True,
                              timeout=60)

    key_id = cp.key().key_id  # type: ignore[union-attr]
    ok = verifier(bundle, "--key-id", key_id)
    assert ok.returncode == 0 and "verified: 10 events, 2 checkpoints" in ok.stdout, ok.stdout + ok.stderr
    assert verifier(bundle, "--key-id", "0" * 16).returncode == 1

    edited = json.loads(json.dumps(bundle))
    edited["events"][2]["actor"] = "mallory"
    bad = verifier(edited)
    assert bad.returncode == 1 and "first: event 3: its content does not match its hash" in bad.stdout

    truncated = {**bundle, "events": bundle["events"][:7]}
    bad = verifier(truncated)
    assert bad.returncode == 1 and "checkpoint 2 (event 10" in bad.stdout and "truncated" in bad.stdout

    resigned = json.loads(json.dumps(bundle))
    resigned["checkpoints"][0]["hash"] = "f" * 64
    bad = verifier(resigned)
    assert bad.returncode == 1 and "checkpoint 1" in bad.stdout and "signature does not match" in bad.stdout
    assert verifier({"format": "something else"}).returncode == 2


def test_cli_verify_exits_9_naming_the_checkpoint_and_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              ) -> None:
    from simhost import make, run

    root = str(make(tmp_path, "t4").root)
    monkeypatch.setenv("VGPUMGR_AUDIT_SYSLOG_SOCKET", "")
    for name in ("p1", "p2", "p3"):
        assert run("--sysfs-root", root, "license", "add", name, "--edition", "vWS", "--seats", "1")[0] == 0
    rc, out, err = run("--sysfs-root", root, "audit", "checkpoint", "--json")
    assert rc == 0, err
    assert json.loads(out)["seq"] == 3 and json.loads(out)["n"] == 1
    rc, out, _ = run("--sysfs-root", root, "audit", "verify")
    assert rc == 0 and "consistent with 1 checkpoint(s)" in out and "checkpoint 2 written: event 3" in out
    export = tmp_path / "bundle.json"
    rc, out, _ = run("--sysfs-root", root, "audit", "export", "--output", str(export))
    assert rc == 0 and json.loads(export.read_text())["checkpoints"][-1]["reason"] == "export"
    done = subprocess.run([sys.executable, str(VERIFIER), str(export)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout

    url = f"sqlite:///{Path(root) / '.vgpumgr-state' / 'vgpumgr.db'}"
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            second = conn.execute(text("SELECT hash FROM audit_events WHERE seq = 2")).scalar_one()
            conn.execute(text("DELETE FROM audit_events WHERE seq = 3"))
            conn.execute(text("UPDATE audit_head SET seq = 2, hash = :h"), {"h": second})
    finally:
        engine.dispose()
    rc, out, _ = run("--sysfs-root", root, "audit", "verify", "--json")
    report = json.loads(out)
    assert rc == 9 and report["problems"] == [] and report["checkpoint"] is None
    assert report["checkpoints"]["problems"][0]["checkpoint"] == 1
    assert report["checkpoints"]["problems"][0]["kind"] == "truncated"
    rc, _, err = run("--sysfs-root", root, "audit", "checkpoint")
    assert rc == 9 and "contradicts checkpoint 3" in err
    rc, _, err = run("--sysfs-root", root, "audit", "export", "--output", str(export))
    assert rc == 9 and json.loads(export.read_text())["events"][-1]["seq"] == 2


def test_journal_gets_each_checkpoint_and_its_absence_breaks_nothing(fresh_db_url: str, tmp_path: Path) -> None:
    sock_path = tmp_path / "log.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(sock_path))
        listener.settimeout(5)
        cp = _checkpointer(tmp_path / "state", syslog_socket=str(sock_path))
        _fill(fresh_db_url, cp, 2)
        written = cp.write(get_engine(fresh_db_url), reason="test")
        message = listener.recv(65536).decode()
    assert f"journal: sent to {sock_path}" in written.notes
    assert message.startswith("<86>vgpumgr-audit: checkpoint ")
    assert json.loads(message.split("checkpoint ", 1)[1]) == written.record
    absent = _checkpointer(tmp_path / "state", syslog_socket=str(tmp_path / "missing.sock"))
    again = absent.write(get_engine(fresh_db_url), reason="test")
    assert any("no syslog socket" in note for note in again.notes) and again.record["n"] == 2


def test_witness_receives_each_checkpoint_and_a_dead_one_only_warns(fresh_db_url: str, tmp_path: Path) -> None:
    received: list[dict] = []

    class Witness(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(201)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Witness)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/checkpoints"
        cp = _checkpointer(tmp_path / "state", every=2, witness_url=url)
        _fill(fresh_db_url, cp, 4)
        assert [r["seq"] for r in received] == [2, 4] and received == _lines(cp)
    finally:
        server.shutdown()
        server.server_close()
    dead = _checkpointer(tmp_path / "state", witness_url=url)
    written = dead.write(get_engine(fresh_db_url), reason="test")
    assert any(note.startswith(f"witness: {url} failed") for note in written.notes)
    assert _lines(cp)[-1] == written.record


def _append_flag(path: Path) -> bool:
    with open(path, "rb") as f:
        return bool(struct.unpack("i", fcntl.ioctl(f.fileno(), 0x80086601, struct.pack("i", 0)))[0] & 0x20)


def test_checkpoint_file_is_made_append_only_or_says_why_not(fresh_db_url: str, tmp_path: Path) -> None:
    cp = _checkpointer(tmp_path / "state", append_only=True)
    written = cp.write(get_engine(fresh_db_url), reason="test")
    note = written.notes[0]
    try:
        if "made append-only" in note:
            assert _append_flag(cp.path)
            with pytest.raises(PermissionError):
                cp.path.write_text("")  # truncating is refused
            assert cp.write(get_engine(fresh_db_url), reason="test").notes[0] == "file append-only (chattr +a)"
            assert [r["n"] for r in _lines(cp)] == [1, 2]
        else:
            assert "NOT append-only" in note and "does not allow chattr +a" in note
    finally:
        if _append_flag(cp.path):
            subprocess.run(["chattr", "-a", str(cp.path)], check=True)


def test_settings_from_the_environment_are_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VGPUMGR_AUDIT_CHECKPOINT_EVERY", "often")
    with pytest.raises(InvalidInput, match="VGPUMGR_AUDIT_CHECKPOINT_EVERY"):
        Checkpointer.from_env(tmp_path, "h1")
    monkeypatch.setenv("VGPUMGR_AUDIT_CHECKPOINT_EVERY", "7")
    monkeypatch.setenv("VGPUMGR_AUDIT_WITNESS_URL", "ftp://witness")
    with pytest.raises(InvalidInput, match="http"):
        Checkpointer.from_env(tmp_path, "h1")
    monkeypatch.setenv("VGPUMGR_AUDIT_WITNESS_URL", "http://127.0.0.1:9/x")
    cp = Checkpointer.from_env(tmp_path, "h1", simulated=True)
    assert (cp.every, cp.witness_url, cp.append_only) == (7, "http://127.0.0.1:9/x", False)
    monkeypatch.setenv("VGPUMGR_AUDIT_APPEND_ONLY", "1")
    assert Checkpointer.from_env(tmp_path, "h1", simulated=True).append_only


def test_the_database_refuses_a_second_successor(chain: tuple[str, Checkpointer]) -> None:
    url, _ = chain
    fifth = _events(url)[4]
    with pytest.raises(IntegrityError):
        _exec(url, "INSERT INTO audit_events (seq, at, host, actor, action, outcome, prev_hash, hash) "
                   "VALUES (11, :at, 'h9', 'mallory', 'x', 'ok', :p, :h)", at=T0, p=fifth.prev_hash, h="e" * 64)


def test_hosts_appending_at_once_keep_one_chain_and_their_own_checkpoints(fresh_db_url: str, tmp_path: Path,
                                                                        ) -> None:
    """Several hosts (each its own engine, state dir and key) append to one database at the same time."""
    hosts, per_host = 4, 30
    engines = [make_engine(fresh_db_url) for _ in range(hosts)]
    cps = [_checkpointer(tmp_path / f"host{i}", every=7, host=f"host{i}") for i in range(hosts)]
    errors: list[BaseException] = []
    start = threading.Barrier(hosts)

    def worker(i: int) -> None:
        try:
            start.wait()
            _fill(fresh_db_url, cps[i], per_host, host=f"host{i}", engine=engines[i])
            cps[i].write(engines[i], reason="test")
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(hosts)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for engine in engines:
            engine.dispose()
    assert errors == []
    events = _events(fresh_db_url)
    total = hosts * per_host
    assert [e.seq for e in events] == list(range(1, total + 1))
    assert len({e.prev_hash for e in events}) == total  # no two events extend the same predecessor
    for i, cp in enumerate(cps):
        records = _lines(cp)
        assert {r["host"] for r in records} == {f"host{i}"} and records[-1]["seq"] >= per_host
        result = _verify(fresh_db_url, cp)
        assert result.ok, result.message()
        assert result.checkpoints == len(records)
    # each multiple of 7 made the host that wrote it sign the head as it found it after committing
    auto = [r["seq"] for cp in cps for r in _lines(cp) if r["reason"] == "every 7 events"]
    assert len(auto) == total // 7 and all(seq >= 7 for seq in auto)
