"""Judge a watched run: the run judges on its RunSeries (runner.run_judges, the same runner core as
every check) and the Report `watch` and the training callbacks hand over."""

from __future__ import annotations

from tfdoctor.result import Report, Result
from tfdoctor.watching.series import RunSeries


def judge_run(series: RunSeries, only=None, skip=None, listener=None) -> list[Result]:
    """The Results of the selected run judges on `series`, in catalogue order (see runner.run_judges)."""
    from tfdoctor.runner import run_judges

    return run_judges(series, only, skip, listener)


def watched_report(run, only=None, skip=None, listener=None) -> Report:
    """The Report of a watched run (watching/driver.WatchedRun): the judges' results, the series, and
    how the run ended under "discovered"."""
    results = judge_run(run.series, only, skip, listener=listener)
    report = Report(f"watch {run.name}", results, series=run.series.to_dict())
    report.discovered = {"steps": len(run.series), "ended": run.ended, "seconds": round(run.seconds, 3)}
    if run.error is not None:
        report.discovered["error"] = (f"{type(run.error).__name__}: {run.error}"
                                      + (f" at {run.where}" if run.where else ""))
    return report
