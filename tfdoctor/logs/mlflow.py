"""MLflow's file store, read by hand (a plain format: no mlflow import): a run is a folder
`mlruns/<experiment>/<run id>/` holding `meta.yaml` (its name, its status), `metrics/<name>` (one line per
logged value: `timestamp value step`, the timestamp in milliseconds; a metric named `train/loss` is the
file metrics/train/loss) and `params/<name>` (the Trainer's MLflowCallback logs its arguments there,
max_steps among them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from tfdoctor.logs.logged import Columns, Point

# mlflow.entities.RunStatus: RUNNING 1, SCHEDULED 2, FINISHED 3, FAILED 4, KILLED 5
ENDED_STATUSES = {"3": "FINISHED", "4": "FAILED", "5": "KILLED", "FINISHED": "FINISHED", "FAILED": "FAILED",
                  "KILLED": "KILLED"}


def is_run(folder: Path) -> bool:
    return (folder / "meta.yaml").is_file() and (folder / "metrics").is_dir()


def read(folder: Path, name: str) -> Columns:
    meta = _meta(folder / "meta.yaml")
    label = meta.get("run_name") or _text(folder / "tags" / "mlflow.runName") or name
    columns = Columns("mlflow", str(folder), label if label == name else f"{name} ({label})",
                      step_from="the metrics' step")
    metrics = folder / "metrics"
    columns.modified = (folder / "meta.yaml").stat().st_mtime
    half = 0
    for root, _dirs, files in os.walk(metrics):
        for file in sorted(files):
            path = Path(root) / file
            columns.modified = max(columns.modified, path.stat().st_mtime)
            metric = path.relative_to(metrics).as_posix()
            points, cut = _points(path)
            half += cut
            if points:
                columns.columns[metric] = points
    if half:
        columns.notes.append(f"{half} metric file(s) ended in a half-written line: left out")
    status = str(meta.get("status", "")).strip()
    columns.facts["complete"] = status in ENDED_STATUSES if status else None
    if status in ENDED_STATUSES and ENDED_STATUSES[status] != "FINISHED":
        columns.notes.append(f"MLflow says the run ended {ENDED_STATUSES[status]}")
    max_steps = _text(folder / "params" / "max_steps")
    if max_steps and max_steps.strip().lstrip("-").isdigit() and int(max_steps) > 0:
        columns.facts.update(max_steps=int(max_steps), planned_steps=int(max_steps),
                             planned_from="the run's max_steps parameter (MLflow)")
    return columns


def _points(path: Path) -> tuple[list[Point], int]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return [], 0
    lines = text.splitlines(keepends=True)
    cut = 0
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
        cut = 1
    by_step: dict[int, Point] = {}
    for line in lines:
        parts = line.split()
        if len(parts) < 2:
            continue
        try:
            stamp, value = float(parts[0]), float(parts[1])
            step = int(parts[2]) if len(parts) > 2 else 0
        except ValueError:
            continue
        by_step[step] = Point(step, value, stamp / 1000.0)  # a step logged again: the later value
    return [by_step[step] for step in sorted(by_step)], cut


def _meta(path: Path) -> dict:
    """meta.yaml's top-level `key: value` lines (all this reader needs; no YAML parser)."""
    out = {}
    for line in (_text(path) or "").splitlines():
        if line[:1].isspace() or ":" not in line:
            continue
        key, _, value = line.partition(":")
        out[key.strip()] = value.strip().strip("'\"")
    return out


def _text(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
