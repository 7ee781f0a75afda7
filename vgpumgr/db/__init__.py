"""Persistence: models, engine/session setup and migrations, and the small store API the service uses.
Layer 5 (records): may import the base modules, hostfs, config, audit and licensing.
"""

from vgpumgr.db.session import (
    current_revision,
    default_db_url,
    downgrade,
    get_engine,
    make_engine,
    session_factory,
    upgrade,
)

__all__ = [
    "current_revision",
    "default_db_url",
    "downgrade",
    "get_engine",
    "make_engine",
    "session_factory",
    "upgrade",
]
