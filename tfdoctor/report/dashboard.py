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
import time
from collections import deque
from typing import Iterator, Optional

from tfdoctor.report.watched import number_of

SPARK_WIDTH = 48  # the steps a sparkline shows: the latest ones
REFRESH_PER_SECOND = 4


def sparkline(values) -> str:
    """The latest SPARK_WIDTH steps' curve (drawing.sparkline; a missing value is drawn as NaN)."""
    from tfdoctor.drawing import sparkline as drawn

    return drawn([math.nan if v is None else v for v in list(values)[-SPARK_WIDTH:]], SPARK_WIDTH)


class Dashboard:
    def __init__(self, console, target: str) -> None:
        from rich.live import Live

        self.console, self.target = console, target
        self.recent: deque = deque(maxlen=SPARK_WIDTH)
        self.steps = self.skipped = 0
        self.wall = self.wait = 0.0
        self.eval: Optional[dict] = None
        self.found: list[dict] = []
        self.started = time.monotonic()
        self.pending_text = ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.live = Live(self._render(), console=console, refresh_per_second=REFRESH_PER_SECOND, transient=False,
                         redirect_stdout=False, redirect_stderr=False, get_renderable=self._render)
        self.live.start()

    # the supervisor's Progress protocol: watch has no counted tasks of its own
    def __call__(self, description: str, total: int):
        return lambda n=1: None

    def rows(self, rows: list[dict], latest_eval: Optional[dict] = None) -> None:
        for row in rows:
            self.recent.append(row)
            self.steps += 1
            self.skipped += bool(row.get("skipped"))
            if self.steps > 1:  # the first step's wall time holds the script's start
                self.wall += number_of(row.get("wall")) or 0.0
                self.wait += number_of(row.get("data_wait")) or 0.0
        if latest_eval is not None:
            self.eval = latest_eval

    def findings(self, found: list[dict]) -> None:
        self.found = found

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
        from rich.panel import Panel
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column(style="cyan")
        table.add_column()
        rows = list(self.recent)
        last = rows[-1] if rows else {}
        losses = [number_of(r.get("loss")) for r in rows]
        norms = [number_of(r.get("grad_norm")) for r in rows]
        eval_text = f"  eval {self.eval['loss']:.4g} at step {self.eval['step']}" if self.eval else ""
        table.add_row("loss", sparkline(losses), _num(last.get("loss")) + eval_text)
        table.add_row("grad norm", sparkline(norms), _num(last.get("grad_norm")))
        lrs = last.get("lrs") or []
        table.add_row("rate", sparkline([(number_of((r.get("lrs") or [None])[0])) for r in rows]),
                      ", ".join(_num(v) for v in lrs[:3]) + (" ..." if len(lrs) > 3 else ""))
        if last.get("scale") is not None or self.skipped:
            table.add_row("loss scale", "", f"{_num(last.get('scale'))}   skipped {self.skipped} of {self.steps} steps")
        table.add_row("throughput", "", self._throughput(rows))
        table.add_row("memory", "", _memory(last))
        for found in self.found[:6]:
            mark = "[red]✗[/red]" if found["status"] == "fail" else "[yellow]![/yellow]"
            at = f" (step {found['step']})" if found.get("step") is not None else ""
            table.add_row(f"{mark} {found['id']}", "", _short(found["message"] + at))
        seconds = int(time.monotonic() - self.started)
        title = f"tfdoctor watch {self.target} · step {self.steps} · {seconds // 60}:{seconds % 60:02d}"
        return Panel(table, title=title, title_align="left", border_style="dim")

    def _throughput(self, rows: list[dict]) -> str:
        tokens = [r.get("tokens") for r in rows[1:] if r.get("tokens")]
        walls = [number_of(r.get("wall")) or 0.0 for r in rows[1:] if r.get("tokens")]
        rate = f"{sum(tokens) / sum(walls):,.0f} tokens/s" if tokens and sum(walls) > 0 else "tokens/s unknown"
        share = f"data wait {100 * self.wait / self.wall:.0f}% of the step time" if self.wall > 0 else ""
        return f"{rate}   {share}"


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


def _short(text: str, width: int = 90) -> str:
    from rich.markup import escape

    return escape(text if len(text) <= width else text[: width - 1] + "…")


@contextlib.contextmanager
def terminal_dashboard(target: str) -> Iterator[Optional[Dashboard]]:
    """Yield the live view while stderr is a terminal; None otherwise (a CI log, a pipe)."""
    from rich.console import Console

    from tfdoctor.report.text import clean

    console = Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    view = Dashboard(console, clean(target))
    try:
        yield view
    finally:
        view.clear()
