"""The boot-time profile of a host whose vGPUs someone else assigns (a Nova compute node): which VFs each
PF has, which VF carries which vGPU type, MIG mode and GPU instances. `vgpumgr restore --profile FILE`
applies it next to vgpumgr's own records; `vgpumgr profile nova FILE` prints Nova's matching lines.

TOML (read with the standard library) or JSON, chosen by the file's suffix:

    [[gpu]]
    address = "0000:3d:00.0"
    vfs = 8                          # VFs enabled on this PF
    mig = true                       # MIG mode on (GPU instances imply it)
    gpu_instance = [{profile = "3g.40gb", start = 0}]
    vf = [{address = "0000:3d:00.4", type = "L40S-2Q", resource_class = "CUSTOM_NVIDIA_L40S_2Q"}]
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpumgr import ids
from vgpumgr.errors import InvalidInput, NotFound

_RESOURCE_CLASS = re.compile(r"^CUSTOM_[A-Z0-9_]{1,248}$")
_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._+-]{0,63}$")
_GPU_KEYS = {"address", "vfs", "mig", "gpu_instance", "vf"}
_VF_KEYS = {"address", "type", "resource_class", "alias"}
_GI_KEYS = {"profile", "start", "compute_instance"}


@dataclass(frozen=True)
class ProfileVf:
    address: str
    type: str  # nvidia-<id>, <id> or a type name (resolved on the host)
    resource_class: str
    alias: str


@dataclass(frozen=True)
class ProfileGi:
    profile: str
    start: int
    compute_instance: bool = False


@dataclass
class ProfileGpu:
    address: str
    vfs: int | None = None
    mig: bool | None = None
    gpu_instances: list[ProfileGi] = field(default_factory=list)
    vf_types: list[ProfileVf] = field(default_factory=list)


@dataclass
class BootProfile:
    path: str
    gpus: list[ProfileGpu]

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "gpu": [
            {"address": g.address, "vfs": g.vfs, "mig": g.mig,
             "gpu_instance": [{"profile": i.profile, "start": i.start, "compute_instance": i.compute_instance}
                              for i in g.gpu_instances],
             "vf": [{"address": v.address, "type": v.type, "resource_class": v.resource_class, "alias": v.alias}
                    for v in g.vf_types]} for g in self.gpus]}


def load(path: str | Path) -> BootProfile:
    from vgpumgr.userinput import files

    p = Path(path)
    hint = "write one (see docs/openstack.md) or pass another --profile"
    if not os.path.lexists(files.checked_path(p, "the profile")):
        raise NotFound(f"no profile file {p}", hint=hint)
    try:
        text = files.read(p, what="the profile", limit=1 << 20, hint=hint).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"the profile {p} is not UTF-8 text", hint=hint) from None
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise InvalidInput(f"{p} is not valid JSON: {e}", hint="fix the file, or write it as TOML") from e
    elif p.suffix == ".toml":
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise InvalidInput(f"{p} is not valid TOML: {e}", hint="fix the file, or write it as JSON") from e
    else:
        raise InvalidInput(f"{p}: a profile is a .toml or .json file", hint="rename it to profile.toml or .json")
    return parse(data, str(p))


def parse(data: Any, where: str = "profile") -> BootProfile:
    if not isinstance(data, dict) or set(data) - {"gpu"}:
        raise InvalidInput(f"{where}: the top level holds only a list `gpu` of GPUs",
                           hint="write [[gpu]] tables (TOML) or {\"gpu\": [...]} (JSON)")
    gpus = [_gpu(g, f"{where}: gpu[{i}]") for i, g in enumerate(_list(data.get("gpu", []), f"{where}: gpu"))]
    seen: dict[str, str] = {}
    for g in gpus:
        for a in [g.address] + [v.address for v in g.vf_types]:
            if a in seen:
                raise InvalidInput(f"{where}: {a} appears twice ({seen[a]} and gpu {g.address})",
                                   hint="name each GPU and each VF once")
            seen[a] = f"gpu {g.address}"
    return BootProfile(where.split(":")[0], gpus)


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidInput(f"{where} must be a list", hint="use [[...]] tables in TOML, [...] in JSON")
    return value


def _table(value: Any, keys: set[str], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidInput(f"{where} must be a table/object")
    extra = sorted(set(value) - keys)
    if extra:
        raise InvalidInput(f"{where}: unknown key(s) {', '.join(extra)}", hint=f"known keys: {', '.join(sorted(keys))}")
    return value


def _int(value: Any, where: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidInput(f"{where} must be a whole number ≥ {low}, not {value!r}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInput(f"{where} must be true or false, not {value!r}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidInput(f"{where} must be a string, not {value!r}")
    return value


def _gpu(value: Any, where: str) -> ProfileGpu:
    t = _table(value, _GPU_KEYS, where)
    if "address" not in t:
        raise InvalidInput(f"{where} has no address", hint='add address = "0000:3d:00.0" (the PF)')
    g = ProfileGpu(ids.pci_address(_str(t["address"], f"{where}.address")))
    if "vfs" in t:
        g.vfs = _int(t["vfs"], f"{where}.vfs")
    if "mig" in t:
        g.mig = _bool(t["mig"], f"{where}.mig")
    for i, gi in enumerate(_list(t.get("gpu_instance", []), f"{where}.gpu_instance")):
        w = f"{where}.gpu_instance[{i}]"
        gt = _table(gi, _GI_KEYS, w)
        if "profile" not in gt or "start" not in gt:
            raise InvalidInput(f"{w} needs a profile and a start",
                               hint='e.g. {profile = "3g.40gb", start = 4}; `vgpumgr mig list` shows placements')
        from vgpumgr.mig.plan import normalise_profile_name

        g.gpu_instances.append(ProfileGi(normalise_profile_name(_str(gt["profile"], f"{w}.profile")),
                                         _int(gt["start"], f"{w}.start"),
                                         _bool(gt.get("compute_instance", False), f"{w}.compute_instance")))
    if g.gpu_instances and g.mig is False:
        raise InvalidInput(f"{where}: GPU instances need MIG on, but mig = false", hint="drop one of the two")
    starts = [i.start for i in g.gpu_instances]
    if len(starts) != len(set(starts)):
        raise InvalidInput(f"{where}: two GPU instances start at the same slice")
    for i, vf in enumerate(_list(t.get("vf", []), f"{where}.vf")):
        g.vf_types.append(_vf(vf, f"{where}.vf[{i}]"))
    return g


def _vf(value: Any, where: str) -> ProfileVf:
    t = _table(value, _VF_KEYS, where)
    if "address" not in t or "type" not in t:
        raise InvalidInput(f"{where} needs an address and a type",
                           hint='e.g. {address = "0000:3d:00.4", type = "L40S-2Q"}')
    address = ids.pci_address(_str(t["address"], f"{where}.address"))
    vtype = _str(t["type"], f"{where}.type").strip()
    if not _TYPE.match(vtype):
        raise InvalidInput(f"{where}.type '{vtype}' is not a vGPU type", hint="use nvidia-<id> or a name like L40S-2Q")
    rc = _str(t.get("resource_class", default_resource_class(vtype)), f"{where}.resource_class")
    if not _RESOURCE_CLASS.match(rc):
        raise InvalidInput(f"{where}.resource_class '{rc}' is not a custom resource class",
                           hint="Nova's custom classes are CUSTOM_ followed by A-Z, 0-9 and _")
    alias = _str(t.get("alias", default_alias(vtype)), f"{where}.alias")
    if not _ALIAS.match(alias):
        raise InvalidInput(f"{where}.alias '{alias}' is not a usable alias name", hint="letters, digits, . _ -")
    return ProfileVf(address, vtype, rc, alias)


def default_resource_class(vtype: str) -> str:
    short = vtype.split()[-1]
    return "CUSTOM_NVIDIA_" + re.sub(r"[^A-Z0-9]+", "_", short.upper().removeprefix("NVIDIA-")).strip("_")


def default_alias(vtype: str) -> str:
    return "vgpu-" + re.sub(r"[^a-z0-9.]+", "-", vtype.split()[-1].lower()).strip("-")


def nova_lines(profile: BootProfile, vf_ids: dict[str, tuple[str, str]]) -> str:
    """Nova's `[pci]` lines for the profile's VF vGPUs: one device_spec per VF (`managed: no`: the VF stays on
    the nvidia driver), one type-VF alias per resource class. vf_ids: VF -> (vendor id, device id) when known."""
    specs, aliases = [], {}
    for g in profile.gpus:
        for v in g.vf_types:
            spec: dict[str, str] = {}
            if v.address in vf_ids:
                spec["vendor_id"], spec["product_id"] = vf_ids[v.address]
            spec |= {"address": v.address, "resource_class": v.resource_class, "managed": "no"}
            specs.append(f"device_spec = {json.dumps(spec)}")
            aliases.setdefault(v.alias, {"name": v.alias, "device_type": "type-VF",
                                         "resource_class": v.resource_class})
    if not specs:
        return "# the profile names no VF vGPUs: nothing for Nova's [pci] section\n"
    out = ["# nova.conf on this compute node (vGPU VFs prepared by `vgpumgr restore --profile`)", "[pci]",
           "report_in_placement = True", *specs, *(f"alias = {json.dumps(a)}" for a in aliases.values()), "",
           "[filter_scheduler]", "pci_in_placement = True", "",
           "# a flavor asks for one such vGPU with:"]
    out += [f"#   openstack flavor set FLAVOR --property \"pci_passthrough:alias\"=\"{a}:1\"" for a in aliases]
    return "\n".join(out) + "\n"
