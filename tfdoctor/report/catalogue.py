"""`tfdoctor checks`: the catalogue of checks as a table (id, what it catches, the fix), or one
check's full documentation. Read at 80 columns too (a pipe, a CI log): a fix is code the user copies,
so a long token (`torch.finfo(scores.dtype).min`) breaks across lines and is never cut with "…"."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text


def render_catalogue(specs, console: Console) -> None:
    table = Table(show_lines=True)
    table.add_column("id", style="bold", no_wrap=True, overflow="fold")
    table.add_column("what it catches", overflow="fold")
    table.add_column("the fix", overflow="fold")
    for spec in specs:
        table.add_row(spec.id, Text(spec.summary), Text(spec.fix))
    console.print(table)
    console.print("`tfdoctor checks ID` prints one check's full documentation.", highlight=False, markup=False)


def applies_to(spec) -> str:
    """What the check judges, in a line: the models' kinds and what it needs, or a watched run."""
    if spec.judges_run:
        return "a whole watched run (tfdoctor watch, TfdoctorCallback)"
    return f"{', '.join(spec.kinds)} models" + (f"; needs {', '.join(spec.needs)}" if spec.needs else "")


def render_check(spec, console: Console) -> None:
    console.print(Text.assemble((spec.id, "bold"), f": {spec.title}"), highlight=False)
    console.print(f"applies to: {applies_to(spec)}", highlight=False, markup=False)
    for paragraph in spec.doc.split("\n\n"):  # reflowed to the terminal's width
        console.print()
        console.print(" ".join(paragraph.split()), highlight=False, markup=False)
