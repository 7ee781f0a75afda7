#!/usr/bin/env python3
"""Write tests/fixtures/schema/<revision>.sql: an SQLite database populated by vgpumgr's own commands on a
simulated mixed host (mdev and vendor-VF vGPUs in VMs, a MIG-backed one, a licence pool with seats taken, API
tokens, a cordon, the fleet's rows, the audit chain of all of it), taken at this release's head revision and then
at every earlier revision by downgrading one step at a time. tests/test_schema_upgrades.py upgrades each to head.
Run it again after a new migration (the existing files stay valid: only the new head's file is added).

    .venv/bin/python scripts/make_schema_fixtures.py
"""

from __future__ import annotations

import io
import os
import sqlite3
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests/fixtures/schema"


def populate(tmp: Path) -> str:
    from vgpumgr.cli.main import main

    root, state = tmp / "host", tmp / "state"
    url = f"sqlite:///{state / 'vgpumgr.db'}"
    os.environ.update(VGPUMGR_SYSFS_ROOT=str(root), VGPUMGR_STATE_DIR=str(state), VGPUMGR_DB=url,
                      VGPUMGR_HOSTNAME="fixture-host", VGPUMGR_LIBVIRT_URI="test:///default", VGPUMGR_FLEET_PUBLISH="1")
    steps = [["sim", "create", str(root), "--profile", "mixed"],
             ["license", "add", "lab-vws", "--edition", "vWS", "--seats", "10"],
             ["vm", "create", "web1", "--vgpu", "T4-4Q"],
             ["vm", "create", "cad1", "--vgpu", "L40S-2Q"],
             ["vm", "create", "ml1", "--mig", "1g.10gb"],
             ["vgpu", "--type", "T4-4Q", "--vm", "later"],
             ["token", "create", "--name", "hook", "--role", "hook"],
             ["host", "cordon", "--reason", "fixture"],
             ["fleet", "publish"]]
    for argv in steps:
        err = io.StringIO()
        rc = main(argv, io.StringIO(), err)
        if rc != 0:
            raise SystemExit(f"vgpumgr {' '.join(argv)} exited {rc}: {err.getvalue()}")
    return url


def main() -> int:
    from vgpumgr.db import schema, session, snapshot

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as t:
        url = populate(Path(t))
        path = url.removeprefix("sqlite:///")
        chain = [s.revision for s in schema.steps()]
        for i in range(len(chain) - 1, -1, -1):
            session.dispose_engines()
            conn = sqlite3.connect(path)
            try:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                text = snapshot.dump(conn, chain[i])
            finally:
                conn.close()
            target = OUT / f"{chain[i]}.sql"
            target.write_text(text, encoding="utf-8")
            print(f"wrote {target.relative_to(REPO)} ({len(snapshot.statements(text)[1])} statements)")
            if i:
                session.downgrade(url, chain[i - 1])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
