"""`tfdoctor watch SCRIPT`: a whole training run, the user's real one, recorded and judged."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from tfdoctor.cli.app import Format, app
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
from tfdoctor.cli.outcome import emit, fail_usage, finish, handled, launched, report_from_outcome, shown
from tfdoctor.errors import TfdoctorError
from tfdoctor.process.protocol import Ended
from tfdoctor.result import ExitCode
from tfdoctor.watching.protection import after_line, before_line, cut_short_by


@app.command(context_settings={"allow_interspersed_args": True})
def watch(
    argv: Optional[list[str]] = typer.Argument(None, metavar="[SCRIPT] [-- ARGS...]",
                                               help="the training script and, after --, its own arguments"),
    module: Optional[str] = typer.Option(None, "-m", "--module", help="run this module as `python -m` does"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="stop the run after this many optimizer "
                                                                      "steps (default: run to its end)"),
    max_time: Optional[float] = typer.Option(None, "--max-time", help="stop the run after this many seconds"),
    only: Optional[str] = typer.Option(None, "--only", help="run only these judges (comma-separated ids)"),
    skip: Optional[str] = typer.Option(None, "--skip", help="skip these judges (comma-separated ids)"),
    fmt: Format = typer.Option(Format.rich, "--format", help="report format (json carries every series)"),
    output: Optional[Path] = typer.Option(None, "--output", help="write the report to this file instead of stdout"),
    strict: bool = typer.Option(False, "--strict", help="treat warnings as failures"),
    seed: Optional[int] = typer.Option(None, "--seed", help="torch seed set before the script starts (default: "
                                                            "none, the script's own randomness)"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="seconds after which the run is stopped as "
                                                                    "hung (default: none)"),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="start the script as this many ranks with torchrun; "
                                                              "rank 0's run is judged"),
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
    report = report_from_outcome(outcome, f"watch {target}", strict)
    if report is not None:
        report.series = outcome.discovered.pop("series", {})
        report.discovered = dict(outcome.discovered)
    watch_ended(outcome, report, fmt, output, protected_by)


def watch_ended(outcome, report, fmt: Format, output: Optional[Path], protected_by: list[str]) -> None:
    """The report, then what protected the user's files, then the one verdict line every watched run
    ends with on stderr (watching/protection.py, report/verdict.py), and the exit code."""
    from tfdoctor.report.verdict import verdict_line

    if report is None:
        finish(outcome, report, fmt, output)
    emit(report, fmt, output, said=False)
    protected = after_line(report.sandbox, protected_by) if protected_by else None
    if protected:
        typer.echo(protected, err=True)
    where = "judged above" if fmt is Format.rich else f"the {fmt.value} report is on stdout"
    ended = report.discovered.get("ended")
    if ended == "interrupted":  # Ctrl-C: the steps it took are judged
        typer.echo(f"tfdoctor: interrupted (Ctrl-C) after {report.discovered.get('steps')} optimizer step(s)",
                   err=True)
    elif report.discovered.get("error"):  # judged on the steps it took, but the run itself failed
        how = "raised" if ended == "raised" else "exited with"
        typer.echo(f"tfdoctor: error: the watched script {how} {shown(report.discovered['error'])}", err=True)
    elif outcome.ended != Ended.DONE:
        typer.echo(f"tfdoctor: error: {shown(outcome.message)}", err=True)
    typer.echo(verdict_line(report, output, where), err=True)
    if ended == "interrupted":
        raise typer.Exit(130)
    if report.discovered.get("error") or outcome.ended != Ended.DONE:
        raise typer.Exit(ExitCode.USAGE_ERROR)
    raise typer.Exit(report.exit_code())


def watch_view(live: bool, target: str):
    """The live view on a terminal (report/dashboard.py), else nothing."""
    import contextlib

    if not live:
        return contextlib.nullcontext(None)
    from tfdoctor.report.dashboard import terminal_dashboard

    return terminal_dashboard(target)
