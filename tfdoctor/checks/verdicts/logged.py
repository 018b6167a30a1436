"""What the run judges need to know about a RunSeries read from a training log (`tfdoctor judge`)
rather than recorded by `watch`: a log's rows are its logged points, sparse (the Trainer's
logging_steps=10 gives steps 10, 20, 30, ...), each a mean over the steps since the last one for the
Trainer and most loggers or one step's own value for others (Lightning's on_step values); its series
are the ones the user chose to log, named as the log names them; and what it never holds (which
rows were trained on, the DataLoader, the model's mode) cannot be judged from it.

The reader (tfdoctor/logs/) puts facts["logged"] = {"format", "path", "interval", "sources",
"still_written"} on the series; `sources` maps a series ("loss", "grad_norm", "lr", "eval:<name>", ...)
to the column or tag it came from. A watched series has no facts["logged"]: every function here then
says "not a log" (interval 1), so a judge's watched behaviour does not change.
"""

from __future__ import annotations

import math

from tfdoctor.watching.series import RunSeries


def log_of(series: RunSeries) -> dict | None:
    """facts["logged"] of a series read from a log, None for a watched run."""
    logged = series.facts.get("logged")
    return logged if isinstance(logged, dict) else None


def interval(series: RunSeries) -> int:
    """Optimizer steps between two logged training points (1 for a watched run, or a log of every step)."""
    logged = log_of(series)
    value = logged.get("interval") if logged else None
    return int(value) if isinstance(value, (int, float)) and value >= 1 else 1


def named(series: RunSeries, key: str) -> str:
    """The log's own name for a series ("train/loss" for "loss"), else the series' name."""
    logged = log_of(series) or {}
    sources = logged.get("sources") or {}
    return str(sources.get(key) or key)


def missing(what: str, key: str) -> str:
    """A skip's reason on a log that lacks a series: "the log has no gradient norm (grad_norm)"."""
    return f"the log has no {what} ({key})"


def points_for(series: RunSeries, steps: int, least: int) -> int:
    """How many logged points cover `steps` optimizer steps (a judge's window, measured in steps on
    watched runs), at least `least` of them: a median of fewer points says little."""
    return max(least, math.ceil(steps / interval(series)))


def spacing(series: RunSeries) -> str:
    """", logged every 10 steps" for a sparse log, "" otherwise: what a message says its points are."""
    every = interval(series)
    return f", logged every {every} steps" if log_of(series) and every > 1 else ""
