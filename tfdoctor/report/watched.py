"""`tfdoctor watch`'s header in the console report: the run in a few lines (how it ended, the loss from
start to end, the evaluations, the gradient norm, the rates, the scaler, throughput, data wait and
memory), read from the series the report carries. No torch: the series is plain data here."""

from __future__ import annotations

import math
import statistics

from rich.text import Text

# The start and the end of a curve are the medians of this many steps: one noisy batch is not the run.
ENDS = 10


def watched_lines(report) -> list[Text]:
    series, facts = report.series.get("steps", {}), report.series.get("facts", {})
    evals = report.series.get("evals", {})
    found = report.discovered or {}
    steps = len(series.get("step", []))
    lines = [f"{steps} optimizer step(s) in {found.get('seconds', facts.get('seconds', 0)):.1f} s, "
             f"{_ended(found.get('ended', facts.get('ended')))}"]
    if found.get("error"):
        lines.append(f"the script ended with {found['error']}")
    losses = _finite(series.get("loss", []))
    if losses:
        evaluations = _evaluations(evals)
        lines.append(f"loss {_median(losses[:ENDS]):.4g} at the start, {_median(losses[-ENDS:]):.4g} at the end"
                     + ("" if evaluations else ", no evaluation seen"))
        if evaluations:
            lines.append(evaluations)
    norms = _finite(series.get("grad_norm", []))
    rates = [lrs[0] for lrs in series.get("lrs", []) if lrs]
    if norms or rates:
        lines.append(", ".join(filter(None, [
            f"gradient norm (before clipping) median {_median(norms):.3g}, max {max(norms):.3g}" if norms else "",
            f"rate {min(rates):.3g} to {max(rates):.3g}" if rates else ""])))
    skipped = sum(1 for s in series.get("skipped", []) if s)
    if facts.get("scaler"):
        scales = _finite(series.get("scale", []))
        lines.append(f"GradScaler: {skipped} of {steps} steps skipped" + (f", scale {scales[-1]:g} at the end"
                                                                             if scales else ""))
    lines.append(_throughput(series))
    rss = [v for v in series.get("rss", []) if v]
    cuda = [v for v in series.get("cuda_allocated", []) if v]
    if rss or cuda:
        lines.append(", ".join(filter(None, [f"RSS peak {max(rss) / 2 ** 20:,.0f} MiB" if rss else "",
                                             f"CUDA allocated peak {max(cuda) / 2 ** 20:,.0f} MiB" if cuda else ""])))
    return [Text.assemble(("watched    " if i == 0 else "           ", "evidence"), line) for i, line in enumerate(lines)]


def _evaluations(evals: dict) -> str:
    """The script's evaluation (its held-out source), and a training-split estimate beside it, labelled
    as one: nanoGPT's estimate_loss prints both, and only the val split is the evaluation. "" if none."""
    from tfdoctor.watching.series import RunSeries

    series = RunSeries.from_dict({"evals": evals})
    said = []
    for points, name in ((series.evaluation(), "evaluation"), (series.training_split(), "train-split estimate")):
        losses = _finite(point.loss for point in points)
        if losses:
            said.append(f"{name} {losses[-1]:.4g} at the end, best {min(losses):.4g} ({len(points)} at "
                        f"{points[0].source})")
    return "; ".join(said)


def _ended(ended) -> str:
    return {"finished": "the script ran to its end", "max-steps": "stopped at --max-steps",
            "max-time": "stopped at --max-time", "exit": "the script exited with an error code",
            "raised": "the script raised", "stopped": "stopped by tfdoctor (stop_on)",
            "interrupted": "interrupted (Ctrl-C)",
            "running": "still running"}.get(ended, str(ended))


def _throughput(series: dict) -> str:
    walls = [number_of(w) or 0.0 for w in series.get("wall", [])[1:]]  # the first step holds the start
    waits = [number_of(w) or 0.0 for w in series.get("data_wait", [])[1:]]
    tokens = [t or 0 for t in series.get("tokens", [])[1:]]
    wall = sum(walls)
    parts = [f"{sum(tokens) / wall:,.0f} tokens/s" if wall > 0 and sum(tokens) else "tokens/s unknown",
             f"data wait {100 * sum(waits) / wall:.1f}% of the step time" if wall > 0 else ""]
    return ", ".join(filter(None, parts))


def number_of(value):
    """A number the series carries as JSON data (a float, "nan", None) as a float, or None."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _finite(values) -> list[float]:
    out = []
    for value in values:
        number = number_of(value)
        if number is not None and math.isfinite(number):
            out.append(number)
    return out


def _median(values) -> float:
    return statistics.median(values) if values else math.nan
