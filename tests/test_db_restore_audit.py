"""`db restore` on a simulated host (issue 45): the backup compared with the host before anything changes, and the
restore a signed fact in the checkpoint file that `audit verify` understands; a cut without one stays broken."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from simhost import make, run

from vgpumgr.audit.key import canonical, signed_bytes

VERIFIER = Path(__file__).resolve().parents[1] / "scripts" / "verify-audit-export"


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setenv("VGPUMGR_LICENCE_MODE", "off")
    monkeypatch.setenv("VGPUMGR_AUDIT_SYSLOG_SOCKET", "")
    root = make(tmp_path, "t4").root
    base = ["--sysfs-root", str(root), "--state-dir", str(tmp_path / "state")]

    def call(*argv: str) -> tuple[int, str, str]:
        return run(*base, *argv)

    call.state = tmp_path / "state"  # type: ignore[attr-defined]
    call.backup = tmp_path / "backup.db"  # type: ignore[attr-defined]
    return call


def vgpu(host, vm: str) -> str:  # noqa: ANN001
    rc, out, err = host("vgpu", "--type", "T4-4Q", "--vm", vm, "--json")
    assert rc == 0, err
    return json.loads(out)["uuid"]


def the_issues_sequence(host) -> list[str]:  # noqa: ANN001
    """Two vGPUs, a backup, two more, a checkpoint at the head: the UUIDs of the two made after the backup."""
    vgpu(host, "a"), vgpu(host, "b")
    assert host("db", "backup", str(host.backup))[0] == 0
    later = [vgpu(host, "c"), vgpu(host, "d")]
    rc, out, err = host("audit", "verify")
    assert rc == 0 and "checkpoint 1 written: event 8" in out, out + err
    return later


def settle(host) -> None:  # noqa: ANN001
    """What the restore's listing tells the operator to do: the vGPUs nobody recorded removed."""
    rc, out, err = host("reconcile", "--fix", "--remove-unknown")
    assert rc == 0 and "devices nobody recorded: 2" in out, out + err


def db(host) -> Path:  # noqa: ANN001
    return host.state / "vgpumgr.db"


def cut_to(path: Path, seq: int) -> None:
    """What someone who writes the database does: the tail gone, the head rewritten to match."""
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("DELETE FROM audit_events WHERE seq > ?", (seq,))
        conn.execute("UPDATE audit_head SET seq = ?, hash = (SELECT hash FROM audit_events WHERE seq = ?)",
                     (seq, seq))
        conn.commit()


def test_restore_lists_the_hosts_extra_vgpus_first_and_verify_names_the_restore(host) -> None:  # noqa: ANN001
    later = the_issues_sequence(host)
    rc, out, err = host("db", "restore", "--dry-run", str(host.backup))
    assert rc == 0, err
    assert "vGPUs on the host that the backup does not record: 2" in out and all(u in out for u in later)
    assert "VMs recorded now that the backup does not know: 2" in out and "`reconcile --fix --remove-unknown`" in out
    assert "restored" not in out and not (host.state / "vgpumgr.db.before-restore").exists()
    assert len(json.loads(host("placements", "--json")[1])) == 4  # nothing changed
    rc, out, err = host("db", "restore", str(host.backup))
    assert rc == 0, err
    assert out.index(later[0]) < out.index("restored ") and "signed checkpoint 2: the chain now ends at event 4" in out
    assert {a["vm"] for a in json.loads(host("placements", "--json")[1])} == {"a", "b"}
    rc, out, err = host("audit", "verify")
    assert rc == 0, out + err
    kept = host.state / "vgpumgr.db.before-restore"
    assert f"restored from {host.backup}" in out and f"events 5–8 kept in {kept}" in out
    assert "verified against 1 checkpoint(s)" in out and "checkpoint 3 written: event 4" in out
    settle(host)
    vgpu(host, "e")  # the chain goes on, and so do the checkpoints
    rc, out, err = host("audit", "verify", "--json")
    report = json.loads(out)
    assert rc == 0 and report["checkpoint"]["seq"] == report["head_seq"] > 4, out + err
    [restore] = report["checkpoints"]["restores"]
    assert restore["seq"] == 4 and restore["kept_events"] == [5, 8] and restore["kept"] == str(kept)
    bundle = host.state.parent / "export.json"  # a third party's verifier: the cut events are not in the bundle
    assert host("audit", "export", "--output", str(bundle))[0] == 0
    p = subprocess.run([sys.executable, str(VERIFIER), str(bundle)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "1 checkpoint(s) cover events a signed `db restore` cut" in p.stdout, p.stdout


def test_a_tail_cut_after_a_restore_is_still_broken(host) -> None:  # noqa: ANN001
    the_issues_sequence(host)
    assert host("db", "restore", str(host.backup))[0] == 0
    settle(host)
    vgpu(host, "e")
    rc, out, _ = host("audit", "verify", "--json")
    head = json.loads(out)["checkpoint"]["seq"]
    assert rc == 0 and head > 5
    cut_to(db(host), 5)
    rc, out, _ = host("audit", "verify")
    assert rc == 9 and "truncated: the database ends at event 5" in out and "no checkpoint written" in out
    cut_to(db(host), 3)  # below the restore's own cut
    rc, out, _ = host("audit", "verify")
    assert rc == 9 and re.search(r"checkpoint 2 \(line 2, event 4\): truncated", out), out


def test_a_cut_without_a_signed_record_or_with_a_forged_one_is_broken(host) -> None:  # noqa: ANN001
    the_issues_sequence(host)
    with closing(sqlite3.connect(host.backup)) as src, closing(sqlite3.connect(db(host))) as live:
        src.backup(live)  # the backup put in place by hand: no record
    rc, out, _ = host("audit", "verify")
    assert rc == 9 and "truncated: the database ends at event 4" in out
    import base64

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    path = host.state / "audit-checkpoints.jsonl"
    genuine = json.loads(path.read_text().splitlines()[-1])
    forged = {**genuine, "n": 2, "seq": 4, "reason": "restore", "restore": {
        "backup": str(host.backup), "backup_sha256": "0" * 64, "kept": str(host.backup), "kept_seq": 8,
        "kept_hash": genuine["hash"]}}
    forged["sig"] = base64.b64encode(Ed25519PrivateKey.generate().sign(signed_bytes(forged))).decode()
    path.write_text(path.read_text() + canonical(forged).decode() + "\n")
    rc, out, _ = host("audit", "verify")
    assert rc == 9 and "checkpoint 2 (line 2, event 4): signature: the signature does not match" in out
    assert "truncated: the database ends at event 4" in out and "restored from" not in out


def test_a_genuine_record_altered_or_its_kept_file_gone_is_broken(host) -> None:  # noqa: ANN001
    the_issues_sequence(host)
    assert host("db", "restore", str(host.backup))[0] == 0
    path = host.state / "audit-checkpoints.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines[:-1], lines[-1].replace('"kept_seq":8', '"kept_seq":7')]) + "\n")
    rc, out, _ = host("audit", "verify")
    assert rc == 9 and "signature does not match" in out and "truncated" in out
    path.write_text("\n".join(lines) + "\n")
    assert host("audit", "verify")[0] == 0
    (host.state / "vgpumgr.db.before-restore").unlink()
    rc, out, _ = host("audit", "verify")
    assert rc == 9 and "kept: " in out and "which keeps events 5–8, is gone" in out


def test_a_restore_whose_record_cannot_be_written_is_undone(host, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from vgpumgr.audit.checkpoints import Checkpointer
    from vgpumgr.errors import Unavailable

    the_issues_sequence(host)

    def refuse(*_a: object, **_k: object) -> None:
        raise Unavailable("cannot write the audit checkpoint", hint="run as the owner of the state directory")

    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "write_restore", refuse)
        rc, _, err = host("db", "restore", str(host.backup))
    assert rc == Unavailable.exit_code and "cannot write the audit checkpoint" in err
    assert len(json.loads(host("placements", "--json")[1])) == 4  # the database it would have replaced is back
    assert not (host.state / "vgpumgr.db.before-restore").exists()
    assert host("audit", "verify")[0] == 0


def test_a_forced_restore_of_a_broken_backup_is_recorded_and_stays_broken(host) -> None:  # noqa: ANN001
    the_issues_sequence(host)
    with closing(sqlite3.connect(host.backup)) as conn:
        conn.execute("UPDATE audit_events SET actor = 'someone-else' WHERE seq = 1")
        conn.commit()
    rc, out, err = host("db", "restore", "--force", str(host.backup))
    assert rc == 0 and "audit chain NOT verified (--force)" in out and "signed checkpoint 2" in out, out + err
    rc, out, _ = host("audit", "verify")
    assert rc == 9 and "event 1: altered" in out
