"""The sections in the order they run (each only makes sense once the one before it passed) and `run`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vgpumgr.config import Config
from vgpumgr.ops.doctor import driver, gpus, licensing, services, stack, vendor, virtualisation
from vgpumgr.ops.doctor.facts import Facts
from vgpumgr.ops.doctor.report import Report, Section

Check = Callable[[Section, Facts], None]
SECTIONS: tuple[tuple[str, tuple[Check, ...]], ...] = (
    (virtualisation.TITLE, virtualisation.CHECKS),
    (driver.TITLE, driver.CHECKS),
    (gpus.TITLE, (gpus.run,)),
    (services.TITLE, services.CHECKS),
    (stack.TITLE, stack.CHECKS),
    (licensing.TITLE, licensing.CHECKS),
    (vendor.TITLE, vendor.CHECKS),
)


def run(cfg: Config, hostname: str, gpu: str | None = None, facts: Any = None) -> Report:
    """Every check of every section; `gpu` limits the per-GPU checks to one physical GPU."""
    f = facts or Facts(cfg, gpu)
    if f.only_gpu and f.only_gpu not in f.by_address:
        from vgpumgr.errors import NotFound

        raise NotFound(f"no GPU {f.only_gpu} on this host", hint="`vgpumgr gpus` lists them")
    report = Report(hostname)
    for title, checks in SECTIONS:
        section = Section(title, report)
        for check in checks:
            check(section, f)
    return report
