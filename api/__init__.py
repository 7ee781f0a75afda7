"""vgpumgr's REST service: FastAPI app (api.app), bearer tokens (api.tokens), server (api.server)."""
