"""The Debian package (scripts/build-deb), installed the way an operator installs it: the README's build line run
as written in a copy of the source tree, the README's `apt install ./vgpumgr_*.deb` run as written in a throw-away
Debian 12 root (an overlay on the root scripts/mdev-lab-systemd builds, entered with chroot, so the maintainer
scripts really run), lintian on the package. Then version N holds a vGPU on a simulated host; N+1 (the same
tree, a bumped version and one more schema revision made for this test) is refused while its `upgrade check`
blocks (a VM runs here and the next boot's kernel differs), with nothing changed; then it installs over N and
keeps every record, the audit chain and the administrator's conffile edit, upgrades the SQLite database and
allocates. `apt remove` keeps the records, `apt purge` deletes them and says so.

Runs as root, outside the main suite: scripts/lab-tests runs it as its "deb" stage (no VM)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import wheels

from vgpumgr.db import schema
from vgpumgr.sim import profiles

LAB_ROOT = Path(os.environ.get("MDEVLAB_SYSTEMD_DIR", "/var/tmp/vgpumgr-mdev-lab-systemd")) / "root"
README = wheels.REPO / "README.md"
SIM = "/srv/simhost"  # the simulated host, inside the throw-away root
DEBS = "/srv/debs"  # where the packages are put in the root (the README's lines run there)
KERNEL = "6.1.0-56-amd64"

EXPAND = '''"""Package test: one more table (the next release's expand step).

Revision ID: {rev}
Revises: {prev}
"""
import sqlalchemy as sa
from alembic import op

revision = "{rev}"
down_revision = "{prev}"
branch_labels = None
depends_on = None
phase = "expand"


def upgrade() -> None:
    op.create_table("package_probe", sa.Column("id", sa.Integer(), primary_key=True))


def downgrade() -> None:
    op.drop_table("package_probe")
'''

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chroot and overlay mounts need root")


def package_lines() -> list[str]:
    """The command lines of the README's package block (the first sh block under "## Installing on a host")."""
    text = README.read_text()
    start = text.index("## Installing on a host")
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert block
    return [re.sub(r"\s+# .*$", "", raw).strip() for raw in block.group(1).splitlines()
            if raw.strip() and not raw.strip().startswith("#")]


def source_copy(dest: Path) -> Path:
    """What scripts/build-deb builds from: the wheel's sources, constraints.txt, the packaging and the script."""
    wheels.copy_sources(dest)
    for name in ("constraints.txt", "scripts/build-deb", "packaging"):
        p = wheels.REPO / name
        if p.is_dir():
            shutil.copytree(p, dest / name)
        else:
            shutil.copy2(p, dest / name)
    return dest


def next_release(src: Path, version: str) -> str:
    """N+1 from a copy of N: a bumped version and one expand revision after this release's head."""
    head, n = schema.SCHEMA_REVISION, schema.code_ordinal() + 1
    rev = f"0{n:03d}_package_probe"
    (src / f"migrations/versions/{rev}.py").write_text(EXPAND.format(rev=rev, prev=head))
    sch = src / "vgpumgr/db/schema.py"
    sch.write_text(sch.read_text().replace(f'SCHEMA_REVISION = "{head}"', f'SCHEMA_REVISION = "{rev}"'))
    py = src / "pyproject.toml"
    py.write_text(re.sub(r'^version = "[^"]+"', f'version = "{version}"', py.read_text(), count=1, flags=re.M))
    return rev


class Chroot:
    """An overlay on the lab's Debian 12 root (tmpfs upper layer) with /proc and /dev, entered with chroot."""

    def __init__(self, base: Path) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="vgpumgr-deb-root-"))
        self.path = self.base / "merged"
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", str(self.base)], check=True)
        for d in ("upper", "work", "merged"):
            (self.base / d).mkdir()
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={base},upperdir={self.base}/upper,workdir={self.base}/work", str(self.path)],
                       check=True)
        subprocess.run(["mount", "-t", "proc", "proc", str(self.path / "proc")], check=True)
        subprocess.run(["mount", "--rbind", "/dev", str(self.path / "dev")], check=True)

    def sh(self, line: str, ok: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
               "DEBIAN_FRONTEND": "noninteractive"}
        p = subprocess.run(["chroot", str(self.path), "/bin/bash", "-c", line], env=env, capture_output=True,
                           text=True, timeout=timeout)
        if ok:
            assert p.returncode == 0, f"in the root: {line}\nexit {p.returncode}\n{p.stdout}\n{p.stderr}"
        return p

    def vgpumgr(self, *argv: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        return self.sh("set -a; . /etc/default/vgpumgr; set +a; vgpumgr " + " ".join(argv), ok=ok)

    def close(self) -> None:
        for m in ("dev", "proc", ""):
            subprocess.run(["umount", "-R", "-l", str(self.path / m)], check=False)
        subprocess.run(["umount", "-l", str(self.base)], check=False)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def root() -> Iterator[Chroot]:
    if not (LAB_ROOT / "usr/bin/deb-systemd-helper").exists():
        subprocess.run([str(wheels.REPO / "scripts/mdev-lab-systemd"), "setup"], check=True, timeout=1800)
    r = Chroot(LAB_ROOT)
    try:
        yield r
    finally:
        r.close()


def test_install_upgrade_refused_upgrade_remove_purge(root: Chroot, tmp_path: Path) -> None:
    lines = package_lines()
    build, install = lines[0], lines[1]
    assert "scripts/build-deb" in build and install == "apt install ./vgpumgr_*.deb", lines
    version = re.search(r'^version = "([^"]+)"', (wheels.REPO / "pyproject.toml").read_text(), re.M).group(1)
    nxt = f"{version}+next1"

    # version N: the README's build line, as written, in a copy of the source tree
    src = source_copy(tmp_path / "src")
    p = subprocess.run(["bash", "-c", build], cwd=src, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr
    deb_n = src / f"vgpumgr_{version}_amd64.deb"
    assert deb_n.exists(), list(src.glob("*.deb"))
    keep = os.environ.get("VGPUMGR_DEB_KEEP")  # scripts/lab-tests boots this package in the systemd lab
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy2(deb_n, keep)
    lint = subprocess.Popen(["lintian", "--fail-on", "error", "--tag-display-limit", "0", str(deb_n)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # N+1, built while N is tested
    src_next = source_copy(tmp_path / "src-next")
    new_rev = next_release(src_next, nxt)
    build_next = subprocess.Popen([str(src_next / "scripts/build-deb"), "--version", nxt, "--out", str(tmp_path)],
                                  cwd=src_next, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # the README's install line, as written, in the root
    (root.path / DEBS.lstrip("/")).mkdir(parents=True)
    shutil.copy(deb_n, root.path / DEBS.lstrip("/"))
    out = root.sh(f"cd {DEBS} && {install}").stdout
    assert "upgrading the SQLite database" in out and "vgpumgr-restore.service runs at every boot" in out, out
    assert os.readlink(root.path / "usr/bin/vgpumgr") == "/opt/vgpumgr/bin/vgpumgr"
    unit = (root.path / "lib/systemd/system/vgpumgr-restore.service").read_text()
    assert "ExecStart=/usr/bin/vgpumgr restore" in unit
    wants = root.path / "etc/systemd/system"
    assert (wants / "multi-user.target.wants/vgpumgr-restore.service").is_symlink()
    assert (wants / "sockets.target.wants/vgpumgr.socket").is_symlink()
    assert "/etc/default/vgpumgr" in root.sh("dpkg-query -W -f='${Conffiles}' vgpumgr").stdout
    assert (root.path / "var/lib/vgpumgr/vgpumgr.db").exists()

    # a simulated host with a kernel, and the administrator's settings in the conffile
    sim = profiles.create(root.path / SIM.lstrip("/"), "t4")
    (sim / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
    (sim / "proc/sys/kernel/osrelease").write_text(KERNEL + "\n")
    (sim / "boot").mkdir(exist_ok=True)
    (sim / f"boot/vmlinuz-{KERNEL}").write_text("")
    with (root.path / "etc/default/vgpumgr").open("a") as f:
        f.write(f"VGPUMGR_SYSFS_ROOT={SIM}\nVGPUMGR_STATE_DIR=/var/lib/vgpumgr\n")
    made = json.loads(root.vgpumgr("vgpu", "--type", "T4-4Q", "--vm", "vm1", "--json").stdout)
    before = json.loads(root.vgpumgr("placements", "--json").stdout)
    assert made["uuid"] in json.dumps(before)
    rev_n = root.vgpumgr("db", "current").stdout.strip()

    out_next, err_next = build_next.communicate(timeout=1200)
    assert build_next.returncode == 0, err_next
    deb_next = Path(out_next.strip().splitlines()[-1])
    shutil.copy(deb_next, root.path / DEBS.lstrip("/"))

    # refused: a VM runs here and the next boot's kernel is another one
    (sim / "boot/vmlinuz-6.12.0-99-amd64").write_text("")
    p = root.sh(f"dpkg -i {DEBS}/{deb_next.name}", ok=False)
    assert p.returncode != 0
    assert "refuses this upgrade" in p.stderr and "nothing was changed" in p.stderr, p.stderr
    assert "6.12.0-99-amd64" in p.stdout + p.stderr and "vm1" in p.stdout + p.stderr
    assert root.sh("dpkg-query -W -f='${Version} ${Status}' vgpumgr").stdout == f"{version} install ok installed"
    assert root.vgpumgr("db", "current").stdout.strip() == rev_n
    assert json.loads(root.vgpumgr("placements", "--json").stdout) == before

    # the kernel question settled: N+1 installs over N
    (sim / "boot/vmlinuz-6.12.0-99-amd64").unlink()
    out = root.sh(f"cd {DEBS} && apt install ./{deb_next.name}").stdout
    assert f"applied {new_rev}" in out, out
    assert root.sh("dpkg-query -W -f='${Version}' vgpumgr").stdout == nxt
    assert root.vgpumgr("db", "current").stdout.strip() == new_rev
    assert f"VGPUMGR_SYSFS_ROOT={SIM}" in (root.path / "etc/default/vgpumgr").read_text()  # the edit kept
    after = json.loads(root.vgpumgr("placements", "--json").stdout)
    assert after == before
    root.vgpumgr("audit", "verify")
    second = json.loads(root.vgpumgr("vgpu", "--type", "T4-4Q", "--vm", "vm2", "--json").stdout)
    assert second["uuid"] != made["uuid"]

    # remove keeps the records and the audit trail; purge deletes them and says what
    out = root.sh("apt-get remove -y vgpumgr").stdout
    assert "records and audit trail stay in /var/lib/vgpumgr" in out, out
    assert not (root.path / "opt/vgpumgr/bin").exists() and not (root.path / "usr/bin/vgpumgr").exists()
    assert (root.path / "var/lib/vgpumgr/vgpumgr.db").exists()
    assert (root.path / "etc/default/vgpumgr").exists()
    out = root.sh("apt-get purge -y vgpumgr").stdout
    assert "purge: removing /var/lib/vgpumgr" in out, out
    assert not (root.path / "var/lib/vgpumgr").exists() and not (root.path / "etc/default/vgpumgr").exists()
    assert not (wants / "multi-user.target.wants/vgpumgr-restore.service").exists()

    lint_out, _ = lint.communicate(timeout=1200)
    errors = [line for line in lint_out.splitlines() if line.startswith("E:")]
    assert lint.returncode == 0 and not errors, lint_out
