"""What the benchmarks that talk to a real service share: a percentile, and `python -m api.server` on a unix
socket over a simulated host, stopped and cleaned up afterwards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def clean_env() -> dict[str, str]:
    """This process's environment without any VGPUMGR_ setting (the benchmark chooses its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("VGPUMGR_")}


@contextmanager
def service(root: Path, state_dir: Path, **env: str) -> Iterator[Path]:
    """The service on a simulated host (licences off unless `env` says otherwise); yields its socket."""
    sock_dir = Path(tempfile.mkdtemp(prefix="vgb-"))  # short: a unix socket's path has a 107-byte limit
    sock = sock_dir / "api.sock"
    server = subprocess.Popen([sys.executable, "-m", "api.server", "--uds", str(sock), "--sysfs-root", str(root),
                               "--state-dir", str(state_dir), "--connect", "test:///default"], cwd=REPO,
                              env={**clean_env(), "VGPUMGR_LICENCE_MODE": "off", **env},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.05)
        yield sock
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(sock_dir, ignore_errors=True)
