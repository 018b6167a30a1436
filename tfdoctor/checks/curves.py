"""Curve judges of a whole watched run: the loss and the gradient norm over the optimizer steps. A loss
far above its running band at one step (loss-spike), a NaN loss or a loss that climbed away from its
best and stayed there (loss-divergence), a loss still at ln V or at its start long after the warm-up
(loss-plateau); the gradient norm's trend is checks/grad_norm.py.

Each is a pure function of a RunSeries (tfdoctor/watching/series.py): no torch, no hooks. The bands are
robust (medians and the median absolute deviation of trailing windows), so that a healthy run's noise,
a few odd batches included, never fires them. Thresholds were set on watched healthy runs (called "the
healthy runs" below): fixtures/watch/healthy.py with seeds 0-3 at 300 steps and at 100, 150 and 600
steps, fixtures/watch/healthy_accum.py (dropout, accumulation) with seeds 0-2 at 250 and 500 steps,
and three unshipped variants of healthy.py (batches of 4 over 600 steps, seeds 0-1; SGD with momentum;
no clipping). Each constant says what was measured.
"""

from __future__ import annotations

import math
from statistics import median

from tfdoctor.checks.verdicts import logged
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.watching.series import RunSeries, is_finite, trailing

# loss-spike: the band is the median of the previous SPIKE_WINDOW finite losses and its spread the MAD
# (x 1.4826, a normal's sigma). A step fires when its loss is above the median by SPIKE_Z spreads AND
# by SPIKE_REL of the median AND by SPIKE_MIN_NATS: all three, so that neither a calm stretch (tiny
# MAD) nor a loss near zero (tiny median) makes ordinary noise look like a spike. The healthy runs: a
# robust z of at most 5.1 (healthy.py, 600 steps) and an excess of at most 27% of the median (batches
# of 4, where z stayed under 4.2); no step came within half of all three thresholds at once (largest
# 0.52, batches of 4). The planted rate edit (lr_spike.py): z 20, +67%.
SPIKE_WINDOW = 25
SPIKE_Z = 8.0
SPIKE_REL = 0.3
SPIKE_MIN_NATS = 0.1
# On a log (tfdoctor judge): the band covers SPIKE_WINDOW steps but at least LOG_SPIKE_POINTS logged points,
# and the relative and absolute thresholds shrink by the log's interval, at most LOG_SPIKE_THIN-fold
# The logs of fixtures/logs/make.py's healthy runs (the HF Trainer's means over 5 steps, Lightning's
# one-step values every 5, a loop's means over 10) came no closer than 0.42 of the threshold, whether it
# shrank 2, 5 or 10-fold (their band's spread, z at most 3.3, decides there); the planted rate spikes
# reached 1.8-3.4 of it.
LOG_SPIKE_POINTS = 8
LOG_SPIKE_THIN = 5
# A spike that undid this share of the progress the run had made (start loss - band median) fails.
SPIKE_FAIL_SHARE = 0.5
# Evidence: the gradient norm (against its band's median) or the rate of the update just before the
# spike (against the band's highest rate, so a warm-up's rise is no jump) "moved with" the spike at
# this ratio. The healthy runs: norms at most 1.43x their band's median, rates at most 1.04x the band's
# highest (the warm-ups); the planted edit: norm 4.0x, rate 45x.
MOVED_RATIO = 2.0

# loss-divergence: the smoothed loss is the trailing median of DIVERGE_WINDOW finite losses. It diverged
# when, from some step to the end of the run (at least DIVERGE_SUSTAIN steps), it stayed above its best by
# DIVERGE_REL of the best and by DIVERGE_MIN_NATS. The healthy runs ended at most 4.5% above their best
# smoothed loss (healthy.py, 600 steps: the cosine's floor and batch noise), and no stretch reaching the
# end stayed more than 3.1% above the best before it.
DIVERGE_WINDOW = 25
DIVERGE_SUSTAIN = 20
DIVERGE_REL = 0.25
DIVERGE_MIN_NATS = 0.1
# A rise that gave back this share of the progress (start loss - best) fails; a smaller one warns.
DIVERGE_FAIL_SHARE = 0.5
# On a log the windows cover as many steps (at least LOG_DIVERGE_POINTS / LOG_SUSTAIN_POINTS points), and
# every series counts: the HF Trainer's logging_nan_inf_filter (on by default) leaves NaN and inf losses
# out of its logged mean, so a run whose every loss is NaN logs `loss 0.0` while its grad_norm and
# eval_loss are NaN (fixtures/logs/make.py trainer_nan_hidden). A run blew up when, from some point to
# the log's end, its gradient norm is non-finite or BLOWUP_NORM_RATIO times the median of the norms
# before (at least BLOWUP_POINTS points: fp16's GradScaler logs an inf norm at a skipped step now and
# then), its evaluation loss is non-finite (weights gone NaN stay NaN), or its training loss is exactly
# 0.0 right after a loss above ZERO_FROM (a mean of real losses does not fall from 0.1 to exactly 0 in one
# interval; a memorised batch's loss falls to it by orders of magnitude, point after point).
LOG_DIVERGE_POINTS = 5
LOG_SUSTAIN_POINTS = 3
BLOWUP_NORM_RATIO = 100.0
BLOWUP_POINTS = 2
ZERO_FROM = 0.1

# loss-plateau: judged over the stretch from PLATEAU_AFTER steps after the warm-up (the rate's rise) to
# the end, when that stretch holds PLATEAU_STRETCH steps at least (else too short to tell). Stuck: the
# smoothed loss (trailing medians of PLATEAU_WINDOW) stays within PLATEAU_LNV_SHARE of ln V, or within
# PLATEAU_START_SHARE of the median of the first PLATEAU_EDGE losses, over the whole stretch, and falls
# by less than PLATEAU_FLAT_SHARE of that level per 100 steps across it. Measured on every cut of the
# healthy runs (their first 40, 45, 50, ... steps, as --max-steps or a live judgement sees them) and of
# a slow learner (fixtures/scripts/nanogpt_train.py on the watch corpus at a fifth of its rate: 4.18 to
# 3.72 in 300 steps, 7% below ln 64 at step 100, falling 0.14 nats per 100 steps there): with 10% of
# ln V, 50 steps and no flatness the slow learner fired when cut at 80-255 steps; now no cut of any of
# them fires. The planted shuffled targets (plateau.py): 3.5-3.8% below ln 64 (the targets' token
# frequencies give 4.00), falling 0.008 nats per 100 steps.
PLATEAU_AFTER = 100
PLATEAU_STRETCH = 100
PLATEAU_WINDOW = 20
PLATEAU_EDGE = 5
PLATEAU_LNV_SHARE = 0.05
PLATEAU_START_SHARE = 0.03
PLATEAU_FLAT_SHARE = 0.015
# On a log the same spans in steps; the smoothing window covers PLATEAU_WINDOW steps but at least
# LOG_PLATEAU_POINTS logged points, and the judged stretch holds that many points at least.
LOG_PLATEAU_POINTS = 3



# ---------------------------------------------------------------------------------------------- helpers


def _spread(values: list[float], centre: float) -> float:
    """The median absolute deviation scaled to a normal's sigma (1.4826)."""
    return 1.4826 * median(abs(v - centre) for v in values)


def _trailing_medians(values: list[float], window: int) -> list[float]:
    """The median of each value's `window` values ending at it (from index window - 1 on)."""
    return [median(values[i - window + 1:i + 1]) for i in range(window - 1, len(values))]


def _start_loss(points: list[tuple[int, float]]) -> float:
    return median(v for _, v in points[:PLATEAU_EDGE])


def _no_losses(series: RunSeries) -> str | None:
    if not series.steps:
        return "the run recorded no optimizer step"
    if all(row.loss is None for row in series.steps):
        return "the run recorded no loss (no loss.backward() on a scalar loss was seen)"
    return None


def _rate(row) -> float | None:
    """The largest rate over the parameter groups (a frozen group's 0 does not hide the others)."""
    return max(row.lrs) if row.lrs else None


def _ratio(value, reference) -> float | None:
    if not (is_finite(value) and is_finite(reference)) or reference <= 0:
        return None
    return value / reference


# ------------------------------------------------------------------------------------------- loss-spike


def _averaged_note(series: RunSeries, rule: dict) -> str:
    """What a log's points are, for the message: a spike is thinner in a mean than in the run."""
    every = logged.interval(series)
    if not logged.log_of(series) or every <= 1:
        return ""
    return (f" (the log's points are {every} steps apart: where each is a mean over its {every} steps, as the "
            f"HF Trainer logs it, a one-step spike shows at 1/{every} of its height, so the thresholds "
            f"are {rule['thin']}x lower than on a step-by-step record)")


def _spike_rule(series: RunSeries) -> dict:
    """The band's width in points and the three thresholds: the measured ones on a watched run; on a log
    of points that each stand for `interval` steps, the band covers as many steps (at least
    LOG_SPIKE_POINTS points) and the relative and absolute thresholds shrink by the interval (at most
    LOG_SPIKE_THIN): a mean over N steps shows a one-step spike at 1/N of its height. The z threshold
    stays: the band's spread is measured on the log's own points, averaged or not."""
    if not logged.log_of(series):
        return {"window": SPIKE_WINDOW, "z": SPIKE_Z, "rel": SPIKE_REL, "nats": SPIKE_MIN_NATS, "thin": 1}
    thin = min(logged.interval(series), LOG_SPIKE_THIN)
    return {"window": logged.points_for(series, SPIKE_WINDOW, LOG_SPIKE_POINTS), "z": SPIKE_Z,
            "rel": SPIKE_REL / thin, "nats": SPIKE_MIN_NATS / thin, "thin": thin}


def _spike_limit(rule: dict, centre: float, spread: float) -> float:
    return max(rule["z"] * spread, rule["rel"] * abs(centre), rule["nats"])


def _spike_events(points: list[tuple[int, float]], rule: dict) -> list[dict]:
    """The steps far above their trailing band, grouped into events (flagged steps closer than a window
    are one event); each event keeps its first flagged step and band, and its peak."""
    events: list[dict] = []
    window = rule["window"]
    for i in range(window, len(points)):
        step, loss = points[i]
        band = [v for _, v in points[i - window:i]]
        centre = median(band)
        spread = _spread(band, centre)
        excess = loss - centre
        if excess <= _spike_limit(rule, centre, spread):
            continue
        if events and i - events[-1]["last_index"] <= window:
            event = events[-1]
            event["last_index"] = i
            if loss > event["peak"]:
                event["peak"], event["peak_step"] = loss, step
            continue
        events.append({"index": i, "last_index": i, "step": step, "loss": loss, "median": centre,
                       "spread": spread, "peak": loss, "peak_step": step})
    return events


def _recovery(points: list[tuple[int, float]], event: dict, rule: dict) -> int | None:
    """Steps after the spike until the loss was back under its band's spike threshold, or None."""
    limit = event["median"] + _spike_limit(rule, event["median"], event["spread"])
    for step, loss in points[event["index"] + 1:]:
        if loss <= limit and step > event["peak_step"]:
            return step - event["step"]
    return None


def _spike_evidence(series: RunSeries, event: dict, rule: dict) -> dict:
    """What moved with the spike: the gradient norm at that step, the rate of the update just before it
    (the loss at step s is measured after update s - 1), and the GradScaler's scale. On a log, the
    point before the spike's stands for "just before" (a rate that jumped between two logged points
    may not show at all)."""
    by_step = {row.step: row for row in series.steps}
    row = by_step[event["step"]]
    at = series.steps.index(row)
    earlier = series.steps[max(0, at - rule["window"]):at]
    norms = [r.grad_norm for r in earlier if is_finite(r.grad_norm)]
    rates = [_rate(r) for r in earlier[:-1] if is_finite(_rate(r))]  # the band's rates, the jump's excluded
    before = (series.steps[at - 1] if at else None) if logged.log_of(series) else by_step.get(event["step"] - 1)
    evidence = {"batch": row.batches or None, "grad_norm": row.grad_norm,
                "grad_norm_median": median(norms) if norms else None, "grad_norm_ratio": None,
                "lr_before": _rate(before) if before else None, "lr_band_max": max(rates) if rates else None,
                "lr_ratio": None, "scale_before": before.scale if before else None, "scale": row.scale,
                "skipped": row.skipped}
    evidence["grad_norm_ratio"] = _ratio(row.grad_norm, evidence["grad_norm_median"])
    # against the highest rate of the band (not its median), so that a warm-up's steady rise is no jump
    evidence["lr_ratio"] = _ratio(evidence["lr_before"], evidence["lr_band_max"])
    return evidence


def _spike_story(evidence: dict) -> tuple[str, str]:
    """What moved with the spike, in words, and the fix that follows from it."""
    moved = []
    norm_ratio, lr_ratio = evidence["grad_norm_ratio"], evidence["lr_ratio"]
    if norm_ratio is not None:
        moved.append(f"the gradient norm rose with it to {norm_ratio:.1f}x its median" if norm_ratio >= MOVED_RATIO
                     else f"the gradient norm stayed at {norm_ratio:.1f}x its median")
    if lr_ratio is not None and lr_ratio >= MOVED_RATIO:
        moved.append(f"the rate of the update just before was {lr_ratio:.0f}x the highest of the band's steps")
    scale, scale_before = evidence["scale"], evidence["scale_before"]
    if is_finite(scale) and is_finite(scale_before) and scale != scale_before:
        moved.append(f"the GradScaler's scale went {scale_before:g} -> {scale:g}")
    elif is_finite(scale):
        moved.append("the GradScaler's scale did not move")
    batch = f"batch {evidence['batch']}" if evidence["batch"] else "that step's batch"
    if lr_ratio is not None and lr_ratio >= MOVED_RATIO:
        hint = ("the rate jumped just before the spike: check the schedule (the scheduler's lambda, "
                "milestones, any manual param_group['lr'] edit) around that step")
    elif norm_ratio is not None and norm_ratio >= MOVED_RATIO:
        hint = (f"inspect {batch} (its rows may be corrupt or unusual); clip gradients with "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), and lower the peak rate or "
                "lengthen the warm-up if spikes recur")
    else:
        hint = (f"the gradient did not grow with the loss: inspect {batch} itself (corrupt or mislabelled "
                "rows, an unusually long or heavily padded batch)")
    return "; ".join(moved), hint


def _spike_cause(evidence: dict) -> str:
    """The story in a few words, for a line that has room for little else (the live view)."""
    norm_ratio, lr_ratio = evidence["grad_norm_ratio"], evidence["lr_ratio"]
    scale, scale_before = evidence["scale"], evidence["scale_before"]
    if lr_ratio is not None and lr_ratio >= MOVED_RATIO:
        return f"the rate jumped {lr_ratio:.0f}x"
    if norm_ratio is not None and norm_ratio >= MOVED_RATIO:
        return f"the gradient norm rose {norm_ratio:.1f}x"
    if is_finite(scale) and is_finite(scale_before) and scale != scale_before:
        return f"the GradScaler's scale went {scale_before:g} -> {scale:g}"
    return "the loss jumped alone"


@check("loss-spike", title="The loss never jumps far above its running band")
def loss_spike(series: RunSeries) -> Result:
    """Catches a step whose loss is far above the band of the steps just before it (their median and
    median absolute deviation): a bad batch, a rate that jumped for a step or two, an fp16 overflow. It
    names the step, the DataLoader batch, and whether the gradient norm, the rate of the update just
    before and the GradScaler's scale moved with it. A spike that undid half the progress fails.

    Fix: follow the evidence: a rate that jumped is a schedule bug; a gradient that jumped with the
    loss calls for clipping (`clip_grad_norm_(params, 1.0)`), a lower peak rate or a longer warm-up; a
    loss that jumped alone points at the batch itself.
    """
    reason = _no_losses(series)
    if reason:
        return Result.skipped(reason)
    points = series.finite_losses()
    rule = _spike_rule(series)
    window, what = rule["window"], ("logged points" if logged.log_of(series) else "steps")
    if len(points) <= window:
        return Result.skipped(f"{len(points)} finite losses: the band needs {window + 1} {what} at least",
                              {"steps": len(points)})
    events = _spike_events(points, rule)
    thresholds = {"window": window, "z_threshold": rule["z"], "rel_threshold": rule["rel"],
                  "nats_threshold": rule["nats"], "fail_share": SPIKE_FAIL_SHARE,
                  "interval": logged.interval(series), "thinned_by": rule["thin"]}
    averaged = _averaged_note(series, rule)
    if not events:
        return Result.passed(f"no loss spike over {len(points)} {what} (band: median of the previous "
                             f"{window} losses){averaged}", {"steps": len(points), "spikes": 0, **thresholds})
    first = events[0]
    start = _start_loss(points)
    excess = first["loss"] - first["median"]
    progress = start - first["median"]
    lost = (first["peak"] - first["median"]) / progress if progress > 0 else None
    evidence = _spike_evidence(series, first, rule)
    recovered = _recovery(points, first, rule)
    # the evidence a reader wants first comes first (the terminal report shows the leading entries)
    details = {"step": first["step"], "batch": evidence["batch"], "loss": first["loss"], "band_median": first["median"],
               "band_spread": first["spread"], "z": excess / first["spread"] if first["spread"] > 0 else None,
               "grad_norm_ratio": evidence["grad_norm_ratio"], "lr_ratio": evidence["lr_ratio"],
               "scale_before": evidence["scale_before"], "scale": evidence["scale"], "recovered_after": recovered,
               "progress_lost_share": lost, "excess": excess, "peak_step": first["peak_step"], "peak": first["peak"],
               "start_loss": start, "spikes": len(events), "spike_steps": [e["step"] for e in events][:20],
               **evidence, **thresholds}
    moved, hint = _spike_story(evidence)
    details["cause"] = _spike_cause(evidence)  # the live view's line keeps it when it cuts the message
    batch = f" (batch {evidence['batch']})" if evidence["batch"] else ""
    back = (f"back within its band {recovered} steps later" if recovered is not None
            else "never back within its band")
    more = f"; {len(events) - 1} more spike(s) at steps {details['spike_steps'][1:]}" if len(events) > 1 else ""
    message = (f"loss spiked at step {first['step']}{batch}: {first['loss']:.3f} against a band of "
               f"{first['median']:.3f} ± {first['spread']:.3f} over the previous {window} {what} (peak "
               f"{first['peak']:.3f} at step {first['peak_step']}), {back}"
               + (f"; {moved}" if moved else "") + more + averaged)
    if lost is not None and lost >= SPIKE_FAIL_SHARE:
        undid = (f"it undid {lost:.0%} of the progress the run had made" if lost < 1
                 else f"its peak was above the loss the run started at ({start:.3f}, the median of its first "
                      f"{PLATEAU_EDGE} steps)")
        return Result.failed(f"{message}; {undid}", hint, details)
    return Result.warned(message, hint, details)


# -------------------------------------------------------------------------------------- loss-divergence


def _diverge_windows(series: RunSeries) -> tuple[int, int]:
    """The smoothing window and the sustain length, in points (steps on a watched run)."""
    if not logged.log_of(series):
        return DIVERGE_WINDOW, DIVERGE_SUSTAIN
    return (logged.points_for(series, DIVERGE_WINDOW, LOG_DIVERGE_POINTS),
            logged.points_for(series, DIVERGE_SUSTAIN, LOG_SUSTAIN_POINTS))


def _sustained_rise(points: list[tuple[int, float]], window: int = DIVERGE_WINDOW,
                    sustain: int = DIVERGE_SUSTAIN) -> dict | None:
    """The stretch, reaching the run's end, over which the smoothed loss stayed well above its best."""
    smooth = _trailing_medians([v for _, v in points], window)
    steps = [s for s, _ in points][window - 1:]
    best_index = min(range(len(smooth)), key=smooth.__getitem__)
    best = smooth[best_index]
    limit = best + max(DIVERGE_REL * abs(best), DIVERGE_MIN_NATS)
    start = len(smooth)
    while start > best_index + 1 and smooth[start - 1] > limit:
        start -= 1
    if start == len(smooth) or len(smooth) - start < sustain or steps[-1] - steps[start] + 1 < DIVERGE_SUSTAIN:
        return None
    return {"step": steps[start], "best": best, "best_step": steps[best_index], "limit": limit,
            "final": smooth[-1], "peak": max(smooth[start:]), "last_step": steps[-1]}


def _first_nonfinite(series: RunSeries):
    for row in series.steps:
        if row.loss is not None and not math.isfinite(row.loss):
            return row
    return None


def _blowup_signs(series: RunSeries) -> list[dict]:
    """On a log, each series' sign that the run blew up and never came back (see BLOWUP_NORM_RATIO):
    {"series", "step", "said"}, in no order."""
    signs = []
    norms = [(row.step, row.grad_norm) for row in series.steps if row.grad_norm is not None]
    if norms:
        nonfinite = trailing([not is_finite(n) for _, n in norms])
        before = [n for _, n in norms[:len(norms) - nonfinite] if is_finite(n)]
        typical = median(before[:max(1, len(before) // 2)]) if before else None
        huge = trailing([not is_finite(n) or (typical is not None and typical > 0 and n >= BLOWUP_NORM_RATIO * typical)
                         for _, n in norms])
        name = logged.named(series, "grad_norm")
        if huge >= BLOWUP_POINTS and huge > nonfinite:
            step, value = norms[len(norms) - huge]
            signs.append({"series": name, "step": step, "said": (
                f"the gradient norm ({name}) jumped to {value:.3g} at step {step}, {value / typical:.0f}x its median "
                f"of {typical:.3g} before, and stayed " + ("that high" if not nonfinite else
                                                           f"there (non-finite from step {norms[-nonfinite][0]})")
                + " to the end")})
        elif nonfinite >= BLOWUP_POINTS:
            step, value = norms[-nonfinite]
            signs.append({"series": name, "step": step,
                          "said": f"the gradient norm ({name}) was {value} from step {step} to the end"})
    for source, points in series.sources().items():
        bad = trailing([not math.isfinite(p.loss) for p in points])
        if bad:
            first = points[-bad]
            name = logged.named(series, f"eval:{source}") if source else "evaluation loss"
            signs.append({"series": name, "step": first.step, "said": (
                f"the evaluation loss ({name}) was {first.loss} from step {first.step} to the end "
                f"({bad} of {len(points)} evaluations)")})
    losses = [(row.step, row.loss) for row in series.steps if row.loss is not None]
    zeros = trailing([loss == 0.0 for _, loss in losses])
    if zeros >= BLOWUP_POINTS and zeros < len(losses) and losses[-zeros - 1][1] >= ZERO_FROM:
        step, name = losses[-zeros][0], logged.named(series, "loss")
        signs.append({"series": name, "step": step, "zero_loss": True, "said": (
            f"the training loss ({name}) was logged as exactly 0.0 from step {step} to the end, right after "
            f"{losses[-zeros - 1][1]:.4g} at step {losses[-zeros - 1][0]}: the HF Trainer's logging_nan_inf_filter "
            "(on by default) leaves NaN and inf losses out of its logged mean, so a run whose every loss is NaN "
            "logs 0.0")})
    return signs


def _log_blowup(series: RunSeries) -> Result | None:
    """A failing Result when a log's series show that the run blew up (a NaN its training loss may hide)."""
    signs = sorted(_blowup_signs(series), key=lambda sign: sign["step"])
    if not signs:
        return None
    first = signs[0]
    before = [row for row in series.steps if row.step < first["step"] and is_finite(row.loss) and row.loss > 0]
    last = before[-1] if before else None
    details = {"step": first["step"], "series": [sign["series"] for sign in signs],
               "signs": {sign["series"]: sign["step"] for sign in signs},
               "last_finite_step": last.step if last else None, "last_finite_loss": last.loss if last else None,
               "norm_ratio": BLOWUP_NORM_RATIO, "zero_from": ZERO_FROM, "interval": logged.interval(series)}
    was = f" (the last training loss logged before it: {last.loss:.4g} at step {last.step})" if last else ""
    hidden = any(sign.get("zero_loss") for sign in signs)
    message = (f"the run blew up at step {first['step']} and never came back{was}: "
               + "; ".join(sign["said"] for sign in signs))
    hint = DIVERGE_HINT.format(step=first["step"])
    if hidden:
        hint += ("; and log NaN as NaN while you look into it: TrainingArguments(logging_nan_inf_filter=False) "
                 "keeps the logged loss honest")
    return Result.failed(message, hint, details)


DIVERGE_HINT = ("lower the learning rate (the peak, or the schedule that raised it), lengthen the warm-up, "
                "clip gradients with torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); resume from a "
                "checkpoint taken before step {step}")


@check("loss-divergence", title="The loss stays finite and does not climb away from its best")
def loss_divergence(series: RunSeries) -> Result:
    """Catches a run that blew up: a NaN or infinite loss (failed at the first such step, with the last
    finite loss and gradient norm before it), or a sustained rise, the smoothed loss (a trailing median)
    climbing well above its best and staying there to the end of the run.

    Fix: lower the learning rate or lengthen its warm-up, clip gradients by their global norm, use a
    GradScaler for float16; resume from a checkpoint before the step named.
    """
    reason = _no_losses(series)
    if reason:
        return Result.skipped(reason)
    bad = _first_nonfinite(series)
    if bad is not None:
        before = [row for row in series.steps if row.step < bad.step and is_finite(row.loss)]
        last = before[-1] if before else None
        nonfinite = sum(1 for row in series.steps if row.loss is not None and not math.isfinite(row.loss))
        details = {"step": bad.step, "loss": bad.loss, "batch": bad.batches or None,
                   "last_finite_step": last.step if last else None, "last_finite_loss": last.loss if last else None,
                   "grad_norm_before": last.grad_norm if last else None, "nonfinite_steps": nonfinite,
                   "lr": _rate(bad)}
        was = (f"; the last finite loss was {last.loss:.4g} at step {last.step}"
               + (f" (gradient norm {last.grad_norm:.3g})" if is_finite(last.grad_norm) else "")) if last else ""
        named = f" ({logged.named(series, 'loss')})" if logged.log_of(series) else ""
        unit = "logged point(s)" if logged.log_of(series) else "step(s)"
        return Result.failed(f"the loss{named} became {bad.loss} at step {bad.step}{was}; {nonfinite} {unit} had a "
                             "non-finite loss", DIVERGE_HINT.format(step=bad.step) + "; to find the first "
                             "non-finite tensor, rerun to that step under torch.autograd.set_detect_anomaly(True)",
                             details)
    if logged.log_of(series):
        blowup = _log_blowup(series)
        if blowup is not None:
            return blowup
    points = series.finite_losses()
    window, sustain = _diverge_windows(series)
    what = "logged points" if logged.log_of(series) else "steps"
    if len(points) < window + sustain:
        return Result.skipped(f"{len(points)} finite losses: a sustained rise needs {window + sustain} {what} at "
                              "least", {"steps": len(points)})
    thresholds = {"window": window, "sustain": sustain, "rel": DIVERGE_REL,
                  "min_nats": DIVERGE_MIN_NATS, "fail_share": DIVERGE_FAIL_SHARE}
    rise = _sustained_rise(points, window, sustain)
    if rise is None:
        smooth = _trailing_medians([v for _, v in points], window)
        return Result.passed(f"finite loss at all {len(points)} {what}, ending at {smooth[-1]:.3f} against a best "
                             f"of {min(smooth):.3f} (medians of {window} {what}){logged.spacing(series)}",
                             {"steps": len(points), "final": smooth[-1], "best": min(smooth), **thresholds})
    start = _start_loss(points)
    progress = start - rise["best"]
    lost = (rise["final"] - rise["best"]) / progress if progress > 0 else None
    details = {**rise, "start_loss": start, "progress_lost_share": lost, **thresholds}
    message = (f"the loss climbed from its best of {rise['best']:.3f} (step {rise['best_step']}) and stayed above "
               f"{rise['limit']:.3f} from step {rise['step']} to the end (step {rise['last_step']}), ending at "
               f"{rise['final']:.3f} (medians of {window} {what}){logged.spacing(series)}")
    hint = DIVERGE_HINT.format(step=rise["step"])
    if lost is None or lost >= DIVERGE_FAIL_SHARE:
        share = f": it gave back {lost:.0%} of what the run had learned" if lost is not None else ""
        return Result.failed(message + share, hint, details)
    return Result.warned(f"{message}: it gave back {lost:.0%} of what the run had learned", hint, details)


# ----------------------------------------------------------------------------------------- loss-plateau


def _warmup_end(series: RunSeries) -> int | None:
    """The first step at which the rate reached 90% of its peak, the peak taken over medians of 5 steps
    (a rate that jumped for a step or two is no warm-up's end). None when no rate was recorded."""
    rates = [(row.step, _rate(row)) for row in series.steps if is_finite(_rate(row))]
    if not rates:
        return None
    values = [r for _, r in rates]
    smooth = _trailing_medians(values, 5) if len(values) >= 5 else values
    peak = max(smooth)
    for step, rate in rates:
        if rate >= 0.9 * peak:
            return step
    return rates[-1][0]


def _stuck_levels(series: RunSeries, start: float) -> list[tuple[str, float, float]]:
    """The levels a stuck loss sits at: (name, level, tolerance) for ln V (when the vocabulary is known)
    and for the run's start."""
    levels = []
    vocab = series.facts.get("vocab")
    if isinstance(vocab, int) and vocab > 1:
        levels.append(("ln V", math.log(vocab), PLATEAU_LNV_SHARE * math.log(vocab)))
    levels.append(("its start", start, PLATEAU_START_SHARE * abs(start)))
    return levels


@check("loss-plateau", title="The loss leaves ln V and its start value after the warm-up")
def loss_plateau(series: RunSeries) -> Result:
    """Catches a run that learns nothing: long after the warm-up (the rate's rise, read from the rates
    the optimizer used), the smoothed loss still sits at ln V, the loss of a uniform guess over the
    vocabulary, or at its own start value. Typical causes: targets that do not belong to their inputs
    (inputs and labels shuffled apart), a graph cut between the loss and the weights, an optimizer over
    other parameters than the model's.

    Fix: check that each target is its input shifted by one (same row, same order), that the loss
    reaches the weights (no .detach(), .item() or torch.no_grad() on the way) and that the optimizer was
    built on this model's parameters.
    """
    reason = _no_losses(series)
    if reason:
        return Result.skipped(reason)
    points = series.finite_losses()
    warmup = _warmup_end(series)
    origin = warmup if warmup is not None else points[0][0] if points else 0
    after = [(s, v) for s, v in points if s >= origin]
    judged_from = origin + PLATEAU_AFTER
    if logged.log_of(series):  # spans in steps: a log's points are `interval` steps apart
        window = logged.points_for(series, PLATEAU_WINDOW, LOG_PLATEAU_POINTS)
        edge = logged.points_for(series, PLATEAU_EDGE, 1)
        tail = [(s, v) for s, v in after if s >= judged_from]
        tail = after[max(0, len(after) - len(tail) - window + 1):]
        short = (not after or after[-1][0] - origin < PLATEAU_AFTER + PLATEAU_STRETCH
                 or len(tail) < LOG_PLATEAU_POINTS + window - 1)
        counted = f"{after[-1][0] - origin if after else 0} steps logged after the warm-up"
    else:
        window, edge = PLATEAU_WINDOW, PLATEAU_EDGE
        tail = [(s, v) for s, v in after if s >= judged_from - PLATEAU_WINDOW + 1]
        short = len(after) < PLATEAU_AFTER + PLATEAU_STRETCH or len(tail) < PLATEAU_STRETCH + PLATEAU_WINDOW - 1
        counted = f"{len(after)} finite losses after the warm-up"
    if short:
        return Result.skipped(f"too short to tell: {counted} (ended at step {origin}), "
                              f"{PLATEAU_AFTER + PLATEAU_STRETCH} needed",
                              {"warmup_end": warmup, "steps_after_warmup": len(after)})
    start = median(v for _, v in points[:edge])
    smooth = _trailing_medians([v for _, v in tail], window)
    details = {"warmup_end": warmup, "warmup_from": "rates" if warmup is not None else "none recorded",
               "start_loss": start, "final": smooth[-1], "after": PLATEAU_AFTER, "stretch": PLATEAU_STRETCH,
               "window": window, "interval": logged.interval(series),
               "lnv_share": PLATEAU_LNV_SHARE, "start_share": PLATEAU_START_SHARE,
               "flat_share": PLATEAU_FLAT_SHARE}
    vocab = series.facts.get("vocab")
    if isinstance(vocab, int) and vocab > 1:
        details["ln_vocab"] = math.log(vocab)
    for name, level, tolerance in _stuck_levels(series, start):
        fell = smooth[0] - smooth[-1]
        per_100 = 100 * fell / (tail[-1][0] - judged_from)
        if all(abs(v - level) <= tolerance for v in smooth) and per_100 < PLATEAU_FLAT_SHARE * abs(level):
            details = {"step": judged_from, "level": name, "level_value": level, "tolerance": tolerance,
                       "lowest": min(smooth), "highest": max(smooth), "fell": fell, "fell_per_100_steps": per_100,
                       **details}
            what = "logged points" if logged.log_of(series) else "steps"
            message = (f"the loss is stuck at {name} ({level:.3f}): from step {judged_from}, {PLATEAU_AFTER} steps "
                       f"after the warm-up ended (step {origin}), to the end (step {tail[-1][0]}) its median over "
                       f"{window} {what} stayed within {tolerance:.3f} of it ({min(smooth):.3f}-"
                       f"{max(smooth):.3f}), falling {max(per_100, 0.0):.3f} per 100 steps (the run started at "
                       f"{start:.3f}, the median of its first {edge} {what}{logged.spacing(series)})")
            hint = ("nothing is being learned: check that each target is its input shifted by one (same row, "
                    "same order: inputs and labels shuffled apart?), that the loss reaches the weights (no "
                    ".detach(), .item() or no_grad() before backward) and that the optimizer holds this model's "
                    "parameters (data of uniformly random tokens has nothing to learn: ln V is its floor)")
            if name == "ln V":
                return Result.failed(message + ": no better than a uniform guess over the vocabulary", hint, details)
            return Result.warned(message, hint, details)
    where = f"the warm-up ended at step {origin}" if warmup is not None else "no rate recorded: judged from the start"
    what = "logged points" if logged.log_of(series) else "steps"
    return Result.passed(f"the loss moved from {start:.3f} to {smooth[-1]:.3f} (medians of the first {edge} "
                         f"and last {window} {what}; {where})", details)


# -------------------------------------------------------------------------------------- grad-norm-trend
