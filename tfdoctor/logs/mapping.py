"""From a log's columns to the RunSeries the run judges read: which column is which series (names.py, and
the user's --tag), one StepRow per logged training point at its logged global step (so the rows are
sparse where the log has an interval), one EvalPoint per logged evaluation loss, and the facts a log
can give.

What the rows hold is what the log holds: NaN and inf as logged (a divergence), a Trainer's loss of 0.0
as logged (its logging_nan_inf_filter drops NaN losses from the mean). Where a series is derived, the
sources say how: seconds per step from a clock, tokens per step from a running count, a skipped
step from a fall of the loss scale.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

from tfdoctor.logs.logged import Columns, LoggedRun
from tfdoctor.logs.names import Role, is_place, role_for_tag, role_of
from tfdoctor.watching.series import UNKNOWN, EvalPoint, RunSeries, StepRow

# The StepRow fields a training point may carry (a point at which only an evaluation was logged is no row)
TRAINING = ("loss", "grad_norm", "lr", "scale", "skipped", "wall", "tokens", "rss", "cuda_allocated")
# tokens: which spelling wins where a log has several
TOKENS_PREFERENCE = ("per-step", "cumulative", "per-second")


def logged_run(read: Columns, tags: dict[str, str], following: bool = False) -> LoggedRun:
    """The run `read` holds, with `tags` (series -> column) over the names table. `following`: the log is
    read by `judge --follow`, so a log that cannot say whether its run ended is taken as still written
    (a file's modification time cannot tell: a copy or a fresh checkout of an old log is new)."""
    notes = list(read.notes)
    picked, missing = _chosen_columns(read, tags, notes)
    chosen = {slot: column for slot, (column, _) in picked.items()}
    roles = {slot: role for slot, (_, role) in picked.items()}
    series = RunSeries()
    sources: dict[str, str] = {}
    steps = sorted({p.step for role, name in chosen.items() if role[0] in TRAINING for p in read.columns[name]})
    at = {role: {p.step: p for p in read.columns[name]} for role, name in chosen.items()}

    def logged(series_name: str, step: int):
        point = at.get((series_name, 0), {}).get(step)
        return point.value if point is not None else None

    rows = [StepRow(step=step, loss=logged("loss", step), grad_norm=logged("grad_norm", step),
                    scale=logged("scale", step)) for step in steps]
    groups = sorted(group for series_name, group in chosen if series_name == "lr")
    for row in rows:
        rates = [at[("lr", g)].get(row.step) for g in groups]
        row.lrs = [p.value for p in rates] if rates and all(p is not None for p in rates) else []
    for role, name in chosen.items():
        if role[0] == "eval":
            series.evals += [EvalPoint(p.step, p.value, source=name, split=UNKNOWN, weighting="calls")
                             for p in read.columns[name]]
            sources[f"eval:{name}"] = name
        elif role[0] == "lr":
            sources["lr" if role[1] == 0 else f"lr:{role[1]}"] = name
        elif role[0] in TRAINING and role[0] not in ("wall", "tokens", "skipped"):
            sources[role[0]] = name
    _memory(rows, chosen, roles, at, sources)
    _skipped(rows, chosen, at, sources)
    _wall(rows, chosen, roles, at, read, sources, notes)
    _tokens(rows, chosen, roles, at, sources, notes)
    series.evals.sort(key=lambda point: point.step)
    series.steps = rows
    interval = _interval([p.step for p in read.columns[chosen[("loss", 0)]]] if ("loss", 0) in chosen else steps)
    complete = read.facts.get("complete")
    still_written = complete is False or (following and complete is not True)
    series.facts.update({k: v for k, v in read.facts.items() if k not in ("complete",)})
    series.facts["ended"] = "log"
    series.facts["logged"] = {"format": read.format, "path": read.path, "interval": interval, "sources": sources,
                              "still_written": still_written, "complete": complete, "step_from": read.step_from}
    if interval and interval > 1:
        notes.append(f"one training point every {interval} optimizer steps: each is the mean the log kept, so a "
                     f"spike of one step is about 1/{interval} as tall in the log as in the run")
    used = set(chosen.values())
    unread = [name for name in read.columns if name not in used and not is_place(name)]
    return LoggedRun(read.name, read.path, read.format, series, sources, interval, notes, unread,
                     complete, read.modified, missing)


def _chosen_columns(read: Columns, tags: dict[str, str], notes: list[str]):
    """({(series, group) or ("eval", column): (column, Role)}, the --tag names this log lacks). Where
    several columns spell one series: the tagged one, else the one with the most points (Lightning's
    `train_loss_step` before `loss` logged once); tokens: a per-step count before a running count before
    a rate."""
    chosen: dict[tuple, tuple[str, Role]] = {}
    missing = []
    for key, column in tags.items():
        if key == "step":
            if not read.step_from.endswith(repr(column)) and read.format in ("csv", "jsonl", "lightning-csv"):
                missing.append(f"step={column}")
            continue
        if column not in read.columns:
            missing.append(f"{key.partition(':')[0]}={column}")
            continue
        role = Role("eval") if key.startswith("eval:") else role_for_tag(key)
        chosen[("eval", column) if role.series == "eval" else (role.series, role.group)] = (column, role)
    tagged = {column for column, _ in chosen.values()}
    candidates: dict[tuple, list[tuple[str, Role]]] = {}
    for column in read.columns:
        role = role_of(column)
        if column in tagged or role is None or role.series == "step":
            continue
        slot = ("eval", column) if role.series == "eval" else (role.series, role.group)
        candidates.setdefault(slot, []).append((column, role))
    for slot, found in candidates.items():
        if slot in chosen:
            notes.append(f"{', '.join(c for c, _ in found)} also spell {slot[0]}: {chosen[slot][0]} read (--tag)")
            continue
        if slot[0] == "tokens":
            found.sort(key=lambda pair: TOKENS_PREFERENCE.index(pair[1].how))
        best = max(found, key=lambda pair: len(read.columns[pair[0]]) if slot[0] != "tokens" else 0)
        chosen[slot] = best
        if len(found) > 1:
            others = ", ".join(f"{c} ({len(read.columns[c])} points)" for c, _ in found if c != best[0])
            notes.append(f"{slot[0]}: read {best[0]} ({len(read.columns[best[0]])} points); not read: {others}")
    return chosen, missing


def _memory(rows, chosen, roles, at, sources) -> None:
    for field in ("rss", "cuda_allocated"):
        if (field, 0) not in chosen:
            continue
        unit = roles[(field, 0)].unit
        for row in rows:
            point = at[(field, 0)].get(row.step)
            if point is not None and math.isfinite(point.value):
                if field == "rss":
                    row.rss = int(point.value * unit)
                else:
                    row.cuda_allocated = int(point.value * unit)
        sources[field] = chosen[(field, 0)]


def _skipped(rows, chosen, at, sources) -> None:
    """A skipped optimizer step: where the log says so, else where the loss scale fell (the GradScaler
    halves its scale on each step it skips)."""
    if ("skipped", 0) in chosen:
        for row in rows:
            point = at[("skipped", 0)].get(row.step)
            row.skipped = bool(point is not None and point.value and math.isfinite(point.value))
        sources["skipped"] = chosen[("skipped", 0)]
        return
    if ("scale", 0) not in chosen:
        return
    previous = None
    for row in rows:
        if row.scale is None:
            continue
        row.skipped = previous is not None and row.scale < previous
        previous = row.scale
    sources["skipped"] = f"{chosen[('scale', 0)]} (where it fell)"


def _wall(rows, chosen, roles, at, read: Columns, sources, notes) -> None:
    """Seconds per optimizer step: as logged, else the clock's difference over the steps between points
    (that clock also ran through evaluations and checkpoints between them)."""
    if ("wall", 0) in chosen:
        unit = roles[("wall", 0)].unit
        for row in rows:
            point = at[("wall", 0)].get(row.step)
            if point is not None and math.isfinite(point.value):
                row.wall = point.value * unit
        sources["wall"] = chosen[("wall", 0)] + (" (ms)" if unit == 1e-3 else "")
        return
    clock: dict[int, float] = {}
    if ("time", 0) in chosen:
        clock = {step: p.value for step, p in at[("time", 0)].items()}
        said = f"{chosen[('time', 0)]} (differences)"
    else:
        for role, column in chosen.items():
            if role[0] in TRAINING:
                for p in read.columns[column]:
                    if p.time is not None:
                        clock.setdefault(p.step, p.time)
        said = f"the {read.format} timestamps (differences)"
    if len(clock) < 2:
        return
    previous: Optional[tuple[int, float]] = None
    for row in rows:
        now = clock.get(row.step)
        if now is None:
            continue
        if previous is not None and row.step > previous[0] and now >= previous[1]:
            row.wall = (now - previous[1]) / (row.step - previous[0])
        previous = (row.step, now)
    sources["wall"] = said
    notes.append("seconds per step from the log's clock: the time between two points over the steps between "
                 "them, evaluations and checkpoints in between included")


def _tokens(rows, chosen, roles, at, sources, notes) -> None:
    if ("tokens", 0) not in chosen:
        return
    column, how = chosen[("tokens", 0)], roles[("tokens", 0)].how
    points = at[("tokens", 0)]
    values = [points[row.step].value for row in rows if row.step in points and math.isfinite(points[row.step].value)]
    if how == "per-step" and len(values) >= 3 and all(b >= a for a, b in zip(values, values[1:])) \
            and values[-1] > 2 * values[0] > 0:
        how = "cumulative"  # `tokens` that only grow: a running count
        notes.append(f"{column} only grows: read as the tokens seen so far")
    previous: Optional[tuple[int, float]] = None
    for row in rows:
        point = points.get(row.step)
        if point is None or not math.isfinite(point.value):
            continue
        if how == "per-step":
            row.tokens = int(point.value)
        elif how == "cumulative":
            if previous is not None and row.step > previous[0]:
                row.tokens = int((point.value - previous[1]) / (row.step - previous[0]))
            previous = (row.step, point.value)
        elif row.wall:
            row.tokens = int(point.value * row.wall)
    if how == "per-second" and not any(row.wall for row in rows):
        notes.append(f"{column} (tokens per second) not read: the log keeps no step time to count tokens with")
        return
    sources["tokens"] = column + {"per-step": "", "cumulative": " (differences)",
                                  "per-second": " (times seconds per step)"}[how]


def _interval(steps: list[int]) -> Optional[int]:
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return int(statistics.median(gaps)) if gaps else None

