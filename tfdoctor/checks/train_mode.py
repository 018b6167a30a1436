"""The mode the model trained in (trained-in-eval): optimizer steps whose training forwards ran with
the model's dropout (or batch norm) in eval mode, and the `eval()` call that left it there. The
evidence is recorded at each training forward (recording/recorder.py: which dropout and batch norm
modules of the trained part were in eval mode) and at each outermost `Module.train(mode)` call (an
`eval()` is one), with the user's line.
"""

from __future__ import annotations

from tfdoctor.recording.windows import stepped
from tfdoctor.registry import check
from tfdoctor.result import Result

NAMED = 3  # module names shown in the message; details hold up to 10
KIND_EFFECT = {"dropout": "dropout off", "batch norm": "batch norm on its running statistics"}


@check("trained-in-eval", title="Training steps run with the model in train mode")
def trained_in_eval(subject, trace) -> Result:
    """Catches training in eval mode: a validation function calls `model.eval()` and nothing calls
    `model.train()` again, so every later training step runs with dropout off (and batch norm on its
    running statistics): the model trains without the regularisation it was built with, and nothing
    raises. Also a model that arrives in eval mode (Hugging Face's `from_pretrained` returns one) in a
    loop that never calls `model.train()`.

    Judged on the dropout (p > 0) and batch norm modules of the trained part of the model (a frozen
    encoder kept in eval mode on purpose, as a linear probe does, is not judged); a model with none
    runs alike in both modes and passes.

    Fix: `model.train()` at the start of every training epoch, or right after each evaluation.
    """
    reason = stepped(trace)
    if reason:
        return Result.skipped(reason)
    events = list(enumerate(trace.events))
    forwards = [(i, e) for i, e in events if e.kind == "forward" and "mode_off" in e.data]
    if not forwards:
        return Result.skipped("no training forward of the model was recorded (every forward ran under no_grad)")
    steps = sorted({e.window for _, e in forwards})
    dependent = max(e.data.get("mode_dependent", 0) for _, e in forwards)
    details = {"training_steps": len(steps), "mode_dependent_modules": dependent}
    if dependent == 0:
        return Result.passed("the trained model has no dropout or batch norm: train() and eval() run it alike",
                             details)
    off = [(i, e) for i, e in forwards if e.data["mode_off"]]
    if not off:
        return Result.passed(f"dropout and batch norm were active at every one of the {_steps(len(steps))} "
                             "trained", details)
    off_steps = sorted({e.window for _, e in off})
    first, _ = off[0]
    names = sorted({name for _, e in off for name in e.data["mode_off"]})
    details.update(steps_in_eval_mode=off_steps, modules_in_eval_mode=names[:10],
                   modules_in_eval_mode_count=len(names))
    shown = ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
    kinds = sorted({kind for _, e in off for kind in e.data.get("mode_off_kinds", [])})
    effect = " and ".join(KIND_EFFECT[kind] for kind in kinds)
    said = f"{len(off_steps)} of {_steps(len(steps))} trained with {shown} in eval mode ({effect})"
    cause = _left_in_eval(events, first)
    if cause is not None:
        details["location"], details["call"] = cause.data.get("where", ""), f"{cause.data['module']}.eval()"
    hint = ("call model.train() at the start of each training epoch, or right after each evaluation (for a "
            "deliberately frozen part, eval() that part alone)")
    if off_steps[0] > steps[0]:  # it trained in train mode first: an evaluation left it in eval mode
        left = (f"{cause.data['module']}.eval() left the model in eval mode" if cause is not None
                else "the model was switched to eval mode")
        return Result.failed(f"{said}, from step {off_steps[0]} on, after {off_steps[0] - steps[0]} in train mode: "
                             f"{left} and nothing called train() before the next training step", hint, details)
    if cause is not None and not cause.data.get("by_library"):  # the loop's own eval() before its first step
        return Result.passed(f"{said}: every step, as the loop's own {cause.data['module']}.eval() set before its "
                             "first step (deliberate: LBFGS and RL fine-tuning keep dropout off so)", details)
    return Result.warned(f"{said}: the model was in eval mode from the first step (as from_pretrained() returns "
                         "a model) and the loop never calls model.train()", hint, details)


def _left_in_eval(events: list, before: int):
    """The last `eval()` (train(False)) reaching the model before event `before`, if no train() came
    after it."""
    found = None
    for i, event in events[:before]:
        if event.kind == "mode" and event.data.get("on_model"):
            found = None if event.data["training"] else event
    return found


def _steps(count: int) -> str:
    return f"{count} optimizer step" + ("" if count == 1 else "s")
