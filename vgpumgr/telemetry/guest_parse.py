"""Reading a vendor tool's output from inside a tenant's guest, as untrusted input (docs/sources.md §25).

The tenant controls the guest: its "nvidia-smi" may print anything. So a reading is accepted only in the exact
shape asked for (one CSV line per GPU, the asked fields in their order), every number is checked against its
range, "[N/A]" / "[Not Supported]" mean unknown (never 0), nothing from the output becomes a label or a key
(the guest's own GPU UUIDs are not kept), and output that breaks any of this is refused as a whole: a refused
reading changes nothing but that VM's row, which then says "output refused" and why.
"""

from __future__ import annotations

import math
import re
from typing import Any

NVIDIA_FIELDS = ("index", "driver_version", "utilization.gpu", "utilization.memory", "memory.used", "memory.total")
NVIDIA_ARGS = (f"--query-gpu={','.join(NVIDIA_FIELDS)}", "--format=csv,noheader,nounits")
NPU_ARGS = ("info", "-t", "usages", "-i", "0", "-c", "0")
MAX_GPUS = 16  # a VM with more GPUs in its output than this is lying
MAX_MIB = 1 << 24  # 16 TiB of device memory
UNKNOWN = {"[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", "[insufficient permissions]",
           "[gpu is lost]", "[gpu requires reset]"}
_DRIVER = re.compile(r"^[0-9]{2,4}(\.[0-9]{1,5}){1,3}$")
_NPU_KEYS = {"npu utilization(%)": "gpu", "aicore usage rate(%)": "aicore", "hbm usage rate(%)": "memory"}


class Refused(ValueError):
    """The output is not a reading: the VM's row says why (the text is vgpumgr's, never the guest's)."""


def _number(raw: str, what: str, low: float, high: float) -> float | None:
    text = raw.strip()
    if text.lower() in UNKNOWN:
        return None
    if len(text) > 24:
        raise Refused(f"{what}: a value of {len(text)} characters")
    try:
        value = float(text)
    except ValueError:
        raise Refused(f"{what}: not a number") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise Refused(f"{what}: {value:g} is outside {low:g}..{high:g}")
    return value


def _text(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused("not UTF-8 text") from None
    if any(ord(c) < 32 and c not in "\r\n\t" for c in text):
        raise Refused("control characters in the output")
    return text


def nvidia_smi(raw: bytes, max_gpus: int = MAX_GPUS) -> list[dict[str, Any]]:
    """`nvidia-smi --query-gpu=<NVIDIA_FIELDS> --format=csv,noheader,nounits` -> one reading per GPU:
    {"index", "driver", "util": {"gpu", "memory"} (ratios 0..1 or None), "memory_used_bytes", "memory_total_bytes"}."""
    lines = [ln for ln in _text(raw).splitlines() if ln.strip()]
    if not lines:
        raise Refused("no GPU in the output")
    if len(lines) > max_gpus:
        raise Refused(f"{len(lines)} GPUs in the output, more than the {max_gpus} a VM may have")
    out, seen = [], set()
    for n, line in enumerate(lines):
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(NVIDIA_FIELDS):
            raise Refused(f"line {n + 1}: {len(cells)} fields, {len(NVIDIA_FIELDS)} asked for")
        index = _number(cells[0], "index", 0, max_gpus - 1)
        if index is None or index != int(index) or int(index) in seen:
            raise Refused(f"line {n + 1}: no GPU index, or one given twice")
        seen.add(int(index))
        driver = cells[1] if _DRIVER.match(cells[1]) else None
        if driver is None and cells[1].lower() not in UNKNOWN:
            raise Refused(f"line {n + 1}: the driver version is not a version")
        gpu, mem = (_number(cells[i], f"line {n + 1} {NVIDIA_FIELDS[i]}", 0, 100) for i in (2, 3))
        used, total = (_number(cells[i], f"line {n + 1} {NVIDIA_FIELDS[i]}", 0, MAX_MIB) for i in (4, 5))
        if used is not None and total is not None and used > total:
            raise Refused(f"line {n + 1}: {used:g} MiB used of {total:g} MiB")
        out.append({"index": int(index), "driver": driver,
                    "util": {"gpu": None if gpu is None else gpu / 100, "memory": None if mem is None else mem / 100},
                    "memory_used_bytes": None if used is None else int(used) << 20,
                    "memory_total_bytes": None if total is None else int(total) << 20})
    return sorted(out, key=lambda r: r["index"])


def npu_smi(raw: bytes) -> list[dict[str, Any]]:
    """`npu-smi info -t usages -i 0 -c 0` ("Key : value" lines) -> one reading (the first chip of the first NPU).
    Only the usage rates are read; Ascend's AI-core rate may stay 0 under vNPU splitting (one operator's
    report), so it is kept apart from the NPU utilisation."""
    found: dict[str, float | None] = {}
    lines = _text(raw).splitlines()
    if len(lines) > 200:
        raise Refused(f"{len(lines)} lines, far more than npu-smi prints")
    for line in lines:
        key, sep, value = line.partition(":")
        name = _NPU_KEYS.get(key.strip().lower())
        if sep and name:
            if name in found:
                raise Refused(f"'{key.strip()}' given twice")
            found[name] = _number(value, key.strip(), 0, 100)
    if "gpu" not in found and "aicore" not in found:
        raise Refused("no usage rate in the output")
    ratio = {k: (None if v is None else v / 100) for k, v in found.items()}
    return [{"index": 0, "driver": None, "util": {"gpu": ratio.get("gpu", ratio.get("aicore")),
                                                   "memory": ratio.get("memory")},
             "memory_used_bytes": None, "memory_total_bytes": None}]
