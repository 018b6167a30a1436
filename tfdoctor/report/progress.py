"""A Rich progress bar for long work (the overfit run, the user's loop, memory traces), shown on
stderr only when it is a terminal, so that pipes, CI logs and JSON output stay quiet.

The bar follows the Progress protocol of tfdoctor.context: `start(description, total)` returns
`advance(n=1)`. Each task keeps its own count and is removed once done, so a later task never looks
an earlier one up (Rich keeps its tasks in a dict keyed by id; indexing `Progress.tasks`, a list,
by a task id breaks as soon as one task has been removed).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

Start = Callable[[str, int], Callable[..., None]]


@contextlib.contextmanager
def terminal_progress(console=None) -> Iterator[Optional[Start]]:
    """Yield `start` while a transient bar is live on a terminal; yield None when not a terminal."""
    from rich.console import Console

    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True)

    def start(description: str, total: int) -> Callable[..., None]:
        total = max(int(total), 1)
        task = bar.add_task(description, total=total)
        completed = 0

        def advance(n: int = 1) -> None:
            nonlocal completed
            if completed >= total or n <= 0:
                return
            step = min(n, total - completed)
            completed += step
            bar.advance(task, step)
            if completed >= total:  # the bar goes once its work is done
                bar.remove_task(task)

        return advance

    with bar:
        yield start
