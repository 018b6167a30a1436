"""Measures on a recorded loop (a Trace), shared by the loop judges: which optimizer-step window
each call fell in, the micro-batches per window, the gradient norm at each step, the steps taken on
gradients wiped after the backward, the token weight and loss each window gave the scores, the graded
targets' alignment with the input ids, the learning rate of every param group at each step. Plain
functions of the Trace (and the Subject's kind and pad id), no verdicts: the judges in
tfdoctor/checks/ read them against their thresholds.

Torch is imported inside the functions that need it: the check modules import this one, and
`tfdoctor checks` lists them without loading torch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Optional

from tfdoctor.recording.events import holds_only_frozen
from tfdoctor.recording.trace import MANUAL_UPDATE

# objective: the offsets tried between a scored position and the input token it is graded on.
OFFSETS = (-1, 0, 1, 2, 3)
# The share of graded positions an offset must explain before the input ids are read as the targets
# (objective, ignore-index, eos-trained, packing-labels). On random tokens the right offset matches
# every position and a wrong one about 1/V of them, so 0.9 leaves room only for coincidences.
ALIGN_MIN_SHARE = 0.9


def stepped(trace) -> str | None:
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


def micro_batches(trace) -> tuple[int, dict[int, int]]:
    """Backward calls per optimizer-step window, and the accumulation k: the most common count,
    read past the first window (`if step % k == 0` steps after the very first micro-batch)."""
    per_window = Counter(e.window for e in trace.of("backward") if e.window < trace.steps)
    if not per_window:
        return 0, {}
    later = [n for w, n in per_window.items() if w > 0] or list(per_window.values())
    return Counter(later).most_common(1)[0][0], dict(per_window)


def step_norms(trace) -> list[tuple[int, float, bool]]:
    """(window, gradient norm, all finite) per optimizer step of the loop; optimizers stepped together
    hold disjoint parameters, so their norms add in quadrature."""
    steps: dict[int, list] = {}
    for event in trace.of("opt_step"):
        held = steps.setdefault(event.window, [0.0, True])
        held[0] += event.data["grad_norm"] ** 2
        held[1] = held[1] and event.data["finite"]
    return [(w, math.sqrt(sq), ok) for w, (sq, ok) in sorted(steps.items())]


def backward_window(trace) -> dict[int, tuple[int, float]]:
    """For each backward event's index: its window and the GradScaler scale it ran under (1.0 if none)."""
    return {i: (e.window, e.data["scale"] or 1.0) for i, e in enumerate(trace.events) if e.kind == "backward"}


def window_weights(trace) -> dict[int, float]:
    """The summed token weight each optimizer-step window's gradient gives the scored tokens when it
    reaches the step: read from the gradient at the scores, times any rescaling of .grad between the
    last backward and the step (1.0 is the mean over the window's tokens)."""
    backwards = backward_window(trace)
    rescale = getattr(trace, "grad_rescale", {})
    totals: dict[int, float] = {}
    for entry in trace.scores:
        if entry.get("backward") not in backwards:
            continue
        window, scale = backwards[entry["backward"]]
        totals[window] = totals.get(window, 0.0) + float(entry["weights"].sum()) / scale * rescale.get(window, 1.0)
    return totals


def window_losses(trace) -> list[float]:
    """The weighted mean loss of the graded tokens at each window, from the scores' gradients."""
    backwards = backward_window(trace)
    sums: dict[int, list[float]] = {}
    for entry in trace.scores:
        if entry.get("backward") not in backwards:
            continue
        window = backwards[entry["backward"]][0]
        held = sums.setdefault(window, [0.0, 0.0])
        held[0] += float((entry["weights"] * entry["nll"]).sum())
        held[1] += float(entry["weights"].sum())
    return [total / weight for _, (total, weight) in sorted(sums.items()) if weight > 0]


def scaled_clips(trace) -> list[tuple]:
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


# Optimizer steps taken on gradients wiped after the backward made them (zero-grad's evidence beside
# stale gradients). `optimizer.zero_grad()` moved between `loss.backward()` and `optimizer.step()`
# still clears the gradients once per step, so the stale-gradient test passes; but every step then
# runs on zeros (or on no gradient at all, with set_to_none) and the weights never learn. Read off the
# trace: the last backward of a step left non-zero gradients (seen on a sample of their elements), and
# the exact norm of the gradients the optimizers were handed at that step is 0.
def wiped_steps(trace) -> list[dict]:
    """One entry per optimizer step (window) whose optimizers all got zero or missing gradients while
    the window's last backward had left non-zero ones: its step number (1-based) and where it stepped."""
    after: dict[int, bool] = {}
    cleared: dict[int, str] = {}  # window -> where zero_grad() was called after its last backward
    for event in trace.events:
        if event.kind == "backward" and "grads_after" in event.data:
            after[event.window] = event.data["grads_after"]  # the window's last backward wins
            cleared.pop(event.window, None)
        elif event.kind == "zero_grad" and event.window in after and event.data.get("where"):
            cleared.setdefault(event.window, event.data["where"])
    steps: dict[int, list] = {}
    for event in trace.of("opt_step"):
        if event.data.get("manual"):  # a hand-written update is read off the weights, not a .grad
            continue
        steps.setdefault(event.window, []).append(event)
    wiped = []
    for window, events in sorted(steps.items()):
        # an optimizer that holds only frozen parameters gets no gradient whatever the loop clears:
        # optimizer-coverage's finding, not a zero_grad() misplaced
        if after.get(window) and all(e.data["grad_norm"] == 0.0 for e in events) \
                and not all(holds_only_frozen(e.data) for e in events):
            wiped.append({"step": window + 1, "where": cleared.get(window) or events[-1].data.get("where"),
                          "call": "zero_grad()" if window in cleared else "optimizer.step()"})
    return wiped


def order(trace, window: int) -> str:
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


def micro_batch_weights(trace) -> dict[int, list[dict]]:
    """Per optimizer-step window, per backward call (micro-batch): its trained tokens (gradient weight
    > 0 at the scores) and their mean, smallest and largest weight, the GradScaler's scale divided out."""
    backwards = backward_window(trace)
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


# ------------------------------------------------------------------------------------------------


_NOT_INPUT_IDS = ("label", "target", "mask", "position", "token_type")


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


def scored_grids(trace, subject) -> list[dict]:
    """Each scored tensor that reached a backward, laid out on the [d0, d1] grid of the input ids it
    came from: targets, weights, hard (one graded token), ids, the offset correction, and the
    forward's other integer inputs by name (position ids, document ids)."""
    forwards = {e.data["index"]: e.data for e in trace.of("forward")}
    backwards = backward_window(trace)
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
                      "hard": grid(entry["hard"]), "correction": correction, "inputs": dict(forward["inputs"])})
    return grids


def alignment(trace, subject) -> dict:
    """Over the graded tokens that could be traced back to an input position: for each layout (which
    axis of the ids is time) and offset k, the share of targets equal to the input token k positions
    on. The layout and offset that explain the most are the loop's."""
    import torch

    matches = {(axis, k): 0 for axis in (1, 0) for k in OFFSETS}
    judged = dict.fromkeys(matches, 0)
    rows = 0
    grids = scored_grids(trace, subject)
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


def no_scores(trace, subject) -> str:
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


def optimizer_families(trace) -> set[str]:
    """The update rules of the loop's stepped optimizers (see _family): "sgd", "adam", "muon", "manual",
    "other"."""
    found = {_family(optimizer.class_name, group) for optimizer in trace.optimizers for group in optimizer.groups}
    if getattr(trace, "manual", False) and not trace.optimizers:
        found.add("manual")
    return found


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


@dataclass
class GroupSchedule:
    """One param group's learning rate over the loop's steps, with what the lr-schedule judge weighs it
    against (its optimizer family, hyperparameters, what it holds), as plain data."""

    optimizer: str  # the optimizer's class, "manual update" for a loop that updates the weights itself
    group: int  # the param group's index in its optimizer
    family: str  # adam | muon | sgd | manual | other (see _family)
    rates: list[float]  # the rate at each step: projected from the scheduler's start, or as recorded
    source: str  # where `rates` come from, in the user's terms
    peak_lr: float
    peak_step: int
    start_lr: float
    rising: bool  # recorded (not projected) rates still rising at the last step: the peak is not seen
    base_lr: Any  # the group's initial_lr (a scheduler's base), else its lr; None for a manual update
    betas: Any  # Adam's betas as a list, None for optimizers without them
    eps: Any
    weight_decay: Any
    holds: dict[str, int]  # how many embedding tables, weight matrices and vectors the group holds
    names: list[str]  # the parameters it holds
    matrix_rms: Optional[float]  # the median RMS of its weight matrices before the first update

    def evidence(self) -> dict:
        """The group as a check's details show it: every field but the rates, then their first five."""
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rates"}
        return shown | {"rates_head": self.rates[:5]}


def group_schedules(trace) -> list[GroupSchedule]:
    """Every param group of every optimizer the loop stepped (a loop that updates the weights itself
    counts as one group): its learning rate at each step, projected from its scheduler when it has
    one (Trace.schedules, projected when the recording ended), else as recorded (a manual
    `group["lr"] = f(step)` is read from what it set)."""
    recorded: dict = {}
    first_rms: dict = {}  # optimizer -> its groups' weight-matrix RMS before the first update
    for event in trace.of("opt_step"):
        recorded.setdefault(event.data["optimizer"], []).append(event.data["lrs"])
        if "matrix_rms" in event.data:
            first_rms.setdefault(event.data["optimizer"], event.data["matrix_rms"])
    projected = {}  # optimizer -> (each group's rates, their source): the scheduler stepped most often wins
    for schedule in sorted(trace.schedules, key=lambda s: -s.steps):
        if schedule.optimizer in projected:
            continue
        groups = schedule.projected
        if groups:
            projected[schedule.optimizer] = (groups, f"{schedule.name} projected over {len(groups[0])} steps")
    optimizers = {o.id: o for o in trace.optimizers}
    found = []
    for key, steps in recorded.items():
        optimizer = optimizers.get(key, MANUAL_UPDATE)
        for index in range(max(len(lrs) for lrs in steps)):
            rates = [lrs[index] for lrs in steps if index < len(lrs)]
            group = optimizer.groups[index] if index < len(optimizer.groups) else {}
            held = optimizer.composition[index] if index < len(optimizer.composition) else {}
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
            rms = first_rms.get(key) or []
            found.append(GroupSchedule(
                optimizer=optimizer.class_name, group=index, family=_family(optimizer.class_name, group), rates=rates,
                source=source, peak_lr=peak, peak_step=rates.index(peak), start_lr=rates[0], rising=rising,
                base_lr=group.get("initial_lr", group.get("lr")), betas=group.get("betas"), eps=group.get("eps"),
                weight_decay=group.get("weight_decay"),
                holds={k: held.get(k, 0) for k in ("embedding", "matrix", "vector")},
                names=held.get("names", []), matrix_rms=rms[index] if index < len(rms) else None))
    return found
