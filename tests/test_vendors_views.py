"""Other vendors' cards in the web view's slot maps, the fleet's capacity rows (checked against placement itself,
as tests/test_fleet_capacity.py does for NVIDIA), the REST API and the metrics."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest
from simhost import run
from test_api import ApiEnv, make_env
from test_fleet_capacity import _check_against_placement, live_records_of
from test_ui import cli, login, page_types

from vgpumgr.config import Config
from vgpumgr.fleet import capacity
from vgpumgr.service import Service
from vgpumgr.sim import profiles

ASCEND, MTT, MLU, MI300X, FLEX, BMG, K100 = ("0000:81:00.0", "0000:85:00.0", "0000:87:00.0", "0000:89:00.0",
                                             "0000:8b:00.0", "0000:8d:00.0", "0000:8f:00.0")


@pytest.fixture
def env(tmp_path: Path) -> ApiEnv:
    e, client = make_env(tmp_path, "all")
    with client:
        yield e


def test_slot_maps_of_vendor_cards(env: ApiEnv) -> None:
    cli(env, "vendor", "prepare", ASCEND, "--json")
    env.service.invalidate()
    env.service.allocate("vnpu-vir02", vm="npu1")
    env.service.allocate("MI300X-CPX", vm="mi1")
    login(env, "auditor")
    cli_types = cli(env, "types", "--json")
    for gpu in (ASCEND, MTT, MI300X):
        want: dict[str, int] = defaultdict(int)
        for t in cli_types:
            if t["gpu"] == gpu or t["parent"] == gpu:
                want[t["type"]] += t["available_instances"]
        if gpu == MI300X:
            want["vf-mi300x_cpx"] -= 1  # sysfs cannot see that a VF is taken: the page takes the records' word
        html = env.client.get(f"/ui/gpus/{gpu}").text
        assert page_types(html) == dict(want), gpu
    ascend = env.client.get(f"/ui/gpus/{ASCEND}").text
    assert "Huawei Ascend 310P" in ascend and "npu1" in ascend
    mi = env.client.get(f"/ui/gpus/{MI300X}").text
    assert len(re.findall(r'<tr id="vf-', mi)) == 8 and "mi1" in mi
    assert env.client.get(f"/ui/gpus/{K100}").status_code == 200  # a passthrough-only card has a page too


def test_rest_allocates_a_vendor_slice(env: ApiEnv) -> None:
    r = env.client.post("/v1/vgpus", json={"type": "Flex170-1of8", "vm": "rest1"}, headers=env.headers["operator"])
    assert r.status_code == 404 and f"vgpumgr vendor prepare {FLEX} --vfs N" in r.text  # no VFs yet: says how
    cli(env, "vendor", "prepare", FLEX, "--vfs", "4", "--vf-memory", "4000", "--json")
    env.service.invalidate()
    r = env.client.post("/v1/vgpus", json={"type": "Flex170-1of4", "vm": "rest1"}, headers=env.headers["operator"])
    assert r.status_code == 201, r.text
    assert (r.json()["backend"], r.json()["pci_address"]) == ("vf", "0000:8b:00.4")
    cards = {c["address"]: c for c in env.client.get("/v1/vendors", headers=env.headers["auditor"]).json()}
    assert cards[FLEX]["state"]["i915-lmem-quota"]["quotas"]["4"] == 4000 << 20
    assert (cards[MI300X]["mechanism"], cards[K100]["mechanism"]) == ("module-vfs", "passthrough")
    assert env.client.get("/v1/vendors").status_code == 401
    metrics = env.client.get("/metrics", headers=env.headers["auditor"]).text
    m = re.search(rf'vgpumgr_vendor_slice_memory_bytes{{gpu="{FLEX}",parent="0000:8b:00.4",'
                  rf'type="vf-flex170_1of4"}} (\S+)', metrics)
    assert m and float(m.group(1)) == 4000 << 20  # the VF's lmem_quota
    assert f'vgpumgr_vendor_slices_available{{gpu="{ASCEND}",type="vnpu-vir01"}} 0.0' in metrics  # not in VM mode
    assert 'vgpumgr_gpus{model="Huawei Ascend 310P"} 1.0' in metrics


def test_fleet_capacity_rows_equal_placement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = profiles.create(tmp_path / "sim", "all")
    cfg = Config.resolve(sysfs_root=str(root), state_dir=str(tmp_path / "state"))
    assert run("--sysfs-root", str(root), "--state-dir", str(tmp_path / "state"), "vendor", "prepare", ASCEND)[0] == 0
    assert run("--sysfs-root", str(root), "--state-dir", str(tmp_path / "state"), "vendor", "prepare", MLU,
               "--vfs", "4")[0] == 0
    svc = Service(cfg)
    assert _check_against_placement(svc, monkeypatch) > 0
    for t, vm in (("vnpu-vir04", "a"), ("mtgpu-2132", "b"), ("MI300X-CPX", "c"), ("MI300X-CPX", "d"),
                  ("MLU370-S4-1of4", "e")):
        svc.allocate(t, vm=vm)
    rows = {g.address: g for g in capacity.host_capacity(svc.snapshot(refresh=True).placer, live_records_of(svc))}
    _check_against_placement(svc, monkeypatch)
    modes = {a: rows[a].mode for a in (ASCEND, MTT, MLU, MI300X, K100)}
    assert modes == {ASCEND: "mdev", MTT: "mdev", MLU: "vf", MI300X: "vf", K100: "passthrough"}
    by = {t.type: t for t in rows[MI300X].types}
    assert (by["vf-mi300x_cpx"].free, by["vf-mi300x_cpx"].used) == (6, 2)
    by = {t.type: t for t in rows[ASCEND].types}
    assert (by["vnpu-vir04"].used, by["vnpu-vir04"].free, by["vnpu-vir01"].free) == (1, 0, 3)
    assert rows[K100].types == () and rows[K100].model == "Hygon DCU K100_AI"
