"""mdevctl's persistent definitions, read and written: `<dir>/<parent>/<uuid>` holding
`{"mdev_type": TYPE, "start": "auto"|"manual", "attrs": [{"name": "value"}, ...]}` (mdevctl's default dir is
/etc/mdevctl.d, which also holds its own `scripts.d/`).

Export writes one file per live mdev record, so mdevctl (and libvirt's node devices, which call it) see
vgpumgr's devices; import turns a host's definitions into vgpumgr records, so a host that used mdevctl keeps
its devices when it switches. A definition names no VM: imported records belong to none.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpumgr import ids
from vgpumgr.errors import Conflict, InvalidInput, NotFound
from vgpumgr.model import BACKEND_MDEV

START_VALUES = ("auto", "manual")
OWN_DIRS = ("scripts.d",)  # mdevctl's callouts and notifiers live beside the definitions


@dataclass(frozen=True)
class Definition:
    parent: str
    uuid: str
    mdev_type: str
    start: str = "auto"
    attrs: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"mdev_type": self.mdev_type, "start": self.start, "attrs": self.attrs}


def _attrs(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not all(
            isinstance(a, dict) and len(a) == 1 and all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in a.items()) for a in value):
        raise InvalidInput(f"{where}: \"attrs\" must be a list of one-key objects with string values",
                           hint='e.g. "attrs": [{"assign_adapter": "5"}]')
    return [dict(a) for a in value]


def parse(text: str, parent: str, uuid: str, where: str) -> Definition:
    """One definition file's text, checked as mdevctl would need it."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InvalidInput(f"{where} is not JSON: {e}", hint="fix or remove the file") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{where} is not a JSON object", hint="fix or remove the file")
    mdev_type, start = data.get("mdev_type"), data.get("start")
    if not isinstance(mdev_type, str):
        raise InvalidInput(f"{where} has no \"mdev_type\" string", hint="mdevctl needs the device's type")
    if start not in START_VALUES:
        raise InvalidInput(f"{where}: \"start\" is {start!r}", hint="use \"auto\" or \"manual\"")
    return Definition(parent=parent, uuid=uuid, mdev_type=ids.type_dir(mdev_type), start=start,
                      attrs=_attrs(data.get("attrs", []), where))


def read_all(directory: Path) -> list[Definition]:
    """Every definition under `directory`, all checked before any is returned (nothing half-imported)."""
    if not directory.is_dir():
        raise NotFound(f"no mdevctl definitions directory {directory}", hint="pass --dir DIR")
    found = []
    for pdir in sorted(directory.iterdir()):
        if pdir.name in OWN_DIRS or not pdir.is_dir():
            continue
        try:
            parent = ids.parent_name(pdir.name)
        except InvalidInput:
            raise InvalidInput(f"{pdir} is not named after an mdev parent",
                               hint="definitions live in <dir>/<parent PCI address>/<uuid>") from None
        for f in sorted(pdir.iterdir()):
            if f.name.startswith(".") or not f.is_file():
                continue  # an editor's or our own temporary file
            try:
                uuid = ids.mdev_uuid(f.name)
            except InvalidInput:
                raise InvalidInput(f"{f} is not named after an mdev UUID",
                                   hint="definitions live in <dir>/<parent>/<uuid>") from None
            found.append(parse(f.read_text(), parent, uuid, str(f)))
    return found


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".vgpumgr-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def render(d: Definition) -> str:
    return json.dumps(d.to_json(), indent=2) + "\n"


def definitions_of(records: list[dict[str, Any]]) -> list[Definition]:
    """The definitions of vgpumgr's live mdev records (start and attrs from an import, else auto and none)."""
    out = []
    for a in records:
        if a["backend"] != BACKEND_MDEV or not a.get("uuid"):
            continue
        extra = a.get("mdevctl") or {}
        out.append(Definition(parent=ids.parent_name(a["parent"]), uuid=ids.mdev_uuid(a["uuid"]),
                              mdev_type=ids.type_dir(a["type"]), start=extra.get("start", "auto"),
                              attrs=list(extra.get("attrs", []))))
    return out


def export(definitions: list[Definition], directory: Path) -> dict[str, list[str]]:
    """Write each definition to `directory`/<parent>/<uuid>; files already saying the same are left alone."""
    written, unchanged = [], []
    for d in definitions:
        path = directory / d.parent / d.uuid
        text = render(d)
        try:
            if path.read_text() == text:
                unchanged.append(str(path))
                continue
        except FileNotFoundError:
            pass
        except OSError as e:
            raise InvalidInput(f"cannot read {path}: {e.strerror}") from None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, text)
        except OSError as e:
            from vgpumgr.userinput import files

            raise files.refusal(e, path, "write") from None
        written.append(str(path))
    return {"written": written, "unchanged": unchanged}


def check_importable(definitions: list[Definition], recorded: dict[str, dict[str, Any]]) -> None:
    """Refuse the whole import when a definition contradicts a live record of the same UUID."""
    clashes = [f"{d.uuid} ({d.mdev_type} on {d.parent}; recorded as {r['type']} on {r['parent']})"
               for d in definitions if (r := recorded.get(d.uuid)) is not None
               and (r["backend"] != BACKEND_MDEV or r["parent"] != d.parent or r["type"] != d.mdev_type)]
    if clashes:
        raise Conflict("mdevctl definitions contradict vgpumgr's records: " + "; ".join(clashes),
                       hint="release the record (`vgpumgr release UUID`) or fix the definition, then import again")
