"""The package's layers, as issue 42 set them: a folder per concern, each saying what it holds and what it may
import, and no import from a lower layer to a higher one unless it is listed below with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vgpumgr"

# A unit is a folder of vgpumgr/ or a module at its root (or api/). A unit may import its own layer and below.
LAYERS = {
    "errors": 0, "kinds": 0, "ids": 0, "model": 0, "resources": 0, "userinput": 0,
    "hostfs": 1, "config": 1,
    "nvidia": 2, "mig": 2, "guest": 2, "platforms": 2,
    "discovery": 3, "backends": 3, "vendors": 3,
    "placement": 4,
    "db": 5, "audit": 5, "licensing": 5, "virt": 5,
    "ops": 6, "fleet": 6, "telemetry": 6,
    "service": 7,
    "api": 8,
    "cli": 9,
    "sim": 10,
}
# (importer, imported): why the arrow is right. Empty today: every upward import was moved or inverted.
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}
ROOT_MODULES_MAX = 12


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "api":
        return "api"
    if parts[0] != "vgpumgr" or len(parts) < 2:
        return None
    return parts[1]


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def unit_imports(files: list[Path], root: Path) -> set[tuple[str, str, str]]:
    """(importer unit, imported unit, importing module) for every import between two units, lazy ones too."""
    found = set()
    for path in files:
        module = _module_name(path, root)
        mine = unit_of(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                theirs = unit_of(name)
                if name == "vgpumgr" or theirs is None or theirs == mine:
                    continue
                if name.count(".") == 1 and name.startswith("vgpumgr.") and not _exists(root, theirs):
                    continue  # `from vgpumgr.x import name`: x.name is a name, not a module
                found.add((mine, theirs, module))
    return found


def _exists(root: Path, unit: str) -> bool:
    return (root / "vgpumgr" / unit).is_dir() or (root / "vgpumgr" / f"{unit}.py").is_file() or unit == "api"


def upward(imports: set[tuple[str, str, str]], layers: dict[str, int]) -> list[str]:
    return sorted(f"{module} ({mine}, layer {layers[mine]}) imports {theirs} (layer {layers[theirs]})"
                  for mine, theirs, module in imports
                  if layers[theirs] > layers[mine] and (mine, theirs) not in UPWARD_ALLOWED)


def production() -> list[Path]:
    return [p for d in ("vgpumgr", "api") for p in (ROOT / d).rglob("*.py")]


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(_module_name(p, ROOT)) for p in production()}
    assert sorted(u for u in units if u not in LAYERS) == []


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    assert upward(unit_imports(production(), ROOT), LAYERS) == []


def test_the_layer_check_sees_a_planted_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "vgpumgr"
    (pkg / "hostfs").mkdir(parents=True)
    (pkg / "ops").mkdir()
    (pkg / "hostfs" / "root.py").write_text("def f():\n    from vgpumgr.ops.allocate import allocate\n")
    (pkg / "ops" / "allocate.py").write_text("from vgpumgr.hostfs import root\n")
    files = sorted(pkg.rglob("*.py"))
    assert upward(unit_imports(files, tmp_path), LAYERS) == [
        "vgpumgr.hostfs.root (hostfs, layer 1) imports ops (layer 6)"]


def test_every_allowed_upward_import_still_exists_and_says_why() -> None:
    imports = {(mine, theirs) for mine, theirs, _ in unit_imports(production(), ROOT)}
    for pair, why in UPWARD_ALLOWED.items():
        assert pair in imports, f"{pair} is listed as allowed but no longer happens: remove it"
        assert len(why) > 20


def test_the_package_root_keeps_only_what_everything_uses() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= ROOT_MODULES_MAX, modules


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_every_folder_says_what_it_holds_and_what_it_may_import(folder: str) -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
    assert f"Layer {LAYERS[folder]}" in doc, f"vgpumgr/{folder}/__init__.py does not say its layer"
    assert "may import" in doc


def test_every_folder_is_a_package() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.is_symlink() and p.name != "__pycache__"}
    assert sorted(f for f in folders if not (PACKAGE / f / "__init__.py").is_file()) == []
