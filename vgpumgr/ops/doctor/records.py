"""The database as `doctor` sees it: reachable, its schema against this vgpumgr, its encoding, and the boot
records of this host (read with plain SQL and without a write lock: the doctor changes nothing)."""

from __future__ import annotations

import json
from typing import Any

from vgpumgr.config import Config


def _sqlite_missing(cfg: Config) -> bool:
    if not cfg.db_url.startswith("sqlite:///"):
        return False
    from pathlib import Path

    return not Path(cfg.db_url.removeprefix("sqlite:///")).exists()


def database(cfg: Config) -> dict[str, Any]:
    """{"reachable", "dialect", "revision", "contract_level", "encoding", "verdict", "error", "hint"}."""
    from vgpumgr.db import schema
    from vgpumgr.db.session import get_engine, stored_state
    from vgpumgr.errors import VgpuError

    out: dict[str, Any] = {"reachable": False, "dialect": cfg.db_url.split(":", 1)[0], "revision": None,
                           "contract_level": 0, "encoding": None, "verdict": None, "error": None, "hint": None}
    if _sqlite_missing(cfg):
        out.update(reachable=True, verdict="none")
        return out
    try:
        state = stored_state(cfg.db_url)
        engine = get_engine(cfg.db_url)
        out.update(reachable=True, dialect=engine.dialect.name)
        if engine.dialect.name == "postgresql":
            from vgpumgr.db.session import server_encoding

            out["encoding"] = server_encoding(engine)
    except VgpuError as e:
        out.update(error=e.message, hint=e.hint)
        return out
    if state is None:
        out["verdict"] = "none"
        return out
    out.update(revision=state.revision, contract_level=state.contract_level)
    try:
        out["verdict"] = schema.check(state, dialect=out["dialect"])
    except VgpuError as e:
        out.update(verdict="mismatch", error=e.message, hint=e.hint)
    return out


def boot_states(cfg: Config) -> dict[str, dict[str, Any]] | None:
    """address -> {"numvfs", "mig_enabled", "vgpu_mode", "vendor_state"} recorded for this host; None when the
    database has no such records to read."""
    if _sqlite_missing(cfg):
        return {}
    from sqlalchemy import text

    from vgpumgr.db.session import READ_ONLY, get_engine, stored_state
    from vgpumgr.errors import VgpuError
    from vgpumgr.ops.context import hostname

    try:
        state = stored_state(cfg.db_url)
        if state is None or (state.ordinal or 0) < 13:
            return {}
        with get_engine(cfg.db_url).connect().execution_options(**{READ_ONLY: True}) as conn:
            rows = conn.execute(text(
                "SELECT b.address, b.numvfs, b.mig_enabled, b.vgpu_mode, b.vendor_state FROM gpu_boot_state b "
                "JOIN hosts h ON h.id = b.host_id WHERE h.name = :h"), {"h": hostname()}).all()
    except VgpuError:
        return None
    out = {}
    for address, numvfs, mig, mode, vendor in rows:
        if isinstance(vendor, str):
            vendor = json.loads(vendor)
        out[address] = {"numvfs": numvfs, "mig_enabled": mig, "vgpu_mode": mode, "vendor_state": vendor}
    return out
