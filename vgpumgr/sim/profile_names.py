"""The simulator's profile names: the one table `sim create --profile` checks and its --help lists. It imports
nothing, so the CLI's parser can name every profile without loading the simulator (sim/profiles.py builds them)."""

NVIDIA = ("t4", "a40-sriov", "l40s-vfio", "a100-mig", "h100-mig", "gvtg", "samples", "mixed")
# accelerators besides NVIDIA, one card each (sim/vendor_gpus.py); "all" has every one with the mixed host's GPUs
VENDOR_CARDS = ("ascend-310p", "ascend-910b", "mtt-s4000", "mlu370", "mi300x", "flex170", "bmg", "dcu-k100",
                "metax-c500", "enflame-s60")
PROFILES = (*NVIDIA, *VENDOR_CARDS, "all")
