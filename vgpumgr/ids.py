"""Validation of every identifier that may end up in a path, and vGPU type-name parsing.

Nothing in vgpumgr builds a sysfs path from a string that has not passed through here first.
"""

from __future__ import annotations

import os
import re
from collections import namedtuple
from functools import cache, lru_cache

from vgpumgr.errors import InvalidInput


class _lazy:
    """A regex compiled on first use: the CLI's start path should not pay for patterns it never uses."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern

    @property
    def _re(self) -> re.Pattern[str]:
        return _compile(self.pattern)

    def match(self, text: str) -> re.Match[str] | None:
        return self._re.match(text)


@cache
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)

_PCI_FULL = _lazy(r"^([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-1][0-9a-fA-F])\.([0-7])$")
_PCI_SHORT = _lazy(r"^([0-9a-fA-F]{2}):([0-1][0-9a-fA-F])\.([0-7])$")
_PCI_NVML = _lazy(r"^([0-9a-fA-F]{8}):([0-9a-fA-F]{2}):([0-1][0-9a-fA-F])\.([0-7])$")
_UUID = _lazy(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
# sysfs type directory names: "<driver>-<name>", e.g. nvidia-232, mtty-1, i915-GVTg_V5_4
_TYPE_DIR = _lazy(r"^[A-Za-z0-9][A-Za-z0-9_]*-[A-Za-z0-9_]+$")
# virtual mdev parents: class device names such as mtty, mdpy, mbochs
_VIRTUAL_PARENT = _lazy(r"^[a-z][a-z0-9_]{0,31}$")
_VM_NAME = _lazy(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")


def pci_address(text: str) -> str:
    """Return the canonical `dddd:bb:ss.f` (lower case) or raise InvalidInput.

    Accepts the short `bb:ss.f` form and NVML's 8-digit domain form."""
    s = (text or "").strip()
    m = _PCI_FULL.match(s)
    if m:
        return f"{m[1]}:{m[2]}:{m[3]}.{m[4]}".lower()
    m = _PCI_SHORT.match(s)
    if m:
        return f"0000:{m[1]}:{m[2]}.{m[3]}".lower()
    m = _PCI_NVML.match(s)
    if m and int(m[1], 16) <= 0xFFFF:
        return f"{int(m[1], 16):04x}:{m[2]}:{m[3]}.{m[4]}".lower()
    raise InvalidInput(
        f"'{text}' is not a PCI address",
        hint="use the form 0000:3b:00.0 (domain:bus:slot.function), as printed by `vgpumgr gpus`",
    )


def is_pci_address(text: str) -> bool:
    try:
        pci_address(text)
    except InvalidInput:
        return False
    return True


def parent_name(text: str) -> str:
    """An mdev parent: a PCI address, or a virtual parent such as `mtty`."""
    s = (text or "").strip()
    if is_pci_address(s):
        return pci_address(s)
    if _VIRTUAL_PARENT.match(s):
        return s
    raise InvalidInput(
        f"'{text}' is not an mdev parent",
        hint="give a PCI address such as 0000:3b:00.0 or a virtual parent name such as mtty",
    )


def is_mdev_uuid(text: str) -> bool:
    return bool(_UUID.match(text))


def mdev_uuid(text: str) -> str:
    s = (text or "").strip()
    if not _UUID.match(s):
        raise InvalidInput(
            f"'{text}' is not a UUID",
            hint="use the 8-4-4-4-12 hex form, e.g. 6e2a8c2e-6a5d-4b1e-9a1f-2b3c4d5e6f70, or omit it",
        )
    return s.lower()


def new_uuid() -> str:
    """A random (version 4) UUID, as uuid.uuid4() makes it, without importing uuid (~3 ms at start)."""
    b = bytearray(os.urandom(16))
    b[6] = b[6] & 0x0F | 0x40  # version 4
    b[8] = b[8] & 0x3F | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def type_dir(text: str) -> str:
    s = (text or "").strip()
    if not _TYPE_DIR.match(s) or len(s) > 64:
        raise InvalidInput(
            f"'{text}' is not an mdev type id",
            hint="type ids look like nvidia-232 or i915-GVTg_V5_4; `vgpumgr types` lists them",
        )
    return s


def nvidia_type_id(text: str | int) -> int:
    s = str(text).strip()
    if s.startswith("nvidia-"):
        s = s[len("nvidia-"):]
    if not s.isdigit() or len(s) > 6:
        raise InvalidInput(f"'{text}' is not an NVIDIA vGPU type id", hint="use nvidia-<number>, e.g. nvidia-1148")
    return int(s)


def vm_name(text: str) -> str:
    s = text or ""
    if not _VM_NAME.match(s):
        raise InvalidInput(
            f"'{text}' is not a usable VM name",
            hint="use 1-64 characters: letters, digits, '.', '_', '+', '-'; start with a letter or digit",
        )
    return s


_HOST_NAME = _lazy(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


def host_name(text: str) -> str:
    """A host as the fleet names it (its hostname, or VGPUMGR_HOSTNAME)."""
    s = (text or "").strip()
    if not _HOST_NAME.match(s):
        raise InvalidInput(f"'{text}' is not a host name",
                           hint="name it as `vgpumgr fleet hosts` lists it (letters, digits, '.', '_', '-')")
    return s


_TIMESLICED = _lazy(r"^(?P<gpu>[A-Za-z0-9]+(?:-[A-Za-z]+)*)-(?P<gb>0|[1-9][0-9]*)(?P<series>[ABCQ])(?P<b4>4)?$")
_MIG = _lazy(
    r"^(?P<gpu>[A-Za-z0-9]+)-(?P<slices>[1-9])-(?P<gb>0|[1-9][0-9]*)(?P<series>[ABCQ])(?P<attr>ME|NOME|MEALL|GFX)?$"
)


class TypeName(namedtuple("TypeName", "short gpu framebuffer_gb series mig_slices attr")):
    """A parsed NVIDIA vGPU type name such as `GRID T4-4Q` or `NVIDIA H100XM-1-10CME`.

    short: the last token (T4-4Q); gpu: T4, A40, H100XM; framebuffer_gb: nominal (0 in the name = 0.5 GB);
    series: A, B, C or Q; mig_slices: compute slices of the GPU instance (MIG-backed types), else None;
    attr: ME, NOME, MEALL, GFX or None."""

    __slots__ = ()

    @property
    def mig_backed(self) -> bool:
        return self.mig_slices is not None

    @property
    def mig_profile(self) -> str | None:
        """The GPU-instance profile a MIG-backed type needs: `H100XM-1-10CME` -> `1g.10gb+me`; else None."""
        if self.mig_slices is None:
            return None
        return f"{self.mig_slices}g.{int(self.framebuffer_gb)}gb{_PROFILE_SUFFIX.get(self.attr, '')}"


_PROFILE_SUFFIX = {None: "", "ME": "+me", "MEALL": "+me.all", "NOME": "-me", "GFX": "+gfx"}


@lru_cache(maxsize=4096)
def parse_type_name(name: str) -> TypeName | None:
    """Parse NVIDIA's vGPU type grammar; None for names that are not NVIDIA vGPU types. Remembered per name:
    the same few names are asked for on every placement."""
    if not name or not name.strip():  # a blank name (" ", "\n") is no type either
        return None
    short = name.strip().split()[-1]
    m = _MIG.match(short)
    if m:
        gb = int(m["gb"])
        return TypeName(short, m["gpu"], gb or 0.5, m["series"], int(m["slices"]), m["attr"])
    m = _TIMESLICED.match(short)
    if m and not (m["b4"] and m["series"] != "B"):
        gb = int(m["gb"])
        return TypeName(short, m["gpu"], gb or 0.5, m["series"], None, None)
    return None
