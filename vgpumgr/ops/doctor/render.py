"""The doctor's text: `= SECTION =` headers, one line per check (`LEVEL  check : message`), the hint of each
result that is not PASS on the line below, a SUMMARY with counts (as pve8to9); colour only on a terminal."""

from __future__ import annotations

from vgpumgr.ops.doctor.report import FAIL, LEVELS, NOTE, PASS, WARN, Report

COLOURS = {PASS: "\033[32m", NOTE: "\033[34m", WARN: "\033[33m", FAIL: "\033[1;31m"}


def text(report: Report, colour: bool = False) -> str:
    lines: list[str] = [f"vgpumgr doctor: host {report.host}"]
    section = None
    width = max((len(_subject(r.check, r.gpu)) for r in report.results), default=0)
    for r in report.results:
        if r.section != section:
            section = r.section
            lines += ["", f"= {section.upper()} ="]
        level = f"{COLOURS[r.level]}{r.level}\033[0m" if colour else r.level
        lines.append(f"{level}  {_subject(r.check, r.gpu).ljust(width)} : {r.message}")
        if r.hint:
            lines.append(f"      hint: {r.hint}")
    c = report.counts()
    lines += ["", "= SUMMARY =", f"TOTAL: {len(report.results)}  " + "  ".join(f"{lvl}: {c[lvl]}" for lvl in LEVELS)]
    if report.failed:
        lines.append("FAIL: fix the FAIL lines one at a time, from the top, and run `vgpumgr doctor` again")
    elif c[WARN]:
        lines.append("no FAIL; read the WARN lines")
    else:
        lines.append("no FAIL")
    return "\n".join(lines) + "\n"


def _subject(check: str, gpu: str | None) -> str:
    return f"{gpu} {check}" if gpu else check
