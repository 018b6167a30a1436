"""The pictures of a watched run (Report.series, watching/series.RunSeries as data): every series over
the optimizer steps, each with the steps where a run judge fired marked on it. Drawn with
report/figures.py's helpers; matplotlib is imported there, on first use.

Every figure spans the same steps, so a spike in the loss lines up with the gradient norm, the scale
and the step time below it.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

from tfdoctor.report.figures import (
    COLOURS,
    WIDE,
    Drawn,
    finite,
    integer_steps,
    legend_above,
    log_scale_helps,
    new_figure,
    plain_rates,
    safely,
    status_colour,
    to_svg,
)
from tfdoctor.report.run_summary import (
    data_wait_measured,
    data_wait_share,
    group_label,
    loss_ends,
    median_step_rate,
    run_wall_clock_rate,
    step_rates,
)
from tfdoctor.result import Report, Status
from tfdoctor.watching.series import RunSeries

# A series longer than this many steps is drawn per bucket of steps (the mean, and the band from the
# lowest to the highest value, so a one-step spike stays visible): a 100,000-step run stays a page of
# a few hundred kilobytes instead of tens of megabytes of SVG path.
MAX_POINTS = 1500
# The smoothed loss: a rolling median over about this share of the run (9 steps of a 300-step run), so
# the trend reads through the batch-to-batch noise; at most MAX_HALF_WINDOW steps either side, so a
# long run stays quick to draw (a 100,000-step run: 100,000 medians of 201 values, about a second).
SMOOTHING_SHARE = 0.03
MAX_HALF_WINDOW = 100
MARKED = (Status.FAIL, Status.WARN, Status.ERROR)
MAX_EVAL_MARKERS = 60  # more evaluations than this are drawn as a line alone
MAX_LABEL = 24  # characters of a judge's id written along its mark (the ids are shorter)


def findings_marked(report: Report) -> list[tuple[int, str, Status]]:
    """(step, check id, status) of every run judge that did not pass and says where it fired."""
    marks = []
    for result in report.results:
        step = result.details.get("step")
        if result.status in MARKED and isinstance(step, int) and not isinstance(step, bool):
            marks.append((step, result.id, result.status))
    return sorted(marks)


def run_figures(report: Report) -> list[Drawn]:
    """Every figure the series has data for, in the order people read a run: loss, gradient norm,
    rate, loss scale, step time, throughput, memory."""
    series = RunSeries.from_dict(report.series)
    if not series.steps:
        return []
    marks = findings_marked(report)
    steps = series.column("step")
    figures = []
    for name, draw in (("loss", _loss), ("grad-norm", _grad_norm), ("rate", _rate), ("scale", _scale),
                       ("step-time", _step_time), ("throughput", _throughput), ("run-memory", _memory)):
        figures += safely(name, _drawn, name, draw, series, steps, marks)
    return figures


def _drawn(name: str, draw, series: RunSeries, steps: list, marks) -> list[Drawn]:
    """One series' figure on the run's step axis, with the findings marked; none without data."""
    drawn = draw(series, steps)
    if drawn is None:
        return []
    (fig, ax), title, note = drawn
    _mark(ax, marks)
    ax.set_xlim(min(steps), max(max(steps), min(steps) + 1))
    ax.set_xlabel("optimizer step")
    integer_steps(ax)
    return [Drawn(name, title, to_svg(fig, f"run-{name}"), wide=name == "loss", note=note)]


def _mark(ax, marks) -> None:
    """A vertical line at each finding's step, labelled with the judge's id along it."""
    from matplotlib.transforms import blended_transform_factory

    along = blended_transform_factory(ax.transData, ax.transAxes)
    for step, check_id, status in marks:
        colour = status_colour(status)
        ax.axvline(step, color=colour, linewidth=1.2, linestyle="--", alpha=0.9)
        label = check_id if len(check_id) <= MAX_LABEL else check_id[:MAX_LABEL - 1] + "…"
        ax.text(step, 0.98, f"{label} ", transform=along, rotation=90, va="top", ha="right", fontsize=7,
                color=colour)


def _trace(ax, xs: list, ys: list, colour: str, label: str, linewidth: float = 1.2, alpha: float = 1.0,
           linestyle: str = "-") -> None:
    """ys over xs (None and non-finite values left out); bucketed past MAX_POINTS."""
    points = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and math.isfinite(y)]
    if not points:
        return
    if len(points) <= MAX_POINTS:
        ax.plot(*zip(*points), color=colour, label=label, linewidth=linewidth, alpha=alpha, linestyle=linestyle)
        return
    size = math.ceil(len(points) / MAX_POINTS)
    buckets = [points[i:i + size] for i in range(0, len(points), size)]
    centre = [statistics.fmean(x for x, _ in b) for b in buckets]
    ax.fill_between(centre, [min(y for _, y in b) for b in buckets], [max(y for _, y in b) for b in buckets],
                    color=colour, alpha=0.25 * alpha, linewidth=0)
    ax.plot(centre, [statistics.fmean(y for _, y in b) for b in buckets], color=colour, label=label,
            linewidth=linewidth, alpha=alpha, linestyle=linestyle)


def _smoothed(values: list, share: float = SMOOTHING_SHARE) -> list:
    """The centred rolling median over about `share` of the run: it follows the trend without the lag
    of a moving average, and a one-step spike does not drag it (the raw line under it shows the spike).
    Gaps (None, NaN) are left out of each window."""
    half = min(MAX_HALF_WINDOW, int(share * len(values) / 2))
    if half < 1:
        return list(values)
    kept = [v if isinstance(v, (int, float)) and math.isfinite(v) else None for v in values]
    out = []
    for i in range(len(kept)):
        window = [v for v in kept[max(0, i - half):i + half + 1] if v is not None]
        out.append(statistics.median(window) if window else None)
    return out


def _loss(series: RunSeries, steps: list):
    fig, (ax,) = new_figure(WIDE, 3.6)
    losses = series.column("loss")
    _trace(ax, steps, losses, COLOURS["series"], "training loss (each step)", linewidth=0.8, alpha=0.35)
    _trace(ax, steps, _smoothed(losses), COLOURS["series"], "training loss (smoothed)", linewidth=1.8)
    # the held-out evaluation is "evaluation loss"; a training-split estimate (nanoGPT's estimate_loss on
    # 'train') is drawn beside it under its own name, never averaged into it
    for points, colour, label in ((series.training_split(), COLOURS["third"], "train-split estimate"),
                                  (series.evaluation(), COLOURS["second"], "evaluation loss")):
        if points:
            ax.plot([e.step for e in points], [e.loss for e in points], linewidth=1.4,
                    marker="o" if len(points) <= MAX_EVAL_MARKERS else None, markersize=4, color=colour,
                    label=label, linestyle="--" if label != "evaluation loss" else "-")
    broken = [s for s, v in zip(steps, losses) if isinstance(v, float) and not math.isfinite(v)]
    if log_scale_helps(losses):
        ax.set_yscale("log")
    if broken:  # NaN or Inf: no height to draw, so a red tick at the top edge of the plot
        ax.plot(broken, [ax.get_ylim()[1]] * len(broken), linestyle="none", marker="x", color=COLOURS["fail"],
                label=f"NaN/Inf loss ({len(broken)} steps)", clip_on=False)
    ax.set_ylabel("cross-entropy (nats)")
    legend_above(ax)
    vocab = series.facts.get("vocab")
    note = f"ln(V) = {math.log(vocab):.2f} nats for the vocabulary of {vocab}" if isinstance(vocab, int) and vocab > 1 \
        else ""
    ends = loss_ends(losses)  # the console's header says the same, in the same words
    title = "Loss" + (f": {ends}" if ends else "")
    return (fig, ax), title, note


def _grad_norm(series: RunSeries, steps: list):
    norms = series.column("grad_norm")
    if not finite(norms):
        return None
    fig, (ax,) = new_figure()
    groups = series.column("group_norms")
    width = max((len(g) for g in groups), default=0)
    if width > 1:  # per parameter group, under the global norm
        for index in range(width):
            _trace(ax, steps, [g[index] if index < len(g) else None for g in groups], COLOURS["third"],
                   "per parameter group" if index == 0 else None, linewidth=0.7, alpha=0.6)
    _trace(ax, steps, norms, COLOURS["series"], "global norm")
    if log_scale_helps(norms):
        ax.set_yscale("log")
    ax.set_ylabel("L2 norm before clipping")
    if width > 1:
        legend_above(ax)
    return (fig, ax), "Gradient norm", ""


def _rate(series: RunSeries, steps: list):
    rates = series.column("lrs")
    width = max((len(r) for r in rates), default=0)
    if not width:
        return None
    fig, (ax,) = new_figure()
    groups = series.facts.get("param_groups") or []
    colours = [COLOURS["series"], COLOURS["second"], COLOURS["third"]]
    columns = [[r[index] if index < len(r) else None for r in rates] for index in range(width)]
    for index, column in enumerate(columns):
        # groups on one schedule draw one line: the same rates would hide each other under two colours
        same = index > 0 and column == columns[0]
        if not same:
            _trace(ax, steps, column, colours[index % len(colours)], _rate_label(index, columns, groups),
                   linestyle="-" if index < len(colours) else "--")
    plain_rates(ax)
    ax.set_ylabel("learning rate used")
    if width > 1:
        legend_above(ax)
    return (fig, ax), "Learning rate", ""


def _rate_label(index: int, columns: list, groups: list) -> Optional[str]:
    """The legend of parameter group `index`'s rates: its weight decay and size; with the groups that
    share its rates at every step named together."""
    if len(columns) == 1:
        return None
    same = [i for i, column in enumerate(columns) if column == columns[index]]
    if len(same) == len(columns):
        return f"every parameter group ({len(columns)})"
    return "; ".join(group_label(i, groups) for i in same)


def _scale(series: RunSeries, steps: list):
    scales = series.column("scale")
    if not finite(scales):
        return None
    fig, (ax,) = new_figure()
    points = [(s, v) for s, v in zip(steps, scales) if isinstance(v, (int, float)) and math.isfinite(v)]
    if len(points) <= MAX_POINTS:
        ax.step(*zip(*points), where="post", color=COLOURS["series"], label="loss scale")
    else:
        _trace(ax, *zip(*points), COLOURS["series"], "loss scale")
    if min(v for _, v in points) > 0:
        ax.set_yscale("log", base=2)
    skipped = [(s, v) for s, v, k in zip(steps, scales, series.column("skipped")) if k]
    if skipped:
        ax.plot([s for s, _ in skipped], [v if v is not None else math.nan for _, v in skipped], linestyle="none",
                marker="v", markersize=4, color=COLOURS["fail"], label="step skipped (inf/NaN gradients)")
    ax.set_ylabel("GradScaler scale")
    legend_above(ax)
    return (fig, ax), f"Loss scale: {len(skipped)} of {len(steps)} steps skipped", ""


def _step_time(series: RunSeries, steps: list):
    walls, waits = series.column("wall"), series.column("data_wait")
    if not any(walls):
        return None
    fig, (ax,) = new_figure()
    measured = data_wait_measured(series.facts, series.column("batches"))
    wait_ms = [1000 * (w or 0.0) for w in waits]
    wall_ms = [1000 * (w or 0.0) for w in walls]
    _trace(ax, steps, wall_ms, COLOURS["third"], "whole step", linewidth=0.8)
    if measured:  # unmeasured, "compute" would be the whole step and the wait a line at zero: neither was seen
        compute_ms = [max(0.0, t - w) for t, w in zip(wall_ms, wait_ms)]
        _trace(ax, steps, compute_ms, COLOURS["series"], "compute", linewidth=1.0)
        _trace(ax, steps, wait_ms, COLOURS["second"], "waiting for the next batch", linewidth=1.0)
    if log_scale_helps(wall_ms):  # a few slow steps (a checkpoint, a busy machine) would flatten the rest
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel("milliseconds per step")
    legend_above(ax)
    # the first step's time holds the script's start (imports, the model's construction): left out
    waited = data_wait_share(sum(wait_ms[1:]) / 1000, sum(wall_ms[1:]) / 1000, measured)
    return (fig, ax), "Step time" + (f": {waited}" if waited else ""), ""


def _throughput(series: RunSeries, steps: list):
    columns = {"tokens": series.column("tokens"), "wall": series.column("wall")}
    rates = step_rates(columns)
    if not finite(rates):
        return None
    fig, (ax,) = new_figure()
    _trace(ax, steps, rates, COLOURS["series"], None, linewidth=0.8, alpha=0.5)
    _trace(ax, steps, _smoothed(rates), COLOURS["series"], None, linewidth=1.8)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("tokens per second")
    said = ", ".join(filter(None, [median_step_rate(columns), run_wall_clock_rate(columns)]))
    return (fig, ax), f"Throughput: {said}", ""


def _memory(series: RunSeries, steps: list):
    columns = {"process RSS": series.column("rss"), "CUDA allocated": series.column("cuda_allocated"),
               "CUDA reserved": series.column("cuda_reserved")}
    columns = {k: v for k, v in columns.items() if finite(v)}
    if not columns:
        return None
    fig, (ax,) = new_figure()
    largest = max(max(finite(v)) for v in columns.values())
    size, unit = (2 ** 30, "GiB") if largest >= 2 ** 30 else (2 ** 20, "MiB")
    colours = iter([COLOURS["series"], COLOURS["second"], COLOURS["third"]])
    for label, values in columns.items():
        _trace(ax, steps, [v / size if isinstance(v, (int, float)) else None for v in values], next(colours), label)
    ax.set_ylim(bottom=0)  # from zero: a zoomed axis makes a few MiB of noise look like a leak
    ax.set_ylabel(unit)
    legend_above(ax)
    return (fig, ax), "Memory", _growth(columns, size, unit)


def _growth(columns: dict, size: int, unit: str) -> Optional[str]:
    first, values = next(iter(columns.items()))
    kept = finite(values)
    return f"{first}: {kept[0] / size:.1f} {unit} at the first step, {kept[-1] / size:.1f} {unit} at the last"
