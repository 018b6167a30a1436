"""Training-loop checks: run the user's own `train(model, batches)` once and judge what it did.

The loop runs on a deep copy of the model, fed random token batches, while tfdoctor records its
calls (see tfdoctor/probes/trace.py). Every check here judges that one shared trace, so the verdicts
do not depend on variable names or code layout, only on what the loop really called.
"""

from __future__ import annotations

import math
from collections import Counter

from tfdoctor.recording.wiped import wiped_steps
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

# lr-schedule: the peak learning rates Transformers train at with Adam-family optimizers run from
# about 1e-5 (fine-tuning large models) to about 3e-3 (small models pre-training). Only what cannot
# be right fails: every param group peaking below 1e-6, a thousand times under the range's bottom
# (the Noam schedule left on Adam's default lr=1e-3 peaks near 7e-7).
LR_FAIL_LOW = 1e-6
# "Far above" a family's usual peak, on a group that holds weight matrices, warns (and fails only if
# the loop's loss or gradients blew up within the recorded steps). Adam family: 10x the top of its
# range. Muon's orthogonalised update is used at 0.02-0.1 (Keller Jordan's Muon, modded-nanogpt), SGD
# at up to ~1: both are judged 10x above that. Groups of embedding tables or vectors only (norm gains,
# biases, scalars) are not judged high: modded-nanogpt trains its embeddings at 0.6 and its scalars
# at 0.04 with Adam, by design, behind a norm.
LR_WARN_HIGH = {"adam": 3e-2, "muon": 1.0, "sgd": 10.0}
# A blow-up: the graded tokens' mean loss at the last recorded step this many times the first's
# (on random tokens a working loop keeps it near ln V), or non-finite gradients.
BLOWUP_LOSS_FACTOR = 1.5
# A recorded (not projected) schedule still rising at its last step has not shown its peak. At its
# recorded pace it must reach the bottom of the usual range within a long warm-up (nanoGPT and
# Llama warm up over 2000 steps, Noam over 4000; 20000 is ten times the common one), else it warns.
LR_USUAL_LOW = 1e-5
WARMUP_HORIZON_STEPS = 20_000
# A schedule whose first step runs at more than half its peak has no warm-up to speak of. Judged
# for pure Adam-family loops only: Muon and SGD loops train without one by design.
WARMUP_START_SHARE = 0.5

# grad-health: a pre-clip norm that rose at every step over at least this many steps, to at least
# twice its start, is noted as growing steadily (the sign of a learning rate set too high).
GROWTH_MIN_STEPS = 6
GROWTH_FACTOR = 2.0


def _trace(subject):
    """The one recorded run of the user's loop, shared by every check of the run.

    A loop that raises is recorded once; every check then re-raises the user's exception, which the
    runner reports as that check's error."""
    from tfdoctor.context import current, memo, progress

    recorded = getattr(subject.train, "trace", None)  # another driver recorded it (tfdoctor run SCRIPT)
    if recorded is not None:
        return recorded

    def record():
        import torch

        from tfdoctor.recording.batches import train_batches
        from tfdoctor.recording.loop import record_loop

        count = int(current().options.get("train_batches") or DEFAULT_TRAIN_BATCHES)
        batches = train_batches(subject, count, torch.Generator().manual_seed(current().seed + 5))
        advance = progress("training loop", count)
        trace = record_loop(subject, batches, advance)
        advance(max(0, count - trace.batches_fed))
        return trace

    return memo(("train-trace", id(subject.model), subject.train), record)


# The call each loop check judges, as the user wrote it: the finding names its file:line (recorded
# from the stack when the call was made). The first kind that was recorded with a location wins.
CALL_NAMES = {"loss": "the loss", "backward": "backward()", "clip": "clip_grad_norm_", "opt_step": "optimizer.step()",
              "sched_step": "scheduler.step()", "autocast": "autocast", "scaler_step": "scaler.step()",
              "unscale": "scaler.unscale_()", "zero_grad": "zero_grad()"}


def _at(*kinds: str):
    """Adds details["location"] (the user's "path:line" of the first recorded call of `kinds`) and
    details["call"] to a loop check's result; skips carry none."""
    import functools

    def wrap(func):
        @functools.wraps(func)
        def located(subject) -> Result:
            result = func(subject)
            if result.status.value == "skip" or "location" in result.details:
                return result
            events = _trace(subject).events
            for kind in kinds:
                where = next((e.data["where"] for e in events if e.kind == kind and e.data.get("where")), None)
                if where:
                    result.details["location"] = where
                    result.details["call"] = CALL_NAMES[kind]
                    break
            return result

        return located

    return wrap


def _stepped(trace) -> str | None:
    """Why the loop's steps cannot be judged, or None when it took at least one."""
    if trace.batches_fed == 0:
        return "the loop never iterated over the batches it was given"
    if trace.steps or trace.of("scaler_step"):
        return None
    backwards = len(trace.of("backward"))
    if not backwards:
        return (f"the loop ran on {trace.batches_fed} batches without calling backward(): it trains nothing "
                "that tfdoctor can see (a loss computed with torch.autograd.grad is not followed)")
    more = (f"; if it accumulates over more than {backwards} micro-batches, pass --train-batches N"
            if backwards >= trace.batches_fed else "")
    return (f"the loop called backward() {backwards} times on the {trace.batches_fed} batches it was given but "
            "never changed the weights: no optimizer.step() and no in-place update of the parameters" + more)


def _untrained(trace) -> str | None:
    """What shows that the loop trained nothing at all, or None. Only a loop that took no optimizer
    step, called no backward() and left every weight as it was (an empty DataLoader, a loop that
    returns before its first batch) is certain: one that called backward() may accumulate over more
    micro-batches than it was fed, and the script driver refuses a script that never stepped."""
    if trace.steps or trace.of("scaler_step") or trace.of("backward"):
        return None
    if trace.isolation.get("weights_changed", True):  # unknown (another driver), or trained unseen
        return None
    if trace.batches_fed == 0:
        return ("the loop returned without iterating over the batches it was given: no optimizer step was "
                "taken, so nothing trains")
    return (f"the loop iterated over the {trace.batches_fed} batches it was given but no optimizer step was "
            "taken: no backward(), no optimizer.step(), every weight left as it was (a DataLoader or filter "
            "that yields nothing?)")


def _micro_batches(trace) -> tuple[int, dict[int, int]]:
    """Backward calls per optimizer-step window, and the accumulation k: the most common count,
    read past the first window (`if step % k == 0` steps after the very first micro-batch)."""
    per_window = Counter(e.window for e in trace.of("backward") if e.window < trace.steps)
    if not per_window:
        return 0, {}
    later = [n for w, n in per_window.items() if w > 0] or list(per_window.values())
    return Counter(later).most_common(1)[0][0], dict(per_window)


def _step_norms(trace) -> list[tuple[int, float, bool]]:
    """(window, gradient norm, all finite) per optimizer step of the loop; optimizers stepped together
    hold disjoint parameters, so their norms add in quadrature."""
    steps: dict[int, list] = {}
    for event in trace.of("opt_step"):
        held = steps.setdefault(event.window, [0.0, True])
        held[0] += event.data["grad_norm"] ** 2
        held[1] = held[1] and event.data["finite"]
    return [(w, math.sqrt(sq), ok) for w, (sq, ok) in sorted(steps.items())]


def _backward_window(trace) -> dict[int, tuple[int, float]]:
    """For each backward event's index: its window and the GradScaler scale it ran under (1.0 if none)."""
    return {i: (e.window, e.data["scale"] or 1.0) for i, e in enumerate(trace.events) if e.kind == "backward"}


def _window_weights(trace) -> dict[int, float]:
    """The summed token weight each optimizer-step window's gradient gives the scored tokens when it
    reaches the step: read from the gradient at the scores, times any rescaling of .grad between the
    last backward and the step (1.0 is the mean over the window's tokens)."""
    backwards = _backward_window(trace)
    rescale = getattr(trace, "grad_rescale", {})
    totals: dict[int, float] = {}
    for entry in trace.scores:
        if entry.get("backward") not in backwards:
            continue
        window, scale = backwards[entry["backward"]]
        totals[window] = totals.get(window, 0.0) + float(entry["weights"].sum()) / scale * rescale.get(window, 1.0)
    return totals


def _window_losses(trace) -> list[float]:
    """The weighted mean loss of the graded tokens at each window, from the scores' gradients."""
    backwards = _backward_window(trace)
    sums: dict[int, list[float]] = {}
    for entry in trace.scores:
        if entry.get("backward") not in backwards:
            continue
        window = backwards[entry["backward"]][0]
        held = sums.setdefault(window, [0.0, 0.0])
        held[0] += float((entry["weights"] * entry["nll"]).sum())
        held[1] += float(entry["weights"].sum())
    return [total / weight for _, (total, weight) in sorted(sums.items()) if weight > 0]


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


# Keyword arguments that hold something other than the tokens the model reads.
_NOT_INPUT_IDS = ("label", "target", "mask", "position", "token_type")
_LAYOUTS = {1: "batch-first [B, T]", 0: "sequence-first [T, B]"}


def _input_ids(forward: dict, shape: list[int], kind: str):
    """The token ids [d0, d1] of a forward that the scored rows (shape `shape`) were computed from, as
    (ids, rows-to-grid function, offset correction), or None.

    Preferred: decoder_input_ids for an encoder-decoder, input_ids, then positional ids (an
    encoder-decoder's last, the target side; otherwise the first). A Hugging Face encoder-decoder given
    only `labels=` builds its decoder input by shifting them right, so its targets are labels[t]."""
    import math as _math

    inputs = dict(forward["inputs"])
    named = [k for k in ("decoder_input_ids",) if kind == "seq2seq"] + ["input_ids"]
    positional = sorted((k for k in inputs if k.isdigit()), key=int, reverse=kind == "seq2seq")
    others = [k for k in inputs if not k.isdigit() and k not in named and not any(w in k for w in _NOT_INPUT_IDS)]
    order = [(k, 0) for k in named + positional + others if k in inputs]
    if kind == "seq2seq" and "decoder_input_ids" not in inputs and "labels" in inputs:
        order.insert(0, ("labels", 1))
    n = _math.prod(shape)
    for key, correction in order:
        ids = inputs[key]
        d0, d1 = ids.shape
        if len(shape) == 2 and tuple(shape) == (d0, d1) or len(shape) == 1 and n == d0 * d1:
            return ids.cpu(), (lambda rows, d0=d0, d1=d1: rows.reshape(d0, d1)), correction
        if len(shape) == 2 and tuple(shape) == (d1, d0):  # the model transposed its input
            return ids.cpu(), (lambda rows, d0=d0, d1=d1: rows.reshape(d1, d0).T), correction
    return None


def _grids(trace, subject) -> list[dict]:
    """Each scored tensor that reached a backward, laid out on the [d0, d1] grid of the input ids it
    came from: targets, weights, hard (one graded token), ids, and the offset correction."""
    forwards = {e.data["index"]: e.data for e in trace.of("forward")}
    backwards = _backward_window(trace)
    grids = []
    for entry in trace.scores:
        forward = forwards.get(entry["forward"])
        if entry.get("backward") not in backwards or forward is None:
            continue
        found = _input_ids(forward, entry["rows_shape"], subject.kind)
        if found is None:
            continue
        ids, grid, correction = found
        grids.append({"ids": ids, "targets": grid(entry["targets"]), "weights": grid(entry["weights"]),
                      "hard": grid(entry["hard"]), "correction": correction})
    return grids


def _alignment(trace, subject) -> dict:
    """Over the graded tokens that could be traced back to an input position: for each layout (which
    axis of the ids is time) and offset k, the share of targets equal to the input token k positions
    on. The layout and offset that explain the most are the loop's."""
    import torch

    matches = {(axis, k): 0 for axis in (1, 0) for k in OFFSETS}
    judged = dict.fromkeys(matches, 0)
    rows = 0
    grids = _grids(trace, subject)
    for grid in grids:
        keep = grid["hard"] & (grid["targets"] >= 0)
        if subject.pad_id is not None:
            keep &= grid["targets"] != subject.pad_id
        rows += int(keep.sum())
        for axis in (1, 0):
            ids, targets, kept = grid["ids"], grid["targets"], keep
            if axis == 0:
                ids, targets, kept = ids.T, targets.T, kept.T
            S, T = ids.shape
            s, t = torch.nonzero(kept, as_tuple=True)
            for k in OFFSETS:
                shifted = t + k - grid["correction"]
                inside = (shifted >= 0) & (shifted < T)
                judged[(axis, k)] += int(inside.sum())
                matches[(axis, k)] += int((ids[s[inside], shifted[inside]] == targets[s[inside], t[inside]]).sum())
    shares = {key: matches[key] / judged[key] for key in matches if judged[key]}
    if not shares:
        return {"rows": rows, "grids": grids, "shares": {}, "axis": 1, "best": None}
    axis, best = max(shares, key=lambda key: (shares[key], key[0]))  # a tie keeps batch-first
    return {"rows": rows, "grids": grids, "axis": axis, "best": best,
            "shares": {k: shares[(axis, k)] for k in OFFSETS if (axis, k) in shares}}


def _no_scores(trace, subject) -> str:
    """Why no graded token could be read."""
    fused = next((e.data["fused_head"] for e in trace.of("forward") if e.data.get("fused_head")), None)
    if fused and not any(bool(entry["readable"].any()) for entry in trace.scores):
        return (f"the model returns {fused} with per-token log_probs and no logits: its loss comes from a fused "
                "LM head (TRL's fused_lm_head) that never holds scores over the vocabulary, so which token each "
                "position was graded on, and its weight, cannot be read")
    if not trace.scores:
        return (f"no scores over the vocabulary (V={subject.vocab_size}) received a gradient from the loop's "
                "backward: neither the model's output nor the input of a softmax / cross-entropy over V "
                "classes; cannot tell which token each position was graded on")
    if not any(bool(entry["readable"].any()) for entry in trace.scores):
        return ("the gradient at the scores over the vocabulary is not that of a softmax loss (cross-entropy, "
                "label smoothing, KL divergence), so no graded token can be read from it")
    return "the scored rows could not be traced back to the model's input ids"


@check("objective", title="Targets are the next input token (no identity, no double shift)",
       kinds=("causal", "seq2seq"), needs=("train",),
       skip_reasons={"encoder": "an encoder is graded on its own positions; the next-token alignment "
                                "does not apply"})
@_at("loss", "backward")
def objective(subject) -> Result:
    """Catches a loss graded on the wrong targets: the input itself (input == target, the loss
    collapses to near zero in the first epoch and means nothing) or labels shifted twice (a library
    model given `labels=` shifts them itself, so pre-shifted labels ask for the token after next).

    Runs the loop and reads, from the gradient that reaches the model's scores over the vocabulary,
    which token each position was graded on (the class the loss pulls up), whatever the loss:
    cross-entropy, label smoothing, KL divergence to a smoothed target, a library's own loss, or one
    computed inside the model's forward. It compares that token with the input tokens around the
    position, batch-first [B, T] or sequence-first [T, B]. The target for position t must be input
    token t+1; the offset found is reported. Ignored targets (-100, padding) are left out.

    Fix: `logits = model(ids[:, :-1])`, `targets = ids[:, 1:]`; flatten logits and targets in the
    same order; give Hugging Face models `labels=input_ids` unshifted.
    """
    trace = _trace(subject)
    found = _alignment(trace, subject)
    rows, shares = found["rows"], found["shares"]
    if not rows or not shares:
        return Result.skipped(_no_scores(trace, subject))
    best = found["best"]
    layout = _LAYOUTS[found["axis"]]
    details = {"offset": best if shares[best] >= ALIGN_MIN_SHARE else None, "graded_positions": rows,
               "share_by_offset": {f"{k:+d}": round(v, 4) for k, v in shares.items()}, "layout": layout}
    seen = f"the target matched input token t{best:+d} at {shares[best]:.0%} of {rows} graded positions"
    if shares[best] < ALIGN_MIN_SHARE:
        return Result.warned(
            f"the loss targets do not line up with the model's inputs at any offset from {OFFSETS[0]:+d} "
            f"to {OFFSETS[-1]:+d}, batch-first or sequence-first (best: t{best:+d} at {shares[best]:.0%} of "
            f"{rows} positions)",
            "for language modelling the targets are the inputs shifted by one: "
            "logits = model(ids[:, :-1]); loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()); "
            "flatten logits and targets in the same order", details)
    where = "" if found["axis"] == 1 else f" ({layout})"
    if best == 1:
        return Result.passed(f"targets are the next input token (offset +1) at {shares[best]:.0%} of "
                             f"{rows} graded positions{where}", details)
    if best == 0:
        return Result.failed(
            f"each position is graded on the token it was given ({seen}{where}): the model only learns to "
            "copy its input, and a loss near zero means nothing",
            "shift by one: logits = model(ids[:, :-1]); targets = ids[:, 1:]", details)
    if best >= 2:
        return Result.failed(
            f"targets are shifted {best} positions ({seen}{where}): position t is graded on token t{best:+d}, "
            "so the labels were shifted twice (a model given labels= shifts them itself)",
            "shift once: give a Hugging Face model labels=input_ids unshifted (it shifts them), or "
            "shift yourself and compute the loss on the returned logits", details)
    return Result.failed(
        f"each position is graded on the token before it ({seen}{where}): targets run the wrong way",
        "targets are the inputs shifted left by one: targets = ids[:, 1:], inputs = ids[:, :-1]", details)


def _end_of_text_pads(found: dict, pad_id: int) -> dict | None:
    """Whether every graded pad target is the first pad of its sequence, once per sequence: the
    GPT-2 convention (pad id == eos id; the collate keeps each row's first pad as its end-of-text
    target and masks the rest). Counts, or None when the graded pads cannot all be placed."""
    import torch

    best = found["best"]
    if best is None or found["shares"].get(best, 0.0) < ALIGN_MIN_SHARE:
        return None
    placed = at_end = sequences = 0
    for grid in found["grids"]:
        ids, targets, graded = grid["ids"], grid["targets"], grid["weights"] > 0
        if found["axis"] == 0:
            ids, targets, graded = ids.T, targets.T, graded.T
        pads = graded & (targets == pad_id)
        S, T = ids.shape
        is_pad = ids == pad_id
        # first pad after the real tokens: the first pad that follows a real token
        # A row with no pad in the model's input (fed ids[:, :-1]) may have its first pad just past it.
        first = torch.where(is_pad.any(-1), is_pad.float().argmax(-1), torch.full((S,), T))
        for s, t in zip(*torch.nonzero(pads, as_tuple=True)):
            placed += 1
            if int(t) + best - grid["correction"] == int(first[s]) and int(first[s]) > 0:
                at_end += 1
        sequences += int((pads.sum(-1) > 1).sum())
    return {"graded_pads": placed, "first_pad_of_row": at_end, "rows_with_more_than_one": sequences}


@check("ignore-index", title="Padding targets are left out of the loss", needs=("train", "pad_id"))
@_at("loss", "backward")
def ignore_index(subject) -> Result:
    """Catches a loss that grades padding: pad targets that are neither given `ignore_index=pad_id`
    nor replaced by the ignore value (-100), so part of every update teaches the model to predict
    padding.

    Runs the loop on batches padded with pad_id and measures, from the gradient each scored position
    really received (whatever the loss), the share of the trained weight that goes to pad targets.
    Exactly one graded pad per row, right after its real tokens, is the GPT-2 convention (pad id ==
    eos id, the first pad kept as the end-of-text target): it passes with a note.

    Fix: `ignore_index=pad_id`, `targets.masked_fill(targets == pad_id, -100)`, or weight a
    hand-written loss by `targets != pad_id`.
    """
    trace = _trace(subject)
    entries = [e for e in trace.scores if e.get("backward") is not None and bool(e["readable"].any())]
    if not entries:
        return Result.skipped(_no_scores(trace, subject))
    pad_weight = total_weight = pad_loss = total_loss = 0.0
    graded = graded_pads = 0
    for entry in entries:
        weights = entry["weights"]
        pad = (entry["targets"] == subject.pad_id) & (weights > 0)
        contribution = weights * entry["nll"].abs()
        pad_weight += float(weights[pad].sum())
        total_weight += float(weights.sum())
        pad_loss += float(contribution[pad].sum())
        total_loss += float(contribution.sum())
        graded += int((weights > 0).sum())
        graded_pads += int(pad.sum())
    token_share = pad_weight / total_weight if total_weight else 0.0
    loss_share = pad_loss / total_loss if total_loss else 0.0
    found = _alignment(trace, subject)
    # Pad targets offered to the loss, graded or not: read off the inputs once the alignment is known
    # (a target replaced by -100 no longer says it was a pad), else counted in cross-entropy's targets.
    losses = [e.data for e in trace.training_losses() if "targets" in e.data]
    aligned = found["best"] is not None and found["shares"].get(found["best"], 0.0) >= ALIGN_MIN_SHARE
    offered = (_pad_targets(found, subject.pad_id) if aligned
               else sum(int((loss["targets"] == subject.pad_id).sum()) for loss in losses))
    offered = max(offered, graded_pads)  # the last position's target lies past the input ids
    ignore_values = sorted({e.data["ignore_index"] for e in trace.training_losses()})
    details = {"pad_id": subject.pad_id, "ignore_index": ignore_values, "pad_targets": offered,
               "graded_targets": graded, "graded_pad_targets": graded_pads, "pad_weight_share": token_share,
               "pad_loss_share": loss_share}
    said = f" (ignore_index {', '.join(map(str, ignore_values))})" if ignore_values else ""
    if token_share <= PAD_WEIGHT_TOLERANCE:
        if offered:
            return Result.passed(f"all {offered} pad targets are ignored{said}", details)
        return Result.passed(f"no pad target reached the loss ({graded} graded targets, none of them "
                             f"pad_id={subject.pad_id})", details)
    eos = _end_of_text_pads(found, subject.pad_id)
    if eos is not None:
        details["end_of_text"] = eos
    if eos is not None and eos["graded_pads"] == graded_pads == eos["first_pad_of_row"] \
            and not eos["rows_with_more_than_one"]:
        rest = f"; the other {offered - graded_pads} pad targets are ignored" if offered > graded_pads else ""
        return Result.passed(
            f"one pad per padded row is graded, the first one after the real tokens ({graded_pads} rows): "
            f"pad_id={subject.pad_id} doubles as end-of-text, the GPT-2 convention (pad == eos){rest}",
            details, hint=f"a note: if {subject.pad_id} is not your end-of-text token, ignore that pad too")
    ignored = ", ".join(map(str, ignore_values)) if ignore_values else "not set (the loss is not F.cross_entropy)"
    return Result.failed(
        f"the loss grades padding: {graded_pads} pad targets (pad_id={subject.pad_id}) carry {token_share:.0%} "
        f"of the target weight and {loss_share:.0%} of the loss (ignore_index is {ignored})",
        f"pass ignore_index={subject.pad_id} to F.cross_entropy / nn.CrossEntropyLoss, or replace pad "
        f"targets with -100: targets = targets.masked_fill(targets == {subject.pad_id}, -100) (a hand-written "
        "loss: multiply each token's loss by (targets != pad_id) and divide by its sum)", details)


def _pad_targets(found: dict, pad_id: int) -> int:
    """About how many scored positions had a pad as their target (graded or not), from the aligned
    inputs (the target of the last position lies past the input and is not counted)."""
    best = found["best"]
    if best is None:
        return 0
    count = 0
    for grid in found["grids"]:
        ids = grid["ids"] if found["axis"] == 1 else grid["ids"].T
        T = ids.shape[1]
        shift = best - grid["correction"]
        if 0 <= shift < T:
            count += int((ids[:, shift:] == pad_id).sum())
    return count


@check("unscale-before-clip", title="GradScaler gradients are unscaled before clipping", needs=("train",))
@_at("clip", "unscale")
def unscale_before_clip(subject) -> Result:
    """Catches `clip_grad_norm_` on gradients a GradScaler has not unscaled: they are still multiplied
    by the loss scale (65536 at the start), so every batch looks like an outlier, the clip cuts every
    update to a sliver and the model barely moves.

    Judged on the order of calls (scale, backward, clip, unscale_), not on whether unscale_ appears:
    calling it after the clip is as wrong as never calling it. A GradScaler('cuda') disables itself on
    a machine without CUDA, but the order is the same, so the bug is caught there too.

    Fix: `scaler.unscale_(optimizer)` after the last backward, before the clip.
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
@_at("backward")
def accumulation_scaling(subject) -> Result:
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
    trace = _trace(subject)
    reason = _stepped(trace)
    if reason:
        return Result.skipped(reason)
    k, per_window = _micro_batches(trace)
    if k <= 1:
        return Result.skipped("one backward per optimizer step: the loop does not accumulate gradients")
    weights = _window_weights(trace)
    even = {w: weights[w] for w, n in per_window.items() if n == k and w in weights}
    if not even:
        return Result.skipped(_no_scores(trace, subject))
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
    backwards = _backward_window(trace)
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
                   f"backward: the accumulated gradient is {factor:.2f}x the mean, so the effective "
                   f"learning rate is {factor:.2f}x what you set")
    else:
        problem = (f"the {k} micro-batches per optimizer step send {factor / k:.3f}x their loss to backward: "
                   f"the accumulated gradient is {factor:.2f}x the mean (divided more than once), so "
                   f"the effective learning rate is {factor:.2f}x what you set")
    hint = f"divide before backward: (loss / {k}).backward(), or with a scaler scaler.scale(loss / {k}).backward()"
    if at:
        problem += f"; also, {at}"
        hint += f"; and step after every k-th micro-batch: if (step + 1) % {k} == 0"
    return Result.failed(problem, hint, details)


def _micro_batch_weights(trace) -> dict[int, list[dict]]:
    """Per optimizer-step window, per backward call (micro-batch): its trained tokens (gradient weight
    > 0 at the scores) and their mean, smallest and largest weight, the GradScaler's scale divided out."""
    backwards = _backward_window(trace)
    found: dict[int, dict[int, dict]] = {}
    for entry in trace.scores:
        index = entry.get("backward")
        if index not in backwards:
            continue
        window, scale = backwards[index]
        weights = entry["weights"][entry["weights"] > 0].double() / scale
        if not weights.numel():
            continue
        held = found.setdefault(window, {}).setdefault(index, {"tokens": 0, "sum": 0.0, "min": math.inf, "max": 0.0})
        held["tokens"] += int(weights.numel())
        held["sum"] += float(weights.sum())
        held["min"] = min(held["min"], float(weights.min()))
        held["max"] = max(held["max"], float(weights.max()))
    return {w: [dict(m, mean=m["sum"] / m["tokens"]) for _, m in sorted(per.items())] for w, per in found.items()}


@check("token-weighting", title="Every trained token weighs the same within an optimizer step",
       needs=("train", "pad_id"))
@_at("loss", "backward")
def token_weighting(subject) -> Result:
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
    trace = _trace(subject)
    reason = _stepped(trace)
    if reason:
        return Result.skipped(reason)
    k, _ = _micro_batches(trace)
    if k <= 1:
        return Result.skipped("one backward per optimizer step: tokens are weighed within one batch")
    windows = {w: m for w, m in _micro_batch_weights(trace).items() if len(m) > 1}
    if not windows:
        return Result.skipped(_no_scores(trace, subject))

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


@check("scheduler-placement", title="The LR scheduler steps once per optimizer step", needs=("train",))
@_at("sched_step")
def scheduler_placement(subject) -> Result:
    """Catches `scheduler.step()` placed outside the accumulation `if`: it then steps once per
    micro-batch, so the schedule runs k times faster than the optimizer (a warm-up meant for 4000
    updates is over after 1000, and the decay ends early).

    Counts the loop's scheduler steps against its optimizer steps. Once per optimizer step, or once
    per epoch, passes.

    Fix: step the scheduler inside the accumulation `if`, after `optimizer.step()`.
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
@_at("opt_step", "backward")
def zero_grad(subject) -> Result:
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
    norms = [norm for _, norm, _ in _step_norms(trace)]
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
        return Result.passed(f"gradients cleared after each of {len(firsts)} optimizer steps", details)
    return Result.failed(
        f"gradients were not cleared after {len(stale)} of {len(firsts)} optimizer steps "
        f"(zero_grad called {details['zero_grad_calls']} times): each update re-applies every earlier "
        "batch's gradient",
        "call optimizer.zero_grad(set_to_none=True) right after optimizer.step()", details)


@check("clip-global-norm", title="Gradients are clipped by their global norm", needs=("train",))
@_at("clip", "opt_step")
def clip_global_norm(subject) -> Result:
    """Catches clipping that changes the update's direction: `clip_grad_norm_` called per parameter
    (or per group), which scales each tensor by its own factor, and `clip_grad_value_`, which cuts
    each element on its own. Clipping by the global norm over all parameters only shortens the update.

    No clipping at all is noted, not faulted.

    Fix: `clip_grad_norm_(model.parameters(), max_norm)` once per step, after unscaling.
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


def _family(optimizer: str, group: dict) -> str:
    """The update rule a param group follows: adam (anything with betas), muon, sgd, manual, other.
    Muon optimizers that carry an auxiliary Adam mark their groups use_muon True/False."""
    name = optimizer.lower()
    if optimizer == "manual update":
        return "manual"
    if group.get("use_muon") is True or ("muon" in name and "betas" not in group and group.get("use_muon") is None):
        return "muon"
    if "betas" in group or "adam" in name:
        return "adam"
    if "sgd" in name or "momentum" in group:
        return "sgd"
    return "other"


def _group_schedules(trace) -> list[dict]:
    """Every param group of every optimizer the loop stepped (a loop that updates the weights itself
    counts as one group): its learning rate at each step, projected from its scheduler when it has
    one, else as recorded (a manual `group["lr"] = f(step)` is read from what it set)."""
    from tfdoctor.recording.schedule import project_groups

    recorded: dict = {}
    for event in trace.of("opt_step"):
        recorded.setdefault(event.data["optimizer"], []).append(event.data["lrs"])
    projected = {}
    for schedule in sorted(trace.schedules, key=lambda s: -s["steps"]):
        if schedule.get("optimizer") in projected:
            continue
        groups = project_groups(schedule["snapshot"])
        if groups:
            projected[schedule.get("optimizer")] = (groups, f"{schedule['name']} projected over "
                                                            f"{len(groups[0])} steps")
    optimizers = {o["id"]: o for o in trace.optimizers}
    found = []
    for key, steps in recorded.items():
        optimizer = optimizers.get(key, {"class": "manual update", "groups": [{}], "composition": [{}]})
        for index in range(max(len(lrs) for lrs in steps)):
            rates = [lrs[index] for lrs in steps if index < len(lrs)]
            group = optimizer["groups"][index] if index < len(optimizer["groups"]) else {}
            held = optimizer["composition"][index] if index < len(optimizer["composition"]) else {}
            rising = False
            if key in projected and index < len(projected[key][0]):
                rates, source = projected[key][0][index], projected[key][1]
            else:
                source = ("read off the loop's own updates of the weights" if key is None
                          else "recorded at the loop's optimizer steps" if trace.schedules or len(set(rates)) > 1
                          else "constant (no LR scheduler)")
                rising = len(rates) >= 2 and rates[-1] > rates[-2]
            if not rates:
                continue
            peak = max(rates)
            found.append({"optimizer": optimizer["class"], "group": index,
                          "family": _family(optimizer["class"], group), "rates": rates, "source": source,
                          "peak_lr": peak, "peak_step": rates.index(peak), "start_lr": rates[0],
                          "rising": rising, "base_lr": group.get("initial_lr", group.get("lr")),
                          "betas": group.get("betas"), "eps": group.get("eps"),
                          "weight_decay": group.get("weight_decay"),
                          "holds": {k: held.get(k, 0) for k in ("embedding", "matrix", "vector")},
                          "names": held.get("names", [])})
    return found


def _blow_up(trace) -> str | None:
    """What shows that the loop's training blew up within the recorded steps, or None."""
    bad = [i + 1 for i, (_, _, ok) in enumerate(_step_norms(trace)) if not ok]
    if bad:
        return f"gradients were NaN/Inf from step {bad[0]}"
    losses = _window_losses(trace)
    if len(losses) >= 2 and (not math.isfinite(losses[-1]) or losses[-1] > BLOWUP_LOSS_FACTOR * losses[0]):
        return f"the loss rose from {losses[0]:.2f} to {losses[-1]:.2f} within {len(losses)} steps"
    return None


def _holds(group: dict) -> str:
    held = group["holds"]
    parts = [kind if kind != "vector" else "norms/biases" for kind in ("matrix", "embedding", "vector")
             if held.get(kind)]
    return "matrices" if parts == ["matrix"] else " + ".join(p if p != "matrix" else "matrices" for p in parts) \
        or "?"


def _describe(group: dict) -> str:
    rising = " and rising" if group["rising"] else ""
    return f"{group['optimizer']} group {group['group']} ({_holds(group)}) {group['peak_lr']:.2g}{rising}"


@check("lr-schedule", title="The learning-rate schedule warms up to a sensible peak", needs=("train",))
@_at("sched_step", "opt_step")
def lr_schedule(subject) -> Result:
    """Catches a learning rate that cannot train a Transformer: every param group peaking far below
    the range they train at (a Noam LambdaLR left on Adam's default lr=1e-3 peaks near 7e-7, a
    thousand times too small, because LambdaLR multiplies the optimizer's lr by the lambda); a
    weight-matrix group far above its optimizer family's usual peak (warned, failed only if the loss
    or gradients blow up within the loop's steps); and, for pure Adam-family loops, a schedule with no
    warm-up (warned: early updates on untrained attention are the unstable ones).

    Judged per param group and per family: Adam-like groups, Muon, SGD, a loop that updates the weights
    itself. Groups of embedding tables or norm gains are not judged high (some train them at 0.6 by
    design). Each scheduler is projected forward on a copy bound to a stand-in optimizer (the user's
    is not touched) until its peak is seen; a schedule written in the loop (`group["lr"] = ...`) is
    read from the rates it set.

    Fix: Noam lambdas need the optimizer at `lr=1.0`; keep Adam matrix groups within 1e-5..3e-3 and
    ramp the rate up over the first steps.
    """
    trace = _trace(subject)
    reason = _stepped(trace)
    if reason:
        return Result.skipped(reason)
    from tfdoctor.checks.learning import sparkline

    groups = _group_schedules(trace)
    if not groups:
        return Result.skipped("the loop's optimizer steps carried no learning rate")
    size = {id(g): sum(g["holds"].values()) for g in groups}
    main = max(groups, key=lambda g: (size[id(g)], g["peak_lr"]))
    peak, peak_step, start = main["peak_lr"], main["peak_step"], main["start_lr"]
    adaptive = main["betas"] is not None
    details = {"source": main["source"], "peak_lr": peak, "peak_step": peak_step, "start_lr": start,
               "optimizer": main["optimizer"], "base_lr": main["base_lr"], "betas": main["betas"],
               "eps": main["eps"], "weight_decay": main["weight_decay"],
               "schedule_sparkline": sparkline(main["rates"]), "schedule_head": main["rates"][:5],
               "groups": [{k: v for k, v in g.items() if k != "rates"} | {"rates_head": g["rates"][:5]}
                          for g in groups]}
    adam = (f"{main['optimizer']} betas {tuple(main['betas'])}, eps {main['eps']:g}" if adaptive and main["eps"]
            is not None else main["optimizer"])
    several = f"; {len(groups)} param groups" if len(groups) > 1 else ""
    shape = f"peak {peak:.1e} at step {peak_step} ({main['source']}); {adam}{several}"

    seen = [g for g in groups if not g["rising"]]
    if all(g["peak_lr"] < LR_FAIL_LOW for g in groups):
        top = max(groups, key=lambda g: g["peak_lr"])
        if not top["rising"]:
            details.update(peak_lr=top["peak_lr"], peak_step=top["peak_step"])
            hint = f"pick a peak learning rate between 1e-5 and 3e-3 for {top['optimizer']}"
            if any(s["name"] == "LambdaLR" for s in trace.schedules):
                hint = (f"LambdaLR multiplies the optimizer's lr ({top['base_lr']:g}) by your lambda; if the "
                        "lambda already returns the rate (Noam), create the optimizer with lr=1.0")
            every = "every param group peaks" if len(groups) > 1 else "the learning rate peaks"
            return Result.failed(f"{every} below {LR_FAIL_LOW:g}: at most {top['peak_lr']:.1e} (step "
                                 f"{top['peak_step']}), far below the 1e-5..3e-3 range Transformers train at "
                                 f"with {top['optimizer']}; {adam}", hint, details)
    rising = [g for g in groups if g["rising"]]
    if rising and all(g["peak_lr"] < LR_USUAL_LOW for g in groups):
        pace = []
        for g in rising:
            per_step = (g["rates"][-1] - g["rates"][0]) / (len(g["rates"]) - 1)
            pace.append((LR_USUAL_LOW - g["rates"][-1]) / per_step if per_step > 0 else math.inf)
        details["steps_to_usual_low"] = min(pace)
        if min(pace) > WARMUP_HORIZON_STEPS:
            return Result.warned(
                f"the learning rate is still rising at the last of {trace.steps} steps but only reaches "
                f"{max(g['rates'][-1] for g in rising):.1e}; at its pace it reaches {LR_USUAL_LOW:g} (the bottom "
                f"of the usual range) only after about {min(pace):.0f} steps",
                "check the warm-up length and the base rate the schedule multiplies", details)
        return Result.passed(f"still warming up at the last of {trace.steps} recorded steps "
                             f"({max(g['rates'][-1] for g in rising):.1e} and rising; the peak lies beyond them); "
                             f"{adam}{several}", details)

    high = [g for g in seen if g["holds"].get("matrix") and g["family"] in LR_WARN_HIGH
            and g["peak_lr"] > LR_WARN_HIGH[g["family"]]]
    by_design = [g for g in seen if not g["holds"].get("matrix") and sum(g["holds"].values())
                 and g["family"] in LR_WARN_HIGH and g["peak_lr"] > LR_WARN_HIGH[g["family"]]]
    if high:
        listed = ", ".join(f"{_describe(g)} (usual peak up to {LR_WARN_HIGH[g['family']] / 10:g})" for g in high)
        details["too_high"] = [[g["optimizer"], g["group"]] for g in high]
        blown = _blow_up(trace)
        hint = "lower the peak learning rate of the weight matrices (Adam family: 1e-5..3e-3)"
        if blown:
            details["blow_up"] = blown
            return Result.failed(f"the learning rate is far above the usual peak: {listed}; and {blown}",
                                 hint, details)
        return Result.warned(f"the learning rate is far above the usual peak: {listed} (the loss did not "
                             f"blow up within {trace.steps} steps)", hint, details)
    def listed(gs):
        return ", ".join(_describe(g) + (" (by design: embeddings/norms)" if g in by_design else "") for g in gs[:6])

    note = f"; large rates on {listed(by_design)}" if by_design and len(groups) == 1 else ""
    families = {g["family"] for g in groups}
    if families == {"adam"} and not main["rising"] and start > WARMUP_START_SHARE * peak:
        return Result.warned(f"no warm-up: the first step already runs at {start:.1e}, "
                             f"{start / peak:.0%} of the peak; {shape}{note}",
                             "ramp the rate up over the first steps, e.g. LambdaLR(optimizer, lambda s: "
                             "min(1.0, (s + 1) / warmup_steps)) (often combined with a decay)", details)
    if len(groups) > 1:
        classes = ", ".join(dict.fromkeys(g["optimizer"] for g in groups))
        return Result.passed(f"{len(groups)} param groups ({classes}) peak at {listed(groups)}; "
                             f"schedule {main['source']}", details)
    return Result.passed(f"warm-up from {start:.1e} to a {shape}{note}" if start < peak else f"{shape}{note}",
                         details)


@check("amp-loss-scaling", title="float16 autocast comes with loss scaling", needs=("train",))
@_at("autocast", "backward")
def amp_loss_scaling(subject) -> Result:
    """Catches float16 autocast without a GradScaler: float16 cannot hold gradients below about 6e-8
    (and loses precision below 6e-5), so many Transformer gradients silently become zero. bfloat16
    has float32's range and needs no scaling.

    Reads the autocast regions the loop requested (also a CUDA autocast that disables itself on a
    CPU-only machine) and whether its backward calls start from a GradScaler-scaled loss.

    Fix: `torch.amp.GradScaler('cuda')` around backward and step, or autocast with
    `dtype=torch.bfloat16`.
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
@_at("opt_step", "backward")
def grad_health(subject) -> Result:
    """Catches NaN or Inf gradients reaching the optimizer (every weight they touch becomes NaN) and
    notes a pre-clip gradient norm that grows at every step (usually a learning rate set too high).

    Records the global gradient norm over all parameters before any clipping at each optimizer step
    and draws it as a sparkline.

    Fix: find the first non-finite gradient with `torch.autograd.set_detect_anomaly(True)`; clip and
    lower the rate.
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
    for window, step_norm, step_finite in _step_norms(trace):
        norm, ok = pre_clip.get(window, (step_norm, step_finite))
        norms.append(norm)
        finite.append(ok and step_finite)
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


@check("optimizer-coverage", title="Every parameter that gets a gradient is updated by an optimizer",
       needs=("train",))
@_at("opt_step")
def optimizer_coverage(subject) -> Result:
    """Catches parameters that receive gradients but sit in no optimizer: they keep their initial
    values however long you train (an optimizer built before a module was added, a param-group filter
    by name that misses some). nanoGPT's configure_optimizers asserts this for the same reason.

    Compares the parameters that hold a gradient at the loop's optimizer steps with those its
    optimizers hold. Also makes sure the loop left your own model as it found it: the loop trains a
    copy, and function attributes that captured submodules (minGPT's `self.mlpf = lambda x: ...`),
    which copy.deepcopy does not copy, are rebuilt on the copy; anything of yours the loop still
    changed is put back and reported.

    Also fails a loop that took no optimizer step at all: it returned without iterating over its
    batches, or iterated without a backward() or any change to the weights (an empty DataLoader, a
    `range(1, epochs)` that is empty, a filter that keeps nothing), so nothing trains.

    Fix: build the optimizer from every trainable parameter; reach submodules through `self`, not
    through a closure. A loop that never steps: make it iterate over the batches it is given.
    """
    trace = _trace(subject)
    untrained = _untrained(trace)
    if untrained:
        return Result.failed(untrained, "make the loop iterate over the batches it is given and call loss.backward() "
                                        "and optimizer.step() on them (an empty DataLoader: check its dataset, "
                                        "batch_size and drop_last)",
                             {"batches_fed": trace.batches_fed, "optimizer_steps": 0, "backward_calls": 0})
    reason = _stepped(trace)
    if reason:
        return Result.skipped(reason)
    coverage, isolation = trace.coverage, trace.isolation
    restored, rebound = isolation.get("restored", []), isolation.get("rebound", [])
    missing = coverage.get("not_optimized", [])
    details = {"parameters_with_grad": coverage.get("with_grad"), "trainable": coverage.get("trainable"),
               "not_optimized": missing[:20], "never_reached": coverage.get("never_reached", [])[:20],
               "optimizers": coverage.get("optimizers"), "rebound": rebound, "restored": restored[:20]}
    if missing:
        return Result.failed(
            f"{len(missing)} of the {coverage['with_grad']} parameter tensors that receive gradients are in no "
            f"optimizer and never change: {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}",
            "build the optimizer from every trainable parameter (model.parameters(), or param groups that "
            "together cover all of model.named_parameters()); set requires_grad=False on what you freeze",
            details)
    if restored:
        return Result.warned(
            f"training tfdoctor's copy of your model changed {len(restored)} of your model's own tensors "
            f"({', '.join(restored[:4])}{', ...' if len(restored) > 4 else ''}): the copy still shares them "
            "through something copy.deepcopy cannot follow; tfdoctor put them back, but an EMA or any "
            "copy.deepcopy(model) shares them the same way",
            "reach submodules through self inside forward (self.mlp(x)), not through a closure stored on "
            "the module", details)
    if trace.manual and not coverage.get("optimizers"):
        return Result.skipped("the loop updates the parameters itself (no optimizer object)", details)
    note = ""
    if rebound:
        note = (f"; note: copy.deepcopy(model) shares submodules with the original through "
                f"{', '.join(rebound[:3])}{', ...' if len(rebound) > 3 else ''} (functions are not copied): "
                "tfdoctor rebuilt them on its copy, but an EMA made with deepcopy would run your live weights")
    return Result.passed(f"all {coverage['with_grad']} parameter tensors that receive gradients are in the "
                         f"loop's optimizer{'s' if coverage.get('optimizers', 1) > 1 else ''}{note}", details)
