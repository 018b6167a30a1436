"""`tfdoctor watch`'s header in the console report: the run in a few lines (how it ended, the loss from
start to end, the evaluations, the gradient norm, the rates, the scaler, throughput, data wait and
memory), read from the series the report carries. Every number is report/run_summary.py's, under the
name the live view and the HTML give it. No torch: the series is plain data here."""

from __future__ import annotations

import math
import statistics

from rich.text import Text

from tfdoctor.report.run_summary import (
    finite,
    loss_ends,
    median_step_rate,
    rates_said,
    run_data_wait,
    run_wall_clock_rate,
)


def watched_lines(report) -> list[Text]:
    series, facts = report.series.get("steps", {}), report.series.get("facts", {})
    evals = report.series.get("evals", {})
    found = report.discovered or {}
    steps = len(series.get("step", []))
    lines = [f"{steps} optimizer step(s) in {found.get('seconds', facts.get('seconds', 0)):.1f} s, "
             f"{_ended(found.get('ended', facts.get('ended')))}"]
    logged = bool(facts.get("logged"))
    if logged:  # `tfdoctor judge`: a run read from its log (report/logged.py)
        from tfdoctor.report.logged import logged_lines

        lines = logged_lines(report.series, found)
    if found.get("error"):
        lines.append(f"the script ended with {found['error']}")
    ends = loss_ends(series.get("loss", []))
    if ends:
        evaluations = _evaluations(evals)
        lines.append(f"loss {ends}" + ("" if evaluations else ", no evaluation seen"))
        if evaluations:
            lines.append(evaluations)
    norms = finite(series.get("grad_norm", []))
    if norms:
        lines.append(f"gradient norm (before clipping) median {_median(norms):.3g}, max {max(norms):.3g}")
    lines += rates_said(series.get("lrs", []), facts.get("param_groups") or [])
    skipped = sum(1 for s in series.get("skipped", []) if s)
    if facts.get("scaler"):
        scales = finite(series.get("scale", []))
        lines.append(f"GradScaler: {skipped} of {steps} steps skipped" + (f", scale {scales[-1]:g} at the end"
                                                                             if scales else ""))
    throughput = [run_wall_clock_rate(series), median_step_rate(series)]
    if not logged or any(throughput):
        lines.append(", ".join(filter(None, throughput)) or "tokens/s unknown")
    waited = run_data_wait(series, facts) if not logged else ""
    if waited:
        lines.append(waited)
    rss = [v for v in series.get("rss", []) if v]
    cuda = [v for v in series.get("cuda_allocated", []) if v]
    if rss or cuda:
        lines.append(", ".join(filter(None, [f"RSS peak {max(rss) / 2 ** 20:,.0f} MiB" if rss else "",
                                             f"CUDA allocated peak {max(cuda) / 2 ** 20:,.0f} MiB" if cuda else ""])))
    label = "judged     " if logged else "watched    "
    return [Text.assemble((label if i == 0 else "           ", "evidence"), line) for i, line in enumerate(lines)]


def _evaluations(evals: dict) -> str:
    """The script's evaluation (its held-out source), and a training-split estimate beside it, labelled
    as one: nanoGPT's estimate_loss prints both, and only the val split is the evaluation. "" if none."""
    from tfdoctor.watching.series import RunSeries

    series = RunSeries.from_dict({"evals": evals})
    said = []
    for points, name in ((series.evaluation(), "evaluation"), (series.training_split(), "train-split estimate")):
        losses = finite(point.loss for point in points)
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


def _median(values) -> float:
    return statistics.median(values) if values else math.nan
