"""Reading the host through the one sysfs root: PCI facts, mdev types and instances, NVIDIA's and other
vendors' VFs, and the one snapshot of it all (inventory).
Layer 3 (devices): may import the base modules, hostfs, config, backends and vendors.
"""
