"""The one line a watched run ends with, on stderr (the command) or through the `tfdoctor` logger (the
Trainer and Lightning callbacks): the verdict, the judges that failed or warned, and where the report
went. Whatever the format and wherever the report was written, the terminal gets this line, so a run
of days never ends in silence. No Rich, no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from tfdoctor.report.run_summary import CURVES_HEALTHY, curves_healthy
from tfdoctor.result import Report, Status


def verdict_line(report: Report, path: Optional[str | Path] = None, where: str = "") -> str:
    """"tfdoctor: FAIL (loss-spike, eval-gap; warn: data-wait); report in run.html". `path`: the file
    the report was written to (None: printed above, `where` says so when the caller knows better,
    e.g. "judged above")."""
    failed = [r.id for r in report.results if r.status in (Status.FAIL, Status.ERROR)]
    warned = [r.id for r in report.results if r.status == Status.WARN]
    word = "FAIL" if report.problems() else "WARN" if warned else "PASS"  # --strict: a warning fails
    named = ", ".join(failed) + ("; " if failed and warned else "") + ("warn: " + ", ".join(warned) if warned else "")
    if not named:
        counts = report.summary()
        named = ", ".join(f"{counts[s.value]} {s.value}" for s in (Status.PASS, Status.SKIP) if counts[s.value])
        named = f"{CURVES_HEALTHY}: {named}" if curves_healthy(report.results) else named
    line = f"tfdoctor: {word}" + (f" ({named})" if named else "")
    if path is not None:
        line += f"; report in {path}"
    elif where:
        line += f"; {where}"
    return line
