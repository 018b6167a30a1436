"""How the loop stepped its learning-rate scheduler, read against what the scheduler promised: for
lr-trajectory (checks/run_health.py). Pure functions of the RunSeries: each row's rate used and the
number of scheduler.step() calls made before it (`scheduler_steps`), and the scheduler's promise, the
rate it gives after k calls (facts["schedulers"][i]["promise"], watching/promise.py).

The rate used at optimizer step i is promise[position_i]: the loop's stepping decides which of the
promised rates it gets. Stepped once per optimizer step, position_i = i (up to one step of offset).
Stepped once per epoch (Lightning's default `interval`), never, or once per micro-batch, the run
walks the schedule at another speed, and whether that is a bug depends on the unit the schedule was
written in, which the code does not say: StepLR(step_size=30) stepped per epoch is torchvision's
recipe; a 100-step LambdaLR warm-up stepped per epoch leaves the rate at its first warm-up value all
run. The rule, measured on the promise over the run's planned length:

- stepped less often than once per step (per epoch, never): a fault when the run, by its planned end,
  gets through less than PROGRESS_MIN of the change the schedule makes over that length (its
  "movement": the sum of |rate change| from its start to where it ends or turns back up, a cosine's
  trough or a restart). A schedule written in epochs reaches its end within the epochs (a cosine
  over max_epochs: 100%, StepLR(30) over 90 epochs: 99.9%, ExponentialLR(0.95) over 30 epochs: 77%);
  one written in optimizer steps barely starts (fixtures/watch/lightning_warmup_per_epoch.py: 3%).
- stepped several times per step: a fault when the schedule's change ends within the planned
  optimizer steps (it was counted in optimizer steps, and the run goes through it k times too fast);
  a schedule that still changes past them was counted in the unit the loop steps it in.
"""

from __future__ import annotations

import statistics
from typing import Optional

from tfdoctor.result import Result
from tfdoctor.watching.series import RunSeries, StepRow

# A rate used and its promised value agree within 0.1% (both are the same float arithmetic; a
# float32 tensor lr rounds at 1e-7), at 90% of the steps or more: else something besides this
# scheduler sets the rate (a second scheduler, a manual param_group["lr"] = ...), and the promise
# says nothing about the rate.
MATCH_REL = 1e-3
MATCH_SHARE = 0.9
# Stepped once per optimizer step: 0.8-1.25 calls per step on average (a run whose GradScaler skipped
# steps and whose Trainer skipped the scheduler with them is not counted on those steps).
ONCE_LOW, ONCE_HIGH = 0.8, 1.25
# Changes of the promise below 0.1% of its peak are no change (an exponential decay's tail).
CHANGE_TOL = 1e-3
PROGRESS_MIN = 0.10
# A schedule counted in optimizer steps ends at the plan's length, give or take a miscount
# (drop_last, a rounded epoch): up to 25% past it.
DESIGN_SLACK = 1.25


def stepping_verdict(series: RunSeries, details: dict) -> Optional[Result]:
    """A failing Result when the loop steps the scheduler at a speed its schedule was not written for;
    None when it steps it once per optimizer step, as written, or when the promise cannot be compared
    (no single scheduler, a rate the scheduler does not set). Adds its evidence to `details`."""
    found = _promised(series)
    if found is None:
        return None
    record, rows, promise = found
    start = rows[0].scheduler_steps
    counted = [(a, b) for a, b in zip(rows, rows[1:]) if b.step == a.step + 1 and not a.skipped]
    if not counted:
        return None
    per_step = sum(b.scheduler_steps - a.scheduler_steps for a, b in counted) / len(counted)
    planned, planned_from = _plan(series, len(rows))
    peak = max(promise[start:])
    tol = CHANGE_TOL * peak
    end = schedule_end(promise, start, tol)
    evidence = {"scheduler": record.get("name"), "steps_called": record.get("steps_called"),
                "calls_per_step": per_step, "planned_steps": planned, "planned_from": planned_from,
                "schedule_ends_at": end - start, "points": _points(rows, promise, start)}
    details["stepping"] = evidence
    if ONCE_LOW <= per_step <= ONCE_HIGH:
        return None
    name = record.get("name", "scheduler")
    if per_step < ONCE_LOW:
        if planned is None:  # a per-epoch schedule watched for a few epochs of many: cannot tell yet
            return None
        reached = rows[-1].scheduler_steps + per_step * (planned - len(rows))
        wanted = moved(promise, start, min(start + planned - 1, end))
        got = moved(promise, start, min(int(reached), end))
        if wanted <= tol:
            return None  # the schedule does not change over the plan anyway
        evidence.update(progress=got / wanted, progress_min=PROGRESS_MIN)
        if got / wanted >= PROGRESS_MIN:
            return None  # written in the unit it is stepped in (per epoch by design)
        return _slow_verdict(series, rows, promise, start, name, per_step, planned, details)
    limit = DESIGN_SLACK * planned if planned is not None else len(rows)
    if end - start > limit:
        return None  # it still changes past the plan: counted in the unit the loop steps it in
    return _fast_verdict(rows, promise, start, name, per_step, planned or len(rows), details)


def _promised(series: RunSeries) -> Optional[tuple[dict, list[StepRow], list[float]]]:
    """The one scheduler driving the watched optimizer, the rows with a position in its promise, and
    the promise; None when there is not exactly one, it was stepped with explicit epochs (positions
    are then the loop's numbers, not calls), or the rates used are not its promise."""
    watched = [s for s in series.facts.get("schedulers") or [] if isinstance(s, dict) and s.get("watched")]
    if len(watched) != 1 or not watched[0].get("promise") or watched[0].get("epoch_given"):
        return None
    record, promise = watched[0], watched[0]["promise"]
    rows = [row for row in series.steps
            if row.lrs and row.scheduler_steps is not None and row.scheduler_steps < len(promise)]
    if len(rows) < 2:
        return None
    agree = sum(_agrees(max(row.lrs), promise[row.scheduler_steps]) for row in rows)
    return (record, rows, promise) if agree >= MATCH_SHARE * len(rows) else None


def _agrees(used: float, promised: float) -> bool:
    return abs(used - promised) <= MATCH_REL * max(abs(used), abs(promised)) + 1e-30


def _plan(series: RunSeries, steps: int) -> tuple[Optional[int], Optional[str]]:
    """The run's planned optimizer steps and where that number came from: a run that finished on its
    own ran its plan; a run stopped early (by --max-steps, --max-time, Ctrl-C) had a plan only the
    framework told (the Trainer's max_steps, Lightning's estimate); else unknown."""
    planned, source = series.facts.get("planned_steps"), series.facts.get("planned_from")
    if series.facts.get("ended") == "finished":
        return steps, "the run's own length"
    if isinstance(planned, int) and planned > 0 and source != "--max-steps":
        return max(planned, steps), source
    return None, None


def schedule_end(promise: list[float], start: int, tol: float) -> int:
    """Where the schedule's change ends, from position `start`: the first trough it climbs back out of
    (a cosine's period, a warm restart, a cycle), else its last change larger than `tol`."""
    top = promise[start]
    falling, low, low_at, last_change = False, 0.0, start, start
    for k in range(start + 1, len(promise)):
        value = promise[k]
        if abs(value - promise[k - 1]) > tol:
            last_change = k
        if not falling:
            top = max(top, value)
            if value < top - tol:
                falling, low, low_at = True, value, k
        elif value < low:
            low, low_at = value, k
        elif value > low + tol:
            return low_at
    return last_change


def moved(promise: list[float], start: int, stop: int) -> float:
    """The schedule's movement from position `start` to `stop`: the sum of its rate changes' sizes."""
    stop = min(max(stop, start), len(promise) - 1)
    return sum(abs(promise[k + 1] - promise[k]) for k in range(start, stop))


def _points(rows: list[StepRow], promise: list[float], start: int) -> list[dict]:
    """A few steps' evidence: the rate used, its position, and what the schedule promised for that
    step had it been stepped once per optimizer step."""
    first = rows[0].step
    picks = sorted({0, len(rows) // 4, len(rows) // 2, 3 * len(rows) // 4, len(rows) - 1})
    out = []
    for i in picks:
        row = rows[i]
        per_step = start + row.step - first
        out.append({"step": row.step, "used": max(row.lrs), "scheduler_steps": row.scheduler_steps,
                    "promised": promise[per_step] if per_step < len(promise) else None})
    return out


def _how_often(series: RunSeries, rows: list[StepRow], per_step: float) -> str:
    """"never", "once per epoch (every 40 optimizer steps)" or "once every 7 optimizer steps"."""
    if per_step == 0:
        return "never"
    # the typical spacing of the steps at which it advanced (the run's start counts as one)
    advanced = [rows[0].step] + [b.step for a, b in zip(rows, rows[1:]) if b.scheduler_steps > a.scheduler_steps]
    interval = statistics.median(b - a for a, b in zip(advanced, advanced[1:]))
    loader = series.facts.get("loader") or {}
    batches = loader.get("batches_per_epoch")
    micro = statistics.median(max(1, len(row.micro_losses)) for row in rows)
    if isinstance(batches, int) and batches > 0 and abs(interval - batches / micro) <= 0.15 * batches / micro:
        return f"once per epoch (every {batches / micro:.0f} optimizer steps)"
    return f"once every {interval:.0f} optimizer steps"


def _diverged(rows: list[StepRow], promise: list[float], start: int, ratio: float) -> StepRow:
    """The first step whose rate is not the one the schedule gives at `ratio` calls per step."""
    first = rows[0].step
    for row in rows:
        at = start + int(round(ratio * (row.step - first)))
        if at < len(promise) and not _agrees(max(row.lrs), promise[at]):
            return row
    return rows[-1]


def _slow_verdict(series, rows, promise, start, name, per_step, planned, details) -> Result:
    evidence = details["stepping"]
    how = _how_often(series, rows, per_step)
    row = _diverged(rows, promise, start, 1.0)
    details["step"] = row.step
    first = rows[0].step

    def gap(r: StepRow) -> float:  # how far the rate used is from the schedule's value for its step
        at = start + r.step - first
        return abs(promise[at] - max(r.lrs)) if at < len(promise) else 0.0

    worst = max(rows, key=gap)
    used = [max(r.lrs) for r in rows]
    calls = evidence.get("steps_called")
    stepped = (f"scheduler.step() was never called between the run's {len(rows)} optimizer steps"
               + (f" ({calls} calls in all)" if calls else "") if per_step == 0 else
               f"scheduler.step() ran {how}, {calls} times in {len(rows)} optimizer steps")
    stayed = (f"at {used[0]:.3g}, its first value" if min(used) == max(used) else
              f"between {min(used):.3g} and {max(used):.3g}")
    message = (f"{stepped}, but the {name} is written in optimizer steps: by the end of the {planned}-step run "
               f"it gets through {evidence['progress']:.0%} of its schedule, so the rate stayed {stayed}, from "
               f"step {row.step} on (at step {worst.step} {max(worst.lrs):.3g}, where the schedule gives "
               f"{promise[start + worst.step - first]:.3g})")
    hint = ("step the scheduler once per optimizer step: in Lightning, return {'scheduler': scheduler, "
            "'interval': 'step'} as configure_optimizers' lr_scheduler (the default interval is 'epoch'); in "
            "your own loop, call scheduler.step() right after optimizer.step(). A schedule meant per epoch "
            "takes its lengths in epochs")
    return Result.failed(message, hint, details)


def _fast_verdict(rows, promise, start, name, per_step, planned, details) -> Result:
    evidence = details["stepping"]
    k = per_step
    row = _diverged(rows, promise, start, 1.0)
    details["step"] = row.step
    late = rows[len(rows) // 2]
    own = start + late.step - rows[0].step
    ends = evidence["schedule_ends_at"]
    message = (f"scheduler.step() ran {k:.3g} times per optimizer step ({rows[-1].scheduler_steps - start} calls in "
               f"{len(rows)} steps), but the {name} is written in optimizer steps (its change ends at step {ends}, "
               f"within the {planned}-step run): the rate runs {k:.3g}x fast from step {row.step} on and reaches "
               f"the schedule's end by step {ends / k:.0f}; at step {late.step} it was {max(late.lrs):.3g}, the "
               f"schedule's value for step {late.scheduler_steps - start}"
               + (f" (for step {late.step} it gives {promise[own]:.3g})" if own < len(promise) else ""))
    hint = ("call scheduler.step() once per optimizer step: under gradient accumulation, inside the branch "
            "that calls optimizer.step(), not once per micro-batch; or give the schedule its lengths in the "
            "unit you step it in")
    return Result.failed(message, hint, details)
