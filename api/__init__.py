"""vgpumgr's REST service: FastAPI app (api.app), bearer tokens (api.tokens), server (api.server).
Layer 8 (front ends): may import every vgpumgr layer but the CLI and the simulator."""
