"""Run the app with uvicorn on 127.0.0.1:8470 (default) or on a unix socket."""

from __future__ import annotations

import os
import socket
import stat

from vgpumgr.config import Config
from vgpumgr.errors import InvalidInput
from vgpumgr.userinput.numbers import integer

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
DEFAULT_SOCKET = "/run/vgpumgr/api.sock"


SD_LISTEN_FDS_START = 3  # systemd passes sockets from fd 3 on (sd_listen_fds(3))
SOCKET_MODE = 0o660


def systemd_socket() -> socket.socket | None:
    """The listening socket systemd passed (vgpumgr.socket), if this process was socket-activated.

    LISTEN_PID must name this process, so a variable inherited by accident is ignored; the variables are
    then removed, so that children do not take the socket for theirs."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    count = os.environ.get("LISTEN_FDS", "0")
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    if count != "1":
        raise InvalidInput(f"systemd passed {count} sockets (LISTEN_FDS), vgpumgr serves exactly one",
                           hint="give vgpumgr.socket a single ListenStream= line")
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.type != socket.SOCK_STREAM:
        raise InvalidInput("the socket systemd passed is not a stream socket",
                           hint="use ListenStream= in vgpumgr.socket")
    os.set_inheritable(sock.fileno(), False)
    return sock


def bind_unix_socket(path: str) -> socket.socket:
    """A listening unix socket at `path`, created rw for owner and group only (never world-accessible,
    not even for a moment: the mode comes from the umask at bind time)."""
    from vgpumgr.userinput import files

    sock_path = files.checked_path(path, "--socket")
    try:
        sock_path.parent.mkdir(parents=True, exist_ok=True)
        if stat.S_ISSOCK(os.lstat(sock_path).st_mode):
            sock_path.unlink()  # left over from a previous run; bind() cannot reuse it
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise files.refusal(exc, sock_path, "listen on", "choose a path in a writable directory") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~SOCKET_MODE)
    try:
        sock.bind(str(sock_path))
    except OSError as exc:
        sock.close()
        raise InvalidInput(f"cannot listen on {sock_path}: {exc.strerror}",
                           hint="choose a path in a writable directory, or remove what is there") from exc
    finally:
        os.umask(old)
    sock.listen(128)
    return sock


def _freeze_start() -> None:
    """Keep what the start made (modules, the app, SQLAlchemy's caches) out of the garbage collector's full
    passes: each pass would walk all of it again, ~50 ms on this project's machine, and a request that meets one
    waits that long (`scripts/bench_fleet.py` saw it as the p99 of `fleet place`)."""
    import gc

    gc.collect()
    gc.freeze()


def _endpoint(sock: socket.socket | None, host: str, port: int) -> str | None:
    """Where this service answers, as the fleet publishes it: unix:PATH or http://HOST:PORT."""
    if sock is None:
        shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
    name = sock.getsockname()
    return f"unix:{name}" if isinstance(name, str) and name else None


def serve(cfg: Config | None = None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, uds: str | None = None,
          log_level: str = "info", metrics_public: bool = False) -> None:
    """Serve until interrupted. With `uds`, listen on that unix socket (mode 0660) instead of TCP; a socket
    passed by systemd socket activation (LISTEN_FDS) is used in preference to both. /metrics needs a token on
    TCP unless `metrics_public`; on a unix socket it needs none (the socket's mode decides who connects)."""
    import uvicorn

    from api.app import create_app

    if not 0 < port < 65536:
        raise InvalidInput(f"port {port} is out of range", hint="use 1-65535; the default is 8470")
    sock = systemd_socket()
    unix = sock.family == socket.AF_UNIX if sock is not None else bool(uds)
    app = create_app(cfg, metrics_public=metrics_public or unix)  # its start cleans up: before the socket appears
    _freeze_start()
    if sock is None and uds:
        sock = bind_unix_socket(uds)
    fleet = app.state.service.fleet  # the heartbeat starts with the server: it publishes where we answer
    fleet.endpoint = fleet.endpoint or _endpoint(sock, host, port)
    if sock is None:
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
        return
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> None:
    """`python -m api.server [--host H] [--port P] [--uds PATH]`: for tests and for running without the CLI."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m api.server", description="run the vgpumgr REST service")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=integer(1, 65535, "--port"), default=DEFAULT_PORT)
    p.add_argument("--uds", help=f"listen on this unix socket (e.g. {DEFAULT_SOCKET}) instead of TCP")
    p.add_argument("--sysfs-root")
    p.add_argument("--state-dir")
    p.add_argument("--db")
    p.add_argument("--connect")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--metrics-public", action="store_true", help="/metrics without a token on TCP too")
    a = p.parse_args(argv)
    cfg = Config.resolve(sysfs_root=a.sysfs_root, state_dir=a.state_dir, db=a.db, connect=a.connect)
    serve(cfg, host=a.host, port=a.port, uds=a.uds, log_level=a.log_level, metrics_public=a.metrics_public)


if __name__ == "__main__":
    main()
