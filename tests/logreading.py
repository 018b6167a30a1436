"""A tiny reading of the logs fixtures/logs/make.py writes into the RunSeries `tfdoctor judge` builds
(its contract: one StepRow per logged training point at its logged step, each evaluation loss an
EvalPoint of source <its name>, facts["logged"] and facts["ended"] = "log"), so that the judges can be
tested on real logs before and apart from the readers of tfdoctor/logs/. Plain json and csv, and
TensorBoard's own event reader; nothing here interprets a value."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

from tfdoctor.watching.series import UNKNOWN, EvalPoint, RunSeries, StepRow


def logged_series(fmt: str, path, points: dict[int, dict], evals: list[tuple[int, float, str]],
                  sources: dict[str, str]) -> RunSeries:
    """points: {step: {"loss", "grad_norm", "lr"}} of the logged training points; evals: (step, loss, name)."""
    rows = [StepRow(step, _float(p.get("loss")), grad_norm=_float(p.get("grad_norm")),
                    lrs=[p["lr"]] if p.get("lr") is not None else [])
            for step, p in sorted(points.items()) if p.get("loss") is not None]
    gaps = [b.step - a.step for a, b in zip(rows, rows[1:])]
    interval = int(statistics.median(gaps)) if gaps else None
    series = RunSeries(rows, [EvalPoint(step, loss, source=name, split=UNKNOWN, weighting="calls")
                              for step, loss, name in evals])
    series.facts = {"logged": {"format": fmt, "path": str(path), "interval": interval, "sources": sources,
                               "still_written": False}, "ended": "log"}
    return series


def _float(value):
    return None if value is None or value == "" else float(value)


def trainer_state(path) -> RunSeries:
    history = json.loads(Path(path).read_text())["log_history"]
    points = {r["step"]: {"loss": r["loss"], "grad_norm": r.get("grad_norm"), "lr": r.get("learning_rate")}
              for r in history if "loss" in r}
    evals = [(r["step"], r["eval_loss"], "eval_loss") for r in history if "eval_loss" in r]
    return logged_series("trainer-state", path, points, evals,
                         {"loss": "loss", "grad_norm": "grad_norm", "lr": "learning_rate", "eval:eval_loss": "eval_loss"})


def lightning_csv(path) -> RunSeries:
    points: dict[int, dict] = {}
    evals = []
    for row in csv.DictReader(Path(path).open()):
        step = int(row["step"])
        point = points.setdefault(step, {})
        for key, column in (("loss", "train_loss"), ("grad_norm", "grad_2.0_norm_total"), ("lr", "lr-AdamW")):
            if row.get(column):
                point[key] = float(row[column])
        if row.get("val_loss"):
            evals.append((step, float(row["val_loss"]), "val_loss"))
    return logged_series("lightning-csv", path, points, evals, {"loss": "train_loss", "grad_norm": "grad_2.0_norm_total",
                                                                 "lr": "lr-AdamW", "eval:val_loss": "val_loss"})


def jsonl(path) -> RunSeries:
    points, evals = {}, []
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if "val_loss" in record:
            evals.append((record["step"], record["val_loss"], "val_loss"))
        else:
            points[record["step"]] = record
    return logged_series("jsonl", path, points, evals,
                         {"loss": "loss", "grad_norm": "grad_norm", "lr": "lr", "eval:val_loss": "val_loss"})


def tensorboard(folder) -> RunSeries:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    points: dict[int, dict] = {}
    for key, tag in (("loss", "train/loss"), ("grad_norm", "train/grad_norm"), ("lr", "train/lr")):
        for event in events.Scalars(tag):
            points.setdefault(event.step, {})[key] = event.value
    evals = [(e.step, e.value, "val/loss") for e in events.Scalars("val/loss")]
    return logged_series("tensorboard", folder, points, evals,
                         {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr", "eval:val/loss": "val/loss"})


def nonfinite(value) -> bool:
    return value is not None and not math.isfinite(value)
