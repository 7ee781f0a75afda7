"""`vgpumgr demo --profile all`: one host with every vendor, a VM on a slice of each vendor that slices, a VM on a
passthrough-only card, and a reboot that restore undoes (Ascend's VM mode, AMD's checked VF count, Intel's quotas,
every mdev). Each step is the real CLI command, as in demo.py."""

from __future__ import annotations

from collections.abc import Callable

ASCEND, ASCEND_910B, MTT, MLU, MI300X, FLEX, BMG = ("0000:81:00.0", "0000:83:00.0", "0000:85:00.0", "0000:87:00.0",
                                                    "0000:89:00.0", "0000:8b:00.0", "0000:8d:00.0")
SLICES = (("npu1", "vnpu-vir02"), ("mtt1", "mtgpu-1104"), ("mlu1", "MLU370-S4-1of4"), ("mi1", "MI300X-CPX"),
          ("flex1", "Flex170-1of8"), ("b60", "ArcProB60-1of4"))


def vendor_steps(run: Callable[..., str], say: Callable[[str], None]) -> None:
    say("2. Every card, named from the project's vendor table (pci.ids lacks the Ascend ids), and its mechanism")
    run("gpus", "--no-nvml")
    run("vendor", "list")

    say("3. The steps that make the slices: Ascend's vNPU VM mode (npu-smi), Intel's per-VF memory and VFs, "
        "Cambricon's VFs; AMD's VF count is GIM's, checked")
    run("vendor", "prepare", ASCEND)
    run("vendor", "prepare", FLEX, "--vfs", "8", "--vf-memory", "2000")
    run("vendor", "prepare", BMG, "--vfs", "4")
    run("vendor", "prepare", MLU, "--vfs", "4")
    run("vendor", "prepare", MI300X)
    run("vendor", "prepare", MI300X, "--vfs", "1", expect_fail=True)
    run("types", "--parent", ASCEND)
    run("types", "--parent", MTT, "--available")

    say("4. Where a vNPU would go, and a slice asked of a passthrough-only card")
    run("place", "--type", "vnpu-vir02", "--vm", "npu1", "--explain")
    run("vm", "create", "x", "--vgpu", "910B", expect_fail=True)

    say("5. A VM on a slice of each slicing vendor, and one on a whole Ascend 910B")
    for vm, slice_ in SLICES:
        run("vm", "create", vm, "--vgpu", slice_)
    run("vm", "create", "npu910", "--passthrough", ASCEND_910B)
    run("placements")

    say("6. A reboot: vNPU mode, mdevs, VFs and Intel's quotas are gone; GIM makes its VFs again itself")
    run("sim", "reboot")
    run("reconcile", expect_fail=True)
    run("restore")
    run("reconcile")
    run("vendor", "list")
