"""`tfdoctor watch SCRIPT`: a whole training run, the user's real one, recorded and judged."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from tfdoctor.cli.app import app
from tfdoctor.cli.flags import (
    budget_in_range,
    format_ready,
    keeping_folder,
    nproc_in_range,
    positive,
    script_argument,
    seed_in_range,
    selection_nonempty,
    writable,
)
from tfdoctor.cli.options import (
    Format,
    Module,
    OnlyJudges,
    Output,
    Script,
    SeriesFmt,
    SkipJudges,
    Strict,
    WatchNproc,
    WatchSeed,
    WatchTimeout,
)
from tfdoctor.cli.outcome import end_command, fail_usage, handled, launched, report_from_outcome, stopped
from tfdoctor.errors import TfdoctorError
from tfdoctor.process.protocol import Ended
from tfdoctor.result import ExitCode
from tfdoctor.watching.protection import after_line, before_line, cut_short_by


@app.command(context_settings={"allow_interspersed_args": True})
def watch(
    argv: Script = None,
    module: Module = None,
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="stop the run after this many optimizer "
                                                                      "steps (default: run to its end)"),
    max_time: Optional[float] = typer.Option(None, "--max-time", help="stop the run after this many seconds"),
    only: OnlyJudges = None,
    skip: SkipJudges = None,
    fmt: SeriesFmt = Format.rich,
    output: Output = None,
    strict: Strict = False,
    seed: WatchSeed = None,
    timeout: WatchTimeout = None,
    nproc: WatchNproc = None,
    keep_writes: Optional[Path] = typer.Option(None, "--keep-writes", metavar="DIR",
                                               help="with --max-steps/--max-time: keep a copy of what the run "
                                                    "wrote in DIR (your own files stay as they were)"),
) -> None:
    """Watch a whole training run: record every optimizer step and judge the run's curves.

    The script runs as __main__ (as `python SCRIPT ARGS`, or `python -m MODULE ARGS`) to its end or to
    --max-steps / --max-time, each step's loss, gradient norm, rates, loss scale, data wait, tokens/s,
    memory and evaluation loss recorded, then judged. A terminal shows a live view; JSON carries it all.

    It is your real run: what it writes (checkpoints, logs) is kept, as `python SCRIPT` keeps it. Only
    a run that --max-steps or --max-time may cut short is protected: its writes are thrown away unless
    --keep-writes DIR keeps a copy. Ctrl-C reaches the script as it would the bare script.
    """
    argv = list(argv or [])
    try:
        script = script_argument(argv, module, "watch")
        positive("--max-steps", max_steps)
        if max_time is not None:
            budget_in_range("--max-time", max_time)
        if timeout is not None:
            budget_in_range("--timeout", timeout)
        if seed is not None:
            seed_in_range(seed)
        selection_nonempty(only, skip, run_judges=True)
        writable(output)
        format_ready(fmt)
        nproc_in_range(nproc)
        protected_by = cut_short_by(max_steps, max_time)
        keep_in = keeping_folder(keep_writes, protected_by)
    except TfdoctorError as error:
        fail_usage(error)
    if nproc is not None and nproc > 1:
        launched(nproc, "watch")
    from tfdoctor.usercode.world import world

    me = world()
    target = script if script is not None else f"-m {module}"
    request = dict(command="watch", script=script, module=module, args=argv, max_steps=max_steps, max_time=max_time,
                   target=target, only=only, skip=skip, seed=seed, protect=bool(protected_by), keep_writes=keep_in)
    budget = timeout if timeout is not None else math.inf
    if protected_by and me.rank == 0:
        typer.echo(before_line(protected_by, keep_in), err=True)
    # The live view only where one process draws (another rank's output would tear it), and not where
    # the report itself goes to stdout as data; a report written to a file leaves the terminal free.
    live = (fmt is Format.rich or output is not None) and not me.distributed
    from tfdoctor.process.supervisor import supervise

    with watch_view(live, target) as view:
        outcome = handled(supervise(request, timeout=budget, timeout_per_check=budget, progress=view))
    if me.rank != 0:  # rank 0 speaks for the job
        raise typer.Exit(ExitCode.OK if outcome.ended == Ended.DONE else ExitCode.USAGE_ERROR)
    watch_ended(outcome, report_from_outcome(outcome, f"watch {target}", strict), fmt, output, protected_by)


def watch_ended(outcome, report, fmt: Format, output: Optional[Path], protected_by: list[str]) -> None:
    """After the report: what protected the user's files (watching/protection.py), how the run ended when
    it did not end well, and the one verdict line every watched run ends with (report/verdict.py)."""
    if report is None:  # cut short before any judge ran: its one line, no verdict
        end_command(None, fmt, output, error=stopped(outcome))
    protected = after_line(report.sandbox, protected_by) if protected_by else None
    notes = [protected] if protected else []
    ended, failed = report.discovered.get("ended"), report.discovered.get("error")
    if ended == "interrupted":  # Ctrl-C: the steps it took are judged, and the exit code is Ctrl-C's
        notes.append(f"tfdoctor: interrupted (Ctrl-C) after {report.discovered.get('steps')} optimizer step(s)")
        end_command(report, fmt, output, notes=notes, code=130, verdict=True)
    # judged on the steps it took, but the run itself failed
    error = f"the watched script {'raised' if ended == 'raised' else 'exited with'} {failed}" if failed else ""
    end_command(report, fmt, output, notes=notes, error=error or stopped(outcome), verdict=True)


def watch_view(live: bool, target: str):
    """The live view on a terminal (report/dashboard.py), else nothing."""
    import contextlib

    if not live:
        return contextlib.nullcontext(None)
    from tfdoctor.report.dashboard import terminal_dashboard

    return terminal_dashboard(target)
