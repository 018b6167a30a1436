"""What a log reader hands on, and what `find_runs` returns: the raw columns of one run's log (`Columns`,
names not yet interpreted) and the run as the judges read it (`LoggedRun`, its RunSeries and where each
series came from). Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tfdoctor.errors import UsageError
from tfdoctor.watching.series import RunSeries

FORMATS = ("trainer-state", "lightning-csv", "tensorboard", "jsonl", "csv", "mlflow")


@dataclass
class Point:
    """One logged value: the global step it was logged at, the value, and the clock (seconds) where the
    log keeps one (TensorBoard's wall_time, MLflow's timestamp)."""

    step: int
    value: float
    time: Optional[float] = None


@dataclass
class Columns:
    """One run's log as read: every numeric column (tag, key, metric) by its own name, as points."""

    format: str
    path: str  # the file read (a folder for a TensorBoard run of several event files, an MLflow run)
    name: str
    columns: dict[str, list[Point]] = field(default_factory=dict)
    step_from: str = ""  # where each point's step came from: "the step column 'iter'", "the line number"
    # what the log says beside its series: max_steps / planned_steps / planned_from (the Trainer's),
    # seconds (train_runtime), complete (True: the log says the run ended; False: it says it did not;
    # None: it cannot say)
    facts: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    modified: float = 0.0  # the newest modification time of the files read

    def add(self, name: str, point: Point) -> None:
        self.columns.setdefault(name, []).append(point)


@dataclass
class LoggedRun:
    name: str  # a short label: the run's folder or file, relative to the path given
    path: str  # the file read
    format: str  # one of FORMATS
    series: RunSeries
    sources: dict[str, str]  # series -> the column it came from: {"loss": "train/loss", "eval:val_loss": "val_loss"}
    interval: Optional[int]  # median optimizer steps between logged training points
    notes: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)  # columns no series was read from (map one with --tag)
    complete: Optional[bool] = None  # the log says the run ended (True), is still going (False), or cannot say
    modified: float = 0.0
    missing_tags: list[str] = field(default_factory=list)  # --tag names this run's log does not hold

    def described(self) -> dict[str, Any]:
        """The run as the report's "discovered" names it (JSON-safe)."""
        return {"name": self.name, "path": self.path, "format": self.format, "points": len(self.series),
                "evaluations": len(self.series.evals), "interval": self.interval, "sources": dict(self.sources),
                "unread": list(self.unread), "notes": list(self.notes), "complete": self.complete,
                "still_written": self.series.facts.get("logged", {}).get("still_written", False)}


class LogUnreadable(UsageError):
    """A log that cannot be read now: a trainer_state.json mid-write, a file that vanished. `--follow`
    tries again at its next read; a one-time judge reports it (exit 2)."""


class NothingLogged(UsageError):
    """PATH holds no log tfdoctor reads (yet: `--follow` waits for one to appear)."""
