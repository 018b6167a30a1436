"""The `tfdoctor` Typer app and the entry point that turns every usage problem, the parser's included,
into one line on stderr and exit 2 (the options the commands share are in options.py)."""

from __future__ import annotations

import sys

import typer

from tfdoctor.cli.flags import format_alias_hint, script_options_hint
from tfdoctor.result import ExitCode
from tfdoctor.usercode.environment import DEBUG

app = typer.Typer(
    name="tfdoctor",
    help="A doctor for Transformer training code: finds the bugs that make training look better.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,
)


def shown(text: str) -> str:
    """The user's text in our line, escape sequences and control characters shown, not obeyed."""
    from tfdoctor.report.safe_text import clean

    return clean(text)


def _show_version(value: bool) -> None:
    if value:
        from tfdoctor import __version__

        typer.echo(f"tfdoctor {__version__}")
        raise typer.Exit(ExitCode.OK)


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", help="print the version and exit", is_eager=True,
                                 callback=_show_version),
) -> None:
    """A doctor for Transformer training code: finds the bugs that make training look better."""


def _usage_exceptions() -> tuple[type, ...]:
    """Command-line parsing errors: recent Typer raises its own (it vendors click), older Typer
    raises click's."""
    kinds: list[type] = [getattr(typer, "TyperException", None)]
    try:
        import click

        kinds.append(click.exceptions.ClickException)
    except ImportError:
        pass
    return tuple(kind for kind in kinds if kind is not None)


def main() -> None:
    """Entry point: every usage problem, the parser's included, is one line on stderr and exit 2."""
    try:
        code = app(standalone_mode=False)
    except _usage_exceptions() as error:
        message = error.format_message()
        if type(error).__name__ == "NoArgsIsHelpError":  # bare `tfdoctor`: the help is the message
            typer.echo(message, err=True)
        else:
            hint = script_options_hint(error, sys.argv[1:]) or format_alias_hint(message)  # the line that works
            said = " ".join(message.split())
            typer.echo(f"tfdoctor: error: {said.rstrip('.') if hint else said}{shown(hint)}", err=True)
        sys.exit(ExitCode.USAGE_ERROR)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("tfdoctor: aborted", err=True)
        sys.exit(130)
    except Exception as error:  # never a traceback; TFDOCTOR_DEBUG=1 shows it
        if DEBUG.on():
            raise
        typer.echo(f"tfdoctor: internal error: {type(error).__name__}: {error} "
                   "(rerun with TFDOCTOR_DEBUG=1 for the traceback)", err=True)
        sys.exit(ExitCode.USAGE_ERROR)
    sys.exit(code if isinstance(code, int) else 0)
