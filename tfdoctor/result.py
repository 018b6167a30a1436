"""Outcomes as data: a check's Result, the run's Report and the one place that decides exit codes.

No torch and no Rich here: reporters and the CLI read these objects, checks produce them.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

from tfdoctor.versions import tool_versions


class Status(str, enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


def json_safe(value: Any) -> Any:
    """Details as strict JSON: NaN and infinities become the strings "nan", "inf", "-inf" (they are
    evidence, e.g. a loss that went NaN), tuples become lists, anything unknown its str()."""
    if isinstance(value, float):
        return value if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """"1 optimizer step", "2 optimizer steps": a count and its noun, agreed (a message in the user's terms)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def percent(share: float) -> str:
    """A share as a person reads it: "12%", "0.3%", "under 0.1%" (4 of 1440 rows is not "0%")."""
    if share <= 0:
        return "0%"
    if share < 0.001:
        return "under 0.1%"
    return f"{share:.1%}" if share < 0.01 else f"{share:.0%}"


class ExitCode(enum.IntEnum):
    OK = 0  # no check failed (warnings allowed unless --strict)
    CHECKS_FAILED = 1  # a check failed or errored (or warned under --strict)
    USAGE_ERROR = 2  # bad flags, or the target could not be loaded or called


@dataclass
class Result:
    """What one check saw. `id` and `title` are filled in by the runner from the check's spec."""

    status: Status
    message: str
    hint: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    title: str = ""
    seconds: float = 0.0

    @classmethod
    def passed(cls, message: str, details: dict | None = None, hint: str = "") -> "Result":
        return cls(Status.PASS, message, hint, details or {})

    @classmethod
    def warned(cls, message: str, hint: str, details: dict | None = None) -> "Result":
        return cls(Status.WARN, message, hint, details or {})

    @classmethod
    def failed(cls, message: str, hint: str, details: dict | None = None) -> "Result":
        return cls(Status.FAIL, message, hint, details or {})

    @classmethod
    def skipped(cls, reason: str, details: dict | None = None) -> "Result":
        return cls(Status.SKIP, reason, "", details or {})

    @classmethod
    def errored(cls, message: str, hint: str = "", details: dict | None = None) -> "Result":
        return cls(Status.ERROR, message, hint, details or {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Result":
        """The inverse of to_record(): a Result shipped from a worker process as data."""
        return cls(Status(data["status"]), data["message"], data.get("hint", ""), data.get("details", {}),
                   data.get("id", ""), data.get("title", ""), data.get("seconds", 0.0))

    def to_record(self) -> dict[str, Any]:
        """Everything the parent process needs to render this Result (to_dict plus title and time)."""
        return {**self.to_dict(), "title": self.title, "seconds": self.seconds}

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status.value,
            "message": self.message,
            "hint": self.hint,
            "details": json_safe(self.details),
        }


@dataclass
class Report:
    target: str
    results: list[Result] = field(default_factory=list)
    strict: bool = False  # warnings count as problems (--strict); every reporter and the exit code agree
    stopped: str = ""  # why the run ended before its last check (a budget, the user's sys.exit), if it did
    discovered: dict[str, Any] = field(default_factory=dict)  # `tfdoctor run`: what the script showed
    sandbox: dict[str, Any] = field(default_factory=dict)  # what the user's code tried to write (thrown away)
    versions: dict[str, Any] = field(default_factory=tool_versions)  # tfdoctor's, python's, torch's, transformers'
    # `tfdoctor watch` and the callbacks: the whole run's series (watching/series.RunSeries.to_dict())
    series: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, int]:
        counts = {status.value: 0 for status in Status}
        for result in self.results:
            counts[result.status.value] += 1
        return counts

    def problems(self, strict: bool | None = None) -> list[Result]:
        """The results that make the run unhealthy: fail and error, plus warn under strict (by default
        the report's own `strict`)."""
        strict = self.strict if strict is None else strict
        bad = {Status.FAIL, Status.ERROR} | ({Status.WARN} if strict else set())
        return [r for r in self.results if r.status in bad]

    def exit_code(self, strict: bool | None = None) -> ExitCode:
        return ExitCode.CHECKS_FAILED if self.problems(strict) else ExitCode.OK

    # A Report reads as the collection of its results: `for r in report`, `len(report)`, and
    # `"future-leak" in report` (a check id; a Result works too), beside `report["future-leak"]`.
    def __iter__(self) -> Iterator[Result]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def __contains__(self, item: object) -> bool:
        if isinstance(item, str):
            return any(result.id == item for result in self.results)
        return item in self.results

    def __getitem__(self, check_id: str) -> Result:
        for result in self.results:
            if result.id == check_id:
                return result
        raise KeyError(check_id)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "target": self.target,
            "checks": [r.to_dict() for r in self.results],
            "summary": self.summary(),
            "versions": json_safe(self.versions),
        }
        if self.stopped:
            data["stopped"] = self.stopped
        if self.discovered:
            data["discovered"] = json_safe(self.discovered)
        if any(self.sandbox.get(key) for key in ("written_count", "deleted_count", "error")):  # it tried to write
            data["sandbox"] = json_safe(self.sandbox)
        if self.series:
            data["series"] = json_safe(self.series)
        return data
