"""Judge a model by the attention implementation it runs: a measurement under another one that
fails, or raises, says what would happen after a switch, a warning, not the model's verdict.

The implementation a Hugging Face model runs is `config._attn_implementation` as transformers
resolved it (sdpa by default where the model supports it, eager otherwise, or what the user
configured). The invariance and decoding checks wrap their per-implementation judge with
`judged_as_run`, so that the verdict holds whichever way the shared combiner (checks/verdicts/)
orders them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from tfdoctor.errors import first_line
from tfdoctor.probes.decoding import MODEL_ERRORS, raised_by_model
from tfdoctor.probes.implementations import configured_implementation, using_implementation
from tfdoctor.result import Result


def _demoted(result: Result, implementation: str, running: str) -> Result:
    details = dict(result.details, status_under_implementation=result.status.value, runs=running)
    return Result.warned(result.message,
                         f"{result.hint}; this holds only under attn_implementation={implementation!r}, "
                         f"not under {running!r}, which the model runs: do not switch to {implementation!r}", details)


def _raised(implementation: str, running: str, exc: BaseException) -> Result:
    return Result.warned(f"the model raises under attn_implementation={implementation!r} ({first_line(exc)}); it runs "
                         f"{running!r}, which was judged", f"keep attn_implementation={running!r}: the model cannot "
                         f"run {implementation!r} on this release", {"raised": first_line(exc), "runs": running})


def judged_as_run(model: torch.nn.Module,
                  judge: Callable[[Optional[str]], Result]) -> Callable[[Optional[str]], Result]:
    """judge(implementation) wrapped: under the implementation the model runs it is judge itself
    (measured once); under another, an exception the model raised is a warning naming it, and a
    result that is not a pass or skip while the running one passes (or skips) is a warning not to
    switch."""
    running = configured_implementation(model)
    own: dict = {}

    def run_own():
        if "result" not in own:
            with using_implementation(model, running):
                own["result"] = judge(running)
        return own["result"]

    def wrapped(implementation):
        if running is None or implementation is None:
            return judge(implementation)
        if implementation == running:
            return run_own()
        try:
            result = judge(implementation)
        except MODEL_ERRORS as exc:
            if not raised_by_model(exc):
                raise
            if run_own().status.value not in ("pass", "skip"):  # the running one's verdict is the one to report
                return Result.skipped(f"the model raises under attn_implementation={implementation!r} "
                                      f"({first_line(exc)})", {"raised": first_line(exc)})
            return _raised(implementation, running, exc)
        if result.status.value in ("fail", "error", "warn") and run_own().status.value in ("pass", "skip"):
            return _demoted(result, implementation, running)
        return result

    return wrapped
