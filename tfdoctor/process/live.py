"""What the worker of `tfdoctor watch` tells its supervisor while the run goes on, for the live view on
a terminal: the finalised steps, a few times a second, and the run judges' findings so far, every
few seconds. Both are sent from inside the script's optimizer step, so each send is kept short."""

from __future__ import annotations

import time
from typing import Callable, Optional

from tfdoctor.process.protocol import Event
from tfdoctor.result import Status
from tfdoctor.watching.series import StepRow, row_dict

# Rows go out at most this often: the view redraws a few times a second, and a step of a tiny model
# takes milliseconds, so one message per step would cost more than the step.
SEND_SECONDS = 0.25
# The judges read the whole series: every few seconds is enough for findings a person reads. On a long
# run judging grows with the series (about 1 s at 100,000 steps), so the wait after each judging is
# at least JUDGE_WAIT_FACTOR times what it took: judging stays under 2% of the run's time.
JUDGE_SECONDS = 3.0
JUDGE_WAIT_FACTOR = 50


class LiveFeed:
    def __init__(self, send: Callable[..., None], judge: Callable) -> None:
        self.send, self.judge = send, judge
        self.rows: list[dict] = []
        self.monitor = None
        self.sent_at = self.judged_at = time.monotonic()
        self.judge_wait = JUDGE_SECONDS

    def bind(self, monitor) -> None:
        self.monitor = monitor

    def row(self, row: StepRow) -> None:
        self.rows.append(row_dict(row))
        now = time.monotonic()
        if now - self.sent_at >= SEND_SECONDS:
            self.flush(now)
        if self.monitor is not None and now - self.judged_at >= self.judge_wait:
            self.send(Event.FINDINGS, findings=findings(self.judge(self.monitor.view())))
            self.judged_at = time.monotonic()
            self.judge_wait = max(JUDGE_SECONDS, JUDGE_WAIT_FACTOR * (self.judged_at - now))

    def flush(self, now: Optional[float] = None) -> None:
        if self.rows:
            evals = self.monitor.series.evaluation() if self.monitor is not None else []  # the held-out one
            latest = {"step": evals[-1].step, "loss": evals[-1].loss} if evals else None
            self.send(Event.ROWS, rows=self.rows, eval=latest)
            self.rows = []
        self.sent_at = now if now is not None else time.monotonic()


def findings(results) -> list[dict]:
    """The warn/fail results as the live view lists them ("cause": the judge's cause in a few words,
    which the view keeps when it cuts the message to the terminal's width: report/shortened.py)."""
    return [{"id": r.id, "status": r.status.value, "message": r.message, "step": r.details.get("step"),
             "cause": r.details.get("cause") if isinstance(r.details.get("cause"), str) else ""}
            for r in results if r.status in (Status.WARN, Status.FAIL, Status.ERROR)]
