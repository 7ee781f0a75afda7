"""Run the app with uvicorn on 127.0.0.1:8470 (default) or on a unix socket."""

from __future__ import annotations

import os
from pathlib import Path

from vgpumgr.config import Config
from vgpumgr.errors import InvalidInput

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
DEFAULT_SOCKET = "/run/vgpumgr/api.sock"


def serve(cfg: Config | None = None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, uds: str | None = None,
          log_level: str = "info") -> None:
    """Serve until interrupted. With `uds`, listen on that unix socket (mode 0660) instead of TCP."""
    import uvicorn

    from api.app import create_app

    if not 0 < port < 65536:
        raise InvalidInput(f"port {port} is out of range", hint="use 1-65535; the default is 8470")
    app = create_app(cfg)
    if uds:
        sock = Path(uds)
        sock.parent.mkdir(parents=True, exist_ok=True)
        if sock.is_socket():
            sock.unlink()  # left over from a previous run; uvicorn cannot bind over it
        config = uvicorn.Config(app, uds=str(sock), log_level=log_level, access_log=False)
        server = uvicorn.Server(config)
        old = os.umask(0o117)  # the socket is created rw for owner and group only
        try:
            server.run()
        finally:
            os.umask(old)
        return
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


def main(argv: list[str] | None = None) -> None:
    """`python -m api.server [--host H] [--port P] [--uds PATH]`: for tests and for running without the CLI."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m api.server", description="run the vgpumgr REST service")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--uds", help=f"listen on this unix socket (e.g. {DEFAULT_SOCKET}) instead of TCP")
    p.add_argument("--sysfs-root")
    p.add_argument("--state-dir")
    p.add_argument("--db")
    p.add_argument("--connect")
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    cfg = Config.resolve(sysfs_root=a.sysfs_root, state_dir=a.state_dir, db=a.db, connect=a.connect)
    serve(cfg, host=a.host, port=a.port, uds=a.uds, log_level=a.log_level)


if __name__ == "__main__":
    main()
