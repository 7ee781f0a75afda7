"""The near-copies issue 42 listed, each folded into one place: no production module outside that place reads or
builds the thing again. Behaviour that changed with a fold is tested next to its module (named in each test)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = sorted(p for d in ("vgpumgr", "api") for p in (ROOT / d).rglob("*.py")
                    if "sim" not in p.relative_to(ROOT).parts[1:2])


def places(pattern: str, files: list[Path] = PRODUCTION, root: Path = ROOT) -> list[str]:
    """The production modules (the simulator left out: it is the kernel's side) whose code matches `pattern`."""
    rx = re.compile(pattern)
    return sorted(str(p.relative_to(root)) for p in files if rx.search(p.read_text()))


def test_the_check_sees_a_planted_copy(tmp_path: Path) -> None:
    planted = tmp_path / "vgpumgr" / "ops" / "copy.py"
    planted.parent.mkdir(parents=True)
    planted.write_text('facts = ((nvml or {}).get("vgpu") or {}).get("mixed_size")\n')
    assert places(r'\.get\("mixed_size"\)', [planted], tmp_path) == ["vgpumgr/ops/copy.py"]


def test_one_reader_of_a_gpus_mixed_size_facts() -> None:
    assert places(r'\.get\("mixed_size"\)') == ["vgpumgr/nvidia/mixed.py"]


@pytest.mark.parametrize(("nvml", "facts", "mode"), [
    ({"vgpu": {"mixed_size": {"mode": "mixed", "capable": True}}}, {"mode": "mixed", "capable": True}, "mixed"),
    ({"vgpu": {"mixed_size": {"mode": "equal"}}}, {"mode": "equal"}, "equal"),
    ({"vgpu": {"mixed_size": None}}, {}, None),
    ({"vgpu": {"mixed_size": "unknown"}}, {}, None),  # a record the old readers crashed on (str has no .get)
    ({"vgpu": []}, {}, None),
    ({}, {}, None),
    (None, {}, None),
])
def test_mixed_size_facts_of_any_recorded_shape(nvml: object, facts: dict, mode: str | None) -> None:
    from vgpumgr.nvidia import mixed

    assert dict(mixed.facts_of(nvml)) == facts and mixed.mode_of(nvml) == mode


def test_one_way_to_read_pci_ids_and_find_a_cards_profile() -> None:
    """Issue 42: the vendor profile lookup from an address was written three times (vendor steps, vendor VF
    discovery, and PCI discovery's own id cleaning); vendors.profiles.profile_at / ids_at and fs.read_id now."""
    assert places(r'removeprefix\("0x"\)|startswith\("0x"\)') == ["vgpumgr/discovery/fs.py"]
    assert places(r"mechanism (not )?in \(") == ["vgpumgr/vendors/profiles.py"]


def test_profile_at_reads_what_discovery_reads(tmp_path: Path) -> None:
    from simhost import make

    from vgpumgr.discovery.pci import discover_gpus
    from vgpumgr.vendors import profiles

    host = make(tmp_path, "all")
    cards = [g for g in discover_gpus(host) if profiles.profile(g.vendor_id, g.device_id)]
    assert len(cards) >= 8
    for g in cards:
        assert profiles.ids_at(host, g.address) == (g.vendor_id, g.device_id)
        assert profiles.profile_at(host, g.address) is profiles.profile(g.vendor_id, g.device_id)
    assert profiles.profile_at(host, "0000:ff:1f.7") is None and profiles.ids_at(host, "0000:ff:1f.7") == ("", "")


def test_one_place_builds_intels_per_vf_quota_paths() -> None:
    assert places(r"vf\{[^}]+\}/(gt|profile)/|iov/vf\"|sriov_admin/vf\"") == ["vgpumgr/vendors/quota_paths.py"]


def test_the_quotas_the_steps_write_are_the_sizes_discovery_reads(tmp_path: Path) -> None:
    from simhost import make

    from vgpumgr.discovery import vendor_vf
    from vgpumgr.vendors import profiles, steps
    from vgpumgr.vendors.quota_paths import quota_path, quota_paths

    host = make(tmp_path, "all")
    for pf, mib in (("0000:8b:00.0", 2000), ("0000:8d:00.0", 6144)):  # i915 Flex 170, xe Arc Pro B60
        card = profiles.profile_at(host, pf)
        assert card is not None and card.family.startswith("intel-")
        paths = quota_paths(host, pf, card)
        assert sorted(paths) == list(range(1, len(paths) + 1)) and len(paths) >= 8
        assert all(quota_path(host, pf, card, n) == p for n, p in paths.items())
        assert steps.set_quotas(host, pf, card, {"1": mib << 20, "2": mib << 20}).ok
        assert [vendor_vf.vf_quota_mb(host, pf, card, n) for n in (1, 2)] == [mib, mib]
    mi300 = profiles.profile_at(host, "0000:89:00.0")
    assert mi300 is not None and quota_paths(host, "0000:89:00.0", mi300) == {}


def test_one_wording_of_a_vendor_steps_state() -> None:
    """`vendor list`, the steps' own messages, reconcile's drift and restore's plan say a step's state in the same
    words (vendors.steps.step_text); before issue 42 the list said "8 VF quota(s) 2000 MiB", a step "8 VF(s) x 2000
    MiB" and reconcile "8 VF quota(s)"."""
    from vgpumgr.vendors import steps

    assert places(r"'VM' if|VF\(s\) x|VF quota\(s\)") == ["vgpumgr/vendors/steps.py"]
    assert steps.state_text({"ascend-vnpu-vm-mode": {"mode": 1}, "gim-vf-num": {"vf_num": 8},
                             "i915-lmem-quota": {"quotas": {"1": 2000 << 20, "2": 2000 << 20}}}) \
        == "vnpu-mode 1 (VM); GIM VFs 8; 2 VF quota(s) 2000 MiB"
    assert steps.state_text({}) == "-" and steps.step_text({"quotas": {}}) == "no VF quota"
    assert steps.step_text({"mode": "x"}) == "{'mode': 'x'}"  # a record it cannot read is shown as it is
