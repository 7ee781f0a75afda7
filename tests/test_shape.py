"""The code's shape, as issue 10 set it: the simulator behind a seam, short modules, a stamped schema."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = [p for d in ("vgpumgr", "api") for p in (ROOT / d).rglob("*.py")]
LONG = 400


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_nothing_outside_the_simulator_imports_it() -> None:
    sim = ROOT / "vgpumgr" / "sim"
    offenders = {
        str(p.relative_to(ROOT)): sorted(m for m in _imported_modules(p)
                                         if m == "vgpumgr.sim" or m.startswith("vgpumgr.sim."))
        for p in PRODUCTION if sim not in p.parents
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_sees_an_import_of_the_simulator(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from vgpumgr.sim.kernel import KernelEmulator\n    from vgpumgr import sim\n")
    assert {"vgpumgr.sim.kernel", "vgpumgr.sim"} <= _imported_modules(bad)


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: str(p.relative_to(ROOT)))
def test_long_modules_say_why(path: Path) -> None:
    lines = path.read_text().count("\n")
    if lines <= LONG:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Long because:" in doc, f"{path.name} has {lines} lines and no 'Long because:' in its opening comment"


def test_stamped_schema_revision_is_alembics_head() -> None:
    from vgpumgr.db.session import SCHEMA_REVISION, head_revision

    assert head_revision() == SCHEMA_REVISION


def test_a_simulated_root_names_its_kernel_and_a_plain_tree_gets_the_real_one(tmp_path: Path) -> None:
    from vgpumgr.host import Host, Kernel
    from vgpumgr.sim import profiles

    sim = Host(profiles.create(tmp_path / "sim", "t4"))
    assert sim.simulated and type(sim.kernel).__module__ == "vgpumgr.sim.platform"
    plain = Host(tmp_path / "sim" / "sys")
    assert type(plain.kernel) is Kernel and not plain.simulated


@pytest.mark.parametrize("spec", ["os:system", "vgpumgr.errors:VgpuError", "vgpumgr.host:Host", "../x:Y"])
def test_a_kernel_file_naming_anything_else_is_refused(tmp_path: Path, spec: str) -> None:
    from vgpumgr.errors import InvalidInput
    from vgpumgr.host import KERNEL_FILE, Host

    (tmp_path / KERNEL_FILE).write_text(spec + "\n")
    with pytest.raises(InvalidInput, match="not a vgpumgr kernel"):
        Host(tmp_path)
