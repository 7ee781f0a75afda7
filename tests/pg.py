"""A throwaway PostgreSQL server for the database tests, built from Debian's postgresql packages.

The server lives in a temp dir, listens only on a unix socket in that dir, and runs as the
`postgres` user when the tests run as root (postgres refuses to run as root). Durability is off:
it is thrown away at the end.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"
PG_USER = "postgres"


class PgUnavailable(RuntimeError):
    """Why no server could be started (the caller skips the PostgreSQL tests with this text)."""


def find_bindir(install: bool = True) -> Path:
    candidates = sorted(glob.glob(PG_BIN_GLOB), key=lambda p: int(Path(p).parent.name.split(".")[0]))
    if candidates:
        return Path(candidates[-1])
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        proc = subprocess.run(["apt-get", "install", "-y", "-q", "postgresql"], capture_output=True,
                              text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if proc.returncode == 0:
            return find_bindir(install=False)
        raise PgUnavailable(f"apt-get install postgresql failed: {proc.stderr.strip()[-300:]}")
    raise PgUnavailable(f"no PostgreSQL binaries under {PG_BIN_GLOB} (install the postgresql package)")


class PgServer:
    def __init__(self) -> None:
        self.bindir = find_bindir()
        self.as_root = os.geteuid() == 0
        self.dir = Path(tempfile.mkdtemp(prefix="vgpumgr-pg-"))
        self.data = self.dir / "data"
        self.started = False
        if self.as_root:
            try:
                pw = pwd.getpwnam(PG_USER)
            except KeyError as exc:
                raise PgUnavailable(f"running as root but there is no '{PG_USER}' user") from exc
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.user = PG_USER

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / argv[0]), *argv[1:]]
        if self.as_root:
            cmd = ["runuser", "-u", PG_USER, "--", *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=self.dir, timeout=120)
        if proc.returncode != 0:
            output = (proc.stderr or proc.stdout).strip()[-500:]
            raise PgUnavailable(f"{argv[0]} failed ({proc.returncode}): {output}")
        return proc

    def start(self) -> PgServer:
        self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8",
                  "--no-sync", "--locale=C")
        self._pg_ctl_start()
        return self

    def _pg_ctl_start(self) -> None:
        opts = (f"-c listen_addresses='' -c unix_socket_directories='{self.dir}' -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=100")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-o", opts, "-w", "-t", "60",
                  "start")
        self.started = True

    def restart(self) -> None:
        """Stop (closing every client connection) and start again, keeping the data."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        self._pg_ctl_start()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@/{database}?host={self.dir}"

    def create_database(self, prefix: str = "t") -> str:
        """A new empty database; returns its URL."""
        from sqlalchemy import create_engine

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        engine = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        finally:
            engine.dispose()
        return self.url(name)

    def stop(self) -> None:
        try:
            if self.started:
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except PgUnavailable:
            pass
        finally:
            self.started = False
            shutil.rmtree(self.dir, ignore_errors=True)
