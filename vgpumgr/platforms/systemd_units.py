"""The systemd units shipped in the package (scripts/systemd/ in the checkout), rendered for this install."""

from __future__ import annotations

import os
import re
import shutil
import stat
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

    try:
        executable = stat.S_ISREG(os.stat(p).st_mode) and os.access(p, os.X_OK)
    except OSError:
        executable = False
    if not executable:
        raise NotFound(f"{p} is not an executable file", hint="pass --bin with the path of the vgpumgr command")
    return p


def render(name: str, executable: Path) -> str:
    """A unit's text with ExecStart= and ExecStartPre= naming `executable`."""
    if name not in UNITS:
        raise NotFound(f"no unit named {name}", hint="units: " + ", ".join(UNITS))
    return (data_dir("systemd") / name).read_text().replace(PLACEHOLDER, str(executable))


def install(dest: Path | str, executable: Path) -> list[Path]:
    """Write every unit into `dest` (each file replaced atomically); returns the paths written."""
    from vgpumgr.userinput import files

    d = files.checked_path(dest, "--dest")
    if not files.is_dir(d, "--dest"):
        raise NotFound(f"{d} is not a directory", hint=f"create it first, or use the default {DEFAULT_DEST}")
    texts = {name: render(name, executable) for name in UNITS}  # all read before anything is written
    written = []
    for name, text in texts.items():
        written.append(files.write(d / name, text.encode(), what="a systemd unit", mode=0o644))
    return written
