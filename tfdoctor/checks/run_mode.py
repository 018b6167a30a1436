"""The mode a whole watched run trained in (eval-mode-steps): optimizer steps whose micro-batches were
trained with the model in eval mode (dropout off), and the `eval()` that left it there. A pure function
of the RunSeries: each row's `eval_mode` and facts["mode_calls"], the model's train()/eval() calls with
the user's line (watching/monitor.py); the loop check of the first steps is trained-in-eval."""

from __future__ import annotations

from tfdoctor.checks.verdicts import logged
from tfdoctor.registry import check
from tfdoctor.result import Result, counted
from tfdoctor.watching.series import RunSeries


@check("eval-mode-steps", title="Training steps run with the model in train mode")
def eval_mode_steps(series: RunSeries) -> Result:
    """Catches training in eval mode over a whole run: a validation function calls `model.eval()` and
    nothing calls `model.train()` again, so every step after the first evaluation trains with dropout
    off, without the regularisation the model was built with, and nothing raises.

    Reads, for each optimizer step, whether the forward of each of its micro-batches ran with the
    model in eval mode, and the model's train()/eval() calls with their lines. Switched to eval mode
    mid-run and left there fails, naming the call; eval mode from the first step warns (the model came
    in eval mode, as from_pretrained() returns one, and the loop never calls train()). A model with no
    active dropout runs alike in both modes and passes.

    Fix: `model.train()` at the start of each epoch, or right after each evaluation.
    """
    if logged.log_of(series) is not None:
        return Result.skipped(logged.missing("training mode", "module.training") + ": a log does not say whether "
                              "the model trained in train() or eval() mode")
    rows = [row for row in series.steps if row.micro_losses]
    if not rows:
        return Result.skipped("no optimizer step with a training loss was recorded")
    if not series.facts.get("dropout"):
        return Result.passed("the model holds no active dropout: train() and eval() run it alike",
                             {"steps": len(rows)})
    off = [row.step for row in rows if row.eval_mode]
    details = {"steps": len(rows), "steps_in_eval_mode": len(off), "first_in_eval_mode": off[0] if off else None}
    if not off:
        return Result.passed(f"dropout was on at every one of the {counted(len(rows), 'optimizer step')}", details)
    hint = "call model.train() at the start of each epoch, or right after each evaluation"
    said = f"{len(off)} of {counted(len(rows), 'optimizer step')} trained with the model in eval mode (dropout off)"
    trained_first = [row.step for row in rows if not row.eval_mode and row.step < off[0]]
    if trained_first:
        cause = _left_in_eval(series.facts.get("mode_calls") or [], off[0])
        if cause:
            details["location"], details["call"] = cause, "model.eval()"
        left = f"model.eval() at {cause}" if cause else "a switch to eval mode"
        return Result.failed(f"{said}, from step {off[0]} on, after {len(trained_first)} in train mode: {left} left "
                             "it there and nothing called model.train() before training went on", hint, details)
    return Result.warned(f"{said}, from the first step: the model was in eval mode when training began (as "
                         "from_pretrained() returns a model) and the loop never calls model.train()", hint, details)


def _left_in_eval(calls: list, first_off: int) -> str:
    """The line of the last eval() (train(False)) on the model made before step `first_off` trained,
    with no train() after it; "" when none was seen."""
    found = ""
    for steps_done, mode, where in calls:
        if steps_done > first_off:
            break
        found = "" if mode else where
    return found
