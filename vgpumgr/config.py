"""Where things live: sysfs root, state dir, database URL, libvirt URI (flags > environment > defaults)."""

from __future__ import annotations

import os
from pathlib import Path

from vgpumgr.hostfs.root import Host


class Config:
    # a plain class: `vgpumgr types` should not pay for importing dataclasses
    def __init__(self, host: Host, state_dir: Path, db_url: str, libvirt_uri: str, actor: str,
                 domain_type: str = "kvm") -> None:
        self.host, self.state_dir, self.db_url = host, state_dir, db_url
        self.libvirt_uri, self.actor, self.domain_type = libvirt_uri, actor, domain_type

    def __repr__(self) -> str:
        return (f"Config(root={self.host.root}, state_dir={self.state_dir}, db={self.db_url}, "
                f"libvirt={self.libvirt_uri})")

    @classmethod
    def resolve(cls, sysfs_root: str | None = None, state_dir: str | None = None, db: str | None = None,
                connect: str | None = None, actor: str | None = None) -> Config:
        from vgpumgr.userinput import files

        host = Host.from_env(sysfs_root)
        sd = state_dir or os.environ.get("VGPUMGR_STATE_DIR")
        if sd:
            state = files.checked_path(sd, "--state-dir")
            if os.path.lexists(state) and not files.is_dir(state, "--state-dir"):
                from vgpumgr.errors import InvalidInput

                raise InvalidInput(f"the state directory {sd} is not a directory",
                                   hint="pass --state-dir DIR (or VGPUMGR_STATE_DIR) of a directory, or a new path")
        elif host.simulated:
            state = host.root / ".vgpumgr-state"  # a simulated host keeps its DB and locks with it
        elif os.geteuid() == 0:
            state = Path("/var/lib/vgpumgr")
        else:
            state = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "vgpumgr"
        url = files.text_option(db or os.environ.get("VGPUMGR_DB") or f"sqlite:///{state / 'vgpumgr.db'}", "--db")
        uri = files.text_option(connect or os.environ.get("VGPUMGR_LIBVIRT_URI") or (
            "test:///default" if host.simulated else "qemu:///system"), "--connect")
        who = actor or os.environ.get("VGPUMGR_ACTOR") or _login()
        return cls(host=host, state_dir=state, db_url=url, libvirt_uri=uri, actor=who,
                   domain_type=os.environ.get("VGPUMGR_DOMAIN_TYPE", "kvm"))


def _login() -> str:
    try:
        import pwd

        return f"cli:{pwd.getpwuid(os.geteuid()).pw_name}"
    except (KeyError, ImportError):
        return f"cli:uid{os.geteuid()}"


def env_seconds(name: str, default: float, example: str) -> float:
    """A positive number of seconds from the environment variable `name`, or `default` when it is unset."""
    from vgpumgr.errors import InvalidInput

    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InvalidInput(f"{name}={raw!r} is not a positive number of seconds",
                           hint=f"unset it (default {default:g} s) or give e.g. {example}")
    return value

