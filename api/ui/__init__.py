"""The admin web view under /ui (server-rendered pages, no JavaScript build, nothing fetched from elsewhere)."""

from api.ui.routes import router

__all__ = ["router"]
