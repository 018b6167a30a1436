"""The human report: a summary table, then one panel per problem with its evidence and its fix."""

from __future__ import annotations

import os
from typing import TextIO

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tfdoctor.report.run_summary import CURVES_HEALTHY, beyond_curves, curves_healthy
from tfdoctor.report.theme import THEME
from tfdoctor.report.watch_header import watched_lines
from tfdoctor.result import Report, Result, Status
from tfdoctor.sparkline import sparkline
from tfdoctor.versions import describe

LABELS = {Status.PASS: "PASS", Status.WARN: "WARN", Status.FAIL: "FAIL", Status.SKIP: "SKIP", Status.ERROR: "ERROR"}
# The series checks keep in their details, drawn as one line each under the label that says what it is.
SERIES = {"loss_curve": "loss curve", "pre_clip_norms": "pre-clip gradient norm"}
# Details shown as numbers under a problem; the bulky ones (maps, curves) get drawings instead.
DRAWN_KEYS = {"dependency_map", "traceback", "map_cell_positions", "location", "call", *SERIES}
MAX_EVIDENCE_ITEMS = 10


PIPE_WIDTH = 140  # the report's width in a pipe or a CI log when COLUMNS does not say


def status_text(status: Status) -> Text:
    return Text(LABELS[status], style=f"status.{status.value}")


def heat_map(cells: list[list[int]], step: int) -> Text:
    """Rows are output positions i, columns input tokens j: which outputs move with which tokens."""
    # Distinct glyphs as well as colours, so the map reads in a log file or CI output too.
    styles = {0: ("··", "map.none"), 1: ("░░", "map.past"), 2: ("██", "map.future")}
    text = Text()
    for r, row in enumerate(cells):
        text.append(f"{r * step:>4} ", style="evidence")
        for cell in row:
            glyph, style = styles.get(cell, styles[2])
            text.append(glyph, style=style)
        text.append("\n")
    per_cell = f", {step} positions per cell" if step > 1 else ""
    text.append("     rows: output position i; columns: input token j" + per_cell + "\n", style="evidence")
    text.append("     ")
    text.append("··", style="map.none")
    text.append(" does not depend   ", style="evidence")
    text.append("░░", style="map.past")
    text.append(" depends on itself or the past   ", style="evidence")
    text.append("██", style="map.future")
    text.append(" depends on a later token (leak)", style="evidence")
    return text


def _format_value(value, limit: int = 80) -> str:
    """A detail as the report shows it: numbers to 4 significant digits wherever they sit (in a list,
    in a dict), a long list cut after its last whole item."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_format_value(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        items, used = [], 2
        for item in value:
            shown = _format_value(item) if not isinstance(item, str) else repr(item)
            if used + len(shown) + 2 > limit and items:
                items.append("...")
                break
            items.append(shown)
            used += len(shown) + 2
        return "[" + ", ".join(items) + "]"
    return str(value)


def evidence(result: Result, drawn_maps: list) -> list:
    parts: list = []
    details = result.details
    if "dependency_map" in details:
        if details["dependency_map"] in drawn_maps:  # the same measurement, already drawn above
            parts.append(Text("dependency map: as drawn above", style="evidence"))
        else:
            drawn_maps.append(details["dependency_map"])
            parts.append(heat_map(details["dependency_map"], details.get("map_cell_positions", 1)))
    for key, label in SERIES.items():
        if details.get(key):
            parts.append(Text.assemble((f"{label} ", "evidence"), sparkline(details[key])))
    numbers = [(k, v) for k, v in details.items() if k not in DRAWN_KEYS][:MAX_EVIDENCE_ITEMS]
    if numbers:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="evidence")
        grid.add_column()
        for key, value in numbers:
            grid.add_row(key, _format_value(value))
        parts.append(grid)
    if details.get("traceback"):
        parts.append(Text(details["traceback"].rstrip(), style="evidence"))
    return parts


def problem_panel(result: Result, drawn_maps: list) -> Panel:
    # The title states the healthy behaviour; above a failure it must read as what was expected, not
    # as what was found (and a long title is cut by the panel's border), so it goes in the body.
    body: list = [Text.assemble(("expected: ", "evidence"), (result.title, "evidence")), Text(result.message)]
    if result.details.get("location"):  # a loop finding: the user's line of the call it judges
        call = f" ({result.details['call']})" if result.details.get("call") else ""
        body.append(Text.assemble(("at ", "evidence"), (result.details["location"], "location"), (call, "evidence")))
    if result.hint:
        body.append(Text.assemble(("fix: ", "hint"), (result.hint, "hint")))
    body.extend(evidence(result, drawn_maps))
    title = Text.assemble(status_text(result.status), " ", (result.id, "check.id"))
    return Panel(Group(*body), title=title, title_align="left", border_style=f"status.{result.status.value}")


def summary_table(report: Report) -> Table:
    table = Table(show_header=True, header_style="bold", expand=False, pad_edge=False)
    table.add_column("status", no_wrap=True)
    table.add_column("check", style="check.id", no_wrap=True)
    table.add_column("what was seen", overflow="fold")  # a long path or code breaks across lines, never cut
    table.add_column("time", justify="right", style="evidence", no_wrap=True)
    for result in report.results:
        if result.status is not Status.SKIP:
            table.add_row(status_text(result.status), result.id, result.message, f"{result.seconds:.2f}s")
    return table


def skipped_lines(report: Report) -> list[Text]:
    """Skipped checks, grouped by reason: a dozen 'needs --train' rows would bury the findings."""
    by_reason: dict[str, list[str]] = {}
    for result in report.results:
        if result.status is Status.SKIP:
            by_reason.setdefault(result.message, []).append(result.id)
    return [Text.assemble(status_text(Status.SKIP), " ", (", ".join(ids), "check.id"), f": {reason}")
            for reason, ids in by_reason.items()]


def discovered_lines(facts: dict) -> list[Text]:
    """`tfdoctor run`'s header: what the script showed (the model, how it is called, its batches, the
    steps recorded), each fact overridable by the flag of the same name."""
    if not facts:
        return []
    model = facts.get("model", "?")
    where = f"{facts['model_defined_in']}, " if facts.get("model_defined_in") else ""
    wrapped = f" inside {facts['wrapper']}" if facts.get("wrapper") else ""
    lines = [f"model {model} ({where}{facts.get('parameters', 0):,} parameters){wrapped}, called as "
             f"{facts.get('called_as', '?')}"]
    lightning = facts.get("lightning")
    if lightning:
        trainer = ", ".join(f"{k} {lightning[k]}" for k in ("accumulate_grad_batches", "gradient_clip_val")
                            if k in lightning)
        lines.append(f"Lightning {lightning['module']} (audited: {lightning['audited']}), "
                     f"{lightning.get('strategy', '?')}, precision {lightning.get('precision', '?')}, {trainer}")
    batch = facts.get("batch_shape")
    pad = facts.get("pad_id")
    pad_text = (f"pad_id {pad} (from {facts.get('pad_id_source')})" if pad is not None else "no padding seen")
    side = f", {facts['padding_side']} padding" if facts.get("padding_side") else ""
    lines.append(f"batches {batch if batch else '?'}, vocab {facts.get('vocab_size')}, {pad_text}{side}")
    optimizers = ", ".join(facts.get("optimizers") or []) or "no optimizer"
    stop = f", stopped at {facts['stopped_at']}" if facts.get("stopped_at") else f" ({facts.get('ended')})"
    ranks = f" on each of {facts['world_size']} ranks (rank 0's shown)" if facts.get("world_size") else ""
    lines.append(f"{optimizers}: {facts.get('steps')} optimizer step(s) recorded{ranks} in "
                 f"{facts.get('seconds_to_stop', 0):.2f} s{stop}")
    if facts.get("checkpoint"):
        lines.append(f"checkpoint loaded before the first forward: {facts['checkpoint']}")
    if facts.get("overridden"):
        lines.append("overridden by flags: " + ", ".join(f"{k} {v}" for k, v in facts["overridden"].items()))
    lines.extend(f"note: {note}" for note in facts.get("notes", []))
    texts = []
    for i, line in enumerate(lines):
        texts.append(Text.assemble(("discovered " if i == 0 else "           ", "evidence"), line))
    return texts


def sandbox_lines(record: dict) -> list[Text]:
    """What the user's code tried to write and delete, none of which reached the user's files
    (tfdoctor/process/sandbox); nothing when it wrote nothing."""
    if not record.get("written_count") and not record.get("deleted_count"):
        return []

    def named(key: str, verb: str) -> str:
        count = record.get(f"{key}_count", 0)
        shown = [_near(path) for path in record.get(key, [])[:SANDBOX_NAMED]]
        more = f" and {count - len(shown)} more" if count > len(shown) else ""
        return f"{verb} {', '.join(shown)}{more}" if count else ""

    how = "an overlay" if record.get("mechanism") == "overlay" else "interposed Python file calls"
    kept = f"; a copy is kept in {record['kept_in']}" if record.get("kept_in") else ""
    said = "; ".join(filter(None, [named("written", "wrote"), named("deleted", "deleted")]))
    return [Text.assemble(("sandboxed  ", "evidence"), f"the code {said}: thrown away ({how}), your files are "
                          f"as they were{kept}")]


SANDBOX_NAMED = 3


def _near(path: str) -> str:
    """A path as the user would type it: relative under the current folder."""
    import os

    here = os.getcwd()
    return os.path.relpath(path, here) if path.startswith(here + os.sep) else path


def render(report: Report, out: TextIO, width: int | None = None) -> None:
    # No markup and no emoji codes: a message like "[/]" or ":x:" is the user's text, shown as written.
    console = Console(file=out, theme=THEME, width=width, highlight=False, markup=False, emoji=False,
                      force_terminal=None if width is None else False)
    if width is None and not console.is_terminal and not os.environ.get("COLUMNS"):
        # A pipe or a CI log has no width: Rich's 80 columns fold long parameter names inside the name
        # ("in_proj_bia" / "s"); a log line is read at any length.
        console.width = PIPE_WIDTH
    console.print(Text.assemble(("tfdoctor ", "bold"), report.target))
    if report.versions:
        console.print(Text("versions: " + describe(report.versions), style="evidence"))
    header = watched_lines(report) if report.series else discovered_lines(getattr(report, "discovered", {}))
    for line in header + sandbox_lines(report.sandbox):
        console.print(line)
    console.print(summary_table(report))
    for line in skipped_lines(report):
        console.print(line)
    drawn_maps: list = []
    for result in report.results:
        if result.status in (Status.FAIL, Status.ERROR, Status.WARN):
            console.print(problem_panel(result, drawn_maps))
    counts = report.summary()
    line = Text(", ".join(f"{n} {status}" for status, n in counts.items() if n))
    problems = report.problems()  # under --strict, warnings count: the line agrees with the exit code
    verdict = "healthy" if not problems else f"{len(problems)} problem(s) found"
    watched = bool(report.series) and not problems and not report.stopped
    if watched and curves_healthy(report.results):  # watch judged the curves: not the model, not the loop
        verdict = CURVES_HEALTHY
    if problems and report.strict and not report.problems(strict=False):
        verdict += " (warnings fail under --strict)"
    if report.stopped:
        verdict = "stopped before the last check: " + report.stopped
        problems = [True]
    console.print(Text.assemble(line, " — ", (verdict, "status.fail" if problems else "status.pass")))
    if watched:
        console.print(Text(beyond_curves(report.target), style="evidence"))
