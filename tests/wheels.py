"""Build vgpumgr's wheel from a copy of the source tree and install it, alone, into a fresh venv (no network:
no build isolation, --no-deps; the new venv reaches the dev venv's dependencies through a .pth line naming its
site-packages — a path line in a .pth does not run that directory's own .pth files, so the dev venv's editable
install stays out)."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "vgpumgr", "api", "migrations", "xml_templates", "scripts/systemd")


def copy_sources(dest: Path) -> Path:
    """The files a wheel is built from, copied (symlinks kept, as the package data's links need)."""
    dest.mkdir(parents=True)
    for name in SOURCES:
        p = REPO / name
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if p.is_dir():
            shutil.copytree(p, dest / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(p, dest / name)
    return dest


def build_wheel(src: Path, dist: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(src)], check=True, timeout=180)
    return next(dist.glob("vgpumgr-*.whl"))


def install(wheel: Path, venv: Path) -> Path:
    """A venv with only `wheel` in it (dependencies from the dev venv); its bin/ directory."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=120)
    purelib = subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "dev-deps.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    return venv / "bin"
