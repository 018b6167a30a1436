"""Schedule judge: does the learning rate of every param group warm up to a peak a Transformer can
train at (lr-schedule)? Judges the one recorded trace of the loop, handed in by the runner, through
each param group's rates as recording/windows.py reads them (GroupSchedule): recorded, or projected
from its scheduler when the recording ended. Plain numbers only: no scheduler runs here.
"""

from __future__ import annotations

import math

from tfdoctor.recording.windows import GroupSchedule, group_schedules, step_norms, stepped, window_losses
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.sparkline import sparkline

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
# No warm-up matters when the first updates are large against the weights. Adam's first step moves
# every weight with a gradient by about lr (m / sqrt(v) is +-1 then, whatever the gradient's size), so
# lr / RMS(weights) is the share of its typical size each weight moves. Training from scratch at 1e-3
# on weights of std 0.02 moves them 5% a step, the regime warm-up exists for; fine-tuning at 5e-5
# moves them 0.1-0.25%, and LLMs-from-scratch's 5e-4 on PyTorch's default init (std ~0.036) 1.4%.
# From 2% a step the absence of warm-up warns; below, it is a note.
WARMUP_MATTERS_SHARE = 0.02


def _blow_up(trace) -> str | None:
    """What shows that the loop's training blew up within the recorded steps, or None."""
    bad = [i + 1 for i, (_, _, ok) in enumerate(step_norms(trace)) if not ok]
    if bad:
        return f"gradients were NaN/Inf from step {bad[0]}"
    losses = window_losses(trace)
    if len(losses) >= 2 and (not math.isfinite(losses[-1]) or losses[-1] > BLOWUP_LOSS_FACTOR * losses[0]):
        return f"the loss rose from {losses[0]:.2f} to {losses[-1]:.2f} within {len(losses)} steps"
    return None


def _holds(group: GroupSchedule) -> str:
    held = group.holds
    parts = [kind if kind != "vector" else "norms/biases" for kind in ("matrix", "embedding", "vector")
             if held.get(kind)]
    return "matrices" if parts == ["matrix"] else " + ".join(p if p != "matrix" else "matrices" for p in parts) \
        or "?"


def _describe(group: GroupSchedule) -> str:
    rising = " and rising" if group.rising else ""
    return f"{group.optimizer} group {group.group} ({_holds(group)}) {group.peak_lr:.2g}{rising}"


# The schedule kept as evidence (the HTML report draws it): at most this many [step, rate] points, as a
# projection runs to 40,000 steps and a JSON report should stay small.
SCHEDULE_POINTS = 400


def _thinned(rates: list[float]) -> list[list]:
    stride = max(1, math.ceil(len(rates) / SCHEDULE_POINTS))
    kept = [[step, rates[step]] for step in range(0, len(rates), stride)]
    return kept if kept[-1][0] == len(rates) - 1 else kept + [[len(rates) - 1, rates[-1]]]


def _main_group(groups: list[GroupSchedule]) -> tuple[GroupSchedule, dict]:
    """The param group that holds the most tensors (the highest peak among equals), and the evidence:
    its schedule, then every group's."""
    main = max(groups, key=lambda g: (sum(g.holds.values()), g.peak_lr))
    details = {"source": main.source, "peak_lr": main.peak_lr, "peak_step": main.peak_step,
               "start_lr": main.start_lr, "optimizer": main.optimizer, "base_lr": main.base_lr,
               "betas": main.betas, "eps": main.eps, "weight_decay": main.weight_decay,
               "schedule_sparkline": sparkline(main.rates), "schedule_head": main.rates[:5],
               "schedule": _thinned(main.rates), "groups": [g.evidence() for g in groups]}
    return main, details


def _no_warmup(groups: list[GroupSchedule], start: float, peak: float, details: dict) -> Result | str:
    """A schedule with no warm-up on Adam: a warning (the start of its message) where the first update
    is large against the weights, else the note to add to the pass."""
    moved = _first_update_share(groups)
    said = f"no warm-up: the first step already runs at {start:.1e}, {start / peak:.0%} of the peak"
    details["first_update_share"] = moved[0] if moved is not None else None
    if moved is None or moved[0] >= WARMUP_MATTERS_SHARE:
        size = (f"; Adam's first update moves each weight by about the rate, {moved[0]:.1%} of the typical "
                f"size of the weight matrices (RMS {moved[1]:.2g}) at once" if moved is not None else "")
        return Result.warned(f"{said}{size}", "ramp the rate up over the first steps, e.g. LambdaLR(optimizer, "
                                              "lambda s: min(1.0, (s + 1) / warmup_steps)) (often combined with "
                                              "a decay)", details)
    return (f"; {said} (a note: the first updates move the weights by about {moved[0]:.2%} of their typical "
            f"size (RMS {moved[1]:.2g}), small enough without one)")


def _first_update_share(groups: list[GroupSchedule]) -> tuple[float, float] | None:
    """(the largest share of its weights' typical size that a group of weight matrices moves at the
    first step, that size), from the first rate and the matrices' RMS before it; None when unknown."""
    shares = [(g.start_lr / g.matrix_rms, g.matrix_rms) for g in groups
              if g.matrix_rms and g.holds.get("matrix") and g.start_lr > 0]
    return max(shares) if shares else None


@check("lr-schedule", title="The learning-rate schedule warms up to a sensible peak",
       located=("sched_step", "opt_step"))
def lr_schedule(subject, trace) -> Result:
    """Catches a learning rate that cannot train a Transformer: every param group peaking far below
    the range they train at (a Noam LambdaLR left on Adam's default lr=1e-3 peaks near 7e-7, a
    thousand times too small, because LambdaLR multiplies the optimizer's lr by the lambda); a
    weight-matrix group far above its optimizer family's usual peak (warned, failed only if the loss
    or gradients blow up within the loop's steps); and, for pure Adam-family loops, a schedule with no
    warm-up whose first update is large against the weights (warned from 2% of their typical size a
    step: early updates on untrained attention are the unstable ones; smaller, a note).

    Judged per param group and per family: Adam-like groups, Muon, SGD, a loop that updates the weights
    itself. Groups of embedding tables or norm gains are not judged high (some train them at 0.6 by
    design). Each scheduler is projected forward on a copy bound to a stand-in optimizer (the user's
    is not touched) until its peak is seen; a schedule written in the loop (`group["lr"] = ...`) is
    read from the rates it set.

    Fix: Noam lambdas need the optimizer at `lr=1.0`; keep Adam matrix groups within 1e-5..3e-3 and
    ramp the rate up over the first steps.
    """
    reason = stepped(trace)
    if reason:
        return Result.skipped(reason)
    groups = group_schedules(trace)
    if not groups:
        return Result.skipped("the loop's optimizer steps carried no learning rate")
    main, details = _main_group(groups)
    adam = (f"{main.optimizer} betas {tuple(main.betas)}, eps {main.eps:g}" if main.betas is not None
            and main.eps is not None else main.optimizer)
    several = f"; {len(groups)} param groups" if len(groups) > 1 else ""
    schedulers = [s.name for s in trace.schedules]
    return (_too_low(groups, schedulers, adam, details) or _still_warming(groups, trace.steps, adam, several, details)
            or _too_high(groups, trace, details) or _sensible(groups, main, adam, several, details))


def _too_low(groups: list[GroupSchedule], schedulers: list[str], adam: str, details: dict) -> Result | None:
    """Fails when every group peaks below LR_FAIL_LOW (and the highest is not still rising)."""
    if not all(g.peak_lr < LR_FAIL_LOW for g in groups):
        return None
    top = max(groups, key=lambda g: g.peak_lr)
    if top.rising:
        return None
    details.update(peak_lr=top.peak_lr, peak_step=top.peak_step)
    hint = f"pick a peak learning rate between 1e-5 and 3e-3 for {top.optimizer}"
    if "LambdaLR" in schedulers:
        hint = (f"LambdaLR multiplies the optimizer's lr ({top.base_lr:g}) by your lambda; if the "
                "lambda already returns the rate (Noam), create the optimizer with lr=1.0")
    every = "every param group peaks" if len(groups) > 1 else "the learning rate peaks"
    return Result.failed(f"{every} below {LR_FAIL_LOW:g}: at most {top.peak_lr:.1e} (step "
                         f"{top.peak_step}), far below the 1e-5..3e-3 range Transformers train at "
                         f"with {top.optimizer}; {adam}", hint, details)


def _still_warming(groups: list[GroupSchedule], steps: int, adam: str, several: str, details: dict) -> Result | None:
    """A recorded schedule still rising below the usual range: passes when its pace reaches the range
    within WARMUP_HORIZON_STEPS, else warns."""
    rising = [g for g in groups if g.rising]
    if not rising or not all(g.peak_lr < LR_USUAL_LOW for g in groups):
        return None
    pace = []
    for g in rising:
        per_step = (g.rates[-1] - g.rates[0]) / (len(g.rates) - 1)
        pace.append((LR_USUAL_LOW - g.rates[-1]) / per_step if per_step > 0 else math.inf)
    details["steps_to_usual_low"] = min(pace)
    reached = max(g.rates[-1] for g in rising)
    if min(pace) > WARMUP_HORIZON_STEPS:
        return Result.warned(
            f"the learning rate is still rising at the last of {steps} steps but only reaches "
            f"{reached:.1e}; at its pace it reaches {LR_USUAL_LOW:g} (the bottom "
            f"of the usual range) only after about {min(pace):.0f} steps",
            "check the warm-up length and the base rate the schedule multiplies", details)
    return Result.passed(f"still warming up at the last of {steps} recorded steps "
                         f"({reached:.1e} and rising; the peak lies beyond them); "
                         f"{adam}{several}", details)


def _far_above(group: GroupSchedule) -> bool:
    return group.family in LR_WARN_HIGH and group.peak_lr > LR_WARN_HIGH[group.family]


def _too_high(groups: list[GroupSchedule], trace, details: dict) -> Result | None:
    """Warns when a group of weight matrices peaks far above its family's usual peak; fails when the
    loop's loss or gradients also blew up within the recorded steps."""
    high = [g for g in groups if not g.rising and g.holds.get("matrix") and _far_above(g)]
    if not high:
        return None
    listed = ", ".join(f"{_describe(g)} (usual peak up to {LR_WARN_HIGH[g.family] / 10:g})" for g in high)
    details["too_high"] = [[g.optimizer, g.group] for g in high]
    blown = _blow_up(trace)
    hint = "lower the peak learning rate of the weight matrices (Adam family: 1e-5..3e-3)"
    if blown:
        details["blow_up"] = blown
        return Result.failed(f"the learning rate is far above the usual peak: {listed}; and {blown}", hint, details)
    return Result.warned(f"the learning rate is far above the usual peak: {listed} (the loss did not "
                         f"blow up within {trace.steps} steps)", hint, details)


def _sensible(groups: list[GroupSchedule], main: GroupSchedule, adam: str, several: str, details: dict) -> Result:
    """Passes, noting large rates on groups that are high by design; warns when a pure Adam-family
    schedule has no warm-up and its first update is large against the weights."""
    start, peak = main.start_lr, main.peak_lr
    by_design = [g for g in groups if not g.rising and not g.holds.get("matrix") and sum(g.holds.values())
                 and _far_above(g)]

    def described(some: list[GroupSchedule]) -> str:
        return ", ".join(_describe(g) + (" (by design: embeddings/norms)" if g in by_design else "")
                         for g in some[:6])

    shape = f"peak {peak:.1e} at step {main.peak_step} ({main.source}); {adam}{several}"
    note = f"; large rates on {described(by_design)}" if by_design and len(groups) == 1 else ""
    if {g.family for g in groups} == {"adam"} and not main.rising and start > WARMUP_START_SHARE * peak:
        warned = _no_warmup(groups, start, peak, details)
        if isinstance(warned, Result):
            warned.message = f"{warned.message}; {shape}{note}"
            return warned
        note += warned
    if len(groups) > 1:
        classes = ", ".join(dict.fromkeys(g.optimizer for g in groups))
        return Result.passed(f"{len(groups)} param groups ({classes}) peak at {described(groups)}; "
                             f"schedule {main.source}", details)
    return Result.passed(f"warm-up from {start:.1e} to a {shape}{note}" if start < peak else f"{shape}{note}",
                         details)
