"""A reboot gives back what the host offered (issue 38): the VF count of NVIDIA SR-IOV GPUs is recorded with or
without vGPUs on them, `restore` enables the VFs again; an allocation on a GPU whose VFs are off says so and what
to run; "did you mean" never offers the name that was typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simhost import run

from vgpumgr.config import Config
from vgpumgr.placement.placer import _close_names
from vgpumgr.service import Service
from vgpumgr.sim import profiles

L40S = "0000:3d:00.0"


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = profiles.create(tmp_path / "host", "all")
    monkeypatch.setenv("VGPUMGR_SYSFS_ROOT", str(root))
    monkeypatch.setenv("VGPUMGR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VGPUMGR_LIBVIRT_URI", "test:///default")
    return root


def offered() -> set[tuple[str, str]]:
    return {(t["gpu"] or t["parent"], t["name"]) for t in json.loads(run("types", "--json")[1])}


def test_after_a_reboot_and_restore_the_host_offers_every_type_it_offered(host: Path) -> None:
    before = offered()
    assert any(gpu == L40S for gpu, _ in before)
    assert run("restore")[0] == 0  # the boot's restore: it records the VFs it finds, no vGPU on the L40S
    assert run("sim", "reboot")[0] == 0
    assert not any(gpu == L40S for gpu, _ in offered())
    rc, out, _ = run("restore")
    assert rc == 0 and f"enable 8 VFs on {L40S} (from records)" in out, out
    assert offered() == before


def test_an_allocation_on_a_gpu_whose_vfs_are_off_says_so_and_what_to_run(host: Path) -> None:
    assert run("sim", "reboot")[0] == 0
    for typed in ("L40S-4Q", "l40s-4q", "NVIDIA L40S-4Q"):
        rc, _, err = run("vm", "create", "x", "--vgpu", typed)
        assert rc == 3 and f"the SR-IOV VFs of NVIDIA L40S at {L40S} are off" in err, err
        assert f"/usr/lib/nvidia/sriov-manage -e {L40S}" in err and "vgpumgr restore" in err
        assert "did you mean" not in err


def test_did_you_mean_never_offers_the_name_typed(host: Path) -> None:
    assert run("sim", "break", "vfs-off", "--gpu", L40S)[0] == 0
    px = Service(Config.resolve()).snapshot().placer  # with NVML's catalogue: the L40S's types are known
    hint = _close_names(px, "L40S-4Q")
    assert hint.startswith("did you mean") and "L40S-48Q" in hint
    assert "L40S-4Q," not in hint and "L40S-4Q?" not in hint
