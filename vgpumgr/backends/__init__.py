"""One backend per device kind (mdev, NVIDIA VF, SR-IOV VF, vendor VF, passthrough), each with the same
create/remove contract and a revert on failure.
Layer 3 (devices): may import the base modules, hostfs, config, discovery and vendors.
"""
