"""Judge a watched run: every selected run judge (registry: inputs=("series",)) on one RunSeries,
each outcome, a crash included, as a Result. The judges are pure: the same series gives the same
findings wherever it is judged (the `watch` worker, a callback inside the user's Trainer)."""

from __future__ import annotations

import time
import traceback

from tfdoctor.registry import select
from tfdoctor.result import Report, Result
from tfdoctor.watching.series import RunSeries


def judge_run(series: RunSeries, only=None, skip=None, listener=None) -> list[Result]:
    """The Results of the selected run judges on `series`, in catalogue order. `listener(event,
    payload)` hears "start" (the id) and "result" (the Result), as run_checks' listener does."""
    results = []
    for spec in select(only, skip, run_judges=True):
        if listener is not None:
            listener("start", spec.id)
        started = time.perf_counter()
        try:
            result = spec.func(series)
        except Exception as exc:  # noqa: BLE001 - a judge's crash is tfdoctor's, reported as its result
            where = traceback.extract_tb(exc.__traceback__)[-1]
            result = Result.errored(f"tfdoctor's own {spec.id} judge crashed: {type(exc).__name__}: {exc} "
                                    f"(at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})",
                                    "a bug in tfdoctor, not in your run: please report it")
        result = spec.stamp(result)
        result.seconds = time.perf_counter() - started
        results.append(result)
        if listener is not None:
            listener("result", result)
    return results


def watched_report(run, only=None, skip=None, listener=None) -> Report:
    """The Report of a watched run (watching/driver.WatchedRun): the judges' results, the series, and
    how the run ended under "discovered"."""

    results = judge_run(run.series, only, skip, listener=listener)
    report = Report(f"watch {run.name}", results, series=run.series.to_dict())
    report.discovered = {"steps": len(run.series), "ended": run.ended, "seconds": round(run.seconds, 3)}
    if run.error is not None:
        report.discovered["error"] = f"{type(run.error).__name__}: {run.error}" + (f" at {run.where}" if run.where else "")
    return report
