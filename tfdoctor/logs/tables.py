"""Logs that are tables: CSV (Lightning's CSVLogger `metrics.csv`, a user's own) and JSON lines (one
object per logged point, nested objects flattened with `/`). Each row's step is its step column (`step`,
`global_step`, `iter`, `iteration`, ... or the one --tag step=NAME names), else its line number, which
the report then says.

A log read while it is written may end in half a line: a last line without its newline that does not
parse is left out (and noted), the next read takes it whole. A line in the middle that does not parse
is counted and skipped.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Optional

from tfdoctor.logs.logged import Columns, LogUnreadable, Point
from tfdoctor.logs.names import STEP_NAMES, normal

# the step columns in the order they are preferred when a log has several
STEP_ORDER = ("step", "global_step", "trainer_global_step", "train_global_step", "iter", "iteration", "iters",
              "it", "steps", "num_steps", "batch_idx")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIXES = (".csv",)


def read_csv(path: Path, name: str, step_tag: Optional[str], fmt: str = "csv") -> Columns:
    text, notes = _text(path)
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n") and len(lines) > 1:
        lines.pop()  # the writer is mid-line: its row is read whole next time
        notes.append("its last line was half-written: left out")
    reader = csv.reader(io.StringIO("".join(lines)))
    header = next(reader, None)
    if not header:
        raise LogUnreadable(f"{path} is empty", "a log being created fills in a moment (--follow waits)")
    rows, short = [], 0
    for cells in reader:
        if not cells:
            continue
        if len(cells) != len(header):
            short += 1
            continue
        rows.append(dict(zip(header, cells)))
    if short:
        notes.append(f"{short} row(s) with another number of cells than the header's {len(header)}: skipped")
    return _columns(rows, header, path, name, step_tag, fmt, notes)


def read_jsonl(path: Path, name: str, step_tag: Optional[str]) -> Columns:
    text, notes = _text(path)
    lines = text.splitlines(keepends=True)
    rows, bad, keys = [], 0, {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            data = json.loads(line)  # NaN / Infinity tokens are floats, as a Python json.dumps wrote them
        except ValueError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                notes.append("its last line was half-written: left out")
            else:
                bad += 1
            continue
        if not isinstance(data, dict):
            bad += 1
            continue
        row = _flat(data)
        keys.update(dict.fromkeys(row))
        rows.append(row)
    if bad:
        notes.append(f"{bad} line(s) that are not JSON objects: skipped")
    return _columns(rows, list(keys), path, name, step_tag, "jsonl", notes)


def looks_like_jsonl(path: Path) -> bool:
    """A .json file written a line at a time (its first line one whole object), not a pretty-printed one."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline(1 << 16)
        return isinstance(json.loads(first), dict)
    except (OSError, ValueError):
        return False


def header_of(path: Path) -> list[str]:
    """A table's column names, read cheaply (a folder's data files are told from its logs by them)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline(1 << 16)
    except OSError:
        return []
    if path.suffix.lower() in CSV_SUFFIXES:
        return next(csv.reader([first]), [])
    try:
        data = json.loads(first)
    except ValueError:
        return []
    return list(_flat(data)) if isinstance(data, dict) else []


def _text(path: Path) -> tuple[str, list[str]]:
    try:
        return path.read_text(encoding="utf-8", errors="replace"), []
    except OSError as error:
        raise LogUnreadable(f"cannot read {path}: {error.strerror or error}", "check the path and its permissions")


def _columns(rows: list[dict], header: list[str], path: Path, name: str, step_tag: Optional[str], fmt: str,
             notes: list[str]) -> Columns:
    step_column = step_tag if step_tag is not None else _step_column(header)
    if step_tag is not None and step_tag not in header:
        step_column = None  # find_runs says which --tag named nothing
    columns = Columns(fmt, str(path), name, notes=notes)
    columns.modified = path.stat().st_mtime
    if step_column is None:
        columns.step_from = "the line number (no step column)"
        columns.notes.append("no step column (step, global_step, iter, iteration): each row's step is its "
                             "line number; name one with --tag step=COLUMN")
    else:
        columns.step_from = f"the step column {step_column!r}"
    unplaced = 0
    for i, row in enumerate(rows):
        if step_column is None:
            step = i
        else:
            step = _number(row.get(step_column))
            if step is None or not math.isfinite(step):
                unplaced += 1
                continue
        for key, value in row.items():
            number = _number(value)
            if key == step_column or number is None:
                continue
            columns.add(key, Point(int(step), number))
    if unplaced:
        columns.notes.append(f"{unplaced} row(s) without a step in {step_column!r}: skipped")
    return columns


def _step_column(header: list[str]) -> Optional[str]:
    by_normal = {}
    for name in header:
        by_normal.setdefault(normal(name), name)
    for key in STEP_ORDER:
        if key in by_normal:
            return by_normal[key]
    return next((name for name in header if normal(name) in STEP_NAMES), None)


def _flat(data: dict, prefix: str = "") -> dict:
    """{"train": {"loss": 2.1}} -> {"train/loss": 2.1}: a nested log's keys as one spelling."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "/"))
        else:
            out[name] = value
    return out


def _number(value) -> Optional[float]:
    """A cell as a number: JSON numbers and booleans, CSV text that parses ("nan" and "inf" included:
    they are evidence); None for empty cells and text."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip():
        try:
            return float(value)
        except ValueError:
            return None
    return None
