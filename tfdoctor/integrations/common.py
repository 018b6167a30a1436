"""What the Trainer and Lightning callbacks share: one watched run inside a framework's own loop.

`LiveWatch` installs the watch monitor's hooks (watching/hooks.py) on an ExitStack when training
starts and takes them off when it ends or raises; judges the series so far every `judge_every`
optimizer steps and logs each finding once, through the `logging` logger "tfdoctor"; says when the run
must stop (`stop_on`); and at the end judges the whole run, writes the report `tfdoctor watch` writes
and logs the one verdict line the command ends with (report/verdict.py). A callback only translates
its framework's events into `start`, `step_ended` and `finish`.

In a script that `tfdoctor run`, `check --train` or `watch` runs (tfdoctor/usercode/auditing.py), the callback
stands aside: the command audits the run, and the callback's hooks would hide calls from the recorder
or record every step twice. It says so in one line and does nothing more.

Where the program configured no logging at all, the "tfdoctor" logger prints to stderr itself while a
run is watched (as Lightning's own logger does): the findings and the verdict reach the terminal
instead of being dropped (Python shows nothing under WARNING by default).

No torch, transformers or Lightning at import: the monitor is imported when a run starts.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from tfdoctor.errors import UsageError
from tfdoctor.process.live import JUDGE_WAIT_FACTOR
from tfdoctor.registry import select
from tfdoctor.report.verdict import verdict_line
from tfdoctor.result import Report, Result, Status
from tfdoctor.usercode.auditing import auditor
from tfdoctor.watching.judging import judge_run, watched_report

logger = logging.getLogger("tfdoctor")

STOP_ON = (None, "fail", "warn")
# the statuses that stop a run under each stop_on ("error" is tfdoctor's own crash: never the run's)
_STOPPING = {"fail": {Status.FAIL}, "warn": {Status.FAIL, Status.WARN}}
# report=PATH: the format from the file's suffix, as `tfdoctor watch --format` names them; any other
# suffix (.txt, .log) gets the rich text report
SUFFIX_FORMATS = {".json": "json", ".xml": "junit", ".sarif": "sarif", ".html": "html"}
DEFAULT_JUDGE_EVERY = 50
# The judges read the whole series, so a judgement costs more the longer the run (the four curve
# judges: ~14 us a step, 0.14 s at 10k steps, 1.4 s at 100k; the first call 0.1 s with its imports).
# A judgement that took over JUDGE_COST_FLOOR puts the next due one off until JUDGE_WAIT_FACTOR times
# its cost has passed, as `tfdoctor watch`'s live feed does: live judging stays under 2% of the run's
# time. Cheaper judgements (runs of up to ~15k steps) are never put off: a stop comes at the
# judge_every step asked for.
JUDGE_COST_FLOOR = 0.25


class LiveWatch:
    """One run watched from inside its loop. `main` is whether this process judges and writes (rank 0):
    the others record nothing and only take part in the stop decision, so that every rank stops at the
    same step."""

    def __init__(self, stop_on: Optional[str] = None, judge_every: int = DEFAULT_JUDGE_EVERY,
                 only: Optional[Iterable[str]] = None, skip: Optional[Iterable[str]] = None,
                 report: Optional[str | Path] = None) -> None:
        if stop_on not in STOP_ON:
            raise ValueError(f"stop_on={stop_on!r}: give None, 'fail' or 'warn'")
        if not isinstance(judge_every, int) or judge_every < 1:
            raise ValueError(f"judge_every={judge_every!r}: give a whole number of optimizer steps >= 1")
        self.stop_on, self.judge_every = stop_on, judge_every
        self.name = ""  # the run as the report names it ("Trainer GPT2LMHeadModel"), given at start
        select(only, skip, run_judges=True)  # an unknown id is the user's error now, not at the first judgement
        self.only, self.skip = only, skip
        self.path = Path(report) if report is not None else None
        if self.path is not None:
            _writable(self.path)  # now, not after a run of days
        self.stack: Optional[contextlib.ExitStack] = None
        self.monitor: Any = None
        self.report: Optional[Report] = None
        self.logged: set[tuple[str, str]] = set()  # (id, status) of the findings logged in this run
        self.stopped_by: list[Result] = []  # the findings that met stop_on, when the run was stopped
        self.judged_at = 0  # the optimizer step of the last live judgement (due or not)
        self.judged_time, self.judge_cost = 0.0, 0.0  # when the last judgement ended, and what it took
        self.live = True  # judging while the run goes on (off after a judgement crashed)
        self.started = time.perf_counter()
        self.max_steps: Optional[int] = None  # the run's planned optimizer steps, when the framework knows
        self.aside: Optional[str] = None  # the tfdoctor command auditing this run instead, if one is
        self.terminal: Optional[contextlib.ExitStack] = None  # our own stderr handler, while it is on

    @property
    def watching(self) -> bool:
        return self.stack is not None

    def start(self, name: str, main: bool = True, max_steps: Optional[int] = None, schedulers: Iterable[Any] = (),
              step: int = 0, planned_from: Optional[str] = None, weighting: str = "calls") -> None:
        """Training starts, at optimizer step `step` (a resumed run's): on the main process, install the
        hooks. `max_steps` is the framework's plan and `planned_from` where it came from; `schedulers`
        are the rate schedulers the framework made before the hooks were in place (the monitor hears
        only later ones); `weighting`, how the framework averages an evaluation's batch losses
        (watching/monitor.py)."""
        self.close()  # the hooks (and our handler) of an earlier run of this callback, if it was never ended
        self.name, self.report, self.logged, self.stopped_by, self.judged_at = name, None, set(), [], step
        self.judged_time, self.judge_cost, self.live = 0.0, 0.0, True
        self.started, self.max_steps, self.aside = time.perf_counter(), max_steps, auditor()
        if self.aside is not None:
            if main:
                with _said_on_terminal():
                    logger.info("tfdoctor: TfdoctorCallback stands aside: `%s` is auditing this run (no hooks, "
                                "no stop_on, no report from the callback)", self.aside)
            return
        if not main:
            return
        self.terminal = _said_on_terminal()
        from tfdoctor.watching.hooks import watching
        from tfdoctor.watching.monitor import Monitor

        monitor = Monitor(stop=False, max_steps=max_steps, planned_from=planned_from or "the framework's plan",
                          weighting=weighting)
        for scheduler in schedulers:
            monitor.scheduler_made(scheduler)
        stack = contextlib.ExitStack()
        stack.enter_context(watching(monitor))
        self.stack, self.monitor = stack, monitor

    def step_ended(self, step: int) -> bool:
        """The framework has taken `step` optimizer steps: judge the run so far when `judge_every` steps
        have passed since the last judgement. True when the run must stop (the same answer on every
        rank, which all call this at the same steps). Not at the run's last planned step: the run ends
        there anyway, and `finish` judges it whole and says what it found, never that it stops it."""
        if step - self.judged_at < self.judge_every or self.aside is not None:
            return False
        if self.max_steps is not None and step >= self.max_steps:
            return False
        self.judged_at = step
        stop = False
        if self.watching and self.live and not self._put_off():
            began = time.perf_counter()
            try:
                results = judge_run(self.monitor.so_far(), self.only, self.skip)
            except Exception:  # noqa: BLE001 - tfdoctor's own bug must not end a run of days: said, and left
                logger.exception("tfdoctor: judging the run so far failed (a bug in tfdoctor); the run goes on, "
                                 "recorded, and is judged at its end")
                self.live = False
                results = []
            self._log_new(results)
            stop = self._meets_stop_on(results, step)
            self.judged_time = time.perf_counter()
            self.judge_cost = self.judged_time - began
        if self.stop_on is not None:
            stop = _agreed(stop)
        return stop

    def _put_off(self) -> bool:
        return self.judge_cost > JUDGE_COST_FLOOR and \
            time.perf_counter() - self.judged_time < JUDGE_WAIT_FACTOR * self.judge_cost

    def finish(self, ended: str, error: Optional[BaseException] = None) -> Optional[Report]:
        """The run ended (`ended`: finished | stopped | raised): take the hooks off, judge the whole run,
        log what was not logged yet, write the report and log the verdict line. None on a process that
        did not watch."""
        if not self.watching:
            return self.report
        monitor, self.monitor = self.monitor, None  # the report keeps the series; the model goes free
        self._unhook()  # first: nothing below may leave the hooks on
        try:
            return self._judged(monitor, ended, error)
        except Exception:  # noqa: BLE001 - the run itself is over and fine: its end must not raise for us
            logger.exception("tfdoctor: judging or writing the finished run failed (a bug in tfdoctor, or the "
                             "report path)")
            return None
        finally:
            self.close()  # our stderr handler, after the verdict line

    def _judged(self, monitor, ended: str, error: Optional[BaseException]) -> Report:
        from tfdoctor.usercode.call_sites import raised_at
        from tfdoctor.watching.driver import WatchedRun

        series = monitor.finish(ended)
        run = WatchedRun(series, self.name, ended, time.perf_counter() - self.started, error,
                         raised_at(error) if error is not None else "")
        report = watched_report(run, self.only, self.skip)
        if self.stopped_by:
            report.stopped = "stopped by tfdoctor: " + ", ".join(f"{r.id} {r.status.value}" for r in self.stopped_by)
        self.report = report
        self._log_new(report.results)
        if self.path is not None:
            write_report(report, self.path)
        line = verdict_line(report, self.path, f"report in the callback's .report ({len(series)} optimizer steps)")
        logger.log(logging.WARNING if report.problems() else logging.INFO, "%s", line)
        return report

    def close(self) -> None:
        """Take the hooks off now (idempotent); the series recorded so far is kept but not judged."""
        self._unhook()
        terminal, self.terminal = self.terminal, None
        if terminal is not None:
            terminal.close()

    def _unhook(self) -> None:
        stack, self.stack = self.stack, None
        if stack is not None:
            stack.close()

    # ------------------------------------------------------------------ findings

    def _log_new(self, results: list[Result]) -> None:
        for result in results:
            key = (result.id, result.status.value)
            if result.status not in (Status.WARN, Status.FAIL) or key in self.logged:
                continue
            self.logged.add(key)
            logger.log(logging.ERROR if result.status == Status.FAIL else logging.WARNING, "%s", finding_line(result))

    def _meets_stop_on(self, results: list[Result], step: int) -> bool:
        if self.stop_on is None:
            return False
        met = [r for r in results if r.status in _STOPPING[self.stop_on]]
        if met:
            self.stopped_by = met
            logger.error("tfdoctor: stopping the run after optimizer step %d (stop_on=%r): %s", step, self.stop_on,
                         ", ".join(r.id for r in met))
        return bool(met)


def finding_line(result: Result) -> str:
    """One log line per finding: id, status, the step it names, what was seen and the fix."""
    step = result.details.get("step")
    where = f" at step {step}" if step is not None else ""
    fix = f"; fix: {result.hint}" if result.hint else ""
    return f"tfdoctor: {result.id} {result.status.value.upper()}{where}: {result.message}{fix}"


def _said_on_terminal() -> contextlib.ExitStack:
    """While the returned stack is open: where the program configured no logging (no handler on the
    "tfdoctor" logger or above it, and no level of ours), a stderr handler of our own and level INFO,
    so that the callback's lines are not dropped; else nothing (the program's logging decides)."""
    stack = contextlib.ExitStack()
    if logger.hasHandlers() or logger.level != logging.NOTSET:
        return stack
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))  # every line starts with "tfdoctor: " already
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    stack.callback(logger.setLevel, logging.NOTSET)
    stack.callback(logger.removeHandler, handler)
    return stack


def report_format(path: str | Path) -> str:
    """The format a report path asks for: its suffix's, when tfdoctor has that format, else rich text."""
    from tfdoctor.report import FORMATS

    fmt = SUFFIX_FORMATS.get(Path(path).suffix.lower(), "rich")
    return fmt if fmt in FORMATS else "rich"


def write_report(report: Report, path: str | Path) -> str:
    from tfdoctor.report import render

    fmt = report_format(path)
    with open(path, "w", encoding="utf-8") as out:
        render(report, fmt, out, width=100)
    return fmt


def _writable(path: Path) -> None:
    if path.is_dir():
        raise UsageError(f"report={str(path)!r} is a folder", "give a file path, e.g. report='run.html'")
    if not path.parent.is_dir():
        raise UsageError(f"report={str(path)!r}: the folder {str(path.parent)!r} does not exist", "make it first")
    if report_format(path) == "html":
        from tfdoctor.report.html import require_plotting  # imports no matplotlib

        require_plotting()


def _agreed(stop: bool) -> bool:
    """Rank 0's decision on every rank of a distributed run (the others judge nothing): a rank that
    stopped alone would leave the rest waiting in their next collective."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [stop]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])
    return stop
