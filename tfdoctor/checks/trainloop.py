"""Training-loop checks: run the user's own `train(model, batches)` once and judge what it did.

The loop runs on a deep copy of the model, fed random token batches, while tfdoctor records its
calls (see tfdoctor/probes/trace.py). Every check here judges that one shared trace, so the verdicts
do not depend on variable names or code layout, only on what the loop really called.
"""

from __future__ import annotations

import math
from collections import Counter

from tfdoctor.registry import check
from tfdoctor.result import Result

# Batches fed to the loop: two optimizer steps at accumulation 8, the most common large setting.
DEFAULT_TRAIN_BATCHES = 16

# objective: the offsets tried between a scored position and the input token it is graded on, and
# the share of graded positions an offset must explain. On random tokens the right offset matches
# every position and a wrong one about 1/V of them, so 0.9 leaves room only for coincidences.
OFFSETS = (-1, 0, 1, 2, 3)
ALIGN_MIN_SHARE = 0.9

# ignore-index: pad targets must get no weight at all; anything above rounding is padding graded.
PAD_WEIGHT_TOLERANCE = 1e-6

# accumulation-scaling: the step's summed token weight must be 1 (the mean) within float rounding;
# the bug it catches is off by the accumulation factor k >= 2.
ACCUM_TOLERANCE = 0.05

# scheduler-placement: once per optimizer step is 1 scheduler step per step; the bug is k >= 2
# (once per micro-batch), so anything above 1.5 is the schedule running ahead.
SCHED_MAX_PER_STEP = 1.5

# lr-schedule: the peak learning rates Transformers train at with Adam-family optimizers run from
# about 1e-5 (fine-tuning large models) to about 3e-3 (small models pre-training); a peak 10x outside
# that range fails. The Noam schedule left on Adam's default lr=1e-3 peaks near 7e-7.
LR_FAIL_LOW = 1e-6
LR_FAIL_HIGH = 3e-2
# A schedule whose first step runs at more than half its peak has no warm-up to speak of.
WARMUP_START_SHARE = 0.5

# grad-health: a pre-clip norm that rose at every step over at least this many steps, to at least
# twice its start, is noted as growing steadily (the sign of a learning rate set too high).
GROWTH_MIN_STEPS = 6
GROWTH_FACTOR = 2.0

# overfit-batch with the user's loop (used by tfdoctor.checks.learning.overfit_batch): the same
# batch is fed this many times, and the next-token loss on it must fall to this share of its start.
# Measured on the fixture GPT: working loops at peak lr 3e-4..1e-3 (warm-up 10..100 steps, with or
# without accumulation) cut it by 14% to 60%; the Noam-on-default-lr loop (rates ~1e-6) and the
# identity objective move it by less than 0.1%. A loop whose warm-up is much longer than 160 batches
# may not move it enough: the message says so.
OVERFIT_LOOP_BATCHES = 160
OVERFIT_LOOP_MAX_SHARE = 0.9

_NO_STEP = ("the loop never called optimizer.step() on the {n} batches it was given; "
            "pass --train-batches N to feed it more")


def _trace(subject):
    """The one recorded run of the user's loop, shared by every check of the run.

    A loop that raises is recorded once; every check then re-raises the user's exception, which the
    runner reports as that check's error."""
    from tfdoctor.context import current, memo, progress

    def record():
        import torch

        from tfdoctor.probes.batches import train_batches
        from tfdoctor.probes.trace import record_loop

        count = int(current().options.get("train_batches") or DEFAULT_TRAIN_BATCHES)
        batches = train_batches(subject, count, torch.Generator().manual_seed(current().seed + 5))
        advance = progress("training loop", count)
        trace = record_loop(subject, batches, advance)
        advance(max(0, count - trace.batches_fed))
        return trace

    return memo(("train-trace", id(subject.model), subject.train), record)


def _stepped(trace) -> str | None:
    if trace.batches_fed == 0:
        return "the loop never iterated over the batches it was given"
    if trace.steps == 0 and not trace.of("scaler_step"):
        return _NO_STEP.format(n=trace.batches_fed)
    return None


def _micro_batches(trace) -> tuple[int, dict[int, int]]:
    """Backward calls per optimizer-step window, and the most common count (the accumulation k)."""
    per_window = Counter(e.window for e in trace.of("backward") if e.window < trace.steps)
    if not per_window:
        return 0, {}
    return Counter(per_window.values()).most_common(1)[0][0], dict(per_window)


def _token_weights(loss: dict):
    """The weight each scored token had in the gradient the loop's backward produced.

    The gradient hook on the loss output gives d(backward root)/d(loss): a scalar for mean and sum
    reductions (spread over the non-ignored targets), one value per token for reduction='none'."""
    import torch

    grad, targets = loss["grad"], loss["targets"]
    valid = (targets != loss["ignore_index"]).float()
    if grad.numel() == targets.numel() and loss["reduction"] == "none":
        return grad * valid
    if loss["reduction"] == "sum":
        return grad.sum() * valid
    return grad.sum() * valid / max(1.0, float(valid.sum())) if valid.sum() > 0 else torch.zeros_like(valid)


def _scaled_clips(trace) -> list[tuple]:
    """(clip event, scale) for every clip that ran on gradients a GradScaler had scaled but not yet
    unscaled. Judged on the order of calls, whether or not the scaler is enabled on this device."""
    found, scaled, scale = [], False, None
    for event in trace.events:
        if event.kind == "backward" and event.data["scaled"]:
            scaled, scale = True, event.data["scale"]
        elif event.kind in ("unscale", "opt_step", "scaler_update"):
            scaled = False
        elif event.kind == "clip" and scaled:
            found.append((event, scale))
    return found


def _order(trace, window: int) -> str:
    """The calls of one optimizer-step window in order, repeats collapsed: 'scale -> backward x4 -> ...'."""
    names = {"scale": "scale", "backward": "backward", "unscale": "unscale_", "clip": "clip",
             "scaler_step": "scaler.step", "opt_step": "optimizer.step", "scaler_update": "update"}
    seen: list[list] = []
    for event in trace.events:
        if event.window != window or event.kind not in names:
            continue
        if event.kind == "opt_step" and event.data.get("in_scaler"):
            continue
        if (event.kind == "unscale" and event.data.get("internal")) or event.kind == "scale":
            continue
        name = "scale().backward" if event.kind == "backward" and event.data["scaled"] else names[event.kind]
        if seen and seen[-1][0] == name:
            seen[-1][1] += 1
        else:
            seen.append([name, 1])
    return " -> ".join(name if n == 1 else f"{name} x{n}" for name, n in seen)


# ------------------------------------------------------------------------------------------------


def _alignment(trace, subject) -> tuple[dict[int, int], int]:
    """Over the scored rows that could be traced back to a model position: for each offset k, how
    many targets equal the input token at position t + k; and how many rows were judged."""
    import torch

    matches = {k: 0 for k in OFFSETS}
    judged = {k: 0 for k in OFFSETS}
    forwards = {e.data["index"]: e.data for e in trace.of("forward")}
    rows = 0
    for event in trace.training_losses():
        loss = event.data
        forward = forwards.get(loss["forward"])
        if "positions" not in loss or forward is None:
            continue
        B, T = loss["logits_shape"][:2]
        shaped = [(key, ids) for key, ids in forward["inputs"] if tuple(ids.shape) == (B, T)]
        preferred = ("decoder_input_ids", "input_ids") if subject.kind == "seq2seq" else ("input_ids",)
        named = [ids for key, ids in shaped if key in preferred]
        if named:
            ids = named[0]
        elif shaped:
            ids = shaped[-1][1] if subject.kind == "seq2seq" else shaped[0][1]
        else:
            continue
        ids = ids.cpu()
        positions, targets = loss["positions"], loss["targets"]
        keep = (positions >= 0) & (targets >= 0) & (targets != loss["ignore_index"])
        if subject.pad_id is not None:
            keep &= targets != subject.pad_id
        positions, targets = positions[keep], targets[keep]
        rows += int(keep.sum())
        b, t = positions // T, positions % T
        for k in OFFSETS:
            inside = (t + k >= 0) & (t + k < T)
            judged[k] += int(inside.sum())
            source = ids[b[inside], (t + k)[inside]]
            matches[k] += int((source == targets[inside]).sum())
    shares = {k: matches[k] / judged[k] for k in OFFSETS if judged[k]}
    return shares, rows


@check("objective", title="Targets are the next input token (no identity, no double shift)",
       kinds=("causal", "seq2seq"), needs=("train",),
       skip_reasons={"encoder": "an encoder is graded on its own positions; the next-token alignment "
                                "does not apply"})
def objective(subject) -> Result:
    """Catches a loss graded on the wrong targets: the input itself (input == target, the loss
    collapses to near zero in the first epoch and means nothing) or labels shifted twice (a library
    model given `labels=` shifts them itself, so pre-shifted labels ask for the token after next).

    Runs the loop and, for every logits row the loss scored, finds the model position it came from
    and compares the target with the input tokens around it. The target for position t must be input
    token t+1; the offset found is reported. Ignored targets (-100, padding) are left out. The loss
    is traced wherever it is computed, also inside a Hugging Face model's own forward.
    """
    trace = _trace(subject)
    shares, rows = _alignment(trace, subject)
    if not rows:
        return Result.skipped("no F.cross_entropy / nll_loss call that reached backward scored the "
                              "model's logits; cannot tell which token each position was graded on")
    best = max(shares, key=shares.get)
    details = {"offset": best if shares[best] >= ALIGN_MIN_SHARE else None, "graded_positions": rows,
               "share_by_offset": {f"{k:+d}": round(v, 4) for k, v in shares.items()}}
    seen = f"the target matched input token t{best:+d} at {shares[best]:.0%} of {rows} graded positions"
    if shares[best] < ALIGN_MIN_SHARE:
        return Result.warned(
            f"the loss targets do not line up with the model's inputs at any offset from {OFFSETS[0]:+d} "
            f"to {OFFSETS[-1]:+d} (best: t{best:+d} at {shares[best]:.0%} of {rows} positions)",
            "for language modelling the targets are the inputs shifted by one: "
            "logits = model(ids[:, :-1]); loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())",
            details)
    if best == 1:
        return Result.passed(f"targets are the next input token (offset +1) at {shares[best]:.0%} of "
                             f"{rows} graded positions", details)
    if best == 0:
        return Result.failed(
            f"each position is graded on the token it was given ({seen}): the model only learns to copy "
            "its input, and a loss near zero means nothing",
            "shift by one: logits = model(ids[:, :-1]); targets = ids[:, 1:]", details)
    if best >= 2:
        return Result.failed(
            f"targets are shifted {best} positions ({seen}): position t is graded on token t{best:+d}, "
            "so the labels were shifted twice (a model given labels= shifts them itself)",
            "shift once: give a Hugging Face model labels=input_ids unshifted (it shifts them), or "
            "shift yourself and compute the loss on the returned logits", details)
    return Result.failed(
        f"each position is graded on the token before it ({seen}): targets run the wrong way",
        "targets are the inputs shifted left by one: targets = ids[:, 1:], inputs = ids[:, :-1]", details)


@check("ignore-index", title="Padding targets are left out of the loss", needs=("train", "pad_id"))
def ignore_index(subject) -> Result:
    """Catches a loss that grades padding: pad targets that are neither given `ignore_index=pad_id`
    nor replaced by the ignore value (-100), so part of every update teaches the model to predict
    padding.

    Runs the loop on batches padded at the end with pad_id and measures, from the gradient each
    target really received, the share of the trained loss that comes from pad targets.
    """
    trace = _trace(subject)
    losses = [e.data for e in trace.training_losses() if "targets" in e.data]
    if not losses:
        return Result.skipped("no F.cross_entropy / nll_loss call reached backward; cannot see the targets")
    pad_weight = total_weight = pad_loss = total_loss = 0.0
    pad_targets = graded = 0
    ignore_values = sorted({loss["ignore_index"] for loss in losses})
    for loss in losses:
        weights = _token_weights(loss).abs()
        pad = loss["targets"] == subject.pad_id
        contribution = weights * loss["per_token"].abs()
        pad_weight += float(weights[pad].sum())
        total_weight += float(weights.sum())
        pad_loss += float(contribution[pad].sum())
        total_loss += float(contribution.sum())
        pad_targets += int(pad.sum())
        graded += int((weights > 0).sum())
    token_share = pad_weight / total_weight if total_weight else 0.0
    loss_share = pad_loss / total_loss if total_loss else 0.0
    details = {"pad_id": subject.pad_id, "ignore_index": ignore_values, "pad_targets": pad_targets,
               "graded_targets": graded, "pad_weight_share": token_share, "pad_loss_share": loss_share}
    if pad_targets == 0:
        return Result.passed("no target equal to pad_id reached the loss (padding was replaced by the "
                             "ignore value before it)", details)
    if token_share <= PAD_WEIGHT_TOLERANCE:
        return Result.passed(f"all {pad_targets} pad targets are ignored (ignore_index "
                             f"{', '.join(map(str, ignore_values))})", details)
    return Result.failed(
        f"the loss grades padding: pad targets (pad_id={subject.pad_id}) carry {token_share:.0%} of the "
        f"target weight and {loss_share:.0%} of the loss (ignore_index is "
        f"{', '.join(map(str, ignore_values))})",
        f"pass ignore_index={subject.pad_id} to F.cross_entropy / nn.CrossEntropyLoss, or replace pad "
        f"targets with -100: targets = targets.masked_fill(targets == {subject.pad_id}, -100)", details)


@check("unscale-before-clip", title="GradScaler gradients are unscaled before clipping", needs=("train",))
def unscale_before_clip(subject) -> Result:
    """Catches `clip_grad_norm_` on gradients a GradScaler has not unscaled: they are still multiplied
    by the loss scale (65536 at the start), so every batch looks like an outlier, the clip cuts every
    update to a sliver and the model barely moves.

    Judged on the order of calls (scale, backward, clip, unscale_), not on whether unscale_ appears:
    calling it after the clip is as wrong as never calling it. A GradScaler('cuda') disables itself on
    a machine without CUDA, but the order is the same, so the bug is caught there too.
    """
    trace = _trace(subject)
    scales = trace.of("scale")
    if not scales:
        return Result.skipped("the loop uses no GradScaler")
    clips = trace.of("clip")
    if not clips:
        return Result.skipped("the loop scales its loss but clips no gradients")
    bad = _scaled_clips(trace)
    bad_windows = sorted({event.window for event, _ in bad})
    windows = sorted({event.window for event in clips})
    first = scales[0].data
    scale = first["scale"] if first["enabled"] else first["init_scale"]
    details = {"clip_windows": len(windows), "clips_on_scaled_gradients": len(bad_windows),
               "order": _order(trace, (bad_windows or windows)[0]), "scaler_device": first["device"],
               "scaler_enabled_here": first["enabled"], "loss_scale": scale}
    if not bad:
        return Result.passed(f"gradients unscaled before every clip ({len(windows)} steps; order: "
                             f"{details['order']})", details)
    where = ("" if first["enabled"] else
             f" (GradScaler('{first['device']}') is disabled on this machine, so this run was unharmed; "
             "the order is wrong wherever it is enabled)")
    return Result.failed(
        f"clip ran on still-scaled gradients at {len(bad_windows)} of {len(windows)} steps (order: "
        f"{details['order']}): with a loss scale of {scale:.0f} the clip sees every batch as an outlier "
        f"and shrinks each update about {scale:.0f}-fold{where}",
        "call scaler.unscale_(optimizer) after the last backward and before "
        "torch.nn.utils.clip_grad_norm_(...); scaler.step(optimizer) then does not unscale again", details)


@check("accumulation-scaling", title="Accumulated losses are divided by the number of micro-batches",
       needs=("train",))
def accumulation_scaling(subject) -> Result:
    """Catches gradient accumulation that forgets to divide the loss by the number of accumulated
    micro-batches: the gradients add up to k times the batch mean, which for plain SGD is k times the
    learning rate you set (with Adam, which divides the scale out, it makes a clip threshold bite k
    times as often and shifts the balance against weight decay and eps).

    With k backward calls per optimizer step (k > 1), the tensor sent to backward must be the loss
    divided by k (times the GradScaler's scale when one is enabled). Measured from the gradient each
    loss call received, so it holds for mean, sum or per-token losses alike.
    """
    trace = _trace(subject)
    reason = _stepped(trace)
    if reason:
        return Result.skipped(reason)
    k, per_window = _micro_batches(trace)
    if k <= 1:
        return Result.skipped("one backward per optimizer step: the loop does not accumulate gradients")
    events = dict(enumerate(trace.events))
    totals: dict[int, float] = {}
    for event in trace.training_losses():
        backward = events.get(event.data["backward"]) if event.data["backward"] is not None else None
        if backward is None or backward.kind != "backward" or per_window.get(backward.window) != k:
            continue
        scale = backward.data["scale"] or 1.0
        totals[backward.window] = totals.get(backward.window, 0.0) + float(_token_weights(event.data).sum()) / scale
    if not totals:
        return Result.skipped("no F.cross_entropy / nll_loss call reached backward; cannot measure the "
                              "loss each micro-batch sent")
    factor = sum(totals.values()) / len(totals)
    window = min(totals)
    sent = [e.data["value"] for e in trace.of("backward") if e.window == window]
    losses = [e.data["value"] for e in trace.training_losses()
              if e.data["backward"] is not None and events[e.data["backward"]].window == window]
    details = {"micro_batches_per_step": k, "gradient_factor": factor, "steps_judged": len(totals),
               "backward_values": sent, "loss_values": losses,
               "scale": next((e.data["scale"] for e in trace.of("backward") if e.data["scale"]), None)}
    if abs(factor - 1.0) <= ACCUM_TOLERANCE:
        return Result.passed(f"{k} micro-batches per step, each loss divided by {k}: the step's gradient "
                             f"is the mean ({factor:.2f}x)", details)
    if factor > 1:
        problem = (f"the {k} micro-batches per optimizer step each send {factor / k:.2f}x their loss to "
                   f"backward: the accumulated gradient is {factor:.2f}x the mean, so the effective "
                   f"learning rate is {factor:.2f}x what you set")
    else:
        problem = (f"the {k} micro-batches per optimizer step send {factor / k:.3f}x their loss to backward: "
                   f"the accumulated gradient is {factor:.2f}x the mean (divided more than once), so "
                   f"the effective learning rate is {factor:.2f}x what you set")
    return Result.failed(problem, f"divide before backward: (loss / {k}).backward(), or with a scaler "
                                  f"scaler.scale(loss / {k}).backward()", details)


@check("scheduler-placement", title="The LR scheduler steps once per optimizer step", needs=("train",))
def scheduler_placement(subject) -> Result:
    """Catches `scheduler.step()` placed outside the accumulation `if`: it then steps once per
    micro-batch, so the schedule runs k times faster than the optimizer (a warm-up meant for 4000
    updates is over after 1000, and the decay ends early).

    Counts the loop's scheduler steps against its optimizer steps. Once per optimizer step, or once
    per epoch, passes.
    """
    trace = _trace(subject)
    reason = _stepped(trace)
    if reason:
        return Result.skipped(reason)
    sched = trace.of("sched_step")
    if not sched:
        return Result.skipped("the loop uses no LR scheduler")
    steps = max(trace.steps, len(trace.of("scaler_step")))
    k, _ = _micro_batches(trace)
    rate = len(sched) / steps
    details = {"scheduler_steps": len(sched), "optimizer_steps": steps, "micro_batches_per_step": k,
               "schedulers": sorted({e.data["name"] for e in sched})}
    if rate <= SCHED_MAX_PER_STEP:
        return Result.passed(f"scheduler stepped {len(sched)} times for {steps} optimizer steps", details)
    return Result.failed(
        f"scheduler.step() ran {len(sched)} times for {steps} optimizer steps ({rate:.1f} per step, once "
        f"per micro-batch): the schedule runs {rate:.1f}x fast, so warm-up ends after 1/{rate:.0f} of "
        "its intended updates",
        "move scheduler.step() inside the accumulation `if`, right after optimizer.step()", details)


@check("zero-grad", title="Gradients are cleared between optimizer steps", needs=("train",))
def zero_grad(subject) -> Result:
    """Catches a loop that never clears gradients (no `optimizer.zero_grad()` / `model.zero_grad()`):
    `backward` adds into `.grad`, so every update also re-applies the gradients of all earlier
    batches and the steps grow without bound.

    Checks, at the first backward after each optimizer step, whether the gradients left by that step
    were cleared (set to None or zero), however the loop clears them.
    """
    trace = _trace(subject)
    reason = _stepped(trace)
    if reason:
        return Result.skipped(reason)
    firsts = {}
    for event in trace.of("backward"):
        if event.window >= 1 and event.window not in firsts:
            firsts[event.window] = event.data["grads_clear"]
    if not firsts:
        return Result.skipped("no backward after the first optimizer step; pass --train-batches N to feed more")
    stale = [w for w, clear in firsts.items() if not clear]
    norms = [e.data["grad_norm"] for e in trace.of("opt_step")]
    details = {"steps_checked": len(firsts), "steps_not_cleared": len(stale),
               "zero_grad_calls": len(trace.of("zero_grad")), "grad_norm_at_step": norms}
    if not stale:
        return Result.passed(f"gradients cleared after each of {len(firsts)} optimizer steps", details)
    return Result.failed(
        f"gradients were not cleared after {len(stale)} of {len(firsts)} optimizer steps "
        f"(zero_grad called {details['zero_grad_calls']} times): each update re-applies every earlier "
        "batch's gradient",
        "call optimizer.zero_grad(set_to_none=True) right after optimizer.step()", details)


@check("clip-global-norm", title="Gradients are clipped by their global norm", needs=("train",))
def clip_global_norm(subject) -> Result:
    """Catches clipping that changes the update's direction: `clip_grad_norm_` called per parameter
    (or per group), which scales each tensor by its own factor, and `clip_grad_value_`, which cuts
    each element on its own. Clipping by the global norm over all parameters only shortens the update.

    No clipping at all is noted, not faulted.
    """
    trace = _trace(subject)
    reason = _stepped(trace)
    if reason:
        return Result.skipped(reason)
    clips = trace.of("clip")
    if not clips:
        return Result.passed("the loop does not clip gradients (a note, not a fault)", {"clips": 0},
                             hint="torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) before "
                                  "optimizer.step() guards against rare huge batches")
    windows: dict[int, list] = {}
    for event in clips:
        windows.setdefault(event.window, []).append(event.data)
    kinds = Counter()
    for calls in windows.values():
        if any(c["how"] == "value" for c in calls):
            kinds["value"] += 1
        elif any(c["covers_all"] for c in calls):
            kinds["global"] += 1
        elif len(calls) > 1:
            kinds["per-parameter" if all(c["params"] == 1 for c in calls) else "per-group"] += 1
        else:
            kinds["partial"] += 1
    calls = max(windows.values(), key=len)
    details = {"steps_with_clip": len(windows), "by_kind": dict(kinds), "calls_per_step": len(calls),
               "limit": calls[0]["limit"], "model_params_with_grad": calls[0]["model_params_with_grad"]}
    if set(kinds) == {"global"}:
        return Result.passed(f"clip_grad_norm_ over all {calls[0]['params']} parameter tensors, max_norm "
                             f"{calls[0]['limit']:g}, at {len(windows)} steps", details)
    hint = "clip once over all parameters: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)"
    if "value" in kinds:
        return Result.warned(f"clip_grad_value_({calls[0]['limit']:g}) cuts each gradient element on its "
                             "own, which changes the update's direction", hint, details)
    if "per-parameter" in kinds or "per-group" in kinds:
        unit = "parameter tensor" if "per-parameter" in kinds else "group"
        return Result.warned(f"clip_grad_norm_ called {len(calls)} times per step, once per {unit}: each is "
                             f"cut to norm {calls[0]['limit']:g} on its own, which changes the update's "
                             "direction", hint, details)
    return Result.warned(f"clip_grad_norm_ covers {calls[0]['params']} of the "
                         f"{calls[0]['model_params_with_grad']} parameter tensors with gradients", hint, details)


def _schedule(trace) -> tuple[list[float], str]:
    """The learning rate at each optimizer step: projected from the scheduler when there is one,
    else the rates the loop really used."""
    from tfdoctor.probes.trace import project_schedule

    for schedule in sorted(trace.schedules, key=lambda s: -s["steps"]):
        rates = project_schedule(schedule["snapshot"])
        if rates:
            return rates, f"{schedule['name']} projected over {len(rates)} steps"
    rates = [max(e.data["lrs"]) for e in trace.of("opt_step")]
    return rates, ("recorded at the loop's optimizer steps" if trace.schedules or len(set(rates)) > 1
                   else "constant (no LR scheduler)")


@check("lr-schedule", title="The learning-rate schedule warms up to a sensible peak", needs=("train",))
def lr_schedule(subject) -> Result:
    """Catches a learning rate that cannot train a Transformer: a peak far below or above the range
    they train at (a Noam LambdaLR left on Adam's default lr=1e-3 peaks near 7e-7, a thousand times
    too small, because LambdaLR multiplies the optimizer's lr by the lambda), and a schedule with no
    warm-up (warned: early updates on untrained attention are the unstable ones).

    Projects the loop's scheduler forward on a copy bound to a stand-in optimizer (the user's is not
    touched) until its peak is seen, and reports the optimizer's betas and eps.
    """
    trace = _trace(subject)
    reason = _stepped(trace)
    if reason:
        return Result.skipped(reason)
    from tfdoctor.checks.learning import sparkline

    rates, source = _schedule(trace)
    if not rates:
        return Result.skipped(_NO_STEP.format(n=trace.batches_fed))
    peak = max(rates)
    peak_step = rates.index(peak)
    start = rates[0]
    optimizer = trace.optimizers[0] if trace.optimizers else {"class": "?", "groups": [{}]}
    group = optimizer["groups"][0]
    adaptive = "betas" in group
    base = group.get("initial_lr", group.get("lr"))
    details = {"source": source, "peak_lr": peak, "peak_step": peak_step, "start_lr": start,
               "optimizer": optimizer["class"], "base_lr": base, "betas": group.get("betas"),
               "eps": group.get("eps"), "weight_decay": group.get("weight_decay"),
               "schedule_sparkline": sparkline(rates), "schedule_head": rates[:5]}
    adam = (f"{optimizer['class']} betas {tuple(group['betas'])}, eps {group.get('eps'):g}" if adaptive
            else optimizer["class"])
    shape = f"peak {peak:.1e} at step {peak_step} ({source}); {adam}"
    if adaptive and (peak < LR_FAIL_LOW or peak > LR_FAIL_HIGH):
        direction = "below" if peak < LR_FAIL_LOW else "above"
        hint = (f"pick a peak learning rate between 1e-5 and 3e-3 for {optimizer['class']}")
        if peak < LR_FAIL_LOW and any(s["name"] == "LambdaLR" for s in trace.schedules):
            hint = (f"LambdaLR multiplies the optimizer's lr ({base:g}) by your lambda; if the lambda already "
                    "returns the rate (Noam), create the optimizer with lr=1.0")
        return Result.failed(f"the learning rate peaks at {peak:.1e} (step {peak_step}), far {direction} the "
                             f"1e-5..3e-3 range Transformers train at with {optimizer['class']}; {adam}",
                             hint, details)
    if start > WARMUP_START_SHARE * peak:
        return Result.warned(f"no warm-up: the first step already runs at {start:.1e}, "
                             f"{start / peak:.0%} of the peak; {shape}",
                             "ramp the rate up over the first steps, e.g. LambdaLR(optimizer, lambda s: "
                             "min(1.0, (s + 1) / warmup_steps)) (often combined with a decay)", details)
    return Result.passed(f"warm-up from {start:.1e} to a {shape}", details)


@check("amp-loss-scaling", title="float16 autocast comes with loss scaling", needs=("train",))
def amp_loss_scaling(subject) -> Result:
    """Catches float16 autocast without a GradScaler: float16 cannot hold gradients below about 6e-8
    (and loses precision below 6e-5), so many Transformer gradients silently become zero. bfloat16
    has float32's range and needs no scaling.

    Reads the autocast regions the loop requested (also a CUDA autocast that disables itself on a
    CPU-only machine) and whether its backward calls start from a GradScaler-scaled loss.
    """
    trace = _trace(subject)
    regions = [e.data for e in trace.of("autocast") if e.data["requested"]]
    if not regions:
        return Result.skipped("the loop requests no autocast (mixed precision) region")
    fp16 = [r for r in regions if r["dtype"] == "float16"]
    devices = sorted({r["device"] for r in fp16 or regions})
    scales = trace.of("scale")
    requested = [e.data for e in scales if e.data["requested"]]
    backwards = trace.of("backward")
    scaled = [e for e in backwards if e.data["scaled"]]
    details = {"autocast": sorted({f"{r['device']}:{r['dtype']}" for r in regions}),
               "enabled_here": any(r["enabled"] for r in regions), "grad_scaler": bool(scales),
               "scaler_requested": bool(requested), "backward_calls": len(backwards),
               "scaled_backward_calls": len(scaled)}
    if not fp16:
        return Result.passed(f"{', '.join(details['autocast'])} autocast: bfloat16 keeps float32's range and "
                             "needs no loss scaling", details)
    here = ("" if any(r["enabled"] for r in fp16) else
            f" (autocast('{devices[0]}') disabled itself on this machine, so this run was float32)")
    if requested and len(scaled) == len(backwards):
        return Result.passed(f"float16 autocast ({', '.join(devices)}) with a GradScaler on every backward{here}",
                             details)
    hint = ("scaler = torch.amp.GradScaler('cuda'); scaler.scale(loss).backward(); scaler.step(optimizer); "
            "scaler.update() -- or autocast with dtype=torch.bfloat16, which needs no scaler")
    if scales and not requested:
        return Result.failed(f"float16 autocast ({', '.join(devices)}) with a GradScaler created with "
                             f"enabled=False: small gradients underflow to zero{here}", hint, details)
    unscaled = len(backwards) - len(scaled)
    return Result.failed(f"float16 autocast ({', '.join(devices)}) with no loss scaling on {unscaled} of "
                         f"{len(backwards)} backward calls: gradients below ~6e-8 underflow to zero in "
                         f"float16{here}", hint, details)


@check("grad-health", title="Gradients stay finite and bounded during the loop", needs=("train",))
def grad_health(subject) -> Result:
    """Catches NaN or Inf gradients reaching the optimizer (every weight they touch becomes NaN) and
    notes a pre-clip gradient norm that grows at every step (usually a learning rate set too high).

    Records the global gradient norm over all parameters before any clipping at each optimizer step
    and draws it as a sparkline.
    """
    trace = _trace(subject)
    reason = _stepped(trace)
    if reason:
        return Result.skipped(reason)
    from tfdoctor.checks.learning import sparkline

    scaled = {id(event): scale for event, scale in _scaled_clips(trace)}
    norms, finite = [], []
    pre_clip = {}
    for event in trace.of("clip"):
        if "global_pre_norm" in event.data and event.window not in pre_clip:
            scale = scaled.get(id(event)) or 1.0
            pre_clip[event.window] = (event.data["global_pre_norm"] / scale, event.data["finite"])
    for event in trace.of("opt_step"):
        norm, ok = pre_clip.get(event.window, (event.data["grad_norm"], event.data["finite"]))
        norms.append(norm)
        finite.append(ok and event.data["finite"])
    skipped = [e for e in trace.of("scaler_step") if e.data.get("skipped")]
    details = {"pre_clip_norms": norms, "sparkline": sparkline(norms), "steps": len(norms),
               "non_finite_steps": [i + 1 for i, ok in enumerate(finite) if not ok],
               "scaler_skipped_steps": len(skipped)}
    bad = details["non_finite_steps"]
    if bad:
        return Result.failed(
            f"gradients were NaN/Inf at {len(bad)} of {len(norms)} optimizer steps (first at step {bad[0]}); "
            f"the optimizer wrote them into the weights. Pre-clip norm {details['sparkline']}",
            "find the first non-finite gradient (torch.autograd.set_detect_anomaly(True)); typical causes: "
            "log or sqrt of zero in a custom loss or penalty, -inf masks on fully masked rows, float16 overflow",
            details)
    if skipped and not norms:
        return Result.failed(f"the GradScaler skipped all {len(skipped)} steps: the gradients were never finite",
                             "find the first non-finite gradient with torch.autograd.set_detect_anomaly(True)",
                             details)
    summary = f"gradients finite at all {len(norms)} steps; pre-clip norm {norms[0]:.3g} -> {norms[-1]:.3g} " \
              f"{details['sparkline']}"
    growing = (len(norms) >= GROWTH_MIN_STEPS and all(b >= a for a, b in zip(norms, norms[1:]))
               and norms[-1] >= GROWTH_FACTOR * norms[0])
    if growing:
        details["growing"] = True
        return Result.passed(f"{summary}; note: it grew at every step ({norms[-1] / norms[0]:.1f}x), "
                             "a sign of a learning rate set too high", details,
                             hint="lower the peak learning rate or lengthen the warm-up")
    return Result.passed(summary, details)


# ------------------------------------------------------------------------------------------------
# overfit-batch with the user's loop (called by tfdoctor.checks.learning.overfit_batch)


def _next_token_loss(subject, model, batch) -> float:
    """Mean next-token cross-entropy of `model` on `batch`, dropout off, padding ignored."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from tfdoctor.probes.modes import evaluation
    from tfdoctor.subject import call

    clone = dataclasses.replace(subject, model=model)
    with torch.no_grad(), evaluation(model):
        if subject.kind == "seq2seq":
            src, ids = batch
            logits = call(clone, src, ids[:, :-1])
        else:
            ids = batch
            logits = call(clone, ids[:, :-1])
        targets = ids[:, 1:]
        if subject.pad_id is not None:
            targets = targets.masked_fill(targets == subject.pad_id, -100)
        return float(F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100))


def overfit_with_loop(subject) -> Result:
    """overfit-batch through the user's own loop: feed it one batch over and over on a copy of the
    model, then judge the next-token loss the copy reaches on that batch."""
    import copy

    import torch

    from tfdoctor.checks.learning import OVERFIT_TARGET_NATS, OVERFIT_TARGET_SHARE
    from tfdoctor.context import current, progress
    from tfdoctor.probes.batches import train_batches
    from tfdoctor.probes.trace import run_loop

    model = copy.deepcopy(subject.model)
    batch = train_batches(subject, 1, torch.Generator().manual_seed(current().seed + 2))[0]
    target = max(OVERFIT_TARGET_NATS, OVERFIT_TARGET_SHARE * math.log(subject.vocab_size))
    start = _next_token_loss(subject, model, batch)
    run_loop(subject, model, [batch] * OVERFIT_LOOP_BATCHES, progress("overfit-batch (your loop)",
                                                                       OVERFIT_LOOP_BATCHES))
    final = _next_token_loss(subject, model, batch)
    details = {"start_loss": start, "final_loss": final, "target_loss": target, "batches": OVERFIT_LOOP_BATCHES,
               "max_share": OVERFIT_LOOP_MAX_SHARE, "batch_shape": list((batch[1] if isinstance(batch, tuple)
                                                                         else batch).shape), "loop": True}
    summary = (f"your loop, fed the same batch {OVERFIT_LOOP_BATCHES} times, took its next-token loss "
               f"{start:.2f} -> {final:.3f}")
    if final < target or final <= OVERFIT_LOOP_MAX_SHARE * start:
        return Result.passed(f"{summary} (needs <= {OVERFIT_LOOP_MAX_SHARE:.0%} of the start)", details)
    if not math.isfinite(final):
        return Result.failed(f"{summary}: the weights became non-finite",
                             "run grad-health and fix the first NaN gradient", details)
    return Result.failed(
        f"{summary}, not below {OVERFIT_LOOP_MAX_SHARE:.0%} of the start: the loop does not learn the "
        "next token of a batch it sees over and over (or its warm-up is far longer than "
        f"{OVERFIT_LOOP_BATCHES} batches)",
        "check the loop's objective (targets = inputs shifted by one), its learning rate and schedule "
        "(lr-schedule), and that optimizer.step() runs; without --train this check tests the model alone",
        details)
