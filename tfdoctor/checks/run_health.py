"""Run health judges: what a whole watched run did besides its loss and gradients. The GradScaler's
skipped steps and scale (scaler-overflow), time spent waiting for batches (data-wait), memory that rises step after
step (memory-growth), and the evaluations the script ran (eval-gap). Each is a pure function of the RunSeries that
`tfdoctor watch` or a callback recorded (tfdoctor/watching/series.py); no torch here."""

from __future__ import annotations

import math
import statistics

from tfdoctor.checks.verdicts import logged
from tfdoctor.registry import check
from tfdoctor.result import Result, percent
from tfdoctor.watching.series import HELD_OUT, TRAINING_SPLIT, EvalPoint, RunSeries, trailing

MIB = 2 ** 20

# scaler-overflow. Watched, fp16_healthy.py (init_scale 2**24, growth_interval 50, 200 CPU steps)
# skipped steps 0-3 while it calibrated, then 3 of its next 196 (1.5%); a GPU run with the default
# growth_interval=2000 skips one step in 2000 after its first few. fp16_overflow.py (growth_interval=1)
# skipped 98 of 200 steps, 50% after its first 40.
CALM_STEPS = 10  # calibration is over once this many steps in a row went through
CALIBRATION_MAX_STEPS = 40  # each skip halves the scale: 40 halvings take any init_scale below 1
SKIP_WARN_SHARE = 0.05  # skipped steps after calibration: 5x the healthy fixture's 1%
SKIP_FAIL_SHARE = 0.20  # one step in five thrown away
GIVEN_UP_STEPS = 10  # the run ended on this many skipped steps in a row: the scale never recovered
SCALE_FLOOR = 1.0  # a scale below 1 shrinks the loss: the gradients overflow even unscaled

# lr-trajectory. A cosine decay to exactly 0 spends its last 6% of steps below 1% of its peak (cos
# schedule: 1 - 2/pi * asin(0.1)), a linear decay to 0 its last 1%; healthy.py's floor of 0.1 none.
DATA_WAIT_SHARE = 0.20
MIN_TIMED_STEPS = 10

# memory-growth. A leak is a rise that goes on step after step; its size depends on the model, so it
# is judged by its steadiness and by what it would cost over the planned run, not by a size seen.
# Watched (RSS less tfdoctor's own records, after the first 20% of the steps):
#   healthy.py            321 -> 322 MiB, the line through the steps explains R2 = 0.21 of their variance
#   slow_leak.py          326-329 -> 338 MiB, 53-67 KiB a step, R2 = 0.97-0.99, its 3 largest one-step
#                         rises 12-27% of the rise; 14-18 MiB over its 270 steps (4-5.5% of its level)
#   leaky_total_loss.py   343 -> 415 MiB, 550 KiB a step, R2 = 0.96, 3 largest rises 11%
#   healthy_stairs.py     348 -> 364 MiB, higher in every window and R2 = 0.81, but 3 one-step jumps (at
#                         its evaluations) carry all of the rise: the old rule (a 16 MiB rise in every
#                         window) failed it
HEAP_SHARE = 10  # the heap is read every 5th step: judged when at least a tenth of the steps carry it
MEMORY_SETTLE_SHARE = 0.2  # the first 20% of the run (at least MEMORY_SETTLE_STEPS) is not judged
MEMORY_SETTLE_STEPS = 10
MEMORY_WINDOWS = 5  # the judged steps in 5 windows, each summed up by its median (robust to spikes)
# steady: higher in every window, a straight line explains most of the variance, and no few jumps
# carry the rise (an allocator's stairs: a new arena, a heap grown by one large batch, then level)
STEADY_R2 = 0.8
STAIR_JUMPS = 3
STAIRS_SHARE = 0.5
# costly: the steady rise, continued over the planned run, comes to at least 2% of the level it
# settled at and at least 8 MiB. A leak of this size is small in itself, but it is a graph or tensor
# kept per step, which a longer run or a larger model multiplies (slow_leak.py's line keeps 10 GB over
# 100,000 steps); 8 MiB is four times the spread of healthy.py's window medians (2 MiB).
COST_SHARE = 0.02
COST_MIN_BYTES = 8 * MIB
RISE_SEEN_BYTES = 4 * MIB  # the evidence's step: where the rise first passed 2x healthy.py's spread
# levelling off (warn, not fail): the later half of the windows rose less than half what the earlier half
# did. Halves, not the last window alone: a leak's last window alone can rise little (leaky_total_loss.py
# once: 30, 10, 31, 8 MiB a window)
SLOWING_RATIO = 0.5

# eval-gap. Each evaluation source is judged alone (watching/sources.py tells them apart). Watched:
# healthy.py's held-out rows, 0 of 768 trained on; nanogpt_splits.py's val split 0 of 1280, its train
# split 1164 of 1280 (91%: a training-split estimate, never a leak); val_copied.py 678 of 768 (88%),
# eval_on_train.py 768 of 768. A held-out set mostly (from half) made of trained rows measures
# memorisation more than generalisation: a leak. A smaller share is a partial leak, duplicates across
# the splits: every correct held-out set above shows none, so a tenth is already far from chance.
LEAK_SHARE = 0.5
PART_LEAK_SHARE = 0.1
TRAIN_WINDOW = 10  # the training loss around an evaluation: the median of the steps within +-10
BELOW_MARGIN = 0.05  # evaluation loss more than 5% below that median ...
BELOW_SHARE = 0.5  # ... at half the evaluations or more (and at least BELOW_MIN_POINTS of them)
BELOW_MIN_POINTS = 2
# On a log: no row was fingerprinted and dropout is not known, so only the losses are compared, each
# evaluation against the training loss interpolated at its step (a logged training point is the mean
# over the steps since the one before: it stands at their middle). A model trained with dropout measures
# its training loss with dropout on and its evaluation with it off: fixtures/logs/make.py's Trainer runs
# (eval every 50 of 300 steps) put the evaluation at most 3.9% below training with GPT-2's dropout of
# 0.1 (trainer_dropout: 2.9, 3.9, 1.3, 2.6, 1.7%), at most 0.5% below without (trainer_healthy). The
# margin, 2.5x what dropout gave there, leaves room for larger models' larger dropout gaps; warn at most
# (an easier evaluation set is no proof of a leak).
LOG_BELOW_MARGIN = 0.10


def _scaler_calibration(skipped: list[bool]) -> tuple[int, bool]:
    """How many leading steps the GradScaler spent finding its ceiling: the steps before the first
    CALM_STEPS in a row that went through (then True: it settled), else CALIBRATION_MAX_STEPS (False)."""
    clean = 0
    for i, skip in enumerate(skipped[:CALIBRATION_MAX_STEPS + CALM_STEPS]):
        clean = 0 if skip else clean + 1
        if clean == CALM_STEPS:
            return i + 1 - CALM_STEPS, True
    return min(CALIBRATION_MAX_STEPS, len(skipped)), False


def _scale(value: float | None) -> str:
    return "none" if value is None else f"{value:.0f}" if value >= 1 else f"{value:.3g}"


@check("scaler-overflow", title="The GradScaler settles: few skipped float16 steps")
def scaler_overflow(series: RunSeries) -> Result:
    """Catches a float16 run whose GradScaler keeps skipping optimizer steps: the gradients overflow
    (inf/NaN) again and again, and each skipped step throws a batch away. Two shapes: a scale that
    keeps growing back into overflow (a short growth_interval, a high growth_factor), and a scale that
    falls and never recovers (gradients inf/NaN at any scale: a float16 overflow in the forward).

    The scaler's first steps are its calibration (from init_scale 65536 it halves until the gradients
    fit) and one skip every growth_interval is it probing for a higher scale: both are healthy.

    Fix: keep GradScaler's defaults (growth_interval=2000, backoff_factor=0.5); if the scale collapses,
    find the op that overflows float16 in the forward, or train in bfloat16 (no scaler needed).
    """
    rows = [row for row in series.steps if row.scale is not None or row.skipped]
    if logged.log_of(series):
        return _logged_scale(series, rows)
    if not rows:
        return Result.skipped("the run used no GradScaler (no loss scale recorded)")
    if len(rows) < CALM_STEPS * 2:
        return Result.skipped(f"only {len(rows)} steps with a GradScaler: too few to tell calibration "
                              f"from overflow (needs {CALM_STEPS * 2})")
    skipped = [row.skipped for row in rows]
    scales = [row.scale for row in rows if row.scale is not None]
    calibration, settled = _scaler_calibration(skipped)
    after = skipped[calibration:]
    share = sum(after) / len(after) if after else 1.0
    tail = trailing(skipped)
    details = {"steps": len(rows), "skipped": sum(skipped), "calibration_steps": calibration, "settled": settled,
               "calm_steps": CALM_STEPS, "calibration_skipped": sum(skipped[:calibration]),
               "skipped_after_calibration": sum(after), "share_after_calibration": share,
               "warn_share": SKIP_WARN_SHARE, "fail_share": SKIP_FAIL_SHARE, "trailing_skipped": tail,
               "given_up_steps": GIVEN_UP_STEPS, "scale_first": scales[0] if scales else None,
               "scale_last": scales[-1] if scales else None, "scale_min": min(scales) if scales else None,
               "scale_max": max(scales) if scales else None, "scale_floor": SCALE_FLOOR}
    low = next((row for row in rows if row.scale is not None and row.scale < SCALE_FLOOR), None)
    if tail >= GIVEN_UP_STEPS or low is not None:
        first = rows[len(rows) - tail] if tail >= GIVEN_UP_STEPS else low
        details["step"] = first.step
        return Result.failed(
            f"the GradScaler's scale fell without recovering: from {_scale(details['scale_max'])} to "
            f"{_scale(details['scale_last'])}, the last {tail} of {len(rows)} steps skipped (from step "
            f"{first.step}): the gradients are inf/NaN whatever the scale, so the model stopped training",
            "the overflow is not a scaling problem: find the op that overflows float16 in the forward (large "
            "activations, exp or a sum of squares under autocast: compute it in float32), or train in "
            "torch.bfloat16, which needs no GradScaler", details)
    return _skip_share_verdict(series, rows, skipped, calibration, settled, details)


def _logged_scale(series: RunSeries, rows) -> Result:
    """scaler-overflow on a log: a log holds the scale where it holds any (the Trainer's and Lightning's
    logs do not), never the skipped steps themselves. Each halving between two logged points is one
    skipped step at least (backoff_factor 0.5): their count over the steps after the scale first grew
    (the end of its calibration) is a lower bound on the share skipped."""
    scales = [(row.step, row.scale) for row in rows if row.scale is not None and row.scale > 0]
    if not scales:
        return Result.skipped(logged.missing("loss scale", logged.named(series, "scale")))
    if len(scales) < CALM_STEPS:
        return Result.skipped(f"only {len(scales)} logged loss scales: too few to tell calibration from overflow "
                              f"(needs {CALM_STEPS})")
    grew = next((i for i in range(1, len(scales)) if scales[i][1] > scales[i - 1][1]), None)
    after = scales[grew - 1:] if grew else []
    halvings = sum(max(0, round(math.log2(a / b))) for (_, a), (_, b) in zip(after, after[1:]))
    span = after[-1][0] - after[0][0] if after else 0
    share = halvings / span if span else 0.0
    low = next(((step, scale) for step, scale in scales if scale < SCALE_FLOOR), None)
    name = logged.named(series, "scale")
    details = {"step": low[0] if low else (after[0][0] if after else scales[0][0]), "logged_scales": len(scales),
               "scale_first": scales[0][1], "scale_last": scales[-1][1], "scale_min": min(v for _, v in scales),
               "scale_max": max(v for _, v in scales), "halvings_after_calibration": halvings,
               "steps_after_calibration": span, "share_at_least": share, "warn_share": SKIP_WARN_SHARE,
               "fail_share": SKIP_FAIL_SHARE, "scale_floor": SCALE_FLOOR}
    hint = ("let the scaler wait before it probes a higher scale: GradScaler(growth_interval=2000) (the default); if "
            "the scale collapses, find the op that overflows float16 in the forward, or train in torch.bfloat16")
    if low is not None:
        return Result.failed(f"the loss scale ({name}) fell to {low[1]:.3g} at step {low[0]}: below 1 the scaler "
                             "shrinks the loss and the gradients still overflow, so float16 steps are being thrown "
                             "away whatever the scale", hint, details)
    seen = (f"the loss scale ({name}) halved at least {halvings} times over the {span} steps after it first grew "
            f"(at least {percent(share)} of them skipped; a log shows the scale, not each skipped step)")
    if share >= SKIP_FAIL_SHARE:
        return Result.failed(seen, hint, details)
    if share >= SKIP_WARN_SHARE:
        return Result.warned(seen, hint, details)
    return Result.passed(f"{seen}: it settled (threshold {SKIP_WARN_SHARE:.0%})", details)


def _skip_share_verdict(series: RunSeries, rows, skipped, calibration: int, settled: bool, details) -> Result:
    after, share = skipped[calibration:], details["share_after_calibration"]
    if settled:  # the first skip once the scaler had settled
        first = next((rows[calibration + i].step for i, s in enumerate(after) if s), None)
        seen = (f"the GradScaler skipped {sum(after)} of {len(after)} steps after its calibration ({percent(share)}; "
                f"{details['calibration_skipped']} skipped in its first {calibration} steps)")
    else:  # never settled: the first skip after a step that went through (the start's streak is calibration)
        first = next((row.step for i, row in enumerate(rows) if row.skipped and i and not skipped[i - 1]), None)
        seen = (f"the GradScaler skipped {sum(skipped)} of {len(rows)} steps and never went {CALM_STEPS} in a "
                f"row without a skip ({share:.0%} after its first {calibration} steps)")
    details["step"] = first if first is not None else rows[-1].step
    if share < SKIP_WARN_SHARE:
        return Result.passed(f"{seen}: it settled (threshold {SKIP_WARN_SHARE:.0%})", details)
    message = (f"{seen}, from step {details['step']}: each skipped step throws its batch away; the scale went "
               f"back up into overflow again and again (between {_scale(details['scale_min'])} and "
               f"{_scale(details['scale_max'])}){_scaler_settings(series)}")
    hint = ("let the scaler wait before it probes a higher scale: GradScaler(growth_interval=2000) (the "
            "default) and growth_factor=2.0; or train in torch.bfloat16, which needs no GradScaler")
    if share >= SKIP_FAIL_SHARE:
        return Result.failed(message, hint, details)
    return Result.warned(message, hint, details)


def _scaler_settings(series: RunSeries) -> str:
    """The scaler's settings as the monitor saw them, for the message (", growth_interval=1")."""
    scaler = (series.facts.get("amp") or {}).get("scaler")
    if not isinstance(scaler, dict):
        return ""
    said = [f"{key}={scaler[key]:g}" for key in ("growth_interval", "growth_factor", "backoff_factor")
            if isinstance(scaler.get(key), (int, float))]
    return f"; GradScaler({', '.join(said)})" if said else ""


@check("data-wait", title="Training steps do not wait on the data loader")
def data_wait(series: RunSeries) -> Result:
    """Catches an input pipeline that starves the training step: a large share of each step's wall
    time spent waiting for the DataLoader's next batch, with the likely cause: the batches built in
    the training process (num_workers=0), too few workers for a slow __getitem__, and on a GPU
    pageable host memory (pin_memory=False). Judged on the typical step (medians), so the workers'
    start-up at each epoch does not count.

    Fix: `DataLoader(..., num_workers=4, pin_memory=True, persistent_workers=True)`, and per-row work
    (tokenizing) done once ahead of training rather than in __getitem__.
    """
    loader = series.facts.get("loader")
    log = logged.log_of(series)
    if log is not None:  # data_wait 0.0 on a log means not measured, unless the log has the series
        if "data_wait" not in (log.get("sources") or {}):
            return Result.skipped(logged.missing("time spent waiting for batches", "data_wait") + ": a log rarely "
                                  "says how long each step waited for its DataLoader")
        loader = loader or {}
    if loader is None:
        return Result.skipped("no DataLoader was seen: the time to build batches the script makes itself "
                              "is not measured")
    timed = [row for row in series.steps if row.wall > 0]
    if len(timed) < MIN_TIMED_STEPS:
        return Result.skipped(f"{len(timed)} timed steps: too few to judge (needs {MIN_TIMED_STEPS})")
    wait = statistics.median(row.data_wait for row in timed)
    wall = statistics.median(row.wall for row in timed)
    share = wait / wall
    # over the whole run as the report's header counts it: the first step's time holds the script's start
    after_start = [row for row in timed if row.step > series.steps[0].step] or timed
    total = sum(row.data_wait for row in after_start) / sum(row.wall for row in after_start)
    first = next((row.step for row in timed if row.data_wait >= DATA_WAIT_SHARE * row.wall), timed[0].step)
    details = {"step": first, "share": share, "threshold": DATA_WAIT_SHARE, "total_share": total,
               "median_wait_s": wait, "median_step_s": wall, "loader": loader,
               "device": series.facts.get("device")}
    seen = (f"a typical step waited {wait * 1e3:.1f} ms of its {wall * 1e3:.1f} ms for the next batch "
            f"({percent(share)}; over the whole run {percent(total)})")
    if share < DATA_WAIT_SHARE:
        return Result.passed(f"{seen}: threshold {DATA_WAIT_SHARE:.0%}", details)
    if log is not None and not loader:  # a log does not say how the DataLoader was set up
        details["cause"] = "the input pipeline"
        return Result.warned(f"{seen}, from step {first}: the model sits idle while the next batch is made (the log "
                             f"does not say how the DataLoader was set up)",
                             "load in worker processes: DataLoader(..., num_workers=4, pin_memory=True, "
                             "persistent_workers=True), and do per-row work (tokenizing) once ahead of training",
                             details)
    cause, hint = _loader_cause(loader, str(series.facts.get("device") or ""))
    details["cause"] = _loader_cause_short(loader, str(series.facts.get("device") or ""))
    return Result.warned(f"{seen}, from step {first}: the model sits idle while {cause}", hint, details)


def _loader_cause(loader: dict, device: str) -> tuple[str, str]:
    """The likely cause of a starved step, from the DataLoader's settings, and its fix."""
    workers = loader.get("num_workers") or 0
    gpu = device.startswith("cuda")
    pin = "" if not gpu or loader.get("pin_memory") else (
        "; pin_memory=False also makes each copy to the GPU wait on pageable memory")
    pin_fix = ", pin_memory=True" if gpu and not loader.get("pin_memory") else ""
    if workers == 0:
        return (f"the DataLoader builds every batch in the training process (num_workers=0){pin}",
                f"load in worker processes: DataLoader(..., num_workers=4{pin_fix}, persistent_workers=True); "
                "if __getitem__ does per-row work (tokenizing, decoding), do it once ahead of training")
    return (f"its {workers} workers cannot keep up with the step{pin}",
            f"more workers (num_workers={workers * 2}){pin_fix}, prefetch_factor=4, or a cheaper "
            "__getitem__: tokenize or decode once ahead of training")


def _loader_cause_short(loader: dict, device: str) -> str:
    """The cause in a few words, for a line that has room for little else (the live view)."""
    workers = loader.get("num_workers") or 0
    pinned = "" if not device.startswith("cuda") or loader.get("pin_memory") else ", pin_memory=False"
    return f"DataLoader num_workers={workers}{pinned}"


def _memory_signals(series: RunSeries) -> dict[str, list[tuple[int, int]]]:
    """The memory series to judge, CUDA allocated first where the run used a GPU (live tensors only: the
    cleaner signal), then the process's RSS, which also holds what lives on the host: the autograd
    graph's nodes that `total_loss += loss` keeps (backward() already freed the activations they saved,
    so on a GPU that leak shows in RSS, not in CUDA memory)."""
    cuda = [(row.step, row.cuda_allocated) for row in series.steps if row.cuda_allocated]
    # less what tfdoctor's own records held (the series and the trained rows' fingerprints grow with
    # the run, ~0.8 KB a step): a long healthy run must not read as a leak of the user's
    rss = [(row.step, row.rss - (row.own_bytes or 0)) for row in series.steps if row.rss]
    # malloc's bytes in use (every few steps, glibc): the host leak without the allocator's reuse, which
    # lets RSS sit level for a while over a slow leak and then rise in stairs
    heap = [(row.step, row.heap - (row.own_bytes or 0)) for row in series.steps if row.heap]
    signals = {"cuda_allocated": cuda} if cuda and len(cuda) * 2 >= len(series.steps) else {}
    # only where the model met no new input shape once the run settled: torch's C libraries cache kernels
    # per shape (oneDNN's primitive cache), and a run of varied shapes grows the heap steadily until that
    # cache is full (healthy_stairs.py: 158 -> 168 MiB, R2 0.99; level with the cache off)
    settled = max(MEMORY_SETTLE_STEPS, int(len(series.steps) * MEMORY_SETTLE_SHARE))
    if (heap and len(heap) * HEAP_SHARE >= len(series.steps)
            and not any(row.new_shape for row in series.steps[settled:])):
        signals["heap"] = heap
    return {**signals, "rss": rss} if rss else signals


def _memory_trend(kind: str, points: list[tuple[int, int]], planned: int) -> dict | None:
    """The evidence of one memory series after it settled: MEMORY_WINDOWS window medians, a least-squares
    line through the judged steps (slope, R2), the share of its rise its largest one-step rises carry,
    and what the line costs over the `planned` steps; None if too short."""
    settle = max(MEMORY_SETTLE_STEPS, int(len(points) * MEMORY_SETTLE_SHARE))
    judged = points[settle:]
    if len(judged) < MEMORY_WINDOWS * 4:
        return None
    size = len(judged) // MEMORY_WINDOWS
    windows = [judged[i * size:(i + 1) * size] for i in range(MEMORY_WINDOWS)]
    levels = [statistics.median(value for _, value in window) for window in windows]
    slope, r2 = _line(judged)
    rise = slope * (judged[-1][0] - judged[0][0])  # the line's rise over the judged steps
    jumps = sorted((b - a for (_, a), (_, b) in zip(judged, judged[1:])), reverse=True)[:STAIR_JUMPS]
    jump_share = sum(max(0, j) for j in jumps) / rise if rise > 0 else 1.0
    cost = slope * planned
    needed = max(COST_MIN_BYTES, COST_SHARE * levels[0])
    every = all(b > a for a, b in zip(levels, levels[1:]))
    steady = every and r2 >= STEADY_R2 and jump_share < STAIRS_SHARE
    slowing = levels[-1] - levels[MEMORY_WINDOWS // 2] < SLOWING_RATIO * (levels[MEMORY_WINDOWS // 2] - levels[0])
    return {"signal": kind, "step": next((step for step, value in judged if value > levels[0] + RISE_SEEN_BYTES),
                                         judged[-1][0]),
            "from_step": judged[0][0], "to_step": judged[-1][0], "settled_after_steps": settle,
            "settled_mib": levels[0] / MIB, "window_levels_mib": [round(level / MIB, 1) for level in levels],
            "rise_mib": rise / MIB, "per_step_kib": slope / 1024, "r2": r2, "steady_r2": STEADY_R2,
            "jump_share": jump_share, "stairs_share": STAIRS_SHARE, "needed_mib": RISE_SEEN_BYTES / MIB,
            "planned_steps": planned, "cost_mib": cost / MIB, "cost_needed_mib": needed / MIB,
            "rising_every_window": every, "steady": steady, "growing": steady and cost >= needed, "slowing": slowing}


def _line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least squares through (step, bytes): the slope (bytes per step) and R2 (0 for a flat series)."""
    xs = [float(step) for step, _ in points]
    ys = [float(value) for _, value in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0:
        return 0.0, 0.0
    return sxy / sxx, (sxy * sxy / (sxx * syy) if syy > 0 else 0.0)


def _memory_plan(series: RunSeries) -> tuple[int, str]:
    """The optimizer steps the run was planned to take, and where that number came from: its own
    length when it finished, else the plan it was given (--max-steps, the Trainer's), else its steps."""
    # a log's rows are its logged points: the run's length is its last logged step
    steps = series.steps[-1].step if logged.log_of(series) and series.steps else len(series.steps)
    planned, source = series.facts.get("planned_steps"), series.facts.get("planned_from")
    if series.facts.get("ended") != "finished" and isinstance(planned, int) and planned > steps:
        return planned, str(source or "max_steps")
    return steps, "the run's own length"


@check("memory-growth", title="Memory stays level from step to step")
def memory_growth(series: RunSeries) -> Result:
    """Catches memory that rises step after step for the whole run, the way a leak does: most often a
    tensor kept across steps that holds its autograd graph (`total_loss += loss` without `.item()`,
    a list of losses or logits kept for logging), so every step's graph stays alive until the run
    runs out of memory. Judged after the first steps (allocator, optimizer state) have settled, on CUDA
    allocated memory where the run uses a GPU, on the bytes malloc holds in use where the model meets
    no new input shape (a leak the allocator's reuse hides from RSS for a while), and on the process's
    resident memory (the graph's nodes live on the host).

    A rise is judged by its steadiness, not its size: higher in every fifth of the judged steps, close
    to a straight line (R2 >= 0.8), and not carried by a few jumps (an allocator's stairs: memory that
    rises at a new batch shape or an evaluation and stays level after is not a leak). A steady rise
    fails when, continued over the planned run (its max_steps, the Trainer's plan, else its length), it
    would cost at least 2% of the memory the run settled at (and 8 MiB): a slow leak on a tiny model
    fails as surely as a fast one on a large model.

    Fix: keep numbers, not tensors, across steps: `total_loss += loss.item()` (or `loss.detach()`).
    """
    signals = _memory_signals(series)
    planned, planned_from = _memory_plan(series)
    trends = [trend for trend in (_memory_trend(kind, points, planned) for kind, points in signals.items()) if trend]
    if not signals and logged.log_of(series):
        return Result.skipped(logged.missing("memory series", "rss or cuda_allocated"))
    if not trends:
        counted = max((len(points) for points in signals.values()), default=0)
        return Result.skipped(f"{counted} steps with memory recorded: too few to judge a trend once the first "
                              f"steps settled (needs {MEMORY_SETTLE_STEPS + MEMORY_WINDOWS * 4})")
    # the first growing signal (CUDA before RSS), else the first one
    details = next((trend for trend in trends if trend["growing"]), trends[0])
    details["signals"] = [trend["signal"] for trend in trends]
    details["planned_from"] = planned_from
    name = {"cuda_allocated": "CUDA allocated memory",
            "heap": "the memory malloc holds in use (less tfdoctor's own records, read every few steps)"}.get(
        details["signal"], "the process's resident memory (RSS, less tfdoctor's own records)")
    levels = details["window_levels_mib"]
    seen = (f"{name} went {levels[0]:.0f} -> {levels[-1]:.0f} MiB over steps {details['from_step']}-"
            f"{details['to_step']} (window medians {', '.join(f'{v:.0f}' for v in levels)} MiB)")
    if not details["growing"]:
        return Result.passed(f"{seen}: {_memory_calm(details)}", details)
    per_step = details["per_step_kib"]
    message = (f"{seen}: it rose steadily, about {per_step:.0f} KiB per step (a line through the steps: R2 "
               f"{details['r2']:.2f}), {details['cost_mib']:.0f} MiB over the planned "
               f"{planned} steps ({planned_from}; {details['cost_mib'] / details['settled_mib']:.0%} of the "
               f"{details['settled_mib']:.0f} MiB it settled at, {per_step * 1e4 / 2 ** 20:.1f} GiB per 10,000 "
               f"steps), {details['needed_mib']:.0f} MiB above its settled level by step {details['step']}")
    hint = ("a tensor kept across steps keeps its graph alive, most often `total_loss += loss`: accumulate "
            "`loss.item()` (or `loss.detach()`), and the same for metrics, logits or outputs kept in lists")
    if details["slowing"]:
        return Result.warned(message + "; the rise is slowing, so it may level off", hint, details)
    return Result.failed(message, hint, details)


def _memory_calm(details: dict) -> str:
    """Why a memory series is not a leak, in the words of the rule it missed."""
    if details["rise_mib"] * MIB < RISE_SEEN_BYTES or not details["rising_every_window"]:
        return "level"
    if details["jump_share"] >= STAIRS_SHARE:
        return (f"it rose in stairs ({STAIR_JUMPS} one-step jumps carry {min(details['jump_share'], 1):.0%} of the "
                f"rise), level between them: an allocator's high-water marks, not a leak")
    if details["r2"] < STEADY_R2:
        return f"no steady rise (a line through the steps: R2 {details['r2']:.2f}, from {STEADY_R2})"
    return (f"a steady rise of {details['per_step_kib']:.1f} KiB per step, {details['cost_mib']:.1f} MiB over the "
            f"planned {details['planned_steps']} steps, under the {details['cost_needed_mib']:.0f} MiB that "
            "would be flagged")


def _train_loss_near(series: RunSeries, step: int) -> float | None:
    """The median training loss of the steps within TRAIN_WINDOW of `step`: an evaluation after
    `step` optimizer steps used the weights the training step numbered `step` (0-based) used, and a
    centred window cancels the loss's downward trend as well as one batch's noise."""
    near = [loss for s, loss in series.finite_losses() if abs(s - step) <= TRAIN_WINDOW]
    return statistics.median(near) if len(near) > TRAIN_WINDOW else None


@check("eval-gap", title="Evaluation is held out and does not beat training")
def eval_gap(series: RunSeries) -> Result:
    """Catches an evaluation that does not measure generalisation: a held-out set whose rows the loop
    also trained on (a validation split drawn from, or overlapping, the training rows: a leak), and an
    evaluation loss persistently below the training loss measured around the same step, with no dropout
    to explain it (an easier validation set, a leak the fingerprints miss, an evaluation that averages
    differently). Each evaluation source is judged alone: a training-split estimate (nanoGPT's
    estimate_loss on 'train', an evaluation over the training DataLoader) reads trained rows by design
    and is no leak. Dropout raises the training loss (it is measured in train mode), so with active
    dropout an evaluation below training is expected and not judged.

    Fix: hold out the validation rows before training (split once, by index, with no overlap), and
    compute the evaluation loss the way the training loss is computed.
    """
    if logged.log_of(series) is not None:
        return _logged_eval_gap(series)
    if not series.evals:
        return Result.skipped("the script evaluated nothing (no loss computed under no_grad or eval() on "
                              "batches it did not train on)")
    sources = [_source_evidence(name, points) for name, points in series.sources().items()]
    judged = [s for s in sources if s["split"] != TRAINING_SPLIT]
    dropout = bool(series.facts.get("dropout"))
    details = {"evaluations": len(series.evals), "sources": sources, "leak_threshold": LEAK_SHARE,
               "part_leak_threshold": PART_LEAK_SHARE, "below_margin": BELOW_MARGIN, "dropout": dropout,
               "leak_share": max((s["share"] for s in judged if s["split"] == HELD_OUT), default=0.0)}
    leaked = max((s for s in judged if s["split"] == HELD_OUT and s["share"] >= PART_LEAK_SHARE),
                 key=lambda s: s["share"], default=None)
    if leaked is not None:
        details["step"] = leaked["first_trained_step"]
        seen = (f"{leaked['trained_rows']} of the {leaked['rows']} rows of the held-out evaluation "
                f"{leaked['source']} ({percent(leaked['share'])}) are rows the loop also trained on, from the "
                f"evaluation at step {leaked['first_trained_step']}")
        hint = ("hold the validation rows out before training: split once by index (torch.utils.data.random_split "
                "or a fixed slice) and train only on the other part; drop rows that occur in both splits")
        if leaked["share"] >= LEAK_SHARE:
            return Result.failed(f"{seen}: most of what it measures is memorisation, not generalisation", hint,
                                 details)
        return Result.warned(f"{seen}: that part of the evaluation measures memorisation (a leak is judged "
                             f"from {PART_LEAK_SHARE:.0%} of its rows)", hint, details)
    return _below_verdict(series, sources, details)


def _source_evidence(name: str, points: list[EvalPoint]) -> dict:
    rows, trained = sum(p.rows for p in points), sum(p.trained_rows for p in points)
    splits = [p.split for p in points]
    return {"source": name, "split": max(set(splits), key=splits.count), "evaluations": len(points),
            "rows": rows, "trained_rows": trained, "share": trained / rows if rows else 0.0,
            "first_trained_step": next((p.step for p in points if p.trained_rows), points[0].step),
            "weighting": points[-1].weighting}


def _held_said(source: dict) -> str:
    if source["split"] == TRAINING_SPLIT:
        return (f"the train-split estimate {source['source']} read {source['trained_rows']} trained rows of "
                f"{source['rows']}, as a training-split estimate does (no leak)")
    if not source["rows"]:
        return f"the evaluation {source['source']}'s rows were not fingerprinted"
    if not source["trained_rows"]:
        return f"none of the {source['rows']} rows of the held-out evaluation {source['source']} were trained on"
    return (f"{source['trained_rows']} of the {source['rows']} rows of the held-out evaluation {source['source']} "
            f"({percent(source['share'])}) were trained on (a leak is judged from {PART_LEAK_SHARE:.0%})")


def _below_verdict(series: RunSeries, sources: list[dict], details: dict) -> Result:
    """The evaluation below training, judged per source that is not a training-split estimate."""
    held = "; ".join(_held_said(s) for s in sources)
    worst = None
    for name, points in series.sources().items():
        points = [p for p in points if p.split != TRAINING_SPLIT]
        compared = [(p, _train_loss_near(series, p.step)) for p in points]
        compared = [(p, train) for p, train in compared if train is not None]
        below = [(p, train) for p, train in compared if p.loss < train * (1 - BELOW_MARGIN)]
        persistent = len(below) >= BELOW_MIN_POINTS and len(below) >= BELOW_SHARE * len(compared)
        evidence = {"source": name, "compared": compared, "below": below, "persistent": persistent}
        if points and (worst is None or (persistent, len(below)) > (worst["persistent"], len(worst["below"]))):
            worst = evidence
    if worst is None:  # only training-split estimates
        details["step"] = series.evals[-1].step
        return Result.passed(f"{held}; no held-out evaluation was seen", details)
    below = worst["below"]
    compared = len(worst["compared"])
    details.update(source=worst["source"], compared=compared, below=len(below),
                   points=[{"step": p.step, "eval": p.loss, "train": train} for p, train in worst["compared"]])
    details["step"] = below[0][0].step if below else series.evals[-1].step
    if not worst["persistent"]:
        return Result.passed(f"{held}; the evaluation loss was below the training loss around it at "
                             f"{len(below)} of {compared} evaluations", details)
    point, train = max(below, key=lambda pair: (pair[1] - pair[0].loss) / pair[1])
    seen = (f"the evaluation {worst['source']} sat more than {BELOW_MARGIN:.0%} below the training loss around "
            f"it at {len(below)} of {compared} evaluations, from step {below[0][0].step} (at step "
            f"{point.step}: {point.loss:.3f} against {train:.3f})")
    if details["dropout"]:
        return Result.passed(f"{held}; {seen}, as dropout explains: the training loss is measured with "
                             "dropout active", details)
    return Result.warned(
        f"{held}, but {seen} with no dropout to explain it: the evaluation set is easier than the "
        "training data, or leaks in a way row fingerprints miss, or its loss is averaged differently",
        "check that the validation rows come from the same distribution, share no documents with the "
        "training rows (near-duplicates, overlapping windows), and that its loss averages over tokens the "
        "way the training loss does", details)


def _logged_train_at(points: list[tuple[float, float]], step: int) -> float | None:
    """The training loss at `step`, linear between the logged points around it (each placed at the middle
    of the steps it averages); None outside them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= step <= x1:
            return y0 + (y1 - y0) * (step - x0) / (x1 - x0) if x1 > x0 else y0
    return None


def _logged_eval_gap(series: RunSeries) -> Result:
    """eval-gap on a log: an evaluation loss persistently below the training loss around it, by more
    than dropout explains; what a log cannot show (which rows were trained on) is said, not judged."""
    unknown = "a log holds no row fingerprints: whether the evaluation rows were also trained on cannot be checked"
    if not series.evals:
        return Result.skipped(logged.missing("evaluation loss", "eval_loss, val_loss") + f"; {unknown}")
    every = logged.interval(series)
    centred = [(row.step - (every - 1) / 2, row.loss) for row in series.steps
               if row.loss is not None and math.isfinite(row.loss) and row.loss > 0]
    details = {"evaluations": len(series.evals), "below_margin": LOG_BELOW_MARGIN, "interval": every,
               "fingerprinted": False, "dropout": series.facts.get("dropout")}
    worst = None
    for source, points in series.sources().items():
        # a log of every step: the median around the evaluation, as watched (one step's loss is noisy)
        compared = [(p, _train_loss_near(series, p.step) if every == 1 else _logged_train_at(centred, p.step))
                    for p in points if math.isfinite(p.loss)]
        compared = [(p, train) for p, train in compared if train is not None]
        below = [(p, train) for p, train in compared if p.loss < train * (1 - LOG_BELOW_MARGIN)]
        persistent = len(below) >= BELOW_MIN_POINTS and len(below) >= BELOW_SHARE * len(compared)
        if worst is None or (persistent, len(below)) > (worst["persistent"], len(worst["below"])):
            worst = {"source": source, "compared": compared, "below": below, "persistent": persistent}
    name = logged.named(series, f"eval:{worst['source']}")
    compared, below = worst["compared"], worst["below"]
    details.update(source=name, compared=len(compared), below=len(below),
                   points=[{"step": p.step, "eval": p.loss, "train": train} for p, train in compared])
    details["step"] = below[0][0].step if below else series.evals[-1].step
    if not compared:
        return Result.skipped(f"no evaluation ({name}) falls between two logged training losses; {unknown}", details)
    gaps = [(train - p.loss) / train for p, train in compared]
    if not worst["persistent"]:
        return Result.passed(f"the evaluation loss ({name}) sat at most {max(max(gaps), 0):.0%} below the training "
                             f"loss around it over {len(compared)} evaluations (judged from {LOG_BELOW_MARGIN:.0%}); "
                             f"{unknown}", details)
    point, train = max(below, key=lambda pair: (pair[1] - pair[0].loss) / pair[1])
    return Result.warned(
        f"the evaluation loss ({name}) sat more than {LOG_BELOW_MARGIN:.0%} below the training loss around it at "
        f"{len(below)} of {len(compared)} evaluations, from step {below[0][0].step} (at step {point.step}: "
        f"{point.loss:.3f} against {train:.3f}), more than dropout explains: the evaluation set is easier than the "
        f"training data, overlaps it, or its loss is averaged differently; {unknown}",
        "check that the validation rows are held out before training (no shared documents or overlapping "
        "windows) and that its loss averages over tokens the way the training loss does; `tfdoctor watch` "
        "fingerprints the rows and can tell a leak", details)
