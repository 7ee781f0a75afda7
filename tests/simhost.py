"""Helpers for tests that need a simulated host."""

from __future__ import annotations

import io
from pathlib import Path

from vgpumgr.cli.main import main
from vgpumgr.hostfs.root import Host
from vgpumgr.sim import profiles


def make(tmp_path: Path, profile: str, **kw: object) -> Host:
    return Host(profiles.create(tmp_path / f"sim-{profile}", profile, **kw))


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), out=out, err=err)
    return rc, out.getvalue(), err.getvalue()
