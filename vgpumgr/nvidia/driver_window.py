"""Which guest drivers an NVIDIA vGPU host driver accepts: NVIDIA's rule over a small table of branches
(docs/sources.md §25).

NVIDIA's release notes (vGPU 19 / R580; vGPU 15 / R525 for KVM) allow a vGPU manager with guest drivers (1) of
the same release branch, (2) of the previous major branch, (3) of the previous long-term support branch when the
manager's own branch is a long-term one; a guest driver outside that window "fails to load" (the host logs
"Incompatible Guest/Host drivers"). A guest newer than its host is never listed. NVIDIA's driver catalog says
the same per host branch ("Supports R535, R525 and R470 guests").

The table names each branch, its vGPU release and whether it is a long-term support branch (LTSB). Versions are
compared by branch (the major number): the manager, the Linux and the Windows guest driver of one vGPU release
carry different minor numbers (19.0: 580.65.05 / 580.65.06 / 580.88).

    accepts("580.65.05", "570.124.06")  ->  Acceptance(ok=True, ...)     # the previous branch
    accepts("595.58.02", "535.230.02")  ->  Acceptance(ok=False, ...)    # two branches back, not an LTSB pair
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Branch:
    number: int  # R580 -> 580
    vgpu: str  # the vGPU software release ("19")
    ltsb: bool


BRANCHES = (  # oldest first (docs/sources.md §25)
    Branch(470, "13", True),
    Branch(510, "14", False),
    Branch(525, "15", False),
    Branch(535, "16", True),
    Branch(550, "17", False),
    Branch(570, "18", False),
    Branch(580, "19", True),
    Branch(595, "20", False),
)
_BY_NUMBER = {b.number: b for b in BRANCHES}
_VERSION = re.compile(r"^\s*(?:R)?(\d{3})(?:\.\d{1,4}){0,3}\s*$", re.IGNORECASE)
_WINDOWS = re.compile(r"^\s*\d{1,3}\.\d{1,3}\.(\d{1,2})\.(\d{4})\s*$")  # 32.0.15.6094 -> 560.94


@dataclass(frozen=True)
class Acceptance:
    ok: bool | None  # None: the table cannot tell (a branch it does not know, a version it cannot read)
    reason: str
    host_branch: int | None = None
    guest_branch: int | None = None
    window: tuple[int, ...] = ()  # the guest branches the host accepts

    def as_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "reason": self.reason, "host_branch": self.host_branch,
                "guest_branch": self.guest_branch, "window": [f"R{b}" for b in self.window]}


def branch(version: str | None) -> int | None:
    """The branch of a driver version ("580.65.06", "R580", a Windows "32.0.15.8094"); None if unreadable."""
    if not version:
        return None
    m = _VERSION.match(version)
    if m:
        return int(m.group(1))
    w = _WINDOWS.match(version)  # NVIDIA's number is the last five digits: 15.8094 -> 580.94
    if w:
        digits = (w.group(1) + w.group(2))[-5:]
        return int(digits[:3])
    return None


def window(host_branch: int) -> tuple[int, ...]:
    """The guest branches a host branch accepts, newest first; () for a branch the table does not know."""
    host = _BY_NUMBER.get(host_branch)
    if host is None:
        return ()
    older = [b for b in BRANCHES if b.number < host.number]
    out = [host.number]
    if older:
        out.append(older[-1].number)
    if host.ltsb:
        lts = [b for b in older if b.ltsb]
        if lts and lts[-1].number not in out:
            out.append(lts[-1].number)
    return tuple(out)


def accepts(host_driver: str | None, guest_driver: str | None) -> Acceptance:
    """Does a vGPU manager of `host_driver` accept a guest driver of `guest_driver` (NVIDIA's rule)?"""
    hb, gb = branch(host_driver), branch(guest_driver)
    if hb is None or gb is None:
        what = "host" if hb is None else "guest"
        return Acceptance(None, f"the {what} driver version {(host_driver if hb is None else guest_driver)!r} "
                                "is not one vgpumgr can read", hb, gb)
    if gb > hb:
        return Acceptance(False, f"the guest's driver {guest_driver} (R{gb}) is newer than the host's vGPU manager "
                                 f"{host_driver} (R{hb}); NVIDIA supports a guest driver only of the host's branch "
                                 "or an older one in its window", hb, gb, window(hb))
    if gb == hb:
        return Acceptance(True, f"the same branch (R{hb})", hb, gb, window(hb))
    allowed = window(hb)
    if not allowed:
        return Acceptance(None, f"the host's branch R{hb} is not in vgpumgr's table of NVIDIA driver branches",
                          hb, gb)
    if gb in allowed:
        how = "the previous branch" if len(allowed) > 1 and gb == allowed[1] else "the previous long-term branch"
        return Acceptance(True, f"R{gb} is {how} of R{hb}", hb, gb, allowed)
    return Acceptance(False, f"the guest's driver {guest_driver} (R{gb}) is outside the window of the host's vGPU "
                             f"manager {host_driver} (R{hb} accepts guests of "
                             f"{', '.join(f'R{b}' for b in allowed)}): the vGPU would fail to load "
                             "(\"Incompatible Guest/Host drivers\")", hb, gb, allowed)
