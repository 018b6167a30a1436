"""A progress bar for long work (the overfit run, the user's loop, memory traces), shown on stderr
only when it is a terminal, so that pipes, CI logs and JSON output stay quiet.

The bar follows the Progress protocol of tfdoctor.context: `start(description, total)` returns
`advance(n=1)`; `start.clear()` takes the bar off the screen (the supervisor calls it before a report
is printed). Each task keeps its own count and is dropped once done.

The bar is one line, redrawn in place with a carriage return and an erase of that line only: it
never moves the cursor up. Other processes write to the same terminal (the user's code in the
worker, the other ranks of a torchrun job), and a bar that moves up over the lines it believes are
its own (as a multi-line live display does) erases theirs instead, and leaves itself behind. Erasing
only the current line can at worst erase a partial line (printed without a newline) a process left
there; a line that ended is never touched.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

Start = Callable[[str, int], Callable[..., None]]

ERASE_LINE = "\r\x1b[2K"
BAR_WIDTH = 40
REDRAW_SECONDS = 0.1  # at most ten redraws a second: the worker may advance thousands of times


class _Bar:
    """The one line on the terminal: the latest unfinished task, its count and its elapsed time."""

    def __init__(self, out, width: int) -> None:
        self.out, self.width = out, width
        self.tasks: list[dict] = []
        self.shown = False
        self.drawn_at = 0.0

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.tasks or (not force and now - self.drawn_at < REDRAW_SECONDS):
            return
        task = self.tasks[-1]
        filled = BAR_WIDTH * task["completed"] // task["total"]
        seconds = int(now - task["started"])
        line = (f"{task['description']} {'━' * filled}{'╺' * (BAR_WIDTH - filled)} {task['completed']}/"
                f"{task['total']} {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}")
        self._write(ERASE_LINE + line[: max(self.width - 1, 1)])
        self.shown, self.drawn_at = True, now

    def clear(self) -> None:
        if self.shown:
            self._write(ERASE_LINE)
            self.shown = False

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # a terminal gone (SIGHUP) must not end the run
            self.out.write(text)
            self.out.flush()


@contextlib.contextmanager
def terminal_progress(console=None) -> Iterator[Optional[Start]]:
    """Yield `start` while the bar may draw on a terminal; yield None when not a terminal. The bar is
    gone from the screen when the block ends, however it ends."""
    from rich.console import Console

    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    bar = _Bar(console.file, console.width)

    def start(description: str, total: int) -> Callable[..., None]:
        task = {"description": description, "total": max(int(total), 1), "completed": 0,
                "started": time.monotonic()}
        bar.tasks.append(task)
        bar.draw(force=True)

        def advance(n: int = 1) -> None:
            if task not in bar.tasks or n <= 0:
                return
            task["completed"] = min(task["total"], task["completed"] + n)
            if task["completed"] >= task["total"]:  # the bar goes once its work is done
                bar.tasks.remove(task)
                bar.clear()
                bar.draw(force=True)
            else:
                bar.draw()

        return advance

    def clear() -> None:
        bar.tasks.clear()
        bar.clear()

    start.clear = clear  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        clear()
