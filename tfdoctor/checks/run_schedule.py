"""The rate the optimizer really used over a whole watched run (lr-trajectory): its shape (0 throughout,
a decay that reaches about 0 long before the end, a warm-up that never ends), and how the loop stepped
its learning-rate scheduler, read against what the scheduler promised. Pure functions of the
RunSeries: each row's rate used and the number of scheduler.step() calls made before it
(`scheduler_steps`), and the scheduler's promise, the rate it gives after k calls
(facts["schedulers"][i]["promise"], watching/promise.py).

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

from tfdoctor.checks.verdicts import logged
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.watching.series import RunSeries, StepRow, trailing

MIN_RATE_STEPS = 20  # fewer steps say nothing about a schedule
NEAR_ZERO = 0.01  # a rate below this share of the run's peak is "about 0"
# The run's peak is the highest rate held this many steps in a row: a rate spike of a step or two (the
# curves fixture lr_spike.py: x50 for two steps) is loss-spike's to judge, not a new peak to decay from.
PEAK_SPAN = 5
DECAY_WARN_SHARE = 0.10  # the run's last 10% at about 0: more than any decay that ends at the run's end
DECAY_FAIL_SHARE = 0.25  # a quarter of the run's steps changed (almost) nothing
RISING_TAIL = 0.2  # warm-up never finished: the rate still rising over the run's last 20%
RISING_MIN_RATIO = 1.05  # by at least 5% (a rate flat within float rounding is not rising)
# A shorter run is a smoke test (the shipped fixtures/scripts/lightning_correct.py: 20 steps of a
# 100-step warm-up): a warm-up longer than it is expected there, not a fault.
WARMUP_MIN_STEPS = 100

# A log carries no scheduler and no promise: what its rates show is judged. A rate that jumps back up
# after it had decayed: at least RESTART_JUMP times the point before, which sat at RESTART_DECAYED of the
# highest rate so far or lower, and still that high RESTART_HOLD points on (a jump of one or two steps is
# a spike, loss-spike's to judge). Restarts at even spacing (within RESTART_EVEN) are warm restarts by
# design (CosineAnnealingWarmRestarts, the Trainer's cosine_with_restarts); a lone restart whose rates
# repeat the log's first RESTART_REPLAY rates (within RESTART_MATCH) is a schedule started over: a
# scheduler created anew on resume, its state not loaded. The Trainer's linear, cosine and
# constant_with_warmup schedules only rise during the warm-up, before any decay: never a restart.
RESTART_JUMP = 2.0
RESTART_DECAYED = 0.5
RESTART_HOLD = 2
RESTART_EVEN = 0.1
RESTART_REPLAY = 3
RESTART_MATCH = 0.05

# data-wait. Watched, the healthy runs (TensorDataset, num_workers=0, tiny model on a CPU) wait 1-4%
# of a typical step for their batch, also on a loaded machine; slow_loader.py (8 ms per row in
# __getitem__) 66-79%. A GPU idle a fifth of the time is worth knowing about.

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


def _schedulers(series: RunSeries) -> str:
    """The schedulers the run stepped, for the message: " (schedulers seen: LambdaLR)"."""
    seen = series.facts.get("schedulers") or []
    if not seen and logged.log_of(series):
        every = logged.interval(series)
        return f" (the rate logged every {every} steps)" if every > 1 else ""
    names = [s.get("name", "?") if isinstance(s, dict) else str(s) for s in seen]
    return f" (schedulers seen: {', '.join(names)})" if names else " (no scheduler seen)"


def _scheduler_names(series: RunSeries) -> set[str]:
    return {s.get("name", "") if isinstance(s, dict) else str(s) for s in series.facts.get("schedulers") or []}


@check("lr-trajectory", title="The learning rate the optimizer used follows a sane schedule")
def lr_trajectory(series: RunSeries) -> Result:
    """Catches a learning rate that wastes the run, judged on the rate the optimizer really used at
    each step: stuck at 0 (nothing trains), a decay that reached about 0 long before the run's end (a
    schedule told half the run's length: its second half changes nothing), and a warm-up still rising
    when the run finished on its own (the model never trained at its intended rate).

    And the rate used against what the scheduler itself promises at each optimizer step (its lambda,
    its milestones): a scheduler stepped per epoch (Lightning's default `interval`), never, or several
    times per optimizer step (once per micro-batch) walks its schedule at the wrong speed. Stepped
    less often, it fails when the run gets through under 10% of the schedule's change over its planned
    length (a warm-up in optimizer steps stepped per epoch: the rate sits at its first warm-up values);
    a schedule written in epochs (StepLR(30) over 90 epochs, a cosine over max_epochs) gets through it
    and passes. Stepped k times per step, it fails when the schedule ends within the planned optimizer
    steps (it runs k times too fast).

    Fix: give the schedule the run's real number of optimizer steps (len(loader) * epochs //
    accumulation), a warm-up of a few percent of it, and call scheduler.step() once per optimizer step
    (Lightning: "interval": "step").
    """
    rated = [(row.step, max(row.lrs)) for row in series.steps if row.lrs]
    log = logged.log_of(series)
    if log and not rated:
        return Result.skipped(logged.missing("learning rate", logged.named(series, "lr")))
    if len(rated) < MIN_RATE_STEPS:
        unit = "logged points" if log else "steps"
        return Result.skipped(f"{len(rated)} {unit} with a recorded learning rate: too few to judge a "
                              f"schedule (needs {MIN_RATE_STEPS})")
    rates = [rate for _, rate in rated]
    peak = max(min(rates[i:i + PEAK_SPAN]) for i in range(len(rates) - PEAK_SPAN + 1))
    seen = _schedulers(series)
    details = {"steps": len(rated), "peak": peak, "first": rates[0], "last": rates[-1],
               "near_zero": NEAR_ZERO * peak, "schedulers": [
                   {k: v for k, v in s.items() if k != "promise"} if isinstance(s, dict) else s
                   for s in series.facts.get("schedulers") or []]}
    stepped_wrong = stepping_verdict(series, details)
    if stepped_wrong is not None:
        return stepped_wrong
    if peak <= 0:
        details["step"] = rated[0][0]
        unit = "logged points" if log else "steps"
        return Result.failed(f"the optimizer's learning rate was 0 at every one of {len(rated)} {unit}: no step "
                             f"changed the weights{seen}",
                             "set the optimizer's lr (a scheduler's factor multiplies it), and check the "
                             "scheduler's lambda at step 0", details)
    if log:
        restarted = _restart_verdict(series, rated, details, seen)
        if restarted is not None:
            return restarted
    zero_tail = _near_zero_tail(rates, NEAR_ZERO * peak)
    if zero_tail:
        return _decay_verdict(series, rated, zero_tail, details, seen)
    return _warmup_verdict(series, rated, details, seen)


def _near_zero_tail(rates: list[float], near_zero: float) -> int:
    """How many of the last steps ran at about 0, after the rate had been above it."""
    tail = trailing([rate <= near_zero for rate in rates])
    return tail if tail < len(rates) else 0


def _decay_verdict(series: RunSeries, rated, zero_tail: int, details: dict, seen: str) -> Result:
    share = zero_tail / len(rated)
    step = rated[len(rated) - zero_tail][0]
    details.update({"step": step, "steps_at_zero": zero_tail, "share_at_zero": share,
                    "warn_share": DECAY_WARN_SHARE, "fail_share": DECAY_FAIL_SHARE})
    if share < DECAY_WARN_SHARE:
        unit = "logged points" if logged.log_of(series) else "steps"
        return Result.passed(f"the rate peaked at {details['peak']:.3g} and decayed to about 0 over the last "
                             f"{zero_tail} of {len(rated)} {unit}{seen}", details)
    message = (f"the learning rate reached about 0 (below {NEAR_ZERO:.0%} of its peak {details['peak']:.3g}) "
               f"at step {step} and stayed there: the last {zero_tail} of {len(rated)} steps ({share:.0%}) "
               f"changed (almost) nothing{seen}")
    hint = ("the schedule was told a shorter run than the loop trains: pass the real number of optimizer "
            "steps (len(loader) * epochs // accumulation steps) as its total (num_training_steps, T_max, "
            "total_iters)")
    # ReduceLROnPlateau cuts the rate on purpose when the loss stalls: a rate it took near 0 is its min_lr.
    if share >= DECAY_FAIL_SHARE and "ReduceLROnPlateau" not in _scheduler_names(series):
        return Result.failed(message, hint, details)
    return Result.warned(message, hint, details)


def _warmup_verdict(series: RunSeries, rated, details: dict, seen: str) -> Result:
    rates = [rate for _, rate in rated]
    start = rates[int(len(rates) * (1 - RISING_TAIL))]
    never_fell = all(b >= a * (1 - 1e-6) for a, b in zip(rates, rates[1:]))
    rising = never_fell and rates[-1] >= start * RISING_MIN_RATIO
    ended = series.facts.get("ended")
    details.update({"step": rated[-1][0], "rising_at_end": rising, "tail_start_rate": start,
                    "rising_min_ratio": RISING_MIN_RATIO, "ended": ended})
    if not rising:
        brief = (f", {max(rates):.3g} for fewer than {PEAK_SPAN} steps in a row" if max(rates) > details["peak"]
                 else "")
        ran = (f"the rate held at {details['peak']:.3g}" if min(rates) == details["peak"] else
               f"the rate ran between {min(rates):.3g} and {details['peak']:.3g}")
        return Result.passed(f"{ran}{brief}, and ended at {rates[-1]:.3g}{seen}", details)
    length = rated[-1][0] if logged.log_of(series) else len(rates)  # a log's points are steps apart
    if length < WARMUP_MIN_STEPS:
        return Result.passed(f"the rate was still rising at the end of this {length}-step run ({rates[-1]:.3g}): "
                             f"a run this short is a smoke test, its warm-up is not judged (from "
                             f"{WARMUP_MIN_STEPS} steps){seen}", details)
    if ended == "log":
        return Result.passed(f"the rate was still rising where the log ends ({rates[-1]:.3g}); a log does not say "
                             f"whether the run went on: its warm-up is not judged{seen}", details)
    if ended != "finished":
        how = ended or "how, unknown"
        return Result.passed(f"the rate was still rising when the run was stopped ({how}) at {rates[-1]:.3g}: "
                             f"its warm-up may finish later, not judged{seen}", details)
    return Result.warned(
        f"the learning rate was still rising when the run finished: {rates[0]:.3g} at its first step, "
        f"{start:.3g} at {1 - RISING_TAIL:.0%} of the run, {rates[-1]:.3g} at its last; the warm-up never "
        f"finished, so the model never trained at its intended rate{seen}",
        "make the warm-up a few percent of the run's optimizer steps (counted in optimizer steps, not "
        "samples or micro-batches), or train for longer", details)


def _restarts(rated: list[tuple[int, float]]) -> list[int]:
    """Indices of the troughs the rate climbed back out of after decaying: the rate had fallen to
    RESTART_DECAYED of its highest so far or lower, then rose to RESTART_JUMP times the trough and stayed
    there RESTART_HOLD more points. A scheduler re-created with a warm-up first drops to its start (the
    trough), then rises; one without a warm-up jumps straight up from the trough."""
    found, top, trough = [], 0.0, None
    for i, (_, rate) in enumerate(rated):
        if trough is None or rate < rated[trough][1]:
            if rate <= RESTART_DECAYED * top:
                trough = i
        if trough is not None and i > trough:
            held = [r for _, r in rated[i:i + RESTART_HOLD + 1]]
            if len(held) == RESTART_HOLD + 1 and min(held) >= RESTART_JUMP * rated[trough][1] > 0:
                found.append(trough)
                top, trough = 0.0, None  # the next restart is judged against this cycle's own peak
                continue
        top = max(top, rate)
    return found


def _restart_verdict(series: RunSeries, rated, details: dict, seen: str) -> Optional[Result]:
    """On a log: a rate that jumped back up after decaying, judged as a restart by design (evenly spaced)
    or a schedule started over (its rates repeat the log's first ones); None when the rate never did."""
    found = _restarts(rated)
    if not found:
        return None
    steps = [rated[i][0] for i in found]
    gaps = [b - a for a, b in zip([rated[0][0]] + steps, steps)]
    even = len(found) >= 2 and max(gaps) - min(gaps) <= RESTART_EVEN * max(gaps)

    def replays(at: int) -> bool:  # the rates from `at` on repeat the log's first ones
        count = min(RESTART_REPLAY, len(rated) - at)
        return count > 0 and all(abs(rated[at + k][1] - rated[k][1]) <= RESTART_MATCH * max(rated[k][1], 1e-30)
                                 for k in range(count))

    # the trough is the schedule's first point again (re-created with a warm-up) or the point before it
    first = next((at for at in (found[0], found[0] + 1) if replays(at)), found[0] + 1)
    replay = replays(first)
    count = min(RESTART_REPLAY, len(rated) - first)
    steps[0] = rated[first][0]
    details.update({"step": steps[0], "restarts": steps, "evenly_spaced": even, "replays_start": replay,
                    "rate_before": rated[first - 1][1], "rate_after": rated[first][1], "jump": RESTART_JUMP,
                    "decayed": RESTART_DECAYED})
    jumped = (f"the learning rate jumped from {rated[first - 1][1]:.3g} (step {rated[first - 1][0]}) to "
              f"{rated[first][1]:.3g} (step {steps[0]}) after decaying from {details['peak']:.3g}")
    if even:
        return Result.passed(f"the rate restarted {len(found)} times at steps {', '.join(map(str, steps))}, evenly "
                             f"spaced: warm restarts by design (a cosine with restarts){seen}", details)
    hint = ("save the scheduler with the checkpoint and restore it on resume: "
            "scheduler.load_state_dict(checkpoint['scheduler']) (the HF Trainer does this from "
            "checkpoint-N/scheduler.pt when given resume_from_checkpoint); create the scheduler once")
    if replay:
        return Result.failed(
            f"{jumped}, and from there it repeats the run's first rates "
            f"({', '.join(f'{rated[k][1]:.3g}' for k in range(count))}): "
            f"the schedule started over at step {steps[0]}, as a scheduler created anew does when a run resumes "
            f"without loading its state; the rest of the run follows a schedule meant for its start{seen}",
            hint, details)
    return Result.warned(f"{jumped}{'' if len(found) == 1 else f' ({len(found)} times, at steps {steps})'}: a "
                         "scheduler restarted or re-created mid-run (on resume), unless warm restarts were meant"
                         f"{seen}", hint, details)
