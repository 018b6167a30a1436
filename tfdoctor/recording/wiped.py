"""Optimizer steps taken on gradients that were wiped after the backward made them: the evidence
zero-grad judges beside stale gradients (a pure function of the Trace, no hooks).

`optimizer.zero_grad()` moved between `loss.backward()` and `optimizer.step()` still clears the
gradients once per step, so the stale-gradient test passes; but every step then runs on zeros (or on
no gradient at all, with set_to_none) and the weights never learn. Read off the trace: the last
backward of a step left non-zero gradients (seen on a sample of their elements), and the exact norm
of the gradients the optimizers were handed at that step is 0.
"""

from __future__ import annotations

from tfdoctor.recording.events import holds_only_frozen


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
