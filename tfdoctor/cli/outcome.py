"""From a request to a printed report and an exit code: the supervised worker, the outcomes every
command ends the same way (one line on stderr), the progress bar, and where the report goes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from tfdoctor.cli.app import Format, shown
from tfdoctor.errors import TfdoctorError, UsageError
from tfdoctor.process.protocol import Ended
from tfdoctor.result import ExitCode
from tfdoctor.usercode.environment import DEBUG


def fail_usage(error: TfdoctorError) -> None:
    typer.echo(f"tfdoctor: error: {whose()}{shown(error.one_line())}", err=True)
    raise typer.Exit(ExitCode.USAGE_ERROR)


def finish(outcome, report, fmt: Format, output: Optional[Path]) -> None:
    """Write what the worker delivered, then exit: 2 with its one line when it stopped early."""
    if report is not None:
        emit(report, fmt, output)
    if outcome.ended != Ended.DONE:
        typer.echo(f"tfdoctor: error: {whose()}{shown(outcome.message)}", err=True)
        raise typer.Exit(ExitCode.USAGE_ERROR)
    raise typer.Exit(report.exit_code())


def report_from_outcome(outcome, target: str, strict: bool):
    from tfdoctor.process.supervisor import report_from_outcome as made  # here, not at start-up: --help stays fast

    return made(outcome, target, strict)


def supervised(request: dict, show_progress: bool, timeout: float, timeout_per_check: float, then=None):
    """Run the request in a supervised worker; usage errors, internal errors and Ctrl-C end here.

    `then(outcome)` (which exits) concludes the command. Given, it runs while the worker still waits:
    rank 0 of a distributed run prints its report before the other ranks are told its exit code,
    since torchrun ends every rank as soon as one has exited."""
    from tfdoctor.process.supervisor import supervise

    hold = (lambda outcome: then(handled(outcome))) if then is not None and request.get("release") else None
    with progress_bar(show_progress) as start:
        outcome = supervise(request, timeout=timeout, timeout_per_check=timeout_per_check, progress=start,
                            hold=hold)
    outcome = handled(outcome)
    if then is not None:
        then(outcome)
    return outcome


def handled(outcome):
    """The outcomes every command ends the same way: each one line on stderr and its exit code."""
    if outcome.ended == Ended.USAGE_ERROR:
        if outcome.quiet:  # another rank's line, which rank 0 prints
            raise typer.Exit(ExitCode.USAGE_ERROR)
        fail_usage(UsageError(outcome.message))
    if outcome.ended == Ended.INTERNAL_ERROR:
        if DEBUG.on():
            typer.echo(outcome.debug, err=True)
        typer.echo(f"tfdoctor: internal error: {whose()}{outcome.message} (rerun with TFDOCTOR_DEBUG=1 for the traceback)",
                   err=True)
        raise typer.Exit(ExitCode.USAGE_ERROR)
    if outcome.ended == Ended.INTERRUPTED:
        typer.echo(f"tfdoctor: {whose()}{outcome.message}", err=True)
        raise typer.Exit(outcome.code or 130)
    return outcome


def whose() -> str:
    """Under torchrun every rank's line lands on the same stderr: the other ranks' say whose they are."""
    from tfdoctor.usercode.world import world  # no torch: reads torchrun's environment

    me = world()
    return f"rank {me.rank} of {me.size}: " if me.rank != 0 else ""


def launched(nproc: int, command: str = "run") -> None:
    """--nproc N: torchrun runs this same command as N ranks; their exit code is ours."""
    from tfdoctor.process.launch import launch

    args = sys.argv[1:]
    args = args[args.index(command) + 1:] if command in args else args
    try:
        code = launch(nproc, args, command)
    except TfdoctorError as error:
        fail_usage(error)
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM, SIGHUP (process/launch.py): every rank has ended
        typer.echo(f"tfdoctor: {getattr(stop, 'said', 'interrupted')} while the {nproc} ranks ran", err=True)
        raise typer.Exit(getattr(stop, "code", 130))
    raise typer.Exit(code)


def progress_bar(wanted: bool):
    """The terminal bar when the report is for people; nothing in JSON/JUnit mode or off a terminal."""
    import contextlib

    from tfdoctor.report.progress import terminal_progress

    return terminal_progress() if wanted else contextlib.nullcontext(None)


def emit(report, fmt: Format, output: Optional[Path], said: bool = True) -> None:
    """The report on stdout or in `output` (`said`: say where it went; watch's verdict line says it)."""
    from tfdoctor.report import render

    if output is not None:
        with open(output, "w", encoding="utf-8") as out:
            render(report, fmt.value, out, width=100)
        if said:
            typer.echo(f"tfdoctor: report written to {output}", err=True)
    else:
        render(report, fmt.value, sys.stdout)
