"""Names of the device backends (kept apart from model.py so hot paths need not import dataclasses)."""

BACKEND_MDEV = "mdev"
BACKEND_NVIDIA_VF = "nvidia-vf"
BACKEND_PASSTHROUGH = "passthrough"
BACKEND_MIG = "mig"
BACKEND_VF = "vf"  # a whole SR-IOV VF of a vendor card (AMD GIM, Intel, Cambricon) given to a VM (vendors/profiles.py)
