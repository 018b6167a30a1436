"""The pictures of the HTML report (report/html.py), drawn with matplotlib as inline SVG: the
dependency map of the mask checks, the overfit-batch loss curve, the loop's gradient norm and rate per
step, and the memory breakdown against the budget. A watched run's series are in run_figures.py.

matplotlib is an optional extra (`pip install 'tfdoctor[html]'`), imported only when a figure is drawn.
Figures are drawn on the Agg canvas of a bare `Figure`, never through pyplot: no global backend or
window state is touched, which matters where the report is written inside the user's own process (the
Trainer and Lightning callbacks). Each function returns a list of Drawn figures, empty when the
report holds nothing to draw.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from typing import Any

from tfdoctor.memory.sizes import format_bytes
from tfdoctor.result import Report, Result, Status

# One palette for every figure: the report's status colours (the console theme's red, orange, green)
# and matplotlib's default blue and orange for the measured series.
COLOURS = {"fail": "#d62728", "error": "#9b59b6", "warn": "#e69f00", "pass": "#2ca02c", "skip": "#888888",
           "series": "#1f77b4", "second": "#ff7f0e", "third": "#7f7f7f", "budget": "#d62728"}
# Inches: a figure is drawn at this width and scaled by the browser to its card (the SVG keeps its
# viewBox), so the fonts are sized for a card about 560 px wide.
WIDE, NARROW, ROW_HEIGHT = 11.0, 6.4, 3.3
MIB = 2 ** 20


@dataclass
class Drawn:
    """One figure of the page: its caption, its <svg> element, and what it is (a stable name the page
    and its tests find it by: "dependency-map", "loss", ...)."""

    name: str
    title: str
    svg: str
    wide: bool = False  # spans the page's width (the headline figure)
    note: str = ""  # a line under the figure


def plotting():
    """matplotlib's Figure and Agg canvas, imported on first use (the import takes a few tenths of a
    second that `tfdoctor --help` and the analytic `memory` must not pay)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return Figure, FigureCanvasAgg


def new_figure(width: float = NARROW, height: float = ROW_HEIGHT, rows: int = 1):
    Figure, FigureCanvasAgg = plotting()
    fig = Figure(figsize=(width, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, 1, r + 1) for r in range(rows)]
    for ax in axes:
        ax.grid(True, color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig, axes


def legend_above(ax, columns: int = 4) -> None:
    """The legend in a row above the plot: inside, it hides the very points a finding is about."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=min(columns, len(handles)), fontsize=8,
                  frameon=False, borderaxespad=0.2, handlelength=1.8, columnspacing=1.2)


def integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10]))


def plain_rates(ax) -> None:
    """Learning rates as written in code (0.003, 3e-05), not as multiples of an offset above the axis."""
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.2g}"))


def to_svg(fig, salt: str) -> str:
    """The figure as an <svg> element to inline in HTML: no XML prolog, text kept as text (the
    browser's fonts, searchable, a tenth of the size of glyph outlines), no date, ids salted per
    figure so that two figures on one page never share a clip-path id, and width set by the page."""
    import warnings

    import matplotlib

    out = io.StringIO()
    # matplotlib's layout warnings would land on the user's stderr, inside the run they watch
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None})
    text = out.getvalue()
    text = text[text.index("<svg"):]
    # The page sizes the figure (CSS), the viewBox keeps its proportions.
    return re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r'<svg\1 class="figure"', text, count=1)


def number(value) -> float:
    """A value of the evidence as a float to draw: details that came from a worker went through JSON,
    where NaN and the infinities are the strings "nan", "inf", "-inf" (result.json_safe); anything
    else that is not a number is a gap (NaN), never a category on the axis."""
    if isinstance(value, bool):
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    return float(value) if value in ("nan", "inf", "-inf") else math.nan


def numbers(values) -> list[float]:
    return [number(v) for v in values or []]


def safely(name: str, draw, *args) -> list[Drawn]:
    """draw(*args), or a figure that says it could not be drawn: a plotting bug in tfdoctor must not
    cost the user the report of a run that took hours."""
    try:
        return draw(*args)
    except Exception as exc:  # noqa: BLE001 - reported on the page, in the figure's place
        return [Drawn(name, f"{name}: not drawn", "", note=f"tfdoctor could not draw this figure "
                                                           f"({type(exc).__name__}: {exc}); please report it")]


def status_colour(status) -> str:
    return COLOURS.get(getattr(status, "value", status), COLOURS["series"])


def finite(values: list) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def log_scale_helps(values: list) -> bool:
    """A log axis where the positive values span more than two decades (a norm that explodes or dies)."""
    positive = [v for v in finite(values) if v > 0]
    return len(positive) >= 2 and max(positive) / min(positive) > 100


def _title(result: Result) -> str:
    return f"{result.id}: {result.status.value.upper()}"


def _results(report: Report) -> dict[str, Result]:
    return {r.id: r for r in report.results}


# ------------------------------------------------------------------ the dependency map


def dependency_maps(report: Report) -> list[Drawn]:
    """One heat map per distinct measured map (future-leak and mask-direction judge the same one)."""
    drawn: list[tuple[Any, list[Result]]] = []
    for result in report.results:
        cells = result.details.get("dependency_map")
        if not cells or not isinstance(cells, list):
            continue
        for known, judged in drawn:
            if known == cells:
                judged.append(result)
                break
        else:
            drawn.append((cells, [result]))
    figures = []
    for n, (cells, judged) in enumerate(drawn):
        title = "Dependency map (" + ", ".join(_title(r) for r in judged) + ")"
        figures.append(Drawn("dependency-map", title, to_svg(
            _heat_map(cells, judged[0].details.get("map_cell_positions", 1), judged), f"map{n}")))
    return figures


def _heat_map(cells: list[list[int]], step: int, judged: list[Result]):
    """Rows are output positions i, columns input tokens j; each cell coded 0 (no dependency), 1 (on
    itself or the past), 2 (on a later token: a leak). Drawn as vector cells, crisp at any zoom."""
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    fig, (ax,) = new_figure(NARROW, 5.4)
    ax.grid(False)
    size = len(cells)
    colours = ["#f0f0f0", "#7fbf7b", COLOURS["fail"]]
    edges = [p * step for p in range(size + 1)]
    ax.pcolormesh(edges, edges, cells, cmap=ListedColormap(colours), norm=BoundaryNorm([-0.5, 0.5, 1.5, 2.5], 3),
                  edgecolors="white", linewidth=0.5)
    ax.set_xlim(0, size * step)
    ax.set_ylim(size * step, 0)  # position 0 at the top left, as the matrix is written
    ax.set_aspect("equal")
    ax.set_xlabel("input token j (position)")
    ax.set_ylabel("output position i")
    ax.plot([0, size * step], [0, size * step], color="#444444", linewidth=0.8, linestyle=":")
    per_cell = f"; {step} positions per cell" if step > 1 else ""
    ax.set_title(f"does output i change when token j changes? (T = {judged[0].details.get('seq_len', '?')}"
                 f"{per_cell})", fontsize=10)
    ax.legend(handles=[Patch(color=colours[0], label="no dependency"),
                       Patch(color=colours[1], label="on itself or the past"),
                       Patch(color=colours[2], label="on a later token (leak)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False, fontsize=9)
    return fig


# ------------------------------------------------------------------ learning and the loop


def overfit_curve(report: Report) -> list[Drawn]:
    """overfit-batch: the loss on the one batch as training went (the loop's, and the replayed
    reference's where there was one), against the target it had to reach."""
    result = _results(report).get("overfit-batch")
    if result is None:
        return []
    d = result.details
    fig, (ax,) = new_figure()
    drew = False
    if d.get("loss_curve"):
        curve = numbers(d["loss_curve"])
        ax.plot(range(len(curve)), curve, color=COLOURS["series"], label="loss on the batch")
        ax.set_xlabel("optimizer step")
        drew = True
    if d.get("loss_at_batches"):
        xs, ys = zip(*d["loss_at_batches"])
        ax.plot(numbers(xs), numbers(ys), marker="o", color=COLOURS["series"], label="your loop: next-token loss")
        ax.set_xlabel("batches fed to your loop (the same batch each time)")
        drew = True
    reference = d.get("reference") or {}
    if reference.get("loss_curve"):
        curve = numbers(reference["loss_curve"])
        ax.plot(range(len(curve)), curve, color=COLOURS["second"], label="your optimizer, plain next-token loss")
        drew = True
    if not drew:
        return []
    if isinstance(d.get("target_loss"), (int, float)):
        ax.axhline(d["target_loss"], color=COLOURS["pass"], linestyle="--", linewidth=1,
                   label=f"target {d['target_loss']:.3g}")
    if d.get("loop") and isinstance(d.get("start_loss"), (int, float)) and d.get("pass_share"):
        ax.axhline(d["pass_share"] * d["start_loss"], color=COLOURS["pass"], linestyle=":", linewidth=1,
                   label=f"{d['pass_share']:.0%} of the start (passes)")
    ax.set_ylabel("cross-entropy (nats)")
    integer_steps(ax)
    legend_above(ax, 2)
    return [Drawn("overfit", f"Overfitting one batch ({_title(result)})", to_svg(fig, "overfit"))]


def loop_curves(report: Report) -> list[Drawn]:
    """The loop checks' series per optimizer step: the pre-clip gradient norm (grad-health) and the
    learning rate (lr-schedule's schedule; overfit-batch's recorded rates when it has none)."""
    results = _results(report)
    figures = []
    health = results.get("grad-health")
    norms = (health.details.get("pre_clip_norms") or []) if health else []
    if finite(norms):
        fig, (ax,) = new_figure()
        steps = list(range(1, len(norms) + 1))
        ax.plot(steps, numbers(norms), marker="o",
                color=COLOURS["series"])
        bad = health.details.get("non_finite_steps") or []
        for step in bad:
            ax.axvline(step, color=COLOURS["fail"], linewidth=1)
        if log_scale_helps(norms):
            ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("global L2 norm before clipping")
        integer_steps(ax)
        note = f"{len(norms)} optimizer steps recorded" + (f"; NaN/Inf at {len(bad)} (red lines)" if bad else "")
        figures.append(Drawn("grad-norm", f"Gradient norm per step ({_title(health)})", to_svg(fig, "gradnorm"),
                             note=note))
    rate = _rate_figure(results)
    if rate:
        figures.append(rate)
    return figures


def _rate_figure(results: dict[str, Result]):
    schedule = results.get("lr-schedule")
    points = (schedule.details.get("schedule") or []) if schedule else []
    source = schedule.details.get("source", "") if schedule else ""
    owner = schedule
    if not points:
        overfit = results.get("overfit-batch")
        rates = (overfit.details.get("lr_curve") or []) if overfit else []
        points, source, owner = [[i, r] for i, r in enumerate(rates)], "recorded at your loop's steps", overfit
    if not points:
        return None
    fig, (ax,) = new_figure()
    xs, ys = zip(*points)
    ax.plot(numbers(xs), numbers(ys), color=COLOURS["series"])
    if schedule is not None and isinstance(schedule.details.get("peak_step"), int) and owner is schedule:
        ax.plot([schedule.details["peak_step"]], [schedule.details["peak_lr"]], marker="o",
                color=COLOURS["second"], label=f"peak {schedule.details['peak_lr']:.2g} at step "
                                               f"{schedule.details['peak_step']}")
        legend_above(ax)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    plain_rates(ax)
    integer_steps(ax)
    return Drawn("rate", f"Learning rate per step ({_title(owner)})", to_svg(fig, "rate"), note=source)


# ------------------------------------------------------------------ memory


def memory_figures(data: dict[str, Any], title: str, salt: str = "memory") -> list[Drawn]:
    """What is alive at the peak by category, and the peak under each remedy, against the budget.
    `data` is the memory check's details or the memory command's JSON document (report/memory.py's
    to_dict): both hold breakdown, peak_bytes, budget_bytes and remedies."""
    breakdown = {k: v for k, v in (data.get("breakdown") or {}).items() if isinstance(v, (int, float)) and v > 0}
    peak, budget = data.get("peak_bytes"), data.get("budget_bytes")
    if not breakdown or not isinstance(peak, (int, float)) or not isinstance(budget, (int, float)):
        return []
    share = peak / budget if budget else math.inf
    note = (f"peak {format_bytes(peak)}: {share:.1%} of the budget of {format_bytes(budget)}"
            + ("" if peak <= budget else f", over by {format_bytes(peak - budget)}"))
    figures = [Drawn("memory", title, to_svg(_breakdown(breakdown, peak, budget), salt), note=note)]
    remedies = [r for r in data.get("remedies") or [] if isinstance(r.get("peak_bytes"), (int, float))]
    if remedies:
        starred = "; * changes what is trained" if any(r.get("changes_training") for r in remedies) else ""
        figures.append(Drawn("remedies", "Peak under each remedy, alone",
                             to_svg(_remedies(remedies, peak, budget), salt + "-remedies"),
                             note=f"green fits the budget, red does not{starred}"))
    return figures


def _unit(largest: float) -> tuple[float, str]:
    for size, name in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (MIB, "MiB"), (2 ** 10, "KiB")):
        if largest >= size:
            return size, name
    return 1, "B"


def _budget_shown(ax, peak: float, budget: float, size: float) -> None:
    """The budget as a red line where it is on the scale of the peak (within 4x); else said in the
    title, as a line far to the right would squash every bar to nothing."""
    if budget <= 4 * peak:
        ax.axvline(budget / size, color=COLOURS["budget"], linewidth=1.5, linestyle="--",
                   label=f"budget {format_bytes(budget)}")
        legend_above(ax)


def _breakdown(breakdown: dict[str, float], peak: float, budget: float):
    fig, (ax,) = new_figure(NARROW, 0.9 + 0.42 * (len(breakdown) + 1))
    size, unit = _unit(max(peak, *breakdown.values()))
    names = list(breakdown) + ["peak"]
    values = [v / size for v in breakdown.values()] + [peak / size]
    fits = peak <= budget
    colours = [COLOURS["series"]] * len(breakdown) + [COLOURS["pass"] if fits else COLOURS["fail"]]
    ax.barh(range(len(names)), values, color=colours)
    for y, value in enumerate(values):
        ax.text(value, y, f" {format_bytes(value * size)}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_xlim(0, max(values + [budget / size if budget <= 4 * peak else 0]) * 1.18)
    _budget_shown(ax, peak, budget, size)
    return fig


def _remedies(remedies: list[dict], peak: float, budget: float):
    fig, (ax,) = new_figure(NARROW, 0.9 + 0.42 * (len(remedies) + 1))
    size, unit = _unit(max([peak] + [r["peak_bytes"] for r in remedies]))
    names = ["now"] + [r["name"] + (" *" if r.get("changes_training") else "") for r in remedies]
    values = [peak / size] + [r["peak_bytes"] / size for r in remedies]
    colours = [COLOURS["pass"] if peak <= budget else COLOURS["fail"]] + \
        [COLOURS["pass"] if r.get("fits") else COLOURS["fail"] for r in remedies]
    ax.barh(range(len(names)), values, color=colours)
    ax.set_yticks(range(len(names)), names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.axvline(budget / size, color=COLOURS["budget"], linewidth=1.5, linestyle="--",
               label=f"budget {format_bytes(budget)}")
    legend_above(ax)
    return fig


def check_figures(report: Report) -> list[Drawn]:
    """Every figure a check or run report has something for, in the order the checks run."""
    figures = (safely("dependency-map", dependency_maps, report) + safely("overfit", overfit_curve, report)
               + safely("loop", loop_curves, report))
    memory = _results(report).get("memory")
    if memory is not None and memory.status is not Status.SKIP:
        figures += safely("memory", memory_figures, memory.details,
                          f"Memory at the peak of one training step ({_title(memory)})")
    return figures
