"""`tfdoctor checks [ID]`: the catalogue of checks, or one check's documentation."""

from __future__ import annotations

from typing import Optional

import typer

from tfdoctor.cli.app import app
from tfdoctor.cli.outcome import fail_usage
from tfdoctor.errors import TfdoctorError, UsageError


@app.command("checks")
def list_checks(
    check_id: Optional[str] = typer.Argument(None, help="show this check's full documentation"),
) -> None:
    """List every check: id, title and what it catches (or one check's full documentation)."""
    from rich.console import Console

    from tfdoctor.registry import all_checks, select
    from tfdoctor.report.catalogue import render_catalogue, render_check

    console = Console()
    if check_id is not None:
        try:
            (spec,) = select(only=check_id, run_judges=check_id in {s.id for s in all_checks() if s.judges_run})
        except (TfdoctorError, ValueError) as error:
            fail_usage(error if isinstance(error, TfdoctorError) else UsageError("give one check id"))
        render_check(spec, console)
        return
    render_catalogue(all_checks(), console)
