"""From a request to a printed report and an exit code: the supervised worker, the outcomes every
command ends the same way (one line on stderr), the progress bar, where the report goes, and the one
ending every command's report goes through (end_command)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn, Optional

import typer

from tfdoctor.cli.app import shown
from tfdoctor.errors import TfdoctorError, UsageError
from tfdoctor.process.protocol import Ended
from tfdoctor.result import ExitCode
from tfdoctor.usercode.environment import DEBUG


def fail_usage(error: TfdoctorError) -> None:
    typer.echo(f"tfdoctor: error: {whose()}{shown(error.one_line())}", err=True)
    raise typer.Exit(ExitCode.USAGE_ERROR)


def end_command(report, fmt, output: Optional[Path], *, notes=(), error: str = "", code: Optional[int] = None,
                verdict: bool = False, pages=None) -> NoReturn:
    """Every command ends here: the report on stdout or in `output`, its lines on stderr, the exit code.

    `report`: a Report, or memory's verdict; None when the worker delivered none. `pages`: what is printed
    instead, one after another (judge: each run's own report). `notes`: lines said after the report;
    `error`: why the command stopped early (exit 2); `code`: an exit code the report does not decide
    (Ctrl-C's 130, memory's fits). `verdict`: end with the one verdict line (watch, judge: a run of days
    never ends in silence), which names the file the report went to, instead of a line of its own."""
    for page in pages or ([report] if report is not None else []):
        emit(page, fmt, output, said=not verdict)
    for note in notes:
        typer.echo(note, err=True)
    if error:
        typer.echo(f"tfdoctor: error: {whose()}{shown(error)}", err=True)
    if verdict and report is not None:
        from tfdoctor.report.verdict import verdict_line

        where = "judged above" if fmt.value == "rich" else f"the {fmt.value} report is on stdout"
        typer.echo(verdict_line(report, output, where), err=True)
    if code is None:
        code = ExitCode.USAGE_ERROR if error or report is None else report.exit_code()
    raise typer.Exit(code)


def stopped(outcome) -> str:
    """Why the worker stopped before it was done ("" when it was done): the line the command ends with."""
    return "" if outcome.ended == Ended.DONE else outcome.message


def report_from_outcome(outcome, target: str, strict: bool):
    """The Report the worker delivered (None: it finished no check), with what `run` discovered and the
    series `watch` recorded."""
    from tfdoctor.process.supervisor import report_from_outcome as made  # here, not at start-up: --help stays fast

    report = made(outcome, target, strict)
    if report is not None:
        facts = dict(outcome.discovered)
        report.series = facts.pop("series", {})
        report.discovered = facts
    return report


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
        typer.echo(f"tfdoctor: internal error: {whose()}{outcome.message} "
                   "(rerun with TFDOCTOR_DEBUG=1 for the traceback)", err=True)
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


def emit(report, fmt, output: Optional[Path], said: bool = True) -> None:
    """The report on stdout or in `output` (`said`: say where it went; watch's verdict line says it)."""
    from tfdoctor.report import render

    if output is not None:
        with open(output, "w", encoding="utf-8") as out:
            render(report, fmt.value, out, width=100)
        if said:
            typer.echo(f"tfdoctor: report written to {output}", err=True)
    else:
        render(report, fmt.value, sys.stdout)
