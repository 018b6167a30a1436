"""Render a memory verdict (tfdoctor.memory.analytic.Verdict) as Rich text, one JSON object or an
HTML page: one function per format, reached through report.render like every reporter.

Reads the verdict only; imports neither torch nor anything that does.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tfdoctor.memory.analytic import CATEGORIES, Verdict
from tfdoctor.memory.sizes import format_bytes
from tfdoctor.report.safe_text import clean
from tfdoctor.report.theme import THEME

BAR_WIDTH = 24
MODEL_NOTE = ("Models the peak of live tensor bytes in a steady-state training step: optimizer states already "
              "allocated, forward, cross-entropy on float32 logits, backward, optimizer step, gradients freed by "
              "zero_grad(set_to_none=True), the caller holding logits and loss until the step returns. The "
              "allocator, the CUDA context and the framework add some on top.")
ANALYTIC_NOTE = ("Analytic mode: a GPT-2-style pre-norm decoder (learned token and position embeddings, biases, "
                 "LayerNorm, GELU MLP, untied LM head unless --tied, no dropout); --batch is per device.")
TRACED_NOTE = ("Traced mode: one step of your model was run on fake tensors (no memory allocated) and the bytes of "
               "live tensors counted after every op.")
OOM_SYMPTOM = ("On Linux the symptom is a process killed with exit code 137 (SIGKILL from the OOM killer) and no "
               "Python traceback; on a GPU, torch.OutOfMemoryError.")


def to_dict(verdict: Verdict) -> dict[str, Any]:
    """The JSON document: the issue's fixed keys first, then the evidence."""
    est = verdict.estimate
    data: dict[str, Any] = {
        "mode": verdict.mode,
        "attention_scores_bytes": _scores_bytes(verdict),
        "logits_bytes": _logits_bytes(verdict),
        "peak_bytes": verdict.peak_bytes,
        "budget_bytes": verdict.budget_bytes,
        "budget_source": verdict.budget_source,
        "fits": verdict.fits,
        "over_by_bytes": max(0, verdict.peak_bytes - verdict.budget_bytes),
        "largest_seq_that_fits": verdict.largest_seq,
        "largest_batch_that_fits": verdict.largest_batch,
        "remedies": [r.to_dict() for r in verdict.remedies],
        "models": MODEL_NOTE,
    }
    if verdict.traced is not None:
        traced = verdict.traced
        data.update({"peak_phase": traced["peak_phase"], "peak_op": traced["peak_op"],
                     "peak_node": traced["peak_node"], "peak_module": traced["peak_module"],
                     "breakdown": traced["peak_breakdown"], "attention": traced.get("attention"), "trace": traced})
    if est is not None:
        data.update({"config": est.config.to_dict(), "parameter_count": est.parameter_count})
        if verdict.traced is None:
            data.update({"peak_phase": est.peak_phase, "peak_op": est.peak_op, "breakdown": dict(est.at_peak),
                         "parameter_bytes": est.parameter_bytes, "gradient_bytes": est.gradient_bytes,
                         "optimizer_bytes": est.optimizer_bytes, "kept_per_layer": dict(est.kept_per_layer),
                         "layers": est.config.layers, "kept_model": dict(est.kept_model),
                         "largest_tensors": list(est.largest)})
        else:
            data["analytic_peak_bytes"] = est.peak_bytes
    return data


def _scores_bytes(verdict: Verdict):
    if verdict.traced is None:
        return verdict.estimate.attention_scores_bytes
    return verdict.traced.get("attention_scores_bytes")


def _logits_bytes(verdict: Verdict):
    if verdict.traced is None:
        return verdict.estimate.logits_bytes
    return verdict.traced.get("logits_bytes")


def render_json(verdict: Verdict, out: TextIO, width: int | None = None) -> None:
    json.dump(to_dict(verdict), out, indent=2, allow_nan=False)
    out.write("\n")


def render_rich(verdict: Verdict, out: TextIO, width: int | None = None) -> None:
    # At 80 columns (a pipe, a CI log) a remedy's change is code the user copies: long tokens fold onto
    # the next line, never "…". No markup: module and op names are the user's text.
    console = Console(file=out, width=width, theme=THEME, highlight=False, markup=False, emoji=False)
    traced = verdict.traced
    _header(console, verdict)
    console.print(_peak_table(verdict))
    if traced is None:
        _analytic_tables(console, verdict.estimate)
    else:
        _traced_tables(console, traced)
    _judgement(console, verdict)
    if verdict.remedies:
        console.print(_remedies_table(verdict))
    console.print(MODEL_NOTE, style="dim")
    console.print(ANALYTIC_NOTE if traced is None else TRACED_NOTE, style="dim")


def _bar(verdict: Verdict, nbytes: int, over: bool = False) -> Text:
    """nbytes against the budget, on a scale where the larger of the peak and the budget is BAR_WIDTH."""
    scale = max(verdict.peak_bytes, verdict.budget_bytes, 1)
    cells = round(BAR_WIDTH * nbytes / scale)
    budget_at = round(BAR_WIDTH * verdict.budget_bytes / scale)
    text = Text("█" * min(cells, budget_at), style="bar.over" if over else "bar")
    if cells > budget_at:
        text.append("│", style="head")
        text.append("█" * (cells - budget_at - 1), style="bar.over")
    return text


def _peak_table(verdict: Verdict) -> Table:
    """What is alive at the peak, by category (analytic) or by origin (traced), each against the budget."""
    est, traced = verdict.estimate, verdict.traced
    table = Table(title=f"Alive at the peak: {_peak_where(verdict)}", title_justify="left", show_edge=False)
    table.add_column("what", overflow="fold")
    table.add_column("bytes", justify="right", no_wrap=True, min_width=9)
    table.add_column(f"against the budget ({format_bytes(verdict.budget_bytes)}, │ marks it)", no_wrap=True)
    breakdown = (est.at_peak if traced is None else traced["peak_breakdown"])
    order = CATEGORIES if traced is None else list(breakdown)
    for name in order:
        if breakdown.get(name):
            table.add_row(name, format_bytes(breakdown[name]), _bar(verdict, breakdown[name]))
    table.add_row(Text("peak", style="head"), Text(format_bytes(verdict.peak_bytes), style="head"),
                  _bar(verdict, verdict.peak_bytes, over=not verdict.fits))
    return table


def _analytic_tables(console: Console, est) -> None:
    """The analytic estimate: what each layer and the model keep for backward, the largest tensors."""
    kept = Table(title=f"Kept for backward by each of the {est.config.layers} layers, and by the model",
                 title_justify="left", show_edge=False)
    kept.add_column("activation", overflow="fold")
    kept.add_column("per layer", justify="right")
    kept.add_column("all layers", justify="right")
    for name, nbytes in est.kept_per_layer.items():
        kept.add_row(name, format_bytes(nbytes), format_bytes(nbytes * est.config.layers))
    for name, nbytes in est.kept_model.items():
        kept.add_row(name, "", format_bytes(nbytes))
    if est.kept_per_layer or est.kept_model:
        console.print(kept)
    big = Table(title="Largest single tensors", title_justify="left", show_edge=False)
    big.add_column("tensor", overflow="fold")
    big.add_column("shape", overflow="fold")
    big.add_column("bytes", justify="right")
    for item in est.largest[:3]:
        big.add_row(item["name"] + (f" ({item['note']})" if item["note"] else ""),
                    str(item["shape"]), f"{item['bytes']:,}")
    console.print(big)


def _traced_tables(console: Console, traced: dict[str, Any]) -> None:
    """The traced step: what each module kept for backward, the largest allocations."""
    kept = Table(title="Kept for backward, by module", title_justify="left",
                 show_edge=False)
    kept.add_column("module", overflow="fold")
    kept.add_column("bytes", justify="right")
    for row in traced["kept_by_module"][:8]:
        kept.add_row(clean(row["module"]), format_bytes(row["bytes"]))
    console.print(kept)
    if traced["largest_tensors"]:  # allocations of 1 MiB or more
        big = Table(title="Largest single allocations", title_justify="left", show_edge=False)
        for column in ("op", "shape", "module", "phase", "times", "bytes"):
            big.add_column(column, justify="right" if column in ("bytes", "times") else "left", overflow="fold")
        for item in traced["largest_tensors"][:5]:
            big.add_row(item["op"], f"{item['shape']} {item['dtype']}", clean(item["module"] or "-"), item["phase"],
                        str(item["count"]), f"{item['bytes']:,}")
        console.print(big)


def _judgement(console: Console, verdict: Verdict) -> None:
    """FITS or OUT OF MEMORY, by how much, and the largest length and batch that fit."""
    if verdict.fits:
        console.print(Text(f"FITS: peak {format_bytes(verdict.peak_bytes)} within the budget of "
                           f"{format_bytes(verdict.budget_bytes)} ({verdict.budget_source}), "
                           f"{format_bytes(verdict.budget_bytes - verdict.peak_bytes)} to spare.", style="status.pass"))
    else:
        console.print(Text(f"OUT OF MEMORY: peak {format_bytes(verdict.peak_bytes)} exceeds the budget of "
                           f"{format_bytes(verdict.budget_bytes)} ({verdict.budget_source}) by "
                           f"{format_bytes(verdict.peak_bytes - verdict.budget_bytes)}.", style="status.fail"))
        console.print(OOM_SYMPTOM)
    limits = _limits(verdict)
    if limits:
        console.print("; ".join(limits) + ".")


def _remedies_table(verdict: Verdict) -> Table:
    """Each remedy alone: the change, its peak, the ratio to today's, whether it fits."""
    title = ("Remedies: the peak under each one alone, and the best combination" if verdict.traced is None else
             "Remedies: the peak under each one alone (derived from the trace, or traced again)")
    rem = Table(title=title, title_justify="left", show_edge=False)
    rem.add_column("remedy", overflow="fold")
    rem.add_column("change", overflow="fold")
    rem.add_column("peak", justify="right", no_wrap=True, min_width=9)
    rem.add_column("x now", justify="right", no_wrap=True)
    rem.add_column("fits", no_wrap=True)
    for r in verdict.remedies:
        ratio = r.peak_bytes / verdict.peak_bytes if verdict.peak_bytes else 1.0
        rem.add_row(r.name, r.change + (" (changes what is trained)" if r.changes_training else ""),
                    format_bytes(r.peak_bytes), f"{ratio:.2f}",
                    Text("yes", style="status.pass") if r.fits else Text("no", style="status.fail"))
    return rem


def _header(console: Console, verdict: Verdict) -> None:
    """What was estimated or traced: the model, the shape, and for a trace the attention kernel it ran."""
    est, traced = verdict.estimate, verdict.traced
    if traced is None:
        console.print(Text(f"tfdoctor memory (analytic): {est.config.describe()}", style="head"))
        console.print(f"{est.parameter_count:,} parameters", style="dim")
        return
    console.print(Text(f"tfdoctor memory (traced): {clean(traced['target'])} at batch {traced['batch']} x seq "
                       f"{traced['seq']}, {traced['dtype']}, optimizer {traced['optimizer']}", style="head"))
    console.print(f"{traced['parameter_count']:,} parameters, {traced['ops']:,} ops traced in "
                  f"{traced['seconds']:.1f} s", style="dim")
    if traced.get("attention"):
        console.print(describe_kernels(traced["attention"]), style="dim")
    for note in traced.get("notes") or []:  # per device under sharding, what was not traced
        console.print(f"note: {clean(note)}", style="dim")


def _peak_where(verdict: Verdict) -> str:
    if verdict.traced is not None:
        t = verdict.traced
        parts = [t["peak_phase"], f"op {t['peak_op']}"]
        if t["peak_node"]:
            parts.append(f"in {t['peak_node']}")
        if t["peak_module"]:
            parts.append(f"of {t['peak_module']}")
        return clean(", ".join(parts))
    return f"{verdict.estimate.peak_phase}, {verdict.estimate.peak_op}"


def describe_kernels(summary: dict[str, Any]) -> str:
    """One line: the attention kernel the trace assumed, on which device and why (memory/kernels.py)."""
    where = f"attention on {summary['device']}" + (
        " (CUDA's choice on an sm80+ GPU, emulated)" if summary.get("emulated") else "")
    if not summary["sdpa_calls"]:
        return f"{where}: no F.scaled_dot_product_attention call, the model's own ops were traced; {summary['why']}"
    kernels = ", ".join(f"{k['kernel']} in {k['calls']} of {summary['sdpa_calls']} SDPA calls" +
                        (f" ({k['reason']})" if k["reason"] else "") for k in summary["kernels"])
    return f"{where}: {kernels}; {summary['why']}"


def _count(value: int) -> str:
    return f"{value:,}" if value else "none (not even 1)"


def _limits(verdict: Verdict) -> list[str]:
    """The largest length and batch that fit, each only where it was worked out (a traced length is
    not derived where T equals the head size and no remedy was asked for)."""
    lines = []
    if verdict.largest_seq is not None:
        positions = (verdict.traced or {}).get("max_positions")
        cap = " (the model's maximum positions)" if positions and verdict.largest_seq == positions else ""
        lines.append(f"Largest sequence length that fits: {_count(verdict.largest_seq)}{cap}")
    if verdict.largest_batch is not None:
        lines.append(f"{'largest' if lines else 'Largest'} batch that fits: {_count(verdict.largest_batch)}")
    return lines


def render_html(verdict: Verdict, out: TextIO, width: int | None = None) -> None:
    """The page report/html.py draws from the JSON document, with its heading and notes."""
    from tfdoctor.report.html import render as render_page

    render_page({**to_dict(verdict), "heading": _heading(verdict),
                 "notes": [MODEL_NOTE, ANALYTIC_NOTE if verdict.traced is None else TRACED_NOTE]}, out, width)


def _heading(verdict: Verdict) -> str:
    if verdict.traced is None:
        return f"tfdoctor memory (analytic): {verdict.estimate.config.describe()}"
    traced = verdict.traced
    return (f"tfdoctor memory (traced): {clean(traced['target'])} at batch {traced['batch']} x seq {traced['seq']}, "
            f"{traced['dtype']}, optimizer {traced['optimizer']}")
