"""What other systems leave on the host or expect of it: Proxmox's run directory (pve_run), Nova's boot
profile, mdevctl's definitions, and the systemd units vgpumgr ships.
Layer 2 (drivers and rules): may import the base modules, hostfs, config and mig.
"""
