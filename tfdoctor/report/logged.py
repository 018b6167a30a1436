"""`tfdoctor judge`'s header lines for a run read from a log: where it was read, how often it logged, which
column each series came from, what was left unread (to map with --tag) and the reader's notes. Plain
strings from the series' facts and the report's "discovered"; no Rich, no torch."""

from __future__ import annotations


def logged_lines(series: dict, found: dict) -> list[str]:
    facts = series.get("facts", {})
    logged = facts.get("logged") or {}
    steps = series.get("steps", {}).get("step", [])
    runs = found.get("runs") or [{}]
    run = runs[0]
    interval = logged.get("interval")
    span = f", steps {steps[0]}-{steps[-1]}" if steps else ""
    every = f" every {interval} steps" if interval and interval > 1 else ""
    state = {True: ", the log says the run ended", False: ", the run had not ended when it was written"}.get(
        logged.get("complete"), "")
    if logged.get("still_written"):
        state = ", still being written"
    lines = [f"{len(steps)} training point(s) logged{every}{span}, from {logged.get('format')} {logged.get('path')}"
             f"{state}"]
    sources = logged.get("sources") or {}
    if sources:
        lines.append("read: " + ", ".join(f"{series_name} <- {column}" for series_name, column in sources.items()))
    if run.get("unread"):
        lines.append("not read: " + ", ".join(run["unread"][:15]) + (" ..." if len(run["unread"]) > 15 else "")
                     + " (map one with --tag SERIES=NAME)")
    lines += [f"note: {note}" for note in run.get("notes", [])]
    return lines
