# ---- database fixtures (owner: db/audit/licensing; others append their fixtures below this block) ----
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def pg_server() -> Iterator[object]:
    """A private PostgreSQL server for the whole run, or a skip saying why it cannot start."""
    from pg import PgServer, PgUnavailable

    try:
        server = PgServer().start()
    except PgUnavailable as exc:
        print(f"\nPostgreSQL tests skipped: {exc}", file=sys.stderr)
        pytest.skip(f"PostgreSQL unavailable: {exc}")
    yield server
    from vgpumgr.db.session import dispose_engines
    from vgpumgr.fleet import follow

    follow.settle_all()  # the summaries the run's services left to their followers, while the server runs
    dispose_engines()
    server.stop()


@pytest.fixture(scope="session")
def db_tmpdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="vgpumgr-db-") as d:
        yield Path(d)


def _new_empty_url(backend: str, request: pytest.FixtureRequest, tmpdir: Path) -> str:
    if backend == "sqlite":
        fd, path = tempfile.mkstemp(suffix=".db", dir=tmpdir)
        os.close(fd)
        os.unlink(path)
        return f"sqlite:///{path}"
    return request.getfixturevalue("pg_server").create_database()


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def db_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def db_url(db_backend: str, request: pytest.FixtureRequest, db_tmpdir: Path) -> str:
    """A database migrated to head, shared by the whole run (use unique host/VM names per test)."""
    from vgpumgr.db.session import upgrade

    url = _new_empty_url(db_backend, request, db_tmpdir)
    upgrade(url)
    return url


@pytest.fixture
def empty_db_url(db_backend: str, request: pytest.FixtureRequest, db_tmpdir: Path) -> str:
    """A fresh database with no tables at all, on the same backend as db_url."""
    from vgpumgr.db.session import dispose_engine

    url = _new_empty_url(db_backend, request, db_tmpdir)
    request.addfinalizer(lambda: dispose_engine(url))
    return url


@pytest.fixture
def fresh_db_url(empty_db_url: str) -> str:
    """A fresh database migrated to head (for tests that must see only their own rows)."""
    from vgpumgr.db.session import upgrade

    upgrade(empty_db_url)
    return empty_db_url


@pytest.fixture
def db_session(db_url: str) -> Iterator[object]:
    from vgpumgr.db.session import session_factory

    with session_factory(db_url)() as session:
        yield session
# ---- end of database fixtures ----
