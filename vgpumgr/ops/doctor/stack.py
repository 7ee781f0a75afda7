"""Section "libvirt, QEMU and database": libvirt reachable and its version, QEMU's version, the database
reachable, its schema against this vgpumgr, its encoding."""

from __future__ import annotations

from vgpumgr.ops.doctor.facts import Facts
from vgpumgr.ops.doctor.records import database
from vgpumgr.ops.doctor.report import Section

TITLE = "libvirt, QEMU and database"


def _version(n: int) -> str:
    return f"{n // 1000000}.{n // 1000 % 1000}.{n % 1000}"


def libvirt(s: Section, f: Facts) -> None:
    from vgpumgr.errors import VgpuError
    from vgpumgr.virt.driver import Virt

    try:
        with Virt(f.cfg.libvirt_uri, state_dir=f.cfg.state_dir) as v:
            lib, hv, kind = v.conn.getLibVersion(), v.conn.getVersion(), v.conn.getType()
    except VgpuError as e:
        s.fail("libvirt", "libvirt reachable", e.message, hint=e.hint or "start libvirtd or virtqemud.socket")
        return
    except Exception as e:  # noqa: BLE001 - libvirt's own errors: what it said is the finding
        s.fail("libvirt", "libvirt reachable", f"{f.cfg.libvirt_uri}: {e}",
               hint="`systemctl start libvirtd` (or virtqemud.socket); check --connect / VGPUMGR_LIBVIRT_URI")
        return
    s.pass_("libvirt", "libvirt reachable", f"{f.cfg.libvirt_uri}: libvirt {_version(lib)}")
    if kind.upper() == "QEMU":
        s.pass_("qemu", "QEMU version", f"QEMU {_version(hv)}")
    else:
        s.note("qemu", "QEMU version", f"the {kind} driver answers (hypervisor {_version(hv)}), not QEMU",
               hint="connect to qemu:///system on a real host (--connect)")


def db(s: Section, f: Facts) -> None:
    d = database(f.cfg)
    where = f"{d['dialect']}"
    if not d["reachable"]:
        s.fail("db", "database reachable", d["error"], hint=d["hint"] or "check VGPUMGR_DB / --db")
        return
    if d["verdict"] == "none":
        s.note("db", "database schema", f"{where}: no schema yet",
               hint="made at the first command that records (SQLite) or by `vgpumgr db upgrade` (PostgreSQL)")
    elif d["verdict"] == "mismatch":
        s.fail("db", "database schema", d["error"], hint=d["hint"])
    elif d["verdict"] == "upgrade":
        s.note("db", "database schema", f"{where} at {d['revision']}: upgraded at the next command",
               hint="any vgpumgr command that records upgrades SQLite itself")
    else:
        s.pass_("db", "database schema", f"{where} at {d['revision']}")
    enc = d["encoding"]
    if enc and enc.upper() not in ("UTF8", "UTF-8"):
        s.warn("db.encoding", "database encoding", f"server encoding {enc}: names are kept as ASCII only",
               hint="create the database with `createdb -E UTF8 -T template0 NAME` and move the data there")
    elif enc:
        s.pass_("db.encoding", "database encoding", enc)


CHECKS = (libvirt, db)
