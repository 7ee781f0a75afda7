"""The `RmPVMRL` registry value: the vGPU scheduler the nvidia module sets up when it loads (docs/sources.md §24).

The only setting that survives a reboot or a driver reload (NVML's does not). Bit layout, from
`nvrm_registry.h` in NVIDIA's open GPU kernel modules, with the values NVIDIA's vGPU user guide documents:

    bit 0       1: software run list per VM (equal or fixed share); 0: best effort
    bit 1       1: adaptive round robin (strict round robin) off
    bits 7:4    policy: 0 equal share, 1 fixed share
    bits 21:12  scheduling frequency in Hz (ARR), 63..960, 0 = default
    bits 23:16  time slice in ms, 1..30, 0 = default
    bits 31:24  ARR averaging factor, 1..60, 0 = default

The frequency and time-slice fields overlap: one value sets one of them. Written per GPU into a modprobe
options file as `NVreg_RegistryDwordsPerDevice="pci=<BDF>;RmPVMRL=<value>[;pci=...]"`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vgpumgr import ids
from vgpumgr.errors import InvalidInput

ENABLE, ARR_OFF = 0x1, 0x2
FIXED = 0x10
TIMESLICE_MS = (1, 30)
FREQUENCY_HZ = (63, 960)
AVG_FACTOR = (1, 60)
DEFAULT_FILE = "etc/modprobe.d/vgpumgr-scheduler.conf"  # under the host root


@dataclass(frozen=True)
class Setting:
    policy: str  # best-effort | equal-share | fixed-share
    timeslice_ms: int | None = None
    frequency_hz: int | None = None
    avg_factor: int | None = None
    arr: bool = True


def _check(name: str, value: int | None, bounds: tuple[int, int]) -> None:
    if value is not None and not bounds[0] <= value <= bounds[1]:
        raise InvalidInput(f"{name} {value} is outside {bounds[0]}..{bounds[1]}",
                           hint=f"NVIDIA's RmPVMRL takes a {name} of {bounds[0]} to {bounds[1]}")


def encode(s: Setting) -> int:
    if s.policy == "best-effort":
        if s.timeslice_ms or s.frequency_hz or s.avg_factor:
            raise InvalidInput("best effort takes no time slice, frequency or averaging factor")
        return 0
    if s.policy not in ("equal-share", "fixed-share"):
        raise InvalidInput(f"'{s.policy}' is not a vGPU scheduler policy",
                           hint="use best-effort, equal-share or fixed-share")
    if s.timeslice_ms and (s.frequency_hz or s.avg_factor):
        raise InvalidInput("give a time slice or a frequency with an averaging factor, not both",
                           hint="RmPVMRL's time-slice and frequency fields overlap")
    _check("time slice (ms)", s.timeslice_ms, TIMESLICE_MS)
    _check("frequency (Hz)", s.frequency_hz, FREQUENCY_HZ)
    _check("averaging factor", s.avg_factor, AVG_FACTOR)
    value = ENABLE | (FIXED if s.policy == "fixed-share" else 0) | (0 if s.arr else ARR_OFF)
    value |= (s.timeslice_ms or 0) << 16
    value |= ((s.frequency_hz or 0) & 0x3FF) << 12
    value |= (s.avg_factor or 0) << 24
    return value


def decode(value: int) -> Setting:
    if not value & ENABLE:
        return Setting("best-effort")
    policy = "fixed-share" if (value >> 4) & 0xF == 1 else "equal-share"
    avg = (value >> 24) & 0xFF or None
    if avg or (value >> 12) & 0xF:  # the frequency field's low bits are below the time slice's
        return Setting(policy, frequency_hz=(value >> 12) & 0x3FF or None, avg_factor=avg,
                       arr=not value & ARR_OFF)
    return Setting(policy, timeslice_ms=(value >> 16) & 0xFF or None, arr=not value & ARR_OFF)


def hex_value(v: int) -> str:
    """As NVIDIA's guide writes them: 0x01, 0x11, 0x00180011."""
    return f"0x{v:02x}" if v < 0x100 else f"0x{v:08x}"


def options_line(per_gpu: dict[str, int]) -> str:
    """`options nvidia NVreg_RegistryDwordsPerDevice="pci=0000:3d:00.0;RmPVMRL=0x01;..."`."""
    parts = [f"pci={ids.pci_address(a)};RmPVMRL={hex_value(v)}" for a, v in sorted(per_gpu.items())]
    return f'options nvidia NVreg_RegistryDwordsPerDevice="{";".join(parts)}"'


HEADER = "# Written by `vgpumgr scheduler persist`"


def write(path: Path, per_gpu: dict[str, int], *, make_dir: bool = False) -> str:
    """Write the options file (atomically, vgpumgr.userinput.files); returns its text. No GPU left: the file is
    removed. A file that vgpumgr did not write (no header) is neither replaced nor removed. `make_dir`: create the
    directory (the default file's /etc/modprobe.d), never for a path the user named."""
    from vgpumgr.errors import Conflict
    from vgpumgr.userinput import files

    text = (f"{HEADER}: the vGPU scheduler of each GPU, read by the nvidia module\n"
            "# when it loads (reload the NVIDIA driver or reboot for a change to take effect).\n"
            + options_line(per_gpu) + "\n")
    what = "the scheduler's modprobe file"
    path = files.checked_path(path, what)
    if os.path.lexists(path):
        head = files.read(path, what=what, limit=1 << 16, hint="name another file with --file")
        if not head.startswith(HEADER.encode()):
            raise Conflict(f"{path} exists and was not written by `vgpumgr scheduler persist`",
                           hint="name another file with --file, or move that one away")
    if not per_gpu:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise files.refusal(e, path, "remove") from e
        return ""
    if make_dir:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise files.refusal(e, path.parent, "create") from e
    files.write(path, text.encode(), what=what, mode=0o644)
    return text
