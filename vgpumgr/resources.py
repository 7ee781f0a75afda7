"""Data directories shipped inside the vgpumgr package (`migrations/`, `xml_templates/`, `systemd/`).

They are found next to the package's own files (what importlib.resources gives for a package on disk, without
importing it: ~3 ms of every start), so an installed wheel needs nothing from a source tree. In a
checkout `vgpumgr/migrations`, `vgpumgr/xml_templates` and `vgpumgr/systemd` are symlinks to the top-level
directories (`systemd` to `scripts/systemd`); setuptools copies what they point to into the wheel.
"""

from __future__ import annotations

from pathlib import Path

from vgpumgr.errors import Unavailable

DATA_DIRS = ("migrations", "xml_templates", "systemd", "guest")


def data_dir(name: str) -> Path:
    """The directory `name` of the installed package, as a real path (Alembic and lxml read files by path)."""
    if name not in DATA_DIRS:
        raise ValueError(f"unknown data directory {name!r}")
    found = Path(__file__).parent / name
    if not found.is_dir():
        raise Unavailable(f"vgpumgr's {name}/ directory is missing from the installed package ({found})",
                          hint="reinstall vgpumgr (pip install vgpumgr-*.whl); it cannot run from a zip archive")
    return found
