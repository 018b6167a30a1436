"""The Report of `tfdoctor judge`: the run judges (watching/judging.judge_run, the same as `watch`'s) on each
run a path holds, as one Report.

Its JSON shape (one object, whatever the number of runs):
- `target`: "judge PATH"; `checks`, `summary`, `versions` as every command's.
- `discovered.runs`: one entry per run: {name, path, format, points (logged training points), evaluations,
  interval, sources (series -> the column it came from), unread (columns no series was read from),
  notes, complete, still_written}.
- One run: `series` is its RunSeries (as `watch --format json` gives it), the checks its judges' results.
- Several runs: every run's judges one after another, each check's message starting "<run name>: " and its
  details saying {"run": name}; each run's series is its `discovered.runs[i].series` (no top-level series).
The exit code is the worst of the runs' (one Report: a failure in any run fails it).
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

from tfdoctor.logs.logged import LoggedRun
from tfdoctor.result import Report, Result
from tfdoctor.watching.judging import judge_run


def run_report(run: LoggedRun, target: str, results: list[Result], strict: bool = False) -> Report:
    """One run's Report, as `watch`'s: its results, its series, and the run described."""
    report = Report(target, results, strict=strict, series=run.series.to_dict())
    report.discovered = {"runs": [run.described()], "steps": len(run.series), "ended": "log"}
    if isinstance(run.series.facts.get("seconds"), (int, float)):
        report.discovered["seconds"] = run.series.facts["seconds"]
    return report


def judged_reports(runs: list[LoggedRun], target: str, only=None, skip=None, strict: bool = False,
                   listener: Optional[Callable] = None) -> list[Report]:
    """Each run's own Report (rendered one after another for people)."""
    return [run_report(run, target if len(runs) == 1 else f"{target} [{run.name}]",
                       judge_run(run.series, only, skip, listener=listener), strict)
            for run in runs]


def combined(runs: list[LoggedRun], reports: list[Report], target: str, strict: bool = False) -> Report:
    """The one Report of several runs (see the module's docstring); one run's own Report as it is."""
    if len(reports) == 1:
        return reports[0]
    results = []
    described = []
    for run, report in zip(runs, reports):
        for result in report.results:
            named = copy.copy(result)
            named.message = f"{run.name}: {result.message}"
            named.details = {"run": run.name, **result.details}
            results.append(named)
        described.append({**run.described(), "series": report.series})
    report = Report(target, results, strict=strict)
    report.discovered = {"runs": described, "ended": "log"}
    return report
