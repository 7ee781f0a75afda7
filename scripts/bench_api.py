#!/usr/bin/env python3
"""Load test of the REST API: N concurrent clients allocate and release vGPUs on a simulated 8-GPU T4 host.

    .venv/bin/python scripts/bench_api.py [--clients 16] [--transport unix|tcp] [--pairs 2000] [--seconds 30]
    .venv/bin/python scripts/bench_api.py --floor [--floor-path /v1/gpus] [--transport unix|tcp]

Starts `python -m api.server` (uvicorn) on a unix socket, as the hooks reach it (`--transport unix`,
default), or on 127.0.0.1 at a free port (`--transport tcp`), against `vgpumgr sim create DIR --profile t4
--scale 8` and a fresh SQLite database, then prints throughput (allocate+release pairs per second),
p50/p99 latencies, double allocations (a UUID handed out while still live, or an mdev left over) and 5xx
responses. Targets (issue 13): >= 300 pairs/s with 16 clients, p99 <= 50 ms, 0 double allocations, 0 5xx.

`--floor` drives the same server, transport, clients and client code with an authenticated read that does no
device work (GET /v1/gpus: token check, role check, the cached inventory, JSON out) and prints requests/s,
server CPU per request and p50/p99: what any request costs before the vGPU work. Two of them (allocate and
release) plus the library's own pair cost bound the REST pairs/s from above.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from api import tokens  # noqa: E402
from vgpumgr.config import Config  # noqa: E402
from vgpumgr.discovery.inventory import scan  # noqa: E402
from vgpumgr.hostfs.root import Host  # noqa: E402
from vgpumgr.sim import profiles  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: set[str] = set()
        self.peak_live = 0
        self.pairs: list[float] = []
        self.alloc: list[float] = []
        self.release: list[float] = []
        self.doubles = 0
        self.server_errors = 0
        self.other_errors: dict[int, int] = {}
        self.examples: list[str] = []

    def error(self, status: int, body: bytes) -> None:
        with self.lock:
            if status >= 500:
                self.server_errors += 1
            else:
                self.other_errors[status] = self.other_errors.get(status, 0) + 1
            if len(self.examples) < 5:
                self.examples.append(f"{status}: {body[:200].decode(errors='replace')}")


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a unix socket (what a libvirt or Proxmox hook does)."""

    def __init__(self, path: str, timeout: float = 30) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


def connection(address: str | int, timeout: float = 30) -> http.client.HTTPConnection:
    """A socket path (str) or a TCP port on 127.0.0.1 (int)."""
    if isinstance(address, str):
        return UnixHTTPConnection(address, timeout)
    return http.client.HTTPConnection("127.0.0.1", address, timeout=timeout)


def take_turn(stats: Stats, budget: list[int]) -> bool:
    """One more iteration of the shared budget, if any is left."""
    with stats.lock:
        if budget[0] <= 0:
            return False
        budget[0] -= 1
        return True


def exchange(conn: http.client.HTTPConnection, method: str, path: str, headers: dict[str, str],
             body: str | None = None) -> tuple[int, bytes]:
    conn.request(method, path, body=body, headers=headers)
    r = conn.getresponse()
    return r.status, r.read()


def client(n: int, address: str | int, token: str, type_name: str, stats: Stats, budget: list[int],
           deadline: float, hold: float) -> None:
    conn = connection(address)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    body = json.dumps({"type": type_name, "vm": f"bench-{n}"})
    while time.monotonic() < deadline and take_turn(stats, budget):
        t0 = time.perf_counter()
        status, data = exchange(conn, "POST", "/v1/vgpus", headers, body)
        t1 = time.perf_counter()
        if status != 201:
            stats.error(status, data)
            continue
        uuid = json.loads(data)["uuid"]
        with stats.lock:  # held from the 201 until the DELETE is sent: nobody else may get it meanwhile
            if uuid in stats.live:
                stats.doubles += 1
            stats.live.add(uuid)
            stats.peak_live = max(stats.peak_live, len(stats.live))
        time.sleep(hold)
        with stats.lock:
            stats.live.discard(uuid)
        status, data = exchange(conn, "DELETE", f"/v1/vgpus/{uuid}", headers)
        t2 = time.perf_counter()
        if status != 200:
            stats.error(status, data)
            continue
        with stats.lock:
            stats.alloc.append(t1 - t0)
            stats.release.append(t2 - t1)
            stats.pairs.append(t2 - t0)
    conn.close()


def floor_client(address: str | int, token: str, path: str, stats: Stats, budget: list[int],
                 deadline: float) -> None:
    """The same loop as `client`, with one cheap authenticated GET per iteration instead of the pair."""
    conn = connection(address)
    headers = {"Authorization": f"Bearer {token}"}
    while time.monotonic() < deadline and take_turn(stats, budget):
        t0 = time.perf_counter()
        status, data = exchange(conn, "GET", path, headers)
        t1 = time.perf_counter()
        if status != 200:
            stats.error(status, data)
            continue
        with stats.lock:
            stats.pairs.append(t1 - t0)
    conn.close()


def probe(address: str | int, every: float, stop: threading.Event, latencies: list[float]) -> None:
    """Responsiveness under load: GET /v1/health every `every` seconds on a connection of its own."""
    conn = connection(address)
    while not stop.wait(every):
        t0 = time.perf_counter()
        conn.request("GET", "/v1/health")
        r = conn.getresponse()
        r.read()
        if r.status == 200:
            latencies.append(time.perf_counter() - t0)
    conn.close()


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--transport", choices=("unix", "tcp"), default="unix")
    p.add_argument("--pairs", type=int, default=2000, help="allocate+release pairs in all (bound)")
    p.add_argument("--seconds", type=float, default=30.0, help="time bound")
    p.add_argument("--type", default="T4-1Q", help="T4-16Q (one per GPU) with more clients than GPUs tests "
                   "that capacity is never over-committed")
    p.add_argument("--hold", type=float, default=0.0, help="seconds each client keeps its vGPU before releasing")
    p.add_argument("--floor", action="store_true", help="measure the request machinery alone: GET --floor-path "
                   "instead of allocate+release (--pairs is then the number of requests)")
    p.add_argument("--floor-path", default="/v1/gpus", help="the cheap authenticated read --floor sends")
    p.add_argument("--probe", type=float, default=0.0, metavar="SECONDS",
                   help="also GET /v1/health every SECONDS on one more connection and print its latency: how "
                   "responsive the service stays under the load")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    a = p.parse_args()
    # sysfs lives in memory on a host; the simulated tree and the database go to tmpfs as well
    tmp = Path(tempfile.mkdtemp(prefix="vgpumgr-bench-api-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    root = profiles.create(tmp / "sim", "t4", scale=8)
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp / "state"), connect="test:///default")
    token = tokens.create_token(cfg, "bench", "operator")
    address: str | int
    if a.transport == "unix":
        address = str(tmp / "api.sock")
        listen = ["--uds", address]
    else:
        address = free_port()
        listen = ["--host", "127.0.0.1", "--port", str(address)]
    env = {**os.environ, "VGPUMGR_SYSFS_ROOT": str(root), "VGPUMGR_STATE_DIR": str(cfg.state_dir)}
    log = open(tmp / "server.log", "w")  # noqa: SIM115
    server = subprocess.Popen([sys.executable, "-m", "api.server", *listen, "--connect", "test:///default"],
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                c = connection(address, timeout=2)
                c.request("GET", "/v1/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print((tmp / "server.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.1)
        capacity = sum(t.available_instances for t in scan(Host(root)).types if t.matches(a.type))
        stats = Stats()
        budget = [a.pairs]
        cpu0, client_cpu0 = cpu_seconds(server.pid), own_cpu_seconds()
        start = time.monotonic()
        if a.floor:
            threads = [threading.Thread(target=floor_client, args=(address, token, a.floor_path, stats, budget,
                                                                   start + a.seconds))
                       for _ in range(a.clients)]
        else:
            threads = [threading.Thread(target=client, args=(i, address, token, a.type, stats, budget,
                                                                 start + a.seconds, a.hold))
                       for i in range(a.clients)]
        probed: list[float] = []
        stop_probe = threading.Event()
        if a.probe:
            threads.append(threading.Thread(target=probe, args=(address, a.probe, stop_probe, probed)))
        for t in threads:
            t.start()
        for t in threads[:a.clients]:
            t.join()
        elapsed = time.monotonic() - start
        stop_probe.set()
        for t in threads[a.clients:]:
            t.join()
        if a.probe:
            print(f"GET /v1/health under the load, every {a.probe * 1000:.0f} ms: p50 {pct(probed, .5):.1f} ms, "
                  f"p99 {pct(probed, .99):.1f} ms, max {pct(probed, 1):.1f} ms ({len(probed)} requests)",
                  file=sys.stderr if a.json else sys.stdout)
        server_cpu_ms = (cpu_seconds(server.pid) - cpu0) * 1000 / max(1, len(stats.pairs))
        client_cpu_ms = (own_cpu_seconds() - client_cpu0) * 1000 / max(1, len(stats.pairs))
        if a.floor:
            return report_floor(a, stats, elapsed, server_cpu_ms, client_cpu_ms)
        left = scan(Host(root)).mdevs
        over = max(0, stats.peak_live - capacity)
        doubles = stats.doubles + len(left) + over
        rate = len(stats.pairs) / elapsed
        if a.json:
            print(json.dumps({"transport": a.transport, "clients": a.clients, "pairs": len(stats.pairs),
                              "seconds": elapsed, "pairs_per_s": rate, "p50_ms": pct(stats.pairs, .5),
                              "p99_ms": pct(stats.pairs, .99), "doubles": doubles,
                              "server_errors": stats.server_errors, "other_errors": stats.other_errors,
                              "server_cpu_ms_per_pair": server_cpu_ms, "client_cpu_ms_per_pair": client_cpu_ms}))
            return 0 if doubles == 0 and stats.server_errors == 0 else 1
        print(f"host: simulated 8x T4, {a.clients} clients over {a.transport}, type {a.type}, "
              f"{len(stats.pairs)} pairs in {elapsed:.1f} s")
        print(f"throughput: {rate:.0f} allocate+release pairs/s (target >= 300); server CPU {server_cpu_ms:.1f} ms "
              "per pair")
        print(f"client CPU (this process, {a.clients} threads of http.client): {client_cpu_ms:.1f} ms per pair")
        print(f"pair latency: p50 {pct(stats.pairs, .5):.1f} ms, p99 {pct(stats.pairs, .99):.1f} ms (target <= 50)")
        print(f"allocate: p50 {pct(stats.alloc, .5):.1f} ms, p99 {pct(stats.alloc, .99):.1f} ms; "
              f"release: p50 {pct(stats.release, .5):.1f} ms, p99 {pct(stats.release, .99):.1f} ms")
        print(f"double allocations: {doubles} (UUID handed out twice: {stats.doubles}, mdevs left over: {len(left)}, "
              f"peak live {stats.peak_live} of capacity {capacity})")
        print(f"5xx responses: {stats.server_errors}; other errors: {stats.other_errors or 0}")
        for ex in stats.examples:
            print(f"  e.g. {ex}")
        return 0 if doubles == 0 and stats.server_errors == 0 else 1
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)  # the tree, database and log on tmpfs (memory)


def report_floor(a: argparse.Namespace, stats: Stats, elapsed: float, server_cpu_ms: float,
                 client_cpu_ms: float) -> int:
    rate = len(stats.pairs) / elapsed
    if a.json:
        print(json.dumps({"transport": a.transport, "clients": a.clients, "floor_path": a.floor_path,
                          "requests": len(stats.pairs), "seconds": elapsed, "requests_per_s": rate,
                          "p50_ms": pct(stats.pairs, .5), "p99_ms": pct(stats.pairs, .99),
                          "server_errors": stats.server_errors, "other_errors": stats.other_errors,
                          "server_cpu_ms_per_request": server_cpu_ms, "client_cpu_ms_per_request": client_cpu_ms}))
        return 0 if stats.server_errors == 0 and not stats.other_errors else 1
    print(f"floor: GET {a.floor_path}, {a.clients} clients over {a.transport}, {len(stats.pairs)} requests in "
          f"{elapsed:.1f} s")
    print(f"throughput: {rate:.0f} requests/s; server CPU {server_cpu_ms:.2f} ms per request; client CPU "
          f"{client_cpu_ms:.2f} ms per request")
    print(f"latency: p50 {pct(stats.pairs, .5):.1f} ms, p99 {pct(stats.pairs, .99):.1f} ms")
    print(f"a pair costs at least 2 x {server_cpu_ms:.2f} ms of server CPU before any vGPU work: REST pairs/s "
          f"<= 1000 / (2 x {server_cpu_ms:.2f} + library ms per pair)")
    print(f"errors: 5xx {stats.server_errors}, other {stats.other_errors or 0}")
    for ex in stats.examples:
        print(f"  e.g. {ex}")
    return 0 if stats.server_errors == 0 and not stats.other_errors else 1


if __name__ == "__main__":
    sys.exit(main())
