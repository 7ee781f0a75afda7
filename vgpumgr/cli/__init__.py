"""The `vgpumgr` command: one module per command group, each writing to an output stream.
Layer 9 (front ends): may import everything but the simulator (which it reaches only by module name).
"""
