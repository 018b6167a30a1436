"""The script driver of the watch monitor (`tfdoctor watch`): run an unmodified training script as
__main__, as `python train.py ARGS` or `python -m pkg.mod ARGS` would, with the monitor's hooks
installed, to its end or to --max-steps / --max-time, and hand back the run's series."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from tfdoctor.usercode.as_main import as_main, run_main, script_name
from tfdoctor.usercode.auditing import audited_by
from tfdoctor.errors import InternalError, LoadError, first_line
from tfdoctor.usercode.call_sites import raised_at, raised_in_tfdoctor
from tfdoctor.watching.series import RunSeries, StepRow


class WatchError(LoadError):
    """The script could not be watched: not found, or it ended before its first optimizer step."""


@dataclass
class WatchedRun:
    series: RunSeries
    name: str  # the script as the user named it
    ended: str  # finished | max-steps | max-time | exit | raised
    seconds: float
    error: Optional[BaseException] = None
    where: str = ""  # the script's line that raised or exited, when it did


def watch_script(path: Optional[str] = None, module: Optional[str] = None, args: tuple = (),
                 max_steps: Optional[int] = None, max_time: Optional[float] = None,
                 on_row: Optional[Callable[[StepRow], None]] = None,
                 on_monitor: Optional[Callable] = None) -> WatchedRun:
    """Run the script (a file `path` or a module `module`) with `args`, watched, and return its series.
    Raises WatchError when it cannot start or takes no optimizer step. A KeyboardInterrupt (the
    supervisor forwards the first Ctrl-C) ends the run as "interrupted", judged on its steps. `on_row(row)` hears each
    step as it is finalised; `on_monitor(monitor)` is handed the Monitor before the script starts."""
    from tfdoctor.watching.hooks import watching
    from tfdoctor.watching.monitor import Monitor, StopWatching

    name = script_name(path, module, WatchError)
    monitor = Monitor(on_row=on_row, max_steps=max_steps, max_time=max_time)
    if on_monitor is not None:
        on_monitor(monitor)
    ended, error = "finished", None
    started = time.perf_counter()
    try:
        with as_main(path, module, args), audited_by("tfdoctor watch"), watching(monitor):
            run_main(path, module)
    except StopWatching as stop:
        ended = str(stop)
    except SystemExit as exc:
        ended, error = ("finished", None) if exc.code in (None, 0) else ("exit", exc)
    except KeyboardInterrupt:  # Ctrl-C (forwarded by the supervisor): the run so far is judged
        ended = "interrupted"
    except Exception as exc:  # the script's own error: named in the report, never a traceback
        ours = raised_in_tfdoctor(exc)
        if ours is not None:
            raise InternalError(f"at {ours}, while {os.path.basename(path or module)} ran: {first_line(exc)}; "
                                "not your script's fault") from exc
        ended, error = "raised", exc
    if monitor.stopped and ended != monitor.stopped:  # the script caught the stop and ended on its own
        ended = monitor.stopped
    series = monitor.finish(ended)
    run = WatchedRun(series, name, ended, time.perf_counter() - started, error,
                     raised_at(error) if error is not None else "")
    if not series.steps:
        _refuse_unwatched(run)
    return run


def _refuse_unwatched(run: WatchedRun) -> None:
    where = f" at {run.where}" if run.where else ""
    if run.ended == "raised":
        raise WatchError(f"{run.name} raised {type(run.error).__name__}: {run.error}{where} before its first "
                         "optimizer step", "fix the script so that `python` runs it (TFDOCTOR_DEBUG=1 shows "
                                           "the traceback)") from run.error
    if run.ended == "exit":
        raise WatchError(f"{run.name} called sys.exit({run.error.code!r}){where} before its first optimizer step",
                         "check the script's arguments (give them after --)") from run.error
    if run.ended == "interrupted":
        raise WatchError(f"{run.name} was interrupted (Ctrl-C) before its first optimizer step")
    raise WatchError(f"{run.name} ended without an optimizer step, so there is no run to watch",
                     "give it arguments that make it train (after --)")
