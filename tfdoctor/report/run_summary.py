"""A watched run's headline numbers, each computed here once and written under one name, whoever shows
it: the console header (report/watch_header.py), the live view (report/dashboard.py) and the HTML figure
titles (report/run_figures.py). Before, "loss at the start" was the first step's loss in the HTML and
the median of the first 10 steps in the console, "tokens/s" was total tokens over the wall-clock in one
and the median step's rate in the other, and a run without a DataLoader read "data wait 0.0%".

Pure: the series as JSON data (columns of numbers, None, "nan"), no torch and no Rich.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

# The start and the end of the loss curve are the medians of this many steps: one noisy batch is not
# the run.
ENDS = 10
DATA_WAIT_NOT_MEASURED = "data wait not measured (no DataLoader)"
CURVES_HEALTHY = "curves healthy"


def number_of(value) -> Optional[float]:
    """A number the series carries as JSON data (a float, "nan", None) as a float, or None."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def finite(values) -> list[float]:
    kept = (number_of(v) for v in values)
    return [v for v in kept if v is not None and math.isfinite(v)]


# ------------------------------------------------------------------ the loss


def loss_ends(losses: Sequence) -> Optional[str]:
    """'4.302 to 1.759 (medians of the first and last 10 steps)', or None without a finite loss."""
    kept = finite(losses)
    if not kept:
        return None
    n = min(ENDS, len(kept))
    which = "the first and the last step" if n == 1 else f"medians of the first and last {n} steps"
    return f"{statistics.median(kept[:n]):.4g} to {statistics.median(kept[-n:]):.4g} ({which})"


# ------------------------------------------------------------------ time: the first step holds the script's start
# A row's wall time runs from the end of the step before; the first row's from the monitor's start, so
# it holds the script's imports, the model's construction and the first batch: every share and rate
# below is taken over the steps after the first.


def data_wait_measured(facts: dict, batches: Sequence) -> bool:
    """Whether a DataLoader fed the model: the monitor times only a DataLoader iterator's __next__, so
    a script that slices its batches out of a tensor (nanoGPT's get_batch) waited for data unmeasured,
    not 0% of its time. The same condition as the data-wait judge's skip (facts["loader"])."""
    return bool(facts.get("loader")) or any((number_of(b) or 0) > 0 for b in batches)


def data_wait_share(wait_seconds: float, wall_seconds: float, measured: bool, span: str = "over the whole run") -> str:
    """'data wait 0.7% over the whole run', or that it was not measured."""
    if not measured:
        return DATA_WAIT_NOT_MEASURED
    if wall_seconds <= 0:
        return ""
    return f"data wait {wait_seconds / wall_seconds:.1%} {span}"


def run_data_wait(steps: dict, facts: dict) -> str:
    walls = [number_of(w) or 0.0 for w in steps.get("wall", [])[1:]]
    waits = [number_of(w) or 0.0 for w in steps.get("data_wait", [])[1:]]
    return data_wait_share(sum(waits), sum(walls), data_wait_measured(facts, steps.get("batches", [])))


def wall_clock_rate(tokens: float, seconds: float) -> Optional[str]:
    """'14,753 wall-clock tokens/s': the tokens trained over the time they took, evaluations, printing
    and data wait included."""
    if tokens <= 0 or seconds <= 0:
        return None
    return f"{tokens / seconds:,.0f} wall-clock tokens/s"


def step_rates(steps: dict) -> list[Optional[float]]:
    """Each step's tokens over its own wall time (None where either is missing), the first step's None."""
    rates: list[Optional[float]] = []
    for i, (tokens, wall) in enumerate(zip(steps.get("tokens", []), steps.get("wall", []))):
        tokens, wall = number_of(tokens), number_of(wall)
        rates.append(tokens / wall if i > 0 and tokens and wall and wall > 0 else None)
    return rates


def median_step_rate(steps: dict) -> Optional[str]:
    """'15,210 tokens/s at the median step': the typical step's rate, the slow steps (an evaluation, a
    checkpoint) left out where the wall-clock rate counts them."""
    rates = finite(step_rates(steps))
    return f"{statistics.median(rates):,.0f} tokens/s at the median step" if rates else None


def run_wall_clock_rate(steps: dict) -> Optional[str]:
    tokens = sum(number_of(t) or 0 for t in steps.get("tokens", [])[1:])
    seconds = sum(number_of(w) or 0.0 for w in steps.get("wall", [])[1:])
    return wall_clock_rate(tokens, seconds)


# ------------------------------------------------------------------ the rates of the parameter groups


def group_label(index: int, groups: Sequence[dict]) -> str:
    """'group 1 (weight decay 0, 3.1K parameters)': the group as the script built it, where the monitor
    recorded it (facts["param_groups"])."""
    group = groups[index] if index < len(groups) else {}
    said = []
    decay = number_of(group.get("weight_decay"))
    if decay is not None:
        said.append(f"weight decay {decay:g}")
    if isinstance(group.get("parameters"), int):
        said.append(f"{count(group['parameters'])} parameters")
    return f"group {index}" + (f" ({', '.join(said)})" if said else "")


def count(n: int) -> str:
    """1234 -> '1.2K', 10_600_000 -> '10.6M'."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def rate_columns(lrs: Sequence) -> list[list[float]]:
    """Each parameter group's rates over the steps (the rows hold one rate per group)."""
    width = max((len(r) for r in lrs if isinstance(r, list)), default=0)
    return [finite(r[i] for r in lrs if isinstance(r, list) and i < len(r)) for i in range(width)]


def rates_said(lrs: Sequence, groups: Sequence[dict]) -> list[str]:
    """['rate 0.00015 to 0.003'], where there are several parameter groups ['rate 0.00015 to 0.003 in
    every group (2)'] or one line per group: ['rate 1e-05 to 0.001 in group 0 (weight decay 0.1, 10.6M
    parameters)', ...]. Empty without a rate."""
    columns = rate_columns(lrs)
    if not any(columns):
        return []
    if len(columns) == 1 or all(c == columns[0] for c in columns):
        every = f" in every group ({len(columns)})" if len(columns) > 1 else ""
        return [f"rate {min(columns[0]):.3g} to {max(columns[0]):.3g}{every}"]
    return [f"rate {min(c):.3g} to {max(c):.3g} in {group_label(i, groups)}" for i, c in enumerate(columns) if c]


# ------------------------------------------------------------------ what watch judges, and what it does not


def curves_healthy(results: Sequence) -> bool:
    """Every run judge that judged passed (none warned, failed or crashed), and at least one judged."""
    statuses = [getattr(r.status, "value", r.status) for r in results]
    return "pass" in statuses and not any(s in ("warn", "fail", "error") for s in statuses)


def beyond_curves(target: str) -> str:
    """What a healthy watch leaves unjudged, and the command that judges it. `target` is the report's
    ("watch train.py", "watch -m pkg.train", "watch Trainer GPT2LMHeadModel" from a callback)."""
    run = target[len("watch "):] if target.startswith("watch ") else ""
    script = run if run.endswith(".py") or run.startswith("-m ") else "SCRIPT"
    return (f"watch judges the curves, not the model: a model that reads the future trains to a healthy-looking "
            f"curve; `tfdoctor run {script}` audits the model and the loop, `tfdoctor check model.py:build` "
            f"the model alone")
