"""`tfdoctor judge --follow`: a log that is still being written, read again whenever it grows and judged
each time, each finding (fail, warn) told once, when it first appears. It says nothing itself: the command
prints what `poll` returns. A read that fails now (a trainer_state.json mid-write, no log yet) keeps the
last good read and is tried again at the next poll."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tfdoctor.logs.discovery import find_runs
from tfdoctor.logs.logged import LoggedRun, LogUnreadable, NothingLogged
from tfdoctor.result import Result, Status
from tfdoctor.watching.judging import judge_run

TOLD = (Status.FAIL, Status.ERROR, Status.WARN)
STEP_KEYS = ("step", "first_step", "at_step", "since_step")  # where the judges' details place a finding


@dataclass
class Finding:
    run: str
    result: Result
    step: Optional[int]  # the step the judge places it at, else the last step logged when it appeared


class Follower:
    def __init__(self, path, tags: dict[str, str], only=None, skip=None):
        self.path, self.tags, self.only, self.skip = str(path), tags, only, skip
        self.runs: list[LoggedRun] = []
        self.results: dict[str, list[Result]] = {}
        self.told: set[tuple[str, str, str]] = set()
        self.error: Optional[Exception] = None  # why the latest read failed (kept for the end)
        self._signature: Optional[tuple] = None  # the files as last read and judged
        self._seen: Optional[tuple] = None  # the files as last seen (a read may have failed)
        self.grew_at = time.monotonic()

    def poll(self, force: bool = False) -> list[Finding]:
        """Read and judge again if the log changed since the last poll (or `force`); the new findings."""
        signature = _signature(Path(self.path))
        if signature != self._seen:  # grew (or changed): the idle clock starts again
            self._seen, self.grew_at = signature, time.monotonic()
        if signature == self._signature and not force:
            return []
        try:
            runs = find_runs(self.path, self.tags, following=True)
        except (LogUnreadable, NothingLogged) as error:  # being written, or not written yet: next time
            self.error = error
            return []
        self._signature, self.error, self.runs = signature, None, runs
        found = []
        for run in runs:
            results = judge_run(run.series, self.only, self.skip)
            self.results[run.name] = results
            for result in results:
                key = (run.name, result.id, result.status.value)
                if result.status in TOLD and key not in self.told:
                    self.told.add(key)
                    found.append(Finding(run.name, result, _step(result, run)))
        return found

    @property
    def complete(self) -> bool:
        """Every run's log says its run ended (a Trainer's summary row, MLflow's FINISHED)."""
        return bool(self.runs) and all(run.complete is True for run in self.runs)

    def idle(self) -> float:
        return time.monotonic() - self.grew_at


def _step(result: Result, run: LoggedRun) -> Optional[int]:
    for key in STEP_KEYS:
        value = result.details.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return run.series.steps[-1].step if run.series.steps else None


def _signature(root: Path) -> tuple:
    """What changes when a log grows: every file's size and modification time under `root`."""
    if root.is_file():
        try:
            stat = root.stat()
        except OSError:
            return ()
        return ((str(root), stat.st_size, stat.st_mtime_ns),)
    seen = []
    for folder, names, files in os.walk(root):
        names[:] = [n for n in names if not n.startswith(".")]
        for file in files:
            try:
                stat = os.stat(os.path.join(folder, file))
            except OSError:
                continue
            seen.append((os.path.join(folder, file), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(seen))
