"""SIGTERM (a CI cancel, `timeout`) and SIGHUP (a closed terminal) end a run the way Ctrl-C does:
raised in the main thread as a KeyboardInterrupt (a `Stopped`), so that every `except
KeyboardInterrupt` and `finally` on the way out runs, the run's processes and files go, and the
command prints one line and exits with the shell's code for that signal.

No torch here: the supervisor and the `--nproc` launcher use it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

# A process ended by signal N exits 128 + N, as a shell reports one killed by it: 130 for SIGINT
# (Ctrl-C), 129 for SIGHUP, 143 for SIGTERM.
SIGNAL_EXIT_BASE = 128
CAUGHT = ("SIGINT", "SIGTERM", "SIGHUP")
SAID = {"SIGINT": "interrupted (Ctrl-C)", "SIGTERM": "terminated (SIGTERM)", "SIGHUP": "hung up (SIGHUP)"}


class Stopped(KeyboardInterrupt):
    """The run was told to stop by a signal. `said` names it for the one line, `code` is the exit code."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = int(signum)
        name = signal.Signals(self.signum).name if self.signum in signal.Signals._value2member_map_ else str(signum)
        self.said = SAID.get(name, f"stopped by {name}")
        self.code = SIGNAL_EXIT_BASE + self.signum

    def __str__(self) -> str:
        return self.said


def stopped_by(error: BaseException) -> Stopped:
    """The Stopped behind `error`: itself, or a plain KeyboardInterrupt (Python's own Ctrl-C) as SIGINT."""
    return error if isinstance(error, Stopped) else Stopped(signal.SIGINT)


def is_stop_code(code: int) -> bool:
    """An exit code (or a negative returncode) that says the process was stopped by one of CAUGHT."""
    numbers = {int(getattr(signal, name)) for name in CAUGHT if hasattr(signal, name)}
    return -code in numbers or code - SIGNAL_EXIT_BASE in numbers


@contextlib.contextmanager
def signals_stop() -> Iterator[None]:
    """While inside, SIGINT, SIGTERM and SIGHUP raise Stopped in the main thread, once: a second signal
    while the run ends is ignored, so that ending the processes is not itself cut short. A signal the
    caller ignores (SIGHUP under nohup, SIGINT in a background job) stays ignored. The previous handlers
    come back on exit. Outside the main thread (signals cannot be caught there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum, frame) -> None:
        if fired:
            return
        fired.append(signum)
        raise Stopped(signum)

    previous = {}
    for name in CAUGHT:
        number = getattr(signal, name, None)
        if number is None or signal.getsignal(number) is signal.SIG_IGN:
            continue
        with contextlib.suppress(ValueError, OSError):
            previous[number] = signal.signal(number, handler)
    try:
        yield
    finally:
        for number, old in previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(number, old if old is not None else signal.SIG_DFL)
