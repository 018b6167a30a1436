"""The `memory` check: does one training step at the user's training shape fit the budget?

Torch is imported inside the check, so `tfdoctor checks` stays torch-free.
"""

from __future__ import annotations

from tfdoctor.context import current, progress
from tfdoctor.registry import check
from tfdoctor.result import Result


@check("memory", title="One training step fits in memory")
def memory(subject) -> Result:
    """Peak memory of one training step at --train-batch x --train-seq, traced on fake tensors, against --budget.

    Why: a step that does not fit is killed by the kernel (exit code 137) with no traceback, usually after
    the model, the data and the first layers have run fine; the [B, nh, T, T] attention scores and the
    [B, T, V] logits grow much faster than anything else. The trace allocates nothing, so a model that
    would need 60 GiB is measured on a laptop.

    Fix: the cheapest remedy the check names (micro-batches with gradient accumulation, mixed
    precision, activation checkpointing, fused attention, shorter sequences); `tfdoctor memory TARGET
    --batch B --seq T` prints the full table.
    """
    options = current().options
    batch, seq = options.get("train_batch"), options.get("train_seq")
    if batch is None or seq is None:
        return Result.skipped("needs --train-batch and --train-seq (the training shape to trace)")
    from tfdoctor.memory.budget import resolve_budget
    from tfdoctor.memory.sizes import format_bytes
    from tfdoctor.memory.traced_judge import judge_traced

    budget, source = resolve_budget(options.get("budget"))
    target = type(subject.model).__name__
    # The remedies are derived from the one trace of the step, and only when one is needed.
    verdict = judge_traced(subject, target, batch, seq, budget, source, remedies_if_fits=False, progress=progress)
    trace = verdict.traced
    details = {
        "peak_bytes": verdict.peak_bytes, "budget_bytes": budget, "budget_source": source, "fits": verdict.fits,
        "batch": batch, "seq": seq, "peak_phase": trace["peak_phase"], "peak_op": trace["peak_op"],
        "peak_node": trace["peak_node"], "peak_module": trace["peak_module"],
        "attention_scores_bytes": trace["attention_scores_bytes"], "logits_bytes": trace["logits_bytes"],
        "attention": trace.get("attention"), "notes": trace["notes"],
        "breakdown": trace["peak_breakdown"], "kept_by_module": trace["kept_by_module"][:6],
        "remedies": [r.to_dict() for r in verdict.remedies],
        "largest_seq_that_fits": verdict.largest_seq, "largest_batch_that_fits": verdict.largest_batch,
    }
    where = trace["peak_phase"] + (f" ({trace['peak_node']} of {trace['peak_module']})"
                                   if trace["peak_node"] and trace["peak_module"] else "")
    seen = (f"peak {format_bytes(verdict.peak_bytes)} at batch {batch} x seq {seq}, in {where}, "
            f"against a budget of {format_bytes(budget)}")
    if verdict.fits:
        return Result.passed(f"{seen}: fits with {format_bytes(budget - verdict.peak_bytes)} to spare", details)
    fitting = [r for r in verdict.remedies if r.fits and not r.changes_training]
    if fitting:
        best = min(fitting, key=lambda r: r.peak_bytes)
        hint = (f"{best.name}: {best.change}, peak {format_bytes(best.peak_bytes)}; "
                f"`tfdoctor memory TARGET --batch {batch} --seq {seq}` lists every remedy")
    elif not verdict.largest_seq and not verdict.largest_batch:
        hint = (f"neither batch 1 at seq {seq} nor batch {batch} at the shortest sequence fits: combine remedies "
                "(see `tfdoctor memory`), and where the weights, gradients and optimizer states alone exceed "
                "the budget, shard them (ZeRO/FSDP) or use a device with more memory")
    else:
        known = [f"the largest {what} that fits is {value}" for what, value in
                 (("sequence", verdict.largest_seq), ("batch", verdict.largest_batch)) if value is not None]
        hint = "no single remedy fits; " + ", ".join(known) + ("; " if known else "") + \
            "combine remedies (see `tfdoctor memory`)"
    return Result.failed(f"{seen}: out of memory by {format_bytes(verdict.peak_bytes - budget)}; "
                         "the process would be killed with exit code 137", hint, details)
