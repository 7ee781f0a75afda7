"""Every CLI command and every REST operation, run with generated hostile arguments (tests/hostile.py: paths that
are FIFOs with and without a writer, devices, a socket, a directory, a symlink out, unwritable, too long or under
/proc; strings empty, huge, with control characters, a NUL or non-ASCII digits; numbers negative, zero, huge or
beyond the hardware). None may end in exit 70 or a 5xx, hang past HANG_S, write outside the state directory and the
path it was given, or change the records when it is refused. The CLI runs in-process (one parser per command, kept
across calls) under a per-call alarm; the REST operations through one TestClient."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import sqlite3
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hostile import ALIASES, CLI, JSON_VALUES, NUMBERS, REST, STRINGS, UUID0, Paths, Slot

from vgpumgr.cli import main as cli_main

HANG_S = 5.0
# what a refused call must leave as it was (the audit trail records refusals; hosts/fleet rows record sightings)
RECORDS = ("allocations", "vms", "licence_pools", "licence_leases", "licence_deliveries", "gpu_scheduler_intents",
           "host_cordons", "idempotency_keys", "mig_gpu_instances", "gpu_boot_state")
OK_CODES = (0, 10)  # 10: a check that found something, not a refusal


class Hang(BaseException):
    """Raised by the alarm: not an Exception, so that nothing under test swallows it."""


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    def ring(_sig: int, _frame: object) -> None:
        raise Hang

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class World:
    def __init__(self, base: Path) -> None:
        from vgpumgr.sim import profiles

        self.base = base
        self.root = profiles.create(base / "sim", "mixed")
        self.state = base / "state"
        self.cwd = base / "cwd"
        self.cwd.mkdir()
        self.paths = Paths(base / "p")
        self.parsers: dict[Any, Any] = {}
        self.db = self.state / "vgpumgr.db"
        self.calls = 0

    def run(self, argv: list[str]) -> tuple[object, str]:
        out, err = io.StringIO(), io.StringIO()
        self.calls += 1
        try:
            with alarm(HANG_S), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                rc: object = cli_main.main(argv, out, err, parsers=self.parsers)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 2
        except Hang:
            rc = "hang"
        except Exception as e:  # noqa: BLE001 - what escaped main() is the finding
            rc = f"raised {type(e).__name__}: {e}"
        return rc, err.getvalue()[-400:]

    def records(self) -> str:
        if not self.db.exists():
            return ""
        h = hashlib.sha256()
        with contextlib.closing(sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)) as conn:
            present = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            for t in RECORDS:
                if t in present:
                    h.update(repr(conn.execute(f'SELECT * FROM "{t}" ORDER BY 1').fetchall()).encode())
        tokens = self.state / "licence-token"
        if tokens.is_dir():
            for p in sorted(tokens.iterdir()):
                h.update(p.name.encode() + p.read_bytes())
        return h.hexdigest()

    def around(self) -> dict[str, tuple[int, int, int]]:
        """What lies beside the hostile paths and in the working directory (lstat: nothing is opened)."""
        seen = {}
        for d in (self.paths.base, self.cwd, self.base):
            for e in os.scandir(d):
                st = e.stat(follow_symlinks=False)
                # a directory's own mtime changes with its entries, which are compared one by one
                seen[e.path] = (stat.S_IFMT(st.st_mode), st.st_size, 0 if e.is_dir() else st.st_mtime_ns)
        return seen


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    import uvicorn

    import api.app
    import api.server  # noqa: F401 - imported once here, not inside the first `serve` call's alarm

    base = tmp_path_factory.mktemp("hostile")
    env = {"VGPUMGR_STATE_DIR": str(base / "state"), "VGPUMGR_LIBVIRT_URI": "test:///default",
           "VGPUMGR_HOSTNAME": "h1", "VGPUMGR_LICENCE_MODE": "warn", "VGPUMGR_CHECKPOINT_AT_EXIT": "0"}
    saved = {k: os.environ.get(k) for k in [*env, "VGPUMGR_SYSFS_ROOT"]}
    cwd = os.getcwd()
    served = (uvicorn.run, uvicorn.Server.run)
    uvicorn.run = lambda *a, **k: None  # `serve` with arguments it takes: it would serve, not return
    uvicorn.Server.run = lambda *a, **k: None  # type: ignore[method-assign]
    w = World(base)
    os.environ.update(env, VGPUMGR_SYSFS_ROOT=str(w.root))
    os.chdir(w.cwd)
    try:
        for argv in (["license", "add", "p43", "--edition", "vWS", "--seats", "4"],
                     ["vm", "create", "v43", "--vgpu", "L40S-2Q"]):
            rc, err = w.run(argv)
            assert rc == 0, (argv, err)
        yield w
    finally:
        os.chdir(cwd)
        uvicorn.run, uvicorn.Server.run = served  # type: ignore[method-assign]
        w.paths.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        from vgpumgr.db.session import dispose_engine

        dispose_engine(f"sqlite:///{w.db}")


def test_every_command_is_in_the_table() -> None:
    cli_main.build_parser()
    commands = {p for p in cli_main.COMMANDS if p[0] not in ALIASES}
    assert sorted(commands - set(CLI)) == [], "add the new command to tests/hostile.py's CLI table"
    assert sorted(set(CLI) - commands) == []


def test_every_number_is_parsed_by_the_one_rule() -> None:
    """No option takes int() or float() (they read '٥', '1_0', ' 5', 'nan'): vgpumgr.userinput.numbers does."""
    import argparse

    def actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
        for a in parser._actions:
            yield a
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    yield from actions(sub)

    bare = sorted({"/".join(a.option_strings) or a.dest for a in actions(cli_main.build_parser())
                   if a.type in (int, float)})
    assert bare == [], "use vgpumgr.userinput.numbers.integer/decimal"


def test_every_route_is_in_the_table(world: World) -> None:
    ops = {(m.upper(), p) for p, item in _spec(world)["paths"].items() for m in item}
    assert sorted(ops - set(REST)) == [], "add the new route to tests/hostile.py's REST table"
    assert sorted(set(REST) - ops) == []


def _values(world: World, slot: Slot) -> list[str]:
    if slot.kind == "str":
        return STRINGS
    if slot.kind == "num":
        return NUMBERS
    return world.paths.values(slot)


def _cases(world: World, template: list[object]) -> Iterator[tuple[list[str], str | None]]:
    """(argv, the path asked for, if any) for each hostile value in the template's one slot."""
    for i, token in enumerate(template):
        slot = token if isinstance(token, Slot) else next(
            (s for s in (Slot("str"), Slot("num")) if isinstance(token, str) and str(s) in token), None)
        if slot is None:
            continue
        for value in _values(world, slot):
            text = value if isinstance(token, Slot) else str(token).replace(str(slot), value)
            argv = [str(t) for t in template[:i]] + [text] + [str(t) for t in template[i + 1:]]
            yield argv, value if slot.kind in ("read", "write", "dir") else None
        return
    yield [str(t) for t in template], None


@pytest.mark.parametrize("command", sorted(CLI), ids=" ".join)
def test_command_with_hostile_arguments(world: World, command: tuple[str, ...]) -> None:
    problems = []
    for template in CLI[command]:
        for argv, asked in _cases(world, template):
            argv = [*command, *argv]
            before, around = world.records(), world.around()
            started = time.monotonic()
            rc, err = world.run(argv)
            took = time.monotonic() - started
            shown = [a if len(a) < 60 else a[:40] + f"...({len(a)})" for a in argv]
            if rc == 70 or not isinstance(rc, int):
                problems.append(f"{shown}: {rc} {err}")
                continue
            if took > HANG_S:
                problems.append(f"{shown}: took {took:.1f} s")
            if rc not in OK_CODES and world.records() != before:
                problems.append(f"{shown}: refused (exit {rc}) but changed the records")
            after = world.around()
            allowed = {asked} | ({str(Path(asked).absolute())} if asked else set())
            changed = sorted(k for k in set(around) | set(after)
                             if around.get(k) != after.get(k) and k not in allowed
                             and not (k == str(world.base / "sim") or k.startswith(str(world.state))))
            if changed:
                problems.append(f"{shown}: touched {changed}")
    assert not problems, "\n".join(problems)


# -- REST ------------------------------------------------------------------------------------------------------
_APP: dict[str, Any] = {}


def _client(world: World) -> tuple[Any, dict[str, str]]:
    if "client" not in _APP:
        from fastapi.testclient import TestClient

        from api import tokens
        from api.app import create_app
        from vgpumgr.config import Config
        from vgpumgr.service import Service

        cfg = Config.resolve()
        token = tokens.create_token(cfg, "hostile", "admin")
        _APP["client"] = TestClient(create_app(cfg, service=Service(cfg), watch=False), raise_server_exceptions=False)
        _APP["headers"] = {"Authorization": f"Bearer {token}"}
    return _APP["client"], _APP["headers"]


def _spec(world: World) -> dict[str, Any]:
    client, _ = _client(world)
    if "spec" not in _APP:
        _APP["spec"] = client.app.openapi()
    return _APP["spec"]


PATH_DEFAULTS = {"address": "0000:3d:00.0", "ref": UUID0, "name": "v43"}


def _requests(world: World, method: str, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    op = _spec(world)["paths"][path][method.lower()]
    params = op.get("parameters", [])
    names = [p["name"] for p in params if p["in"] == "path"]
    base = path.format(**{n: PATH_DEFAULTS[n] for n in names})
    body = REST[(method, path)]
    for n in names:
        for v in STRINGS:
            yield path.replace("{" + n + "}", quote(v, safe="")).format(
                **{m: PATH_DEFAULTS[m] for m in names if m != n}), {"json": body}
    for p in params:
        if p["in"] == "query":
            for v in JSON_VALUES:
                yield base, {"params": {p["name"]: v if isinstance(v, str) else json.dumps(v)}, "json": body}
    if body is not None:
        for field in body:
            for v in JSON_VALUES:
                yield base, {"json": {**body, field: v}}
        for raw in (b"{", b"\xff\xfe\x00", b"[]", b"null", b'{"' + b"a" * 100000 + b'": 1}'):
            yield base, {"content": raw, "headers": {"content-type": "application/json"}}


@pytest.mark.parametrize("op", sorted(REST), ids=lambda op: f"{op[0]} {op[1]}")
def test_route_with_hostile_requests(world: World, op: tuple[str, str]) -> None:
    client, headers = _client(world)
    problems = []
    for url, kw in _requests(world, *op):
        before = world.records()
        started = time.monotonic()
        try:
            with alarm(HANG_S):
                r = client.request(op[0], url, headers={**headers, **kw.pop("headers", {})}, **kw)
        except Hang:
            problems.append(f"{op} {url[:80]} {kw}: hang")
            continue
        took = time.monotonic() - started
        what = f"{op[0]} {url[:80]} {str(kw)[:120]}"
        if r.status_code >= 500:
            problems.append(f"{what}: {r.status_code} {r.text[:300]}")
        if took > HANG_S:
            problems.append(f"{what}: took {took:.1f} s")
        if r.status_code >= 400 and world.records() != before:
            problems.append(f"{what}: refused ({r.status_code}) but changed the records")
    assert not problems, "\n".join(problems)
