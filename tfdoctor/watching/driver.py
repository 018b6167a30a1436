"""The script driver of the watch monitor (`tfdoctor watch`): run an unmodified training script as
__main__, as `python train.py ARGS` or `python -m pkg.mod ARGS` would, with the monitor's hooks
installed, to its end or to --max-steps / --max-time, and hand back the run's series. Running the
script and the refusals when it takes no step are `run`'s too (usercode/as_main.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from tfdoctor.errors import LoadError
from tfdoctor.usercode.as_main import refuse_no_step, run_script, script_name
from tfdoctor.watching.series import RunSeries, StepRow


class WatchError(LoadError):
    """The script could not be watched: not found, or it ended before its first optimizer step."""


@dataclass
class WatchedRun:
    series: RunSeries
    name: str  # the script as the user named it
    ended: str  # finished | max-steps | max-time | exit | raised | interrupted
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
    # watch runs the script to its end: sys.exit(0) is how many scripts finish, and Ctrl-C ends the run
    outcome = run_script(path, module, args, "tfdoctor watch", watching(monitor), StopWatching,
                         clean_exit_finishes=True, interrupt_ends=True)
    if monitor.stopped and outcome.ended != monitor.stopped:  # the script caught the stop and ended on its own
        outcome = dataclasses.replace(outcome, ended=monitor.stopped)
    series = monitor.finish(outcome.ended)
    run = WatchedRun(series, name, outcome.ended, outcome.seconds, outcome.error, outcome.where)
    if not series.steps:
        refuse_no_step(name, outcome, WatchError)
        raise WatchError(f"{name} ended without an optimizer step, so there is no run to watch",
                         "give it arguments that make it train (after --)")
    return run
