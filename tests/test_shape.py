"""The code's shape, as issue 10 set it: the simulator behind a seam, short modules, a stamped schema; and, as
issue 23 set it, a checkout that stands on its own: no file cites a path outside the repository."""

from __future__ import annotations

import ast
import re
import subprocess
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


def _module_name(path: Path, root: Path) -> str:
    name = ".".join(path.relative_to(root).with_suffix("").parts)
    return name.removesuffix(".__init__")


def import_graph(files: list[Path], root: Path) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body (lazy imports in functions too: a
    cycle hidden in a function is still a cycle). `from package import submodule` names the submodule only."""
    modules = {_module_name(p, root): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                edges |= subs or ({node.module} & modules.keys())
        graph[name] = edges - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_itself_back() -> None:
    assert import_cycles(import_graph(PRODUCTION, ROOT)) == []


def test_the_cycle_check_sees_a_lazy_import_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "vgpumgr"
    pkg.mkdir()
    (pkg / "a.py").write_text("from vgpumgr import b\n")
    (pkg / "b.py").write_text("def f():\n    from vgpumgr.a import x\n")
    (pkg / "c.py").write_text("from vgpumgr import a\n")
    files = sorted(pkg.glob("*.py"))
    assert import_cycles(import_graph(files, tmp_path)) == [["vgpumgr.a", "vgpumgr.b"]]


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
    from vgpumgr.hostfs.root import Host, Kernel
    from vgpumgr.sim import profiles

    sim = Host(profiles.create(tmp_path / "sim", "t4"))
    assert sim.simulated and type(sim.kernel).__module__ == "vgpumgr.sim.platform"
    plain = Host(tmp_path / "sim" / "sys")
    assert type(plain.kernel) is Kernel and not plain.simulated


@pytest.mark.parametrize("spec", ["os:system", "vgpumgr.errors:VgpuError", "vgpumgr.hostfs.root:Host", "../x:Y"])
def test_a_kernel_file_naming_anything_else_is_refused(tmp_path: Path, spec: str) -> None:
    from vgpumgr.errors import InvalidInput
    from vgpumgr.hostfs.root import KERNEL_FILE, Host

    (tmp_path / KERNEL_FILE).write_text(spec + "\n")
    with pytest.raises(InvalidInput, match="not a vgpumgr kernel"):
        Host(tmp_path)


# -- the repository stands on its own ------------------------------------------------------------------

# Paths that exist only on a development machine or beside the checkout: a clone has none of them. (The
# character classes keep this file from naming them itself.)
MACHINE_PATH = re.compile(
    r"\.\.[/\\]shared\b"  # the research folder next to the checkout
    r"|(?<![\w./-])shared/(?:docs|mdev-lab)/"  # the same, named without ../
    r"|(?<![\w./-])/w[o]rk/"  # the development machine's workspace
    r"|(?<![\w./-])/(?:h[o]me|U[s]ers)/[^/\s'\"`]+/"  # someone's home directory
    r"|(?<![\w./-])/r[o]ot/\S"  # root's home directory
    r"|\b[A-Za-z]:\\U[s]ers\\"  # a Windows home directory
)
DOCS_FILE = re.compile(r"(?<![\w./-])docs/[\w.-]+\.md\b")
SOURCES_SECTION = re.compile(r"§(\d+(?:\.\d+)?)")
# The CI's own entry point may name what surrounds the checkout on the CI machine; today it names nothing.
EXEMPT = (".ci/",)


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [ROOT / n for n in out.decode().split("\0") if n and not n.startswith(EXEMPT)]


def _text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # a tracked symlink to a directory, a file deleted in the work tree
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def machine_paths(files: list[Path], root: Path) -> list[str]:
    """`file:line: match` for every path of a development machine, or beside the checkout, that `files` name."""
    found = []
    for path in files:
        for n, line in enumerate((_text(path) or "").splitlines(), start=1):
            found += [f"{path.relative_to(root)}:{n}: {m.group(0)}" for m in MACHINE_PATH.finditer(line)]
    return found


def broken_doc_citations(files: list[Path], root: Path) -> list[str]:
    """Citations of docs/*.md files that do not exist, and of docs/sources.md sections it does not have."""
    sources = root / "docs" / "sources.md"
    text = sources.read_text() if sources.exists() else ""
    headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, re.M))
    found = []
    for path in files:
        for n, line in enumerate((_text(path) or "").splitlines(), start=1):
            where = f"{path.relative_to(root)}:{n}"
            found += [f"{where}: {m.group(0)} does not exist" for m in DOCS_FILE.finditer(line)
                      if not (root / m.group(0)).is_file()]
            if "docs/sources.md" in line or path == sources:
                found += [f"{where}: docs/sources.md has no §{s}" for s in SOURCES_SECTION.findall(line)
                          if s not in headings]
    return found


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    assert machine_paths(tracked_files(), ROOT) == []


def test_every_cited_doc_and_section_exists() -> None:
    assert broken_doc_citations(tracked_files(), ROOT) == []


def test_the_checks_find_planted_offenders_and_leave_system_paths_alone(tmp_path: Path) -> None:
    up, ws, home, rt = "..", "/" + "work/main", "/" + "home/alice", "/" + "root"
    notes, section = "docs/" + "no-such-notes.md", "docs/sources.md §" + "99"
    bad = tmp_path / "bad.py"
    bad.write_text(f"# from {up}/shared/docs/facts.md\n"
                   "'''see shared/" + "mdev-lab/README.md'''\n"
                   f"ROOT = '{ws}/vgpumgr'\n"
                   f"VENV = '{home}/src/.venv'\n"
                   f"PY = '{rt}/.pyenv/bin/python'\n"
                   f"# cites {notes} and {section}\n")
    good = tmp_path / "good.sh"
    good.write_text("cat /sys/bus/pci/devices/0000:3b:00.0/vendor /newroot/.mdev-lab/out/rc\n"
                    "LAB=/var/tmp/vgpumgr-mdev-lab; /opt/vgpumgr/bin/vgpumgr; ls /etc/pve/qemu-server /run/user\n"
                    "# a shared pool; test:///default; the lab's work/ dir; docs/sources.md §1\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/sources.md").write_text("# Sources\n\n## 1. The kernel\n")
    found = machine_paths([bad, good], tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == ["bad.py:1", "bad.py:2", "bad.py:3", "bad.py:4", "bad.py:5"]
    assert broken_doc_citations([bad, good], tmp_path) == [
        f"bad.py:6: {notes} does not exist", f"bad.py:6: {section.replace(' §', ' has no §')}"]
