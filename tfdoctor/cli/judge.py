"""`tfdoctor judge PATH`: the run judges of `watch` on the logs of runs that already happened (or are
still going, with --follow). In this process: no user code runs, so no supervisor and no torch."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from tfdoctor.cli.app import app, shown
from tfdoctor.cli.flags import budget_in_range, format_ready, selection_nonempty, writable
from tfdoctor.cli.options import Format, OnlyJudges, Output, SeriesFmt, SkipJudges, Strict
from tfdoctor.cli.outcome import end_command, fail_usage
from tfdoctor.errors import TfdoctorError, UsageError

DEFAULT_EVERY = 2.0  # seconds between reads of a followed log
DEFAULT_IDLE = 600.0  # a followed log that has not grown for this long: its run is taken as over


@app.command()
def judge(
    path: Path = typer.Argument(..., metavar="PATH", help="a log file or a folder runs logged into"),
    tag: Optional[list[str]] = typer.Option(None, "--tag", metavar="SERIES=NAME",
                                            help="read SERIES from the column/tag NAME (repeatable): loss, eval, "
                                                 "lr, lr:1, grad_norm, scale, step, wall, wall_ms, tokens, rss, "
                                                 "cuda_allocated"),
    only: OnlyJudges = None,
    skip: SkipJudges = None,
    fmt: SeriesFmt = Format.rich,
    output: Output = None,
    strict: Strict = False,
    follow: bool = typer.Option(False, "--follow", help="keep reading a log that is still being written; report "
                                                        "each finding as it appears"),
    every: float = typer.Option(DEFAULT_EVERY, "--every", metavar="SECONDS", help="with --follow: seconds "
                                                                                  "between reads"),
    idle: float = typer.Option(DEFAULT_IDLE, "--idle", metavar="SECONDS", help="with --follow: stop after this "
                                                                              "many seconds without growth"),
) -> None:
    """Judge the logs of a training run: the run judges of `watch`, on the logs you already keep.

    PATH is a log or a folder: the Trainer's trainer_state.json (or its output folder), Lightning's
    metrics.csv, TensorBoard event files (pip install 'tfdoctor[logs]'), JSON lines or CSV with a step
    column, an MLflow run. Every run found is judged; the report says which series came from which
    column, and --tag loss=train/loss_epoch maps a name tfdoctor does not know.

    --follow reads a log that is still written (a run on another machine) every --every seconds and
    prints each finding as it appears, until the log says the run ended, Ctrl-C, or --idle seconds
    without growth; then the whole report.
    """
    from tfdoctor.logs.names import parse_tags

    try:
        tags = parse_tags(list(tag or []))
        selection_nonempty(only, skip, run_judges=True)
        writable(output)
        format_ready(fmt)
        if follow:
            budget_in_range("--every", every)
            budget_in_range("--idle", idle)
    except TfdoctorError as error:
        fail_usage(error)
    target = f"judge {path}"
    if follow:
        runs, said = _followed(path, tags, only, skip, every, idle)
    else:
        from tfdoctor.logs import find_runs

        try:
            runs = find_runs(path, tags)
        except TfdoctorError as error:
            fail_usage(error)
        said = ""
    _judged(runs, target, only, skip, strict, fmt, output, said)


def _judged(runs, target: str, only, skip, strict: bool, fmt: Format, output: Optional[Path], said: str) -> None:
    """The report (each run's own, one after another, for people; one object for machines), how following
    ended, the verdict line on stderr, the exit code."""
    from tfdoctor.logs.judged import combined, judged_reports

    reports = judged_reports(runs, target, only, skip, strict)
    report = combined(runs, reports, target, strict)
    pages = reports if fmt is Format.rich and output is None and len(reports) > 1 else None
    end_command(report, fmt, output, notes=[said] if said else [], verdict=True, pages=pages)


def _followed(path: Path, tags, only, skip, every: float, idle: float):
    """Follow the log until its run ends, Ctrl-C, or `idle` seconds without growth: each new finding on
    stderr as it appears, a live line on a terminal. The runs as last read, and how following ended."""
    from tfdoctor.logs.follow import Follower

    if not path.exists():
        from tfdoctor.logs import find_runs

        try:
            find_runs(path, tags)  # the one-line error, its did-you-mean included
        except TfdoctorError as error:
            fail_usage(error)
    follower = Follower(path, tags, only, skip)
    live = _LiveLine(sys.stderr)
    ended = ""
    try:
        while True:
            for finding in follower.poll():
                live.clear()
                result = finding.result
                at = f" at step {finding.step}" if finding.step is not None else ""
                whose = f"{finding.run}: " if len(follower.runs) > 1 else ""
                typer.echo(f"tfdoctor: {result.status.value.upper()} {result.id}{at}: {whose}"
                           f"{shown(result.message)}", err=True)
            live.draw(follower)
            if follower.complete:
                ended = "the log says the run ended"
                break
            if follower.idle() >= idle:
                ended = f"the log did not grow for {idle:g} s"
                break
            time.sleep(every)
    except KeyboardInterrupt:
        ended = "stopped following (Ctrl-C)"
    live.clear()
    try:
        follower.poll(force=True)  # the last state of the log, whatever the last poll saw
    except KeyboardInterrupt:
        pass
    if not follower.runs:
        fail_usage(follower.error or UsageError(f"no training log appeared in {path}"))
    return follower.runs, f"tfdoctor: followed {path}: {ended}"


class _LiveLine:
    """One line on a terminal's stderr, drawn over itself: the runs followed, the last step and loss, a
    sparkline of the loss, the findings so far. Nothing off a terminal (a CI log keeps the findings)."""

    def __init__(self, stream):
        self.stream = stream
        self.on = hasattr(stream, "isatty") and stream.isatty()
        self.drawn = False

    def draw(self, follower) -> None:
        if not self.on or not follower.runs:
            return
        from tfdoctor.sparkline import sparkline

        run = max(follower.runs, key=lambda r: r.series.steps[-1].step if r.series.steps else -1)
        losses = [v for _, v in run.series.finite_losses()]
        step = run.series.steps[-1].step if run.series.steps else 0
        loss = f", loss {losses[-1]:.4g} {sparkline(losses[-40:], 40)}" if losses else ""
        line = (f"following {len(follower.runs)} run(s): step {step}{loss}, {len(follower.told)} finding(s), "
                f"idle {follower.idle():.0f} s")
        self.stream.write("\r\033[K" + line[:200])
        self.stream.flush()
        self.drawn = True

    def clear(self) -> None:
        if self.drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.drawn = False
