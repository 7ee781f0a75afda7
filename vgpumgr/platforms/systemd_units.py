"""The systemd units shipped in the package (scripts/systemd/ in the checkout), rendered for this install."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from vgpumgr.errors import InvalidInput, NotFound
from vgpumgr.resources import data_dir

UNITS = ("vgpumgr.socket", "vgpumgr.service", "vgpumgr-restore.service")
PLACEHOLDER = "/usr/local/bin/vgpumgr"  # the path the shipped files name (pip install as root on Debian)
DEFAULT_DEST = "/etc/systemd/system"
# what systemd takes literally in ExecStart= (no spaces, quotes, %-specifiers or escapes)
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._+/-]+$")


def default_executable() -> Path | None:
    """The `vgpumgr` entry point of this installation: the running script, else the one beside the
    interpreter (a venv's bin/), else the one on PATH."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "vgpumgr" and argv0.is_file():
        return argv0.absolute()
    beside = Path(sys.executable).with_name("vgpumgr")
    if beside.is_file():
        return beside
    found = shutil.which("vgpumgr")
    return Path(found).absolute() if found else None


def check_executable(path: Path | str | None) -> Path:
    if path is None:
        raise NotFound("cannot find the vgpumgr executable of this installation", hint="pass --bin /path/to/vgpumgr")
    p = Path(path)
    if not _SAFE_PATH.match(str(p)):
        raise InvalidInput(f"'{str(p)[:200]}' cannot be used in a unit's ExecStart=",
                           hint="give an absolute path of letters, digits and ._+-/ only (--bin)")
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise NotFound(f"{p} is not an executable file", hint="pass --bin with the path of the vgpumgr command")
    return p


def render(name: str, executable: Path) -> str:
    """A unit's text with ExecStart= and ExecStartPre= naming `executable`."""
    if name not in UNITS:
        raise NotFound(f"no unit named {name}", hint="units: " + ", ".join(UNITS))
    return (data_dir("systemd") / name).read_text().replace(PLACEHOLDER, str(executable))


def install(dest: Path | str, executable: Path) -> list[Path]:
    """Write every unit into `dest` (each file replaced atomically); returns the paths written."""
    d = Path(dest)
    if not d.is_dir():
        raise NotFound(f"{d} is not a directory", hint=f"create it first, or use the default {DEFAULT_DEST}")
    texts = {name: render(name, executable) for name in UNITS}  # all read before anything is written
    written = []
    for name, text in texts.items():
        target = d / name
        tmp = d / f".{name}.tmp"
        try:
            tmp.write_text(text)
            tmp.chmod(0o644)
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise InvalidInput(f"cannot write {target}: {exc.strerror}",
                               hint="run as root, or choose a writable directory with --dest") from exc
        written.append(target)
    return written
