"""The README's install lines and its rolling-upgrade lines, run as written (only /opt/vgpumgr moved into a
temporary directory, systemd's lines left out), in a fresh venv whose dependencies pip takes from the package
index under constraints.txt, against a real PostgreSQL through the README's `postgresql://` URL: what a new user
does. (This is the test that would have caught `postgresql://` needing a driver nothing installed.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import wheels

from vgpumgr.sim import profiles

pytestmark = pytest.mark.postgres

README = wheels.REPO / "README.md"


def block_after(heading: str) -> list[str]:
    """The command lines of the first ```sh block after `heading`, comments and continuations joined."""
    text = README.read_text()
    start = text.index(heading)
    body = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert body, f"no sh block after {heading}"
    lines = []
    for raw in body.group(1).splitlines():
        line = re.sub(r"\s+# .*$", "", raw).strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def test_readme_install_and_upgrade_lines_work_as_written(tmp_path: Path, pg_server: object) -> None:
    if shutil.which("pg_dump") is None:
        pytest.skip("pg_dump is not installed (Debian's postgresql-client)")
    opt = tmp_path / "opt-vgpumgr"
    src = wheels.copy_sources(tmp_path / "src")
    shutil.copy(wheels.REPO / "constraints.txt", src / "constraints.txt")
    root = profiles.create(tmp_path / "host", "t4")  # the host the commands run on (a real host: / itself)
    db = pg_server.create_database("readme")  # type: ignore[attr-defined]
    assert db.startswith("postgresql://")  # the README's URL form, no driver named
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPUMGR_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{opt}/bin:{env['PATH']}", HOME=str(tmp_path), VGPUMGR_DB=db, VGPUMGR_SYSFS_ROOT=str(root),
               VGPUMGR_STATE_DIR=str(tmp_path / "state"), VGPUMGR_LIBVIRT_URI="test:///default",
               PIP_DISABLE_PIP_VERSION_CHECK="1")

    def sh(line: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        line = line.replace("/opt/vgpumgr", str(opt))
        p = subprocess.run(["bash", "-c", line], cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, f"README line failed ({p.returncode}): {line}\n{p.stdout}\n{p.stderr}"
        return p

    install = block_after("**With pip**")  # the package's lines: tests/deb/test_package.py
    ran = [sh(line) for line in install if not line.startswith(("systemctl", "/opt/vgpumgr/bin/vgpumgr install-units"))]
    assert len(ran) == 2 and "database at revision" in ran[-1].stdout  # the venv + pip line, then db upgrade
    freeze = subprocess.run([str(opt / "bin/pip"), "freeze"], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^psycopg==", freeze, re.M) and not re.search(r"^psycopg2", freeze, re.M)

    upgrade = block_after("The rolling upgrade, on each host in turn")
    assert any("upgrade check" in line for line in upgrade) and any("db upgrade" in line for line in upgrade)
    for line in upgrade:
        if not line.startswith("systemctl"):
            sh(line)
    assert (src / "vgpumgr-before-upgrade.dump").stat().st_size > 0
    sh("/opt/vgpumgr/bin/vgpumgr db upgrade --contract")
    hosts = sh("/opt/vgpumgr/bin/vgpumgr fleet publish && /opt/vgpumgr/bin/vgpumgr fleet hosts").stdout
    assert "VGPUMGR" in hosts and " ok " in hosts, hosts

    # a driver that is not installed, a server that is not there: exit 8 with the reason, not a traceback
    for url, words in ((db.replace("postgresql://", "postgresql+psycopg2://"), "psycopg2"),
                       (f"postgresql://nobody@/x?host={tmp_path}/nothing", "cannot use the database")):
        p = subprocess.run([str(opt / "bin/vgpumgr"), "--db", url, "placements"], env=env, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 8 and words in p.stderr and "hint:" in p.stderr, p.stderr
