"""Check results, their levels and the summary: PASS, NOTE, WARN, FAIL; only a FAIL fails the run (exit 12)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PASS, NOTE, WARN, FAIL = "PASS", "NOTE", "WARN", "FAIL"
LEVELS = (PASS, NOTE, WARN, FAIL)
EXIT_FAIL = 12  # README, "Doctor": distinct from every error's exit code


@dataclass(frozen=True)
class Result:
    section: str
    check: str  # what is checked, as a short phrase ("IOMMU enabled by the kernel")
    level: str
    message: str  # what was found
    hint: str | None = None  # one line naming the file, module, kernel parameter or command that fixes it
    gpu: str | None = None
    key: str = ""  # a stable id for machines and tests ("iommu", "gpu.driver", ...)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"unknown level {self.level}")
        if self.level != PASS and not self.hint:
            raise ValueError(f"{self.key}: a {self.level} needs a hint")

    def as_dict(self) -> dict[str, Any]:
        return {"section": self.section, "key": self.key, "check": self.check, "gpu": self.gpu,
                "level": self.level, "message": self.message, "hint": self.hint}


@dataclass
class Report:
    host: str
    results: list[Result] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {lvl: sum(1 for r in self.results if r.level == lvl) for lvl in LEVELS}

    @property
    def failed(self) -> bool:
        return any(r.level == FAIL for r in self.results)

    @property
    def exit_code(self) -> int:
        return EXIT_FAIL if self.failed else 0

    def as_dict(self) -> dict[str, Any]:
        c = self.counts()
        return {"host": self.host, "ok": not self.failed, "summary": {"total": len(self.results),
                **{k.lower(): v for k, v in c.items()}}, "results": [r.as_dict() for r in self.results]}


class Section:
    """Collects one section's results; each check function calls pass_/note/warn/fail once or more."""

    def __init__(self, title: str, report: Report) -> None:
        self.title, self.report = title, report

    def add(self, key: str, check: str, level: str, message: str, hint: str | None = None,
            gpu: str | None = None) -> None:
        self.report.results.append(Result(self.title, check, level, message, hint, gpu, key))

    def pass_(self, key: str, check: str, message: str, gpu: str | None = None) -> None:
        self.add(key, check, PASS, message, gpu=gpu)

    def note(self, key: str, check: str, message: str, hint: str, gpu: str | None = None) -> None:
        self.add(key, check, NOTE, message, hint, gpu)

    def warn(self, key: str, check: str, message: str, hint: str, gpu: str | None = None) -> None:
        self.add(key, check, WARN, message, hint, gpu)

    def fail(self, key: str, check: str, message: str, hint: str, gpu: str | None = None) -> None:
        self.add(key, check, FAIL, message, hint, gpu)
