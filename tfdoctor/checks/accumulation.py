"""Accumulation judges: how the loop's micro-batches add up to an optimizer step. The loss divided
by the number of micro-batches (accumulation-scaling), every token of a step weighed alike
(token-weighting), gradients cleared between steps (zero-grad), the scheduler stepped once per
optimizer step (scheduler-placement). Each judges the one recorded trace of the loop, handed in by
the runner; the measures on it are in tfdoctor/recording/windows.py.
"""

from __future__ import annotations

import math

from tfdoctor.recording.windows import (
    backward_window,
    micro_batch_weights,
    micro_batches,
    no_scores,
    optimizer_families,
    step_norms,
    stepped,
    window_weights,
    wiped_steps,
)
from tfdoctor.registry import check
from tfdoctor.result import Result, counted
from tfdoctor.tasks import for_classifiers

# accumulation-scaling: the step's summed token weight must be 1 (the mean) within float rounding;
# the bug it catches is off by the accumulation factor k >= 2. A factor past sqrt(k) (or below
# 1/sqrt(k)) is nearer the k-fold bug than the mean and fails; one in between warns (a normaliser
# that counts other tokens than the trained ones).
ACCUM_TOLERANCE = 0.05

# token-weighting: micro-batches whose tokens' mean gradient weight differ by more than this share
# are weighed unequally. Weights read from the gradient at the scores agree to ~1e-5 relative; the
# bias it catches is the micro-batches' token-count ratio (about 1.7x on the batches fed).
TOKEN_WEIGHT_TOLERANCE = 0.02

# scheduler-placement: once per optimizer step is 1 scheduler step per step; the bug is k >= 2
# (once per micro-batch), so anything above 1.5 is the schedule running ahead.
SCHED_MAX_PER_STEP = 1.5


# Update rules that divide the gradient's scale out of the step (Adam's second moment, Muon's
# orthogonalisation): for them a k-fold gradient is not a k-fold rate.
SCALE_FREE = {"adam", "muon"}


def scale_effect(trace, factor: float) -> str:
    """What a gradient `factor` times the mean does under the optimizer the loop stepped: a rate that
    many times the one set for SGD; for Adam and Muon, which divide the scale out, the damage goes
    through the clip threshold, eps and the balance with weight decay."""
    families = optimizer_families(trace)
    if families and families <= {"sgd", "manual"}:
        return f"under SGD that makes the effective learning rate {factor:.2f}x what you set"
    if not families or not families <= SCALE_FREE:
        return (f"under SGD that is a {factor:.2f}x learning rate; an adaptive optimizer (Adam) divides the "
                "scale out, except through the clip threshold and eps")
    names = "/".join(sorted({o.class_name for o in trace.optimizers}))
    clips = trace.of("clip")
    limit = clips[0].data.get("limit") if clips else None
    clip = (f"clip_grad_norm_(max_norm={limit:g}) measures norms {factor:.2f}x the true ones, so it cuts steps "
            f"whose real norm is only {limit / factor:.3g}" if limit and factor > 1 else
            f"clip_grad_norm_(max_norm={limit:g}) measures norms {factor:.2f}x the true ones, so it cuts steps "
            "later than it should" if limit else "")
    return (f"{names} divides the gradient's scale out of its update, so the rate is not {factor:.2f}x; the "
            f"damage goes elsewhere: " + (clip + ", " if clip else "") +
            f"eps weighs {1 / factor:.2f}x what you set against the gradient, and a gradient that changes "
            "scale mid-run (another k, a last short window) moves the update until Adam's moments catch up")


@check("accumulation-scaling", title="Accumulated losses are divided by the number of micro-batches",
       located=("backward",))
def accumulation_scaling(subject, trace) -> Result:
    """Catches gradient accumulation that forgets to divide the loss by the number of accumulated
    micro-batches: the gradients add up to k times the batch mean, which for plain SGD is k times the
    learning rate you set (with Adam, which divides the scale out, it makes a clip threshold bite k
    times as often and shifts the balance against weight decay and eps).

    With k backward calls per optimizer step (k > 1), the tokens of a step must weigh 1 in total (the
    mean), times the GradScaler's scale when one is enabled. Each token's weight is read from the
    gradient that reached the model's scores, so it holds for any loss (cross-entropy, label smoothing
    through KLDivLoss, a hand-written or library loss; mean, sum or per-token). A first window of
    another size (`if step % k == 0` steps after the very first micro-batch) is named with its factor.

    Fix: `(loss / k).backward()` (or divide by the step's total token count); `if (step + 1) % k ==
    0: optimizer.step()`.
    """
    reason = stepped(trace)
    if reason:
        return Result.skipped(reason)
    k, per_window = micro_batches(trace)
    if k <= 1:
        return Result.skipped("one backward per optimizer step: the loop does not accumulate gradients")
    weights = window_weights(trace)
    even = {w: weights[w] for w, n in per_window.items() if n == k and w in weights}
    if not even:
        return Result.skipped(no_scores(trace, subject))
    wiped = getattr(trace, "grad_rescale", {})
    if all(wiped.get(w) == 0 for w in even):  # a factor of 0 here is zero-grad's finding, not a division
        return Result.skipped("every judged step ran on gradients cleared after the backward (zero_grad() or "
                              "`.grad = None` before the step, see zero-grad): no accumulated gradient reached "
                              "it to weigh", {"grad_rescale": {w: 0.0 for w in sorted(even)}})
    factor = sum(even.values()) / len(even)
    sizes = [per_window.get(w, 0) for w in range(trace.steps)]
    # Windows of another size than k, except a shorter last one (the data ran out before the k-th).
    uneven = [{"window": w, "micro_batches": n, "gradient_factor": weights.get(w)}
              for w, n in per_window.items() if n != k and not (w == trace.steps - 1 and n < k)]
    window = min(even)
    backwards = backward_window(trace)
    sent = [e.data["value"] for e in trace.of("backward") if e.window == window]
    losses = [e.data["value"] for e in trace.training_losses()
              if e.data["backward"] in backwards and backwards[e.data["backward"]][0] == window]
    details = {"micro_batches_per_step": k, "gradient_factor": factor, "steps_judged": len(even),
               "window_sizes": sizes, "uneven_windows": uneven, "backward_values": sent, "loss_values": losses,
               "scale": next((e.data["scale"] for e in trace.of("backward") if e.data["scale"]), None)}
    first = uneven[0] if uneven and uneven[0]["window"] == 0 else None
    if first is not None and first["micro_batches"] < k:
        at = (f"the first optimizer step came after {first['micro_batches']} micro-batch"
              f"{'es' if first['micro_batches'] > 1 else ''} instead of {k} (`if step % {k} == 0` is true at step 0)")
    elif uneven:
        at = (f"optimizer steps came after unequal numbers of micro-batches ({', '.join(map(str, sizes[:8]))}"
              f"{', ...' if len(sizes) > 8 else ''}) instead of {k} each")
    else:
        at = ""
    if at and uneven[0]["gradient_factor"] is not None:
        at += f", with {uneven[0]['gradient_factor']:.2f}x the mean gradient"
    rescaled = [trace.grad_rescale[w] for w in sorted(even) if w in getattr(trace, "grad_rescale", {})]
    details["grad_rescale"] = {w: trace.grad_rescale[w] for w in sorted(even) if w in trace.grad_rescale} or None
    how = (f"; the loop rescales the accumulated gradients by {rescaled[0]:.3g} before the step"
           if rescaled else "")
    if abs(factor - 1.0) <= ACCUM_TOLERANCE:
        summary = (f"{k} micro-batches per step: the gradient reaching the optimizer step is the mean over "
                   f"the step's tokens ({factor:.2f}x){how}")
        if not at:
            return Result.passed(summary, details)
        return Result.warned(f"{at}; the other steps are right ({summary})",
                             f"step after every k-th micro-batch: if (step + 1) % {k} == 0: optimizer.step()",
                             details)
    if 1 / math.sqrt(k) < factor < math.sqrt(k) and not at:
        return Result.warned(
            f"{k} micro-batches per step: the gradient reaching the optimizer step is {factor:.2f}x the mean over "
            f"the step's tokens{how}: not the {k}-fold accumulation bug, but the loss is normalised by another "
            "count than the trained tokens", "divide the summed token loss by the number of trained (non-pad) "
            "target tokens of the whole step", details)
    if factor > 1:
        problem = (f"the {k} micro-batches per optimizer step each send {factor / k:.2f}x their loss to "
                   f"backward: the accumulated gradient is {factor:.2f}x the mean; {scale_effect(trace, factor)}")
    else:
        problem = (f"the {k} micro-batches per optimizer step send {factor / k:.3f}x their loss to backward: "
                   f"the accumulated gradient is {factor:.2f}x the mean (divided more than once); "
                   f"{scale_effect(trace, factor)}")
    hint = f"divide before backward: (loss / {k}).backward(), or with a scaler scaler.scale(loss / {k}).backward()"
    if at:
        problem += f"; also, {at}"
        hint += f"; and step after every k-th micro-batch: if (step + 1) % {k} == 0"
    return Result.failed(problem, hint, details)


@check("token-weighting", title="Every trained token weighs the same within an optimizer step",
       needs=("pad_id",), located=("loss", "backward"), tasks=("lm", "token-classification"),
       skip_reasons=for_classifiers("one label per row: every row weighs the same whatever its padding"))
def token_weighting(subject, trace) -> Result:
    """Catches gradient accumulation that averages each micro-batch over its own tokens and then
    divides by k: with padding, micro-batches hold different numbers of real tokens, so a token in a
    short micro-batch weighs more than one in a long one and the step is not the mean over its tokens
    (transformers#34191, fixed there with num_items_in_batch). It biases, it does not break: a
    warning (a failure with --strict).

    The batches fed to the loop alternate long and short real lengths, so consecutive micro-batches
    differ in token count. Each trained token's weight in the update is read from the gradient that
    reached the model's scores (any loss), and within every optimizer step the mean weight of each
    micro-batch's tokens is compared. Token-summed losses divided by the step's total token count
    (num_items_in_batch, torchtune's scale_grads after backward) pass.

    Fix: sum the token losses and divide by the trained tokens of the whole step:
    loss = F.cross_entropy(..., reduction="sum") / num_tokens_in_step.
    """
    reason = stepped(trace)
    if reason:
        return Result.skipped(reason)
    k, _ = micro_batches(trace)
    if k <= 1:
        return Result.skipped("one backward per optimizer step: tokens are weighed within one batch")
    windows = {w: m for w, m in micro_batch_weights(trace).items() if len(m) > 1}
    if not windows:
        return Result.skipped(no_scores(trace, subject))

    def spread(micro: list[dict]) -> float:
        return max(m["mean"] for m in micro) / min(m["mean"] for m in micro)

    def token_spread(micro: list[dict]) -> float:
        return max(m["tokens"] for m in micro) / min(m["tokens"] for m in micro)

    worst = max(windows, key=lambda w: spread(windows[w]))
    micro = windows[worst]
    ratio = spread(micro)
    details = {"micro_batches_per_step": k, "steps_judged": len(windows), "weight_ratio": ratio,
               "window": worst, "tokens_per_micro_batch": [m["tokens"] for m in micro],
               "mean_weight_per_micro_batch": [m["mean"] for m in micro],
               "within_micro_batch_ratio": max(m["max"] / m["min"] for m in micro),
               "token_count_ratio": token_spread(micro)}
    if ratio <= 1 + TOKEN_WEIGHT_TOLERANCE:
        if max(token_spread(m) for m in windows.values()) <= 1 + TOKEN_WEIGHT_TOLERANCE:
            return Result.skipped("the micro-batches of each step held the same number of trained tokens, so "
                                  "their weighting cannot be told apart", details)
        return Result.passed(
            f"in {len(windows)} optimizer steps of {k} micro-batches ({min(details['tokens_per_micro_batch'])}.."
            f"{max(details['tokens_per_micro_batch'])} trained tokens each) every token weighs the same "
            f"(largest spread {ratio:.3f}x)", details)
    light = min(micro, key=lambda m: m["mean"])
    heavy = max(micro, key=lambda m: m["mean"])
    return Result.warned(
        f"within optimizer step {worst + 1}, tokens of the micro-batch with {heavy['tokens']} trained tokens weigh "
        f"{ratio:.1f}x those of the one with {light['tokens']}: each micro-batch is averaged over its own tokens "
        f"and the {k} means are weighed alike, so short micro-batches count more per token",
        "normalise by the whole step's token count: loss = F.cross_entropy(..., reduction='sum') / "
        "num_tokens_in_step (count the trained targets of the k micro-batches first, as the Hugging Face "
        "Trainer's num_items_in_batch), or backward the summed loss and scale the gradients by "
        "1 / num_tokens_in_step before the step", details)


@check("scheduler-placement", title="The LR scheduler steps once per optimizer step",
       located=("sched_step",))
def scheduler_placement(subject, trace) -> Result:
    """Catches `scheduler.step()` placed outside the accumulation `if`: it then steps once per
    micro-batch, so the schedule runs k times faster than the optimizer (a warm-up meant for 4000
    updates is over after 1000, and the decay ends early).

    Counts the loop's scheduler steps against its optimizer steps. Once per optimizer step, or once
    per epoch, passes.

    Fix: step the scheduler inside the accumulation `if`, after `optimizer.step()`.
    """
    reason = stepped(trace)
    if reason:
        return Result.skipped(reason)
    sched = trace.of("sched_step")
    if not sched:
        return Result.skipped("the loop uses no LR scheduler")
    steps = max(trace.steps, len(trace.of("scaler_step")))
    k, _ = micro_batches(trace)
    rate = len(sched) / steps
    details = {"scheduler_steps": len(sched), "optimizer_steps": steps, "micro_batches_per_step": k,
               "schedulers": sorted({e.data["name"] for e in sched})}
    if rate <= SCHED_MAX_PER_STEP:
        if len(sched) == steps - 1:  # a script stopped inside its last step never reached that step's call
            return Result.passed(f"scheduler stepped once per optimizer step ({counted(len(sched), 'scheduler step')} "
                                 f"for {counted(steps, 'optimizer step')}: the last one's scheduler.step() was not "
                                 "reached)", details)
        times = "once" if len(sched) == 1 else f"{len(sched)} times"
        return Result.passed(f"scheduler stepped {times} for {counted(steps, 'optimizer step')}", details)
    return Result.failed(
        f"scheduler.step() ran {len(sched)} times for {steps} optimizer steps ({rate:.1f} per step, once "
        f"per micro-batch): the schedule runs {rate:.1f}x fast, so warm-up ends after 1/{rate:.0f} of "
        "its intended updates",
        "move scheduler.step() inside the accumulation `if`, right after optimizer.step()", details)


@check("zero-grad", title="Gradients are cleared between optimizer steps",
       located=("opt_step", "backward"))
def zero_grad(subject, trace) -> Result:
    """Catches a loop that never clears gradients (no `optimizer.zero_grad()` / `model.zero_grad()`):
    `backward` adds into `.grad`, so every update also re-applies the gradients of all earlier
    batches and the steps grow without bound.

    Checks, at the first backward after each optimizer step, whether the gradients left by that step
    were cleared (set to None or zero), however the loop clears them. Judged on the parameters the
    optimizers update (a loop with no optimizer object: all of them, its own update step counting).

    Also fails a loop that clears them too early: an optimizer step handed all-zero or missing
    gradients while the backward before it had produced non-zero ones (`zero_grad()` moved between
    `backward()` and `step()`), so every update is empty.

    Fix: `optimizer.zero_grad(set_to_none=True)` after each step.
    """
    reason = stepped(trace)
    if reason:
        return Result.skipped(reason)
    firsts = {}
    for event in trace.of("backward"):
        if event.window >= 1 and event.window not in firsts:
            firsts[event.window] = event.data["grads_clear"]
    if not firsts:
        return Result.skipped("no backward after the first optimizer step; pass --train-batches N to feed more")
    stale = [w for w, clear in firsts.items() if not clear]
    norms = [norm for _, norm, _ in step_norms(trace)]
    details = {"steps_checked": len(firsts), "steps_not_cleared": len(stale),
               "zero_grad_calls": len(trace.of("zero_grad")), "grad_norm_at_step": norms}
    wiped = wiped_steps(trace)
    if wiped:
        details["steps_on_wiped_gradients"] = [w["step"] for w in wiped]
        return Result.failed(
            f"{len(wiped)} of {len(norms)} optimizer steps ran on all-zero or missing gradients although the "
            "backward before each had produced non-zero ones: they were cleared between backward() and the "
            "step (zero_grad() or `.grad = None` in between), so the weights never learn",
            "call optimizer.zero_grad(set_to_none=True) after optimizer.step() (or before the backward), "
            "never between backward() and step()", {**details, "location": wiped[0]["where"], "call": wiped[0]["call"]})
    if not stale:
        return Result.passed("gradients cleared after the optimizer step" if len(firsts) == 1 else
                             f"gradients cleared after each of {len(firsts)} optimizer steps", details)
    return Result.failed(
        f"gradients were not cleared after {len(stale)} of {len(firsts)} optimizer steps "
        f"(zero_grad called {details['zero_grad_calls']} times): each update re-applies every earlier "
        "batch's gradient",
        "call optimizer.zero_grad(set_to_none=True) right after optimizer.step()", details)
