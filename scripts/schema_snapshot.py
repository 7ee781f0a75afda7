#!/usr/bin/env python3
"""Write migrations/sqlite-head.sql again from the migrations (after a new or re-chained Alembic revision):
an empty temporary SQLite database brought to head by Alembic, dumped by vgpumgr.db.snapshot.

    .venv/bin/python scripts/schema_snapshot.py
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile

from vgpumgr.db import session, snapshot


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/head.db"
        session.upgrade(url)
        session.dispose_engine(url)
        conn = sqlite3.connect(f"{tmp}/head.db")
        try:
            text = snapshot.dump(conn, session.head_revision() or "")
        finally:
            conn.close()
    snapshot.path().write_text(text, encoding="utf-8")
    print(f"wrote {snapshot.path()} ({len(snapshot.statements(text)[1])} statements)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
