"""The live view of `tfdoctor watch` on a terminal: the run's curves as sparklines, its rates, scale,
throughput, data wait and memory, and the judges' findings so far, redrawn a few times a second on
stderr. The script's own output (a pipe from the worker, see supervisor.py) is printed above the view,
so it stays readable; nothing of this reaches stdout, where only the report goes.

It follows the supervisor's Progress protocol (`start(description, total)`, `clear()`) and adds
`rows(rows, eval)`, `findings(findings)` and `output(bytes)`.
"""

from __future__ import annotations

import codecs
import contextlib
import math
import re
import time
from collections import deque
from typing import Iterator, Optional

from tfdoctor.report.run_summary import data_wait_share, number_of, wall_clock_rate
from tfdoctor.report.shortened import shortened

SPARK_WIDTH = 48  # the steps a sparkline shows: the latest ones
REFRESH_PER_SECOND = 4
MAX_FINDINGS = 6
MAX_RATES = 3  # parameter groups whose rates are written out; more are counted
# The panel's border and padding take 2 columns each side; the findings' two columns 2 between them.
PANEL_MARGIN, GAP = 4, 2


# The label column ("throughput") and room for the values beside a sparkline ("group 0 0.001, group 1
# 0.0001"): a narrower terminal gets shorter sparklines, not values wrapped one word a line.
LABEL_WIDTH, VALUE_ROOM, MIN_SPARK = 10, 30, 8
# A finding's message beside its id needs this many columns ("loss spiked at step 51; the rate jumped
# 42x" is 43); with fewer it goes on the line under the id.
MIN_BESIDE = 44


def sparkline(values, width: int = SPARK_WIDTH) -> str:
    """The latest `width` steps' curve (drawing.sparkline; a missing value is drawn as NaN)."""
    from tfdoctor.sparkline import sparkline as drawn

    return drawn([math.nan if v is None else v for v in list(values)[-width:]], width)


class RunView:
    """What the view shows, from the rows and findings heard so far; `renderable(width)` draws it (the
    Dashboard redraws it on the terminal; a test renders it at a fixed width)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.recent: deque = deque(maxlen=SPARK_WIDTH)
        self.steps = self.skipped = 0
        # over the steps after the first, as report/run_summary counts them (the first holds the start)
        self.wall = self.wait = 0.0
        self.tokens = 0
        self.loader_seen = False  # a DataLoader fed the model: the data wait was measured
        self.eval: Optional[dict] = None
        self.found: list[dict] = []
        self.started = time.monotonic()

    def rows(self, rows: list[dict], latest_eval: Optional[dict] = None) -> None:
        for row in rows:
            self.recent.append(row)
            self.steps += 1
            self.skipped += bool(row.get("skipped"))
            self.loader_seen = self.loader_seen or (number_of(row.get("batches")) or 0) > 0
            if self.steps > 1:  # the first step's wall time holds the script's start
                self.wall += number_of(row.get("wall")) or 0.0
                self.wait += number_of(row.get("data_wait")) or 0.0
                self.tokens += int(number_of(row.get("tokens")) or 0)
        if latest_eval is not None:
            self.eval = latest_eval

    def findings(self, found: list[dict]) -> None:
        self.found = found

    def renderable(self, width: int):
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        spark = max(MIN_SPARK, min(SPARK_WIDTH, width - PANEL_MARGIN - LABEL_WIDTH - 2 * GAP - VALUE_ROOM))
        rows = list(self.recent)
        last = rows[-1] if rows else {}
        curves = Table.grid(padding=(0, GAP))
        curves.add_column(style="bold", no_wrap=True, min_width=LABEL_WIDTH)
        curves.add_column(style="cyan", no_wrap=True)
        curves.add_column()
        losses = [number_of(r.get("loss")) for r in rows]
        norms = [number_of(r.get("grad_norm")) for r in rows]
        eval_text = f"  eval {self.eval['loss']:.4g} at step {self.eval['step']}" if self.eval else ""
        curves.add_row("loss", sparkline(losses, spark), _num(last.get("loss")) + eval_text)
        curves.add_row("grad norm", sparkline(norms, spark), _num(last.get("grad_norm")))
        curves.add_row("rate", sparkline([(number_of((r.get("lrs") or [None])[0])) for r in rows], spark),
                       _rates_now(last.get("lrs") or []))
        # the rows without a curve: their values take the whole width, not a column beside a curve's
        facts = Table.grid(padding=(0, GAP))
        facts.add_column(style="bold", no_wrap=True, min_width=LABEL_WIDTH)
        facts.add_column()
        if last.get("scale") is not None or self.skipped:
            facts.add_row("loss scale", f"{_num(last.get('scale'))}   skipped {self.skipped} of {self.steps} steps")
        for i, said in enumerate(self._throughput()):
            facts.add_row("throughput" if i == 0 else "", said)
        facts.add_row("memory", _memory(last))
        seconds = int(time.monotonic() - self.started)
        title = f"tfdoctor watch {self.target} · step {self.steps} · {seconds // 60}:{seconds % 60:02d}"
        return Panel(Group(curves, facts, *self._findings(width)), title=title, title_align="left",
                     border_style="dim")

    def _findings(self, width: int) -> list:
        """One line per finding, whatever the terminal's width: cut to fit, keeping its cause; where the
        id leaves too little room beside it, the message goes on the line under it."""
        from rich.table import Table
        from rich.text import Text

        shown = self.found[:MAX_FINDINGS]
        if not shown:
            return []
        labels = [Text.assemble(("✗" if f["status"] == "fail" else "!", "red" if f["status"] == "fail" else "yellow"),
                                " ", (f["id"], "bold")) for f in shown]
        beside = width - PANEL_MARGIN - GAP - max(label.cell_len for label in labels)
        more = len(self.found) - len(shown)
        tail = [Text(f"and {more} more finding(s)", style="dim")] if more > 0 else []
        if beside >= MIN_BESIDE:
            grid = Table.grid(padding=(0, GAP))
            grid.add_column(no_wrap=True)
            grid.add_column(no_wrap=True)
            for label, found in zip(labels, shown):
                grid.add_row(label, Text(shortened(_with_step(found), beside, found.get("cause") or "")))
            return [grid, *tail]
        under = max(1, width - PANEL_MARGIN - GAP)
        lines = []
        for label, found in zip(labels, shown):
            lines += [label, Text(" " * GAP + shortened(_with_step(found), under, found.get("cause") or ""))]
        return [*lines, *tail]

    def _throughput(self) -> list[str]:
        rate = wall_clock_rate(self.tokens, self.wall) or "tokens/s unknown"
        # the first step cannot tell: the loader that feeds the model is known from the second on
        waited = data_wait_share(self.wait, self.wall, self.loader_seen, "so far") if self.steps > 1 else ""
        return [rate] + ([waited] if waited else [])


class Dashboard:
    def __init__(self, console, target: str) -> None:
        from rich.live import Live

        self.console = console
        self.view = RunView(target)
        self.pending_text = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.live = Live(self._render(), console=console, refresh_per_second=REFRESH_PER_SECOND, transient=False,
                         redirect_stdout=False, redirect_stderr=False, get_renderable=self._render)
        self.live.start()

    # the supervisor's Progress protocol: watch has no counted tasks of its own
    def __call__(self, description: str, total: int):
        return lambda n=1: None

    def rows(self, rows: list[dict], latest_eval: Optional[dict] = None) -> None:
        self.view.rows(rows, latest_eval)

    def findings(self, found: list[dict]) -> None:
        self.view.findings(found)

    def output(self, chunk: bytes) -> None:
        text = self.pending_text + self.decoder.decode(chunk)
        *lines, self.pending_text = text.split("\n")
        for line in lines:
            self._print(line)

    def clear(self) -> None:
        if self.pending_text:
            self._print(self.pending_text)
            self.pending_text = ""
        if self.live.is_started:
            self.live.refresh()
            self.live.stop()

    def _print(self, line: str) -> None:
        from rich.text import Text

        self.console.print(Text(line.replace("\r", "")), soft_wrap=True, highlight=False, markup=False)

    def _render(self):
        return self.view.renderable(self.console.width)


def _with_step(found: dict) -> str:
    """The message, its step in front where the message does not name it."""
    step = found.get("step")
    if step is None or re.search(rf"\bstep {step}\b", found["message"]):
        return found["message"]
    return f"at step {step}: {found['message']}"


def _rates_now(lrs: list) -> str:
    """The rates of the last step: one number; with several parameter groups each one named, or one
    number for groups that share it."""
    rates = [number_of(v) for v in lrs]
    if len(rates) <= 1 or all(r == rates[0] for r in rates):
        return _num(rates[0] if rates else None) + (f" in every group ({len(rates)})" if len(rates) > 1 else "")
    named = ", ".join(f"group {i} {_num(v)}" for i, v in enumerate(rates[:MAX_RATES]))
    return named + (f" and {len(rates) - MAX_RATES} more" if len(rates) > MAX_RATES else "")


def _num(value) -> str:
    value = number_of(value)
    return "-" if value is None else f"{value:.4g}"


def _memory(row: dict) -> str:
    parts = []
    if row.get("rss"):
        parts.append(f"RSS {row['rss'] / 2 ** 20:,.0f} MiB")
    if row.get("cuda_allocated") is not None:
        parts.append(f"CUDA {row['cuda_allocated'] / 2 ** 20:,.0f} MiB allocated, "
                     f"{(row.get('cuda_reserved') or 0) / 2 ** 20:,.0f} MiB reserved")
    return "   ".join(parts) or "-"


@contextlib.contextmanager
def terminal_dashboard(target: str) -> Iterator[Optional[Dashboard]]:
    """Yield the live view while stderr is a terminal; None otherwise (a CI log, a pipe)."""
    from rich.console import Console

    from tfdoctor.report.safe_text import clean

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    view = Dashboard(console, clean(target))
    try:
        yield view
    finally:
        view.clear()
