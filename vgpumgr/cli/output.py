"""Readable tables and JSON for command output."""

from __future__ import annotations

import json
from collections.abc import Sequence

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (~7 ms): see cli/main.py
if TYPE_CHECKING:
    from typing import Any, TextIO


def table(out: TextIO, headers: Sequence[str], rows: Sequence[Sequence[Any]], empty: str = "(none)") -> None:
    if not rows:
        out.write(f"{empty}\n")
        return
    cells = [[("-" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()
    out.write(line + "\n")
    for r in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


def dump_json(out: TextIO, data: Any) -> None:
    """Lists print one object per line (readable, and fast: the C encoder does each object)."""
    if isinstance(data, list):
        out.write("[\n" + ",\n".join("  " + json.dumps(o) for o in data) + ("\n]\n" if data else "]\n"))
        return
    json.dump(data, out, indent=2)
    out.write("\n")
