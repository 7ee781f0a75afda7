"""Hostile input for tests/test_hostile.py: the values (paths, strings, numbers) and the table of every CLI command
and REST operation with the places they go. A new command or route is covered by adding a row here; the test fails
while one is missing (the command list comes from the argparse tree, the route list from the app's OpenAPI)."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Slot:
    """Where a hostile value goes: `kind` is read (a file to read), write (a file or directory to make), dir (a
    directory to read), str or num; `fresh`: the write kinds include a new path that may be accepted."""

    kind: str
    fresh: bool = True

    def __str__(self) -> str:  # a template token, e.g. "sm={num}"
        return "{" + self.kind + "}"


R, W, D, S, N = Slot("read"), Slot("write"), Slot("dir"), Slot("str"), Slot("num")
W_BAD = Slot("write", fresh=False)  # a fresh path would start real work (a server, the demo): refusals only

STRINGS = ["", "x" * 20000, "\x01\x07\x1b[2J\x7f", "a\0b", "٥", "../../../../etc/passwd", "ünï—名", "-", "\n",
           "%s%n{0}"]
NUMBERS = ["-1", "0", "-5", "9" * 30, "4294967297", "٥", "1e3", "nan", "0x10", "", " 7"]

# the simulated "mixed" host (vgpumgr/sim/profiles.py)
T4, L40S, VF, A100, GVTG = "0000:3b:00.0", "0000:3d:00.0", "0000:3d:00.4", "0000:65:00.0", "0000:00:02.0"
UUID0 = "c0ffee00-0000-4000-8000-000000000043"

# command -> argument templates; each template holds one Slot (or a token with "{kind}" in it)
CLI: dict[tuple[str, ...], list[list[object]]] = {
    ("gpus",): [["--sysfs-root", D], ["--state-dir", W_BAD], ["--db", S], ["--connect", S]],
    ("types",): [["--parent", S]],
    ("mdev", "list"): [["--json", "--sysfs-root", D]],
    ("mdev", "create"): [["--parent", S, "--type", "T4-1Q"], ["--parent", T4, "--type", S],
                         ["--parent", T4, "--type", "T4-1Q", "--uuid", S]],
    ("mdev", "remove"): [[S], [UUID0, "--grace", N]],
    ("mdev", "export"): [["--dir", W]],
    ("mdev", "import"): [["--dir", D]],
    ("vf", "list"): [["--json", "--state-dir", W_BAD]],
    ("vf", "set"): [[S, "nvidia-1"], [VF, S]],
    ("vf", "clear"): [[S], [VF, "--retries", N]],
    ("sriov", "set"): [[S, "1"], [L40S, N]],
    ("vfio", "bind"): [[S]],
    ("vfio", "unbind"): [[S]],
    ("sim", "create"): [[W, "--profile", "t4"], [W_BAD, "--profile", S], [W_BAD, "--profile", "l40s-vfio", "--vfs", N],
                        [W_BAD, "--profile", "t4", "--scale", N]],
    ("sim", "reboot"): [["--sysfs-root", D]],
    ("sim", "hold"): [[S], [VF, "--by", S]],
    ("sim", "guest"): [["start", S], ["load", VF, "--load", "sm={num}"], ["load", VF, "--load", S],
                       ["start", VF, "--vm", S], ["load", VF, "--fb-used-mb", N], ["licence", VF, "--state", S],
                       ["agent", VF, "--gpu-util", N]],
    ("demo",): [["--dir", W_BAD]],
    ("place",): [["--type", S], ["--type", "T4-1Q", "--vm", S], ["--type", "T4-1Q", "--numa", N],
                 ["--type", "T4-1Q", "--pin-gpu", S], ["--type", "T4-1Q", "--placement-id", N]],
    ("vgpu",): [["--type", S, "--vm", "h1"], ["--type", "T4-1Q", "--vm", S],
                ["--type", "T4-1Q", "--vm", "h2", "--idempotency-key", S], ["--type", "T4-1Q", "--vm", "h3",
                                                                             "--deny-gpu", S]],
    ("release",): [[S], [UUID0, "--grace", N]],
    ("placements",): [["--vm", S], ["--gpu", S]],
    ("license", "add"): [[S, "--edition", "vWS", "--seats", "1"], ["p43", "--edition", S, "--seats", "1"],
                         ["p44", "--edition", "vWS", "--seats", N], ["p45", "--edition", "vWS", "--seats", "1",
                                                                     "--expires", S]],
    ("license", "list"): [["--json", "--db", S]],
    ("license", "usage"): [["--json", "--state-dir", W_BAD]],
    ("license", "remove"): [[S]],
    ("license", "check"): [["--json", "--connect", S]],
    ("license", "token"): [["set", R], ["set", R, "--pool", "p43"], ["show", "--pool", S], ["set", S]],
    ("license", "delivery"): [[S, "agent"], ["--pool", S, "agent"], [S]],
    ("license", "deliver"): [[S]],
    ("license", "guest-helper"): [["script", "--state-dir", W_BAD]],
    ("reconcile",): [["--json", "--sysfs-root", D]],
    ("db", "upgrade"): [["--ignore-host", S, "--dry-run"]],
    ("db", "downgrade"): [[S], [S, "--yes-destroy-data"], ["0012_licence_delivery", "--dry-run", "--backup", W_BAD]],
    ("db", "current"): [["--db", S]],
    ("db", "backup"): [[W], [W, "--force"]],
    ("db", "restore"): [[R]],
    ("upgrade", "check"): [["--kernel", S], ["--driver", S]],
    ("audit",): [["list", "--vm", S], ["list", "--since", S], ["list", "--limit", N], ["export", "--output", W],
                 ["list", "--gpu", S]],
    ("mig", "list"): [["--json", "--sysfs-root", D]],
    ("mig", "plan"): [[S, "1g.10gb"], [A100, S]],
    ("mig", "create"): [[A100, S], [S, "1g.10gb"], [A100, "1g.10gb", "--start", N]],
    ("mig", "destroy"): [[A100, N], [S, "1"]],
    ("mig", "mode"): [[S, "on"]],
    ("scheduler", "show"): [[S]],
    ("scheduler", "set"): [[S, "equal-share"], [L40S, S], [L40S, "equal-share", "--timeslice", N],
                           [L40S, "equal-share", "--frequency", N, "--avg-factor", "3"],
                           [L40S, "equal-share", "--frequency", "480", "--avg-factor", N]],
    ("scheduler", "log"): [[S], [L40S, "--gpu-instance", N]],
    ("scheduler", "persist"): [["--file", W]],
    ("scheduler", "check"): [["--seconds", N], ["--tolerance", N]],
    ("vm", "create"): [[S, "--vgpu", "T4-1Q"], ["v43", "--vgpu", S], ["v44", "--vgpu", "T4-1Q", "--memory", N],
                       ["v45", "--vgpu", "T4-1Q", "--vcpus", N], ["v46", "--vgpu", "T4-1Q", "--disk", S],
                       ["v47", "--vgpu", "T4-1Q", "--network", S], ["v48", "--passthrough", S],
                       ["v49", "--mig", S], ["v50", "--vgpu", "T4-1Q", "--numa", N]],
    ("vm", "list"): [["--json", "--connect", S]],
    ("vm", "show"): [[S]],
    ("vm", "xml"): [[S]],
    ("vm", "start"): [[S]],
    ("vm", "stop"): [[S]],
    ("vm", "delete"): [[S]],
    ("vm", "migrate"): [[S, "--to", "nowhere"], ["v43", "--to", S, "--dry-run"],
                        ["v43", "--to", "h2", "--to-api", S, "--dry-run"],
                        ["v43", "--to", "h2", "--to-api", "http://127.0.0.1:9", "--to-token-file", R, "--dry-run"]],
    ("vm", "attach"): [[S, "--vgpu", "T4-1Q"], ["v43", "--vgpu", S]],
    ("vm", "detach"): [[S, UUID0], ["v43", S]],
    ("serve",): [["--socket", W_BAD], ["--port", N]],
    ("token", "create"): [["--name", S, "--role", "auditor"]],
    ("token", "list"): [["--json", "--db", S]],
    ("token", "revoke"): [[S]],
    ("install-units",): [["--dest", W], ["--dest", W_BAD, "--bin", S]],
    ("restore",): [["--dry-run", "--profile", R]],
    ("profile", "show"): [[R]],
    ("profile", "check"): [[R]],
    ("profile", "apply"): [[R, "--dry-run"]],
    ("profile", "nova"): [[R]],
    ("top",): [["--once", "--gpu", S], ["--once", "--interval", N]],
    ("host", "cordon"): [[S, "--reason", "r"], ["--reason", S]],
    ("host", "uncordon"): [[S]],
    ("host", "drain"): [["--to", S], ["--to", "h2", "--to-api", S], ["--to", "h2", "--to-api", "http://127.0.0.1:9",
                                                                     "--to-token-file", R], ["--reason", S]],
    ("host", "show"): [[S]],
    ("fleet", "hosts"): [["--json", "--db", S]],
    ("fleet", "gpus"): [["--host", S], ["--type", S]],
    ("fleet", "capacity"): [["--type", S]],
    ("fleet", "place"): [["--type", S], ["--type", "T4-1Q", "--vm", S], ["--type", "T4-1Q", "--count", N]],
    ("fleet", "publish"): [["--json", "--state-dir", W_BAD]],
    ("fleet", "compact"): [["--for", S], ["--for", "T4-1Q", "--max-moves", N], ["--for", "T4-1Q", "--per-host", N],
                           ["--for", "T4-1Q", "--apply", "--json"]],
    ("gpu", "mode"): [[S, "--mixed"], [L40S, "--mixed", "--json", "--db", S]],
    ("gpu", "slots"): [[S]],
    ("gpu", "compact"): [[S], [L40S, "--for", S]],
    ("vendor", "list"): [["--json", "--sysfs-root", D]],
    ("guests", "telemetry"): [[S, "on"], ["--pool", S, "on"], [S]],
    ("guests", "check"): [["--driver", S]],
    ("doctor",): [["--gpu", S], ["--for", S]],
    ("sim", "break"): [[S]],  # a valid state would break the shared simulated host for the commands after it
    ("vendor", "prepare"): [[S], [L40S, "--vfs", N], [L40S, "--vfs", "2", "--vf-memory", N]],
}
ALIASES = {"licence": "license"}  # `licence X` is `license X`: run once, covered by its row

# REST operations (METHOD, OpenAPI path) -> a body that passes validation (None: no body); each top-level field of
# it, each path and query parameter, is then given every hostile value of its type
REST: dict[tuple[str, str], dict[str, object] | None] = {
    ("GET", "/v1/gpus"): None, ("GET", "/v1/gpus/{address}"): None, ("GET", "/v1/vendors"): None,
    ("GET", "/v1/types"): None, ("GET", "/v1/devices"): None, ("GET", "/v1/vgpus"): None,
    ("POST", "/v1/vgpus"): {"type": "T4-1Q", "vm": "r1"},
    ("POST", "/v1/vgpus/passthrough"): {"vm": "r2", "address": T4},
    ("GET", "/v1/vgpus/{ref}"): None, ("DELETE", "/v1/vgpus/{ref}"): None, ("GET", "/v1/placements"): None,
    ("POST", "/v1/placements/preview"): {"type": "T4-1Q", "vm": "r3"},
    ("POST", "/v1/hooks/ensure"): {"vm": "r4", "type": "T4-1Q", "uuid": UUID0},
    ("POST", "/v1/hooks/release"): {"vm": "r4"},
    ("POST", "/v1/hooks/libvirt/prepare"): {"domain": "r5", "xml": "<domain/>"},
    ("POST", "/v1/hooks/libvirt/migrate"): {"domain": "r5", "xml": "<domain/>"},
    ("POST", "/v1/migrations/preflight"): {"domain": "r5", "xml": "<domain/>"},
    ("POST", "/v1/migrations/settle"): {"domain": "r5"},
    ("POST", "/v1/hooks/libvirt/release"): {"domain": "r5", "xml": "<domain/>"},
    ("POST", "/v1/hooks/proxmox/check"): {"vm": "r7", "type": "L40S-2Q", "candidates": [VF]},
    ("POST", "/v1/hooks/proxmox/record"): {"vm": "r7", "type": "L40S-2Q", "vf": VF},
    ("GET", "/v1/vms"): None, ("POST", "/v1/vms"): {"name": "r6", "vgpus": ["T4-1Q"]},
    ("GET", "/v1/vms/{name}"): None, ("DELETE", "/v1/vms/{name}"): None, ("GET", "/v1/vms/{name}/xml"): None,
    ("POST", "/v1/vms/{name}/start"): None, ("POST", "/v1/vms/{name}/stop"): None,
    ("POST", "/v1/vms/{name}/vgpus"): {"type": "T4-1Q"},
    ("DELETE", "/v1/vms/{name}/vgpus/{ref}"): None,
    ("POST", "/v1/vms/{name}/migrate"): {"to": "h2", "dry_run": True},
    ("GET", "/v1/licences"): None, ("POST", "/v1/licences"): {"name": "rp", "edition": "vWS", "seats": 2},
    ("GET", "/v1/licences/usage"): None, ("PATCH", "/v1/licences/{name}"): {"seats": 3},
    ("DELETE", "/v1/licences/{name}"): None, ("GET", "/v1/audit"): None, ("GET", "/v1/audit/verify"): None,
    ("GET", "/v1/reconcile"): None, ("POST", "/v1/reconcile"): {"fix": False},
    ("GET", "/v1/tokens"): None, ("GET", "/v1/host"): None,
    ("POST", "/v1/host/cordon"): {"reason": "r"}, ("POST", "/v1/host/uncordon"): {},
    ("GET", "/v1/fleet/hosts"): None, ("GET", "/v1/fleet/gpus"): None, ("GET", "/v1/fleet/capacity"): None,
    ("GET", "/v1/fleet/place"): None, ("POST", "/v1/fleet/publish"): None, ("GET", "/v1/telemetry"): None,
    ("POST", "/v1/licences/check"): None, ("GET", "/v1/licences/deliveries"): None,
    ("POST", "/v1/licences/deliver/{name}"): None,
    ("PUT", "/v1/gpus/{address}/vgpu-mode"): {"mode": "mixed"},
    ("GET", "/v1/gpus/{address}/slots"): None, ("GET", "/v1/health"): None, ("GET", "/metrics"): None,
    ("GET", "/v1/guests/telemetry"): None, ("PUT", "/v1/guests/telemetry"): {"vm": "v43", "telemetry": "on"},
    ("POST", "/v1/guests/check"): None, ("GET", "/v1/host/doctor"): None,
    ("GET", "/v1/fleet/compact"): None, ("POST", "/v1/fleet/compact"): {"type": "T4-1Q", "apply": False},
}
JSON_VALUES = ["", "x" * 20000, "\x01\x1b[2J", "a\0b", "٥", "../../etc/passwd", -1, 0, 2**63, -(2**63) - 1, 10**40,
               1e308, None, [], {}, True, "ünï—名"]


class Paths:
    """The hostile paths, made in `base`: FIFOs (one with a writer holding it open), a socket, a directory, a
    symlink out of its directory, devices, /proc, names too long, a path through a file."""

    def __init__(self, base: Path) -> None:
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        os.mkfifo(base / "fifo")
        os.mkfifo(base / "fifo-w")
        self.writer = os.open(base / "fifo-w", os.O_RDWR | os.O_NONBLOCK)
        os.write(self.writer, b"eyJhbGciOiJSUzI1NiJ9.e30.c2ln\n" * 10)
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(base / "sock"))
        (base / "dir").mkdir()
        (base / "file").write_text("options nvidia\n")
        os.symlink("/etc/passwd", base / "link-out")
        self.fresh_count = 0
        # the devices as nodes of their own (root may make them): a bug that replaces one must not take the
        # machine's /dev/zero with it
        self.zero, self.full = "/dev/zero", "/dev/full"
        with contextlib.suppress(OSError):
            os.mknod(base / "zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5))
            os.mknod(base / "full", 0o666 | stat.S_IFCHR, os.makedev(1, 7))
            self.zero, self.full = str(base / "zero"), str(base / "full")

    def close(self) -> None:
        os.close(self.writer)
        self.sock.close()

    def values(self, slot: Slot) -> list[str]:
        b = self.base
        out = [str(b / "fifo"), str(b / "fifo-w"), self.zero, self.full, str(b / "sock"), str(b / "dir"),
               str(b / "link-out"), str(b / "missing"), str(b / ("n" * 300)), str(b) + "/d" * 2100,
               "/proc/self/mem", "/proc/vgpumgr-hostile", "/sys/vgpumgr-hostile", str(b / "file" / "sub"), "",
               str(b / "a\0b")]
        if slot.kind == "dir":
            out.append("/proc/self")
        if slot.kind == "read":
            out.append(str(b / "file"))  # a regular file with the wrong content
        if slot.kind == "write" and not slot.fresh:  # as good as a fresh path: an empty directory, a new name
            out = [p for p in out if p not in (str(b / "missing"), str(b / "dir"))]
        if slot.kind == "write" and slot.fresh:
            self.fresh_count += 1
            out.append(str(b / f"fresh-{self.fresh_count}"))
        return out
