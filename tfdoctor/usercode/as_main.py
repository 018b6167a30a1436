"""Running the user's script as `python train.py ARGS` or `python -m pkg.mod ARGS` would, for the
drivers that run one (recording/script.py for `run`, watching/driver.py for `watch`): which script it
is, the process's argv and path set for it and restored after, how the run ended (`run_script`), and
the refusal when it ended before its first optimizer step (`refuse_no_step`). The drivers keep only
what differs: what is installed around the script, the stop it raises, and what they hand back."""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Optional

from tfdoctor.errors import InternalError, LoadError, first_line, missing_file_hint
from tfdoctor.usercode.auditing import audited_by
from tfdoctor.usercode.call_sites import raised_at, raised_in_tfdoctor
from tfdoctor.usercode.patches import Patches


def script_name(path: Optional[str], module: Optional[str], error: type) -> str:
    """The script as the user named it; raises `error(message, hint)` (a LoadError) when the file or
    the module is not there."""
    if (path is None) == (module is None):
        raise ValueError("give a path or a module")
    if path is not None and not os.path.isfile(path):
        raise error(f"script not found: {path}",
                    missing_file_hint(path, "give the path of a Python file, or -m package.module"))
    if module is not None:
        import importlib.util

        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise error(f"module not found: {module}", "run from the folder that holds it, or give a path")
    return path if path is not None else f"-m {module}"


@contextlib.contextmanager
def as_main(path: Optional[str], module: Optional[str], args: tuple) -> Iterator[None]:
    """The script's own sys.argv, and its folder first on sys.path (as `python train.py` puts it), for
    the block; the process's own are back after it, however it ends."""
    saved_path = sys.path[:]
    with Patches() as patches:
        patches.setattr(sys, "argv", [path if path is not None else module, *args])
        if path is not None:
            sys.path[0:1] = [os.path.dirname(os.path.abspath(path))]
        try:
            yield
        finally:
            sys.path[:] = saved_path


def run_main(path: Optional[str], module: Optional[str]) -> None:
    if path is not None:
        runpy.run_path(path, run_name="__main__")
    else:
        runpy.run_module(module, run_name="__main__", alter_sys=True)


@dataclass
class ScriptOutcome:
    """How a script run under a driver ended."""

    ended: str  # finished | exit | raised | interrupted, or the driver's stop (stopped, max-steps, ...)
    seconds: float  # from the script's start to its end or the stop
    error: Optional[BaseException] = None  # the SystemExit or the script's own exception

    @property
    def where(self) -> str:
        """The script's line that raised or exited, when it did ("" otherwise)."""
        return raised_at(self.error) if self.error is not None else ""


def run_script(path: Optional[str], module: Optional[str], args: tuple, command: str, installed: ContextManager,
               stop: type[BaseException], *, clean_exit_finishes: bool, interrupt_ends: bool) -> ScriptOutcome:
    """Run the script as __main__ with `args` inside `installed` (the driver's hooks), audited by
    `command`, until it ends or raises `stop` (ended: the stop's text, else "stopped").

    `clean_exit_finishes`: sys.exit(0) is the script's normal end (`watch` runs it to its end), not an
    "exit" to report (`run` stops it early, so any exit before the stop point is noted).
    `interrupt_ends`: a KeyboardInterrupt (the first Ctrl-C, forwarded by the supervisor) ends the run
    as "interrupted", judged on what it did; otherwise it propagates. Raises InternalError when
    tfdoctor's own hook raised inside the script's call; the script's own error is its outcome, never
    a traceback."""
    ended, error = "finished", None
    started = time.perf_counter()
    try:
        with as_main(path, module, args), audited_by(command), installed:
            run_main(path, module)
    except stop as stopped:
        ended = str(stopped) or "stopped"
    except SystemExit as exc:
        ended, error = ("finished", None) if clean_exit_finishes and exc.code in (None, 0) else ("exit", exc)
    except KeyboardInterrupt:
        if not interrupt_ends:
            raise
        ended = "interrupted"
    except Exception as exc:  # the script's own error: named by the driver, never a traceback
        ours = raised_in_tfdoctor(exc)
        if ours is not None:  # a hook or patch of tfdoctor's raised inside the script's call
            raise InternalError(f"at {ours}, while {os.path.basename(path or module)} ran: {first_line(exc)}; "
                                "not your script's fault") from exc
        ended, error = "raised", exc
    return ScriptOutcome(ended, time.perf_counter() - started, error)


def exit_code(error: BaseException) -> Any:
    """The code a script passed to sys.exit, as shown: an int or None as is, anything else as text."""
    code = getattr(error, "code", None)
    return code if code is None or isinstance(code, int) else str(code)


def refuse_no_step(name: str, outcome: ScriptOutcome, error: type[LoadError]) -> None:
    """Raises `error(message, hint)` when the script raised, exited or was interrupted before its first
    optimizer step; returns when it ended on its own, which each driver words itself."""
    where = f" at {outcome.where}" if outcome.where else ""
    if outcome.ended == "raised":
        raise error(f"{name} raised {type(outcome.error).__name__}: {outcome.error}{where} before its first "
                    "optimizer step", "fix the script so that `python` runs it (TFDOCTOR_DEBUG=1 shows "
                                      "the traceback)") from outcome.error
    if outcome.ended == "exit":
        raise error(f"{name} called sys.exit({exit_code(outcome.error)!r}){where} before its first optimizer "
                    "step", "check the script's arguments (give them after --)") from outcome.error
    if outcome.ended == "interrupted":
        raise error(f"{name} was interrupted (Ctrl-C) before its first optimizer step")
