"""Device mode steps: what a vendor card needs before its slices exist, read, run, recorded and restored.

- `ascend-vnpu-mode`: Huawei's vNPU VM mode (`npu-smi set -t vnpu-mode -d 1`); until it is on, the vascend
  mdev types offer no instances. vgpumgr reads the mode from sysfs (instances offered, or mdevs present) and
  runs the vendor's tool to set it; the tool refuses while vNPUs of the other mode exist.
- `gim-vf-num`: AMD's GIM fixes the VF count (and with it the partition mode) when it loads; vgpumgr reads and
  checks it and never writes it: a different count means reloading GIM with the options it prints.
- `i915-lmem-quota` / `xe-vram-quota`: Intel's per-VF memory, written before the VFs are enabled
  (`iov/vfN/gt/lmem_quota` on the i915 backports, `sriov_admin/vfN/profile/vram_quota` on xe, Linux 7.0).

Each step's recorded value lives in `gpu_boot_state.vendor_state` (revision 0013_vendor_slices).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpumgr import ids
from vgpumgr.backends.common import wait_for, write
from vgpumgr.discovery.fs import listdir, read, read_int
from vgpumgr.errors import Conflict, InvalidInput, NotFound, Unavailable, VgpuError
from vgpumgr.hostfs.root import Host
from vgpumgr.vendors import profiles as vendors
from vgpumgr.vendors.quota_paths import quota_paths

NPU_SMI = "usr/local/sbin/npu-smi"  # where Huawei's driver package installs it
GIM_VF_NUM = "sys/module/gim/parameters/vf_num"


def card(host: Host, address: str) -> vendors.Profile:
    address = ids.pci_address(address)
    d = host.pci(address)
    if not d.exists():
        raise NotFound(f"no PCI device {address}", hint="`vgpumgr gpus` lists the GPUs and accelerators")
    vendor, device = vendors.ids_at(host, address)
    p = vendors.profile(vendor, device)
    if p is None or (d / "physfn").exists():
        raise InvalidInput(f"{address} ({vendor}:{device}) is not a vendor card vgpumgr has a profile for",
                           hint="`vgpumgr vendor list` shows the cards with vendor profiles")
    return p


@dataclass
class StepResult:
    step: str
    target: str
    ok: bool
    message: str
    current: Any = None
    hint: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


# -- Ascend vNPU mode ------------------------------------------------------------------------------------------


def ascend_mode(host: Host, pf: str) -> int:
    """1 (VM mode) when the vascend types offer instances or vNPU mdevs exist on the PF, else 0 (container)."""
    base = f"{host.pci(pf)}/mdev_supported_types"
    for t in listdir(base):
        if t.startswith("vnpu-") and ((read_int(f"{base}/{t}/available_instances", 0) or 0) > 0
                                      or listdir(f"{base}/{t}/devices")):
            return 1
    return 0


def npu_smi(host: Host) -> str:
    tool = os.environ.get("VGPUMGR_NPU_SMI")
    if tool:
        return tool
    if host.simulated:
        return str(host.root / NPU_SMI)  # the simulated root's npu-smi applies its effects to that root
    return shutil.which("npu-smi") or f"/{NPU_SMI}"


def run_tool(argv: list[str], what: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except FileNotFoundError as e:
        raise Unavailable(f"{what}: {argv[0]} is not installed",
                          hint="install the vendor's driver package (it brings the tool)") from e
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VgpuError(f"{what}: {' '.join(argv)} did not run: {e}", hint="run it by hand and check `dmesg`") from e
    if done.returncode != 0:
        raise Conflict(f"{what}: {' '.join(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv))} "
                       f"refused: {(done.stderr or done.stdout).strip()[-400:]}",
                       hint="vNPUs of the other mode must be destroyed first (npu-smi set -t destroy-vnpu ...); "
                            "the mode applies to every Ascend card of the host")
    return done.stdout


def set_ascend_mode(host: Host, pf: str, mode: int) -> StepResult:
    step = vendors.STEP_ASCEND_VM_MODE
    if ascend_mode(host, pf) == mode:
        return StepResult(step, pf, True, f"vNPU mode {mode_text(mode)} in place", mode)
    run_tool([npu_smi(host), "set", "-t", "vnpu-mode", "-d", str(mode)], f"setting vNPU mode {mode} on {pf}")
    if not wait_for(lambda: ascend_mode(host, pf) == mode, 0 if host.simulated else 10.0, 0.1):
        raise VgpuError(f"npu-smi set vnpu-mode {mode}, but {pf}'s vNPU types still offer "
                        f"{'no ' if mode else ''}instances", hint="check `npu-smi info` and the vascend driver")
    return StepResult(step, pf, True, f"vNPU mode set to {mode_text(mode)}", mode)


# -- AMD GIM vf_num -------------------------------------------------------------------------------------------


def gim_state(host: Host, pf: str) -> dict[str, Any]:
    d = host.pci(pf)
    vf_num = read(str(host.root / GIM_VF_NUM))
    return {"vf_num": int(vf_num.split(",")[0]) if vf_num and vf_num.split(",")[0].isdigit() else None,
            "numvfs": read_int(f"{d}/sriov_numvfs", 0) or 0,
            "spatial_partition_mode": read(f"{d}/spatial_partition_mode"),
            "memory_partition_mode": next(iter((read(f"{d}/memory_partition_mode") or "").splitlines()), None)}


def gim_reload_hint(n: int) -> str:
    acc, mem = vendors.GIM_PARTITIONS.get(n, ("?", "?"))
    return (f"stop every VM on the GPU, then reload GIM: `modprobe -r gim && modprobe gim vf_num={n}` "
            f"({acc}/{mem}); to keep it over reboots put `options gim vf_num={n}` in /etc/modprobe.d/gim.conf "
            f"(and vf_num={n} in /etc/gim_config)")


def check_gim(host: Host, pf: str, want: int) -> StepResult:
    st = gim_state(host, pf)
    have = st["numvfs"]
    mode = f"{st['spatial_partition_mode'] or '?'}/{st['memory_partition_mode'] or '?'}"
    if have == want:
        return StepResult(vendors.STEP_GIM_VF_NUM, pf, True, f"{have} VFs from GIM (vf_num={st['vf_num']}, {mode})",
                          st)
    return StepResult(vendors.STEP_GIM_VF_NUM, pf, False,
                      f"GIM made {have} VFs (vf_num={st['vf_num']}, {mode}), {want} are recorded; vgpumgr never "
                      "changes GIM's VF count (sriov_numvfs is not GIM's interface)", st, gim_reload_hint(want))


# -- Intel per-VF memory quotas -------------------------------------------------------------------------------


def quotas(host: Host, pf: str, p: vendors.Profile, count: int | None = None) -> dict[str, int]:
    """{VF number (1-based): quota in bytes} for the first `count` VFs (default: the enabled ones)."""
    n = count if count is not None else read_int(f"{host.pci(pf)}/sriov_numvfs", 0) or 0
    return {str(i): read_int(path, 0) or 0 for i, path in quota_paths(host, pf, p).items() if i <= n}


def set_quotas(host: Host, pf: str, p: vendors.Profile, want: dict[str, int]) -> StepResult:
    step = vendors.STEP_XE_VRAM_QUOTA if p.family == "intel-xe" else vendors.STEP_I915_LMEM_QUOTA
    have = quotas(host, pf, p, max((int(k) for k in want), default=0))
    if have == want:
        return StepResult(step, pf, True, f"per-VF memory quotas in place ({quotas_text(want)})", want)
    if read_int(f"{host.pci(pf)}/sriov_numvfs", 0):
        return StepResult(step, pf, False, f"{pf} has VFs enabled with other quotas ({quotas_text(have)})", have,
                          "quotas are written before VFs are enabled: release the VFs' VMs, "
                          f"`vgpumgr sriov set {pf} 0`, then run this again")
    paths = quota_paths(host, pf, p)
    missing = [k for k in want if int(k) not in paths]
    if missing:
        raise InvalidInput(f"{pf} has no VF {missing[0]}", hint=f"it offers {len(paths)} VFs")
    before = {n: read_int(path, 0) or 0 for n, path in paths.items()}
    target = {n: want.get(str(n), 0 if p.family == "intel-i915" else before[n]) for n in paths}
    try:
        _write_quotas(host, pf, paths, before, target)
    except VgpuError as e:
        _put_back(host, pf, paths, before, e)  # nothing half-set
        raise
    return StepResult(step, pf, True, f"per-VF memory quotas written ({quotas_text(want)})", want)


def all_quotas(host: Host, pf: str, p: vendors.Profile) -> dict[int, int]:
    """{VF number: quota in bytes} of every VF the PF offers, enabled or not (what `put_back_quotas` takes)."""
    return {n: read_int(path, 0) or 0 for n, path in quota_paths(host, pf, p).items()}


def put_back_quotas(host: Host, pf: str, p: vendors.Profile, before: dict[int, int], error: VgpuError) -> None:
    """The quotas as `all_quotas` read them before, written back after `error` (a later step failed)."""
    paths = quota_paths(host, pf, p)
    _put_back(host, pf, {n: paths[n] for n in before if n in paths}, before, error)


def _put_back(host: Host, pf: str, paths: dict[int, str], before: dict[int, int], error: VgpuError) -> None:
    """Write `before` back; a write that fails too is added to `error`'s hint, never raised in its place."""
    try:
        _write_quotas(host, pf, paths, {n: read_int(paths[n], 0) or 0 for n in paths}, before)
    except VgpuError as undo:
        error.hint = (f"{error.hint}; " if error.hint else "") + \
            f"the quotas written before it could not be put back ({undo.message}): check `vgpumgr vendor list`"


def _write_quotas(host: Host, pf: str, paths: dict[int, str], now: dict[int, int], target: dict[int, int]) -> None:
    """Lowered quotas first (the driver checks each write against what is free), then raised ones."""
    changes = [(n, v) for n, v in target.items() if v != now[n]]
    for n, v in sorted(changes, key=lambda c: (c[1] > now[c[0]], c[0])):
        write(host, Path(paths[n]), str(v), f"writing the memory quota of VF {n} on {pf}")


# -- a step's state in words: the one wording of `vendor list`, the steps' messages, reconcile and restore ----


def mode_text(mode: int) -> str:
    return f"{mode} ({'VM' if mode else 'container'})"


def quotas_text(q: dict[str, int]) -> str:
    sizes = sorted({int(v) >> 20 for v in q.values()})
    return f"{len(q)} VF quota(s) {'/'.join(map(str, sizes))} MiB" if q else "no VF quota"


def step_text(value: Any) -> str:
    """One step's state as `vendor_state` records it (`observed`), in words; a record that cannot be read as
    its own text (reconcile names it, `recorded` says why)."""
    try:
        if "mode" in value:
            return f"vnpu-mode {mode_text(int(value['mode']))}"
        if "vf_num" in value:
            return f"GIM VFs {int(value['vf_num'])}"
        if "quotas" in value:
            return quotas_text(value["quotas"])
    except (AttributeError, TypeError, ValueError):
        pass
    return str(value)


def state_text(state: dict[str, Any]) -> str:
    """A card's recorded or observed steps, in words ("-" for none)."""
    return "; ".join(step_text(v) for v in state.values()) or "-"


# -- what to record, and one step run from a record ------------------------------------------------------------


def observed(host: Host, pf: str) -> dict[str, Any]:
    """The vendor state of a card as it is now, as `vendor_state` records it."""
    try:
        p = card(host, pf)
    except VgpuError:
        return {}
    out: dict[str, Any] = {}
    if vendors.STEP_ASCEND_VM_MODE in p.steps:
        out[vendors.STEP_ASCEND_VM_MODE] = {"mode": ascend_mode(host, pf)}
    if vendors.STEP_GIM_VF_NUM in p.steps:
        out[vendors.STEP_GIM_VF_NUM] = {"vf_num": gim_state(host, pf)["numvfs"]}
    for step in (vendors.STEP_I915_LMEM_QUOTA, vendors.STEP_XE_VRAM_QUOTA):
        if step in p.steps:
            q = quotas(host, pf, p)
            if q:
                out[step] = {"quotas": q}
    return out


def to_record(state: dict[str, Any]) -> dict[str, Any]:
    """What of `observed` goes into `vendor_state`: GIM's VF count is recorded once, as the PF's VF count
    (gpu_boot_state.numvfs), which restore and reconcile check it against (records from before issue 42 kept it
    here too; they are still read)."""
    return {k: v for k, v in state.items() if k != vendors.STEP_GIM_VF_NUM}


def apply(host: Host, pf: str, step: str, value: dict[str, Any], p: vendors.Profile | None = None) -> StepResult:
    """Bring one recorded step back (restore), or say what is in the way. `p`: the card, where the caller read it."""
    p = p or card(host, pf)
    rec = recorded(pf, step, value)
    if step == vendors.STEP_ASCEND_VM_MODE:
        return set_ascend_mode(host, pf, rec["mode"])
    if step == vendors.STEP_GIM_VF_NUM:
        return check_gim(host, pf, rec["vf_num"])
    return set_quotas(host, pf, p, rec["quotas"])


def read_step(host: Host, pf: str, step: str, value: dict[str, Any], p: vendors.Profile | None = None
              ) -> StepResult:
    """The same check without changing anything (restore --dry-run, reconcile's drift)."""
    p = p or card(host, pf)
    rec = recorded(pf, step, value)
    if step == vendors.STEP_ASCEND_VM_MODE:
        mode = ascend_mode(host, pf)
        return StepResult(step, pf, mode == rec["mode"], f"now {step_text({'mode': mode})}", mode)
    if step == vendors.STEP_GIM_VF_NUM:
        return check_gim(host, pf, rec["vf_num"])
    want = rec["quotas"]
    have = quotas(host, pf, p, max((int(k) for k in want), default=0))
    return StepResult(step, pf, have == want, f"now {quotas_text(have)}", have)


QUOTA_STEPS = (vendors.STEP_I915_LMEM_QUOTA, vendors.STEP_XE_VRAM_QUOTA)


def recorded(pf: str, step: str, value: Any) -> dict[str, Any]:
    """One step's record as `observed` wrote it, checked: a step this vgpumgr does not know (a newer one recorded
    it) or a record it cannot read is an error, never taken for another step or for "in place"."""
    try:
        if step == vendors.STEP_ASCEND_VM_MODE:
            return {"mode": int(value.get("mode", 1))}
        if step == vendors.STEP_GIM_VF_NUM:
            return {"vf_num": int(value["vf_num"])}
        if step in QUOTA_STEPS:
            return {"quotas": {str(int(k)): int(v) for k, v in value.get("quotas", {}).items()}}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        field = f"no {e}" if isinstance(e, KeyError) else str(e)
        raise Conflict(f"the recorded {step} step of {pf} cannot be read ({field}): {value!r}",
                       hint=f"record the card's state again: `vgpumgr vendor prepare {pf}` (with its --vfs)") from e
    raise Conflict(f"unknown vendor step '{step}' recorded for {pf} by a newer vgpumgr",
                   hint="upgrade vgpumgr on this host; this version knows " + ", ".join(
                       (vendors.STEP_ASCEND_VM_MODE, vendors.STEP_GIM_VF_NUM, *QUOTA_STEPS)))


def card_or_none(host: Host, pf: str) -> vendors.Profile | None:
    """`card`, or None where `pf` is no vendor card with a profile (an NVIDIA GPU, a virtual mdev parent)."""
    try:
        return card(host, pf)
    except VgpuError:
        return None
