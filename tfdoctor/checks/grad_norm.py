"""grad-norm-trend: a pre-clip global gradient norm that grows steadily, window after window, to several
times its low (the slow build-up before a run explodes, which a clip hides from the loss), or that
collapses. A pure function of a RunSeries (tfdoctor/watching/series.py), watched or read from a log
(checks/verdicts/logged.py); thresholds measured on the healthy runs checks/curves.py names.
"""

from __future__ import annotations

from statistics import median

from tfdoctor.checks.verdicts import logged
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.watching.series import RunSeries, is_finite

# grad-norm-trend: medians of the finite pre-clip norms over consecutive windows of NORM_WINDOW steps.
# Growth: the last window at least NORM_GROWTH times the lowest window before it, and of the pairs of
# windows since the lowest at least NORM_STEADY in rising order. The healthy runs: the last window at
# most 1.68x the lowest (SGD with momentum; highest over lowest 1.78), though a short run's windows can
# all be in rising order (the factor is the guard); the planted summed micro-batches (grad_growth.py):
# 5.6x, every pair rising. Collapse: the last window below NORM_COLLAPSE of the highest before it (the
# healthy runs: never below 0.92), unless the loss itself went to about zero (its median over the last
# window below LOSS_NEAR_ZERO nats: a memorised batch, whose gradient fades with its loss).
NORM_WINDOW = 20
NORM_MAX_WINDOWS = 200  # a longer run gets wider windows (the growth test compares every pair of them)
NORM_MIN_WINDOWS = 4
NORM_GROWTH = 4.0
NORM_STEADY = 0.75
NORM_COLLAPSE = 0.01
LOSS_NEAR_ZERO = 0.05
# On a log a window covers NORM_WINDOW steps but at least LOG_NORM_POINTS logged points. A logged norm is
# one step's (the Trainer and Lightning log the last step's norm, not a mean), so a window of 3 is as
# noisy as 3 steps: MEASURED below on fixtures/logs/make.py's healthy logs.
LOG_NORM_POINTS = 3


def _norm_windows(series: RunSeries) -> tuple[list[tuple[int, float]], int]:
    """(last step, median norm) of consecutive windows of finite pre-clip norms, and the windows' width
    (NORM_WINDOW norms, wider beyond NORM_MAX_WINDOWS windows); steps the GradScaler skipped are left out
    (their norm is an overflow, scaler-overflow's business)."""
    norms = [(row.step, row.grad_norm) for row in series.steps if is_finite(row.grad_norm) and not row.skipped]
    least = logged.points_for(series, NORM_WINDOW, LOG_NORM_POINTS) if logged.log_of(series) else NORM_WINDOW
    width = max(least, -(-len(norms) // NORM_MAX_WINDOWS))
    return [(norms[i + width - 1][0], median(n for _, n in norms[i:i + width]))
            for i in range(0, len(norms) - width + 1, width)], width


def _growth(windows: list[tuple[int, float]]) -> dict | None:
    """Steady growth from the lowest window to the last: at least NORM_GROWTH-fold, and ordered: of every
    pair of windows since the lowest, at least NORM_STEADY have the later one higher (a staircase counts;
    a rise and fall, or noise around a level, does not)."""
    low = min(range(len(windows) - 1), key=lambda k: windows[k][1])
    rise = [n for _, n in windows[low:]]
    if len(rise) < 3 or rise[0] <= 0:
        return None
    factor = rise[-1] / rise[0]
    pairs = [(a, b) for i, a in enumerate(rise) for b in rise[i + 1:]]
    ordered = sum(1 for a, b in pairs if b > a) / len(pairs)
    if factor < NORM_GROWTH or ordered < NORM_STEADY:
        return None
    crossed = next(step for step, n in windows[low:] if n >= NORM_GROWTH * rise[0])
    return {"step": crossed, "low": rise[0], "low_step": windows[low][0], "last": rise[-1], "factor": factor,
            "ordered_share": ordered}


def _collapse(windows: list[tuple[int, float]]) -> dict | None:
    top = max(range(len(windows) - 1), key=lambda k: windows[k][1])
    high, last = windows[top][1], windows[-1][1]
    if high <= 0 or last > NORM_COLLAPSE * high:
        return None
    crossed = next(step for step, n in windows[top:] if n <= NORM_COLLAPSE * high)
    return {"step": crossed, "high": high, "high_step": windows[top][0], "last": last, "factor": last / high}


def _norm_named(series: RunSeries) -> str:
    return f" ({logged.named(series, 'grad_norm')})" if logged.log_of(series) else ""


def _norm_unit(series: RunSeries) -> str:
    every = logged.interval(series)
    return f"logged points ({every} steps apart)" if logged.log_of(series) and every > 1 else "steps"


@check("grad-norm-trend", title="The gradient norm neither grows steadily nor collapses")
def grad_norm_trend(series: RunSeries) -> Result:
    """Catches a pre-clip global gradient norm that grows steadily, window after window, to several
    times its low (the slow build-up before a run explodes, which a clip hides from the loss), or that
    collapses towards zero while the loss is still far from zero (gradients that vanish: a saturated
    layer, a loss scaled down to nothing, a graph cut). A norm that falls together with a loss going to
    zero (a memorised batch) is healthy.

    Fix: growth: divide each micro-batch's loss by the number of micro-batches in its step (also when
    that number ramps up), lower the peak rate, check that the rate decays as planned; collapse: find
    where the gradient stops (a .detach() or a saturated activation), or undo the scaling of the loss.
    """
    if not any(is_finite(row.grad_norm) for row in series.steps):
        if logged.log_of(series) and series.steps:
            return Result.skipped(logged.missing("gradient norm", logged.named(series, "grad_norm")))
        return Result.skipped("the run recorded no gradient norm" if series.steps
                              else "the run recorded no optimizer step")
    windows, width = _norm_windows(series)
    if len(windows) < NORM_MIN_WINDOWS:
        return Result.skipped(f"too short to tell: {len(windows)} windows of {width} finite gradient norms, "
                              f"{NORM_MIN_WINDOWS} needed", {"windows": len(windows)})
    thresholds = {"window": width, "growth": NORM_GROWTH, "steady": NORM_STEADY, "collapse": NORM_COLLAPSE,
                  "loss_near_zero": LOSS_NEAR_ZERO}
    medians = [round(n, 6) for _, n in windows]
    grow = _growth(windows)
    if grow:
        return Result.warned(
            f"the gradient norm{_norm_named(series)} grew steadily {grow['factor']:.1f}-fold, from a median of "
            f"{grow['low']:.3g} over the {width} {_norm_unit(series)} to {grow['low_step']} to {grow['last']:.3g} "
            f"over the last {width}; it "
            f"passed {NORM_GROWTH:g}x at step {grow['step']}, and {grow['ordered_share']:.0%} of the pairs of "
            "windows since are in rising order: gradients that keep building up (the run heading for an "
            "explosion, or micro-batch gradients summed where a mean was meant)",
            "if the number of micro-batches per step grows, divide each micro-batch's loss by the current count; "
            "otherwise lower the peak learning rate (or make sure the schedule decays it), keep "
            "clip_grad_norm_(model.parameters(), 1.0) and add weight decay if the weights grow unchecked",
            {**grow, "window_medians": medians, **thresholds})
    fall = _collapse(windows)
    points = series.finite_losses()
    final_loss = median(v for _, v in points[-width:]) if points else None
    if fall and (final_loss is None or final_loss > LOSS_NEAR_ZERO):
        loss = f"while the loss is still {final_loss:.3f}" if final_loss is not None else "(no loss recorded)"
        return Result.warned(
            f"the gradient norm collapsed to {fall['last']:.3g}, {fall['factor']:.1e} of its high of "
            f"{fall['high']:.3g} (steps to {fall['high_step']}), from step {fall['step']} {loss}: the weights "
            "barely receive a gradient any more",
            "find where the gradient stops: a .detach() or no_grad() on the way to the loss, a saturated "
            "activation, a loss multiplied by a tiny factor",
            {**fall, "final_loss": final_loss, "window_medians": medians, **thresholds})
    low, high = min(medians), max(medians)
    note = (" (it fell with a loss going to zero: a memorised batch)" if fall else "")
    return Result.passed(f"gradient norm{_norm_named(series)} medians stayed between {low:.3g} and {high:.3g} "
                         f"over {len(windows)} windows of {width} {_norm_unit(series)}{note}",
                         {"last_window_step": windows[-1][0], "window_medians": medians, "final_loss": final_loss,
                          **thresholds})
