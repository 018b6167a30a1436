"""The one Rich theme of tfdoctor's reports: every colour as a named style, shared by the check report
(console.py) and the memory report (memory.py)."""

from __future__ import annotations

from rich.theme import Theme

THEME = Theme({
    "status.pass": "bold green",
    "status.warn": "bold yellow",
    "status.fail": "bold red",
    "status.skip": "dim",
    "status.error": "bold magenta",
    "check.id": "bold",
    "hint": "cyan",
    "evidence": "dim",
    "location": "bold",
    "map.none": "grey35",
    "map.past": "green",
    "map.future": "bold red",
    # the memory report: headings, the notes under them, and the bars against the budget
    "head": "bold",
    "dim": "dim",
    "bar": "cyan",
    "bar.over": "red",
})
