"""Shared ways of turning several measurements into one check verdict (not a check family)."""

from __future__ import annotations

from typing import Callable, Optional

from tfdoctor.result import Result, Status


def judged_per_implementation(subject, judge: Callable[[Optional[str]], Result]) -> Result:
    """judge(implementation) under each attention implementation the model supports (eager and
    sdpa for Hugging Face models, the model as it is otherwise). The first verdict that is not a
    pass is returned, naming its implementation; a skip only when every implementation skips.

    The model is judged by the implementation it runs (configured, or the library's default as
    resolved in config._attn_implementation): a failure under another implementation only is a
    warning not to switch."""
    from tfdoctor.probes.implementations import configured_implementation, label, per_implementation

    verdicts = per_implementation(subject.model, judge)
    configured = configured_implementation(subject.model)
    if configured is not None:
        demoted = _demoted_to_warning(subject.model, verdicts, configured)
        if demoted is not None:
            return demoted
    implementations = [impl for impl, _ in verdicts if impl]
    bad = [(impl, r) for impl, r in verdicts if r.status not in (Status.PASS, Status.SKIP)]
    bad.sort(key=lambda verdict: verdict[0] != configured)  # the implementation the model runs first
    passed = [(impl, r) for impl, r in verdicts if r.status is Status.PASS]
    impl, result = (bad or passed or verdicts)[0]
    if implementations:
        result.details["attn_implementations"] = implementations
        result.details["failing_implementations"] = [i for i, _ in bad]
    if configured is not None:
        result.details["configured_implementation"] = configured
    if bad:
        result.message = label(impl, len(verdicts)) + result.message
    elif len(implementations) > 1 and result.status is Status.PASS:
        result.message += f"; same with attn_implementation {' and '.join(implementations)}"
    return result


def _demoted_to_warning(model, verdicts, configured: str) -> Optional[Result]:
    """The warning for a model that passes under its configured implementation and not under
    another; None when the usual rule applies (the configured one fails or skips, or all pass)."""
    from tfdoctor.probes.implementations import library_release

    own = dict(verdicts)[configured]
    others = [(impl, r) for impl, r in verdicts if impl != configured and r.status not in (Status.PASS, Status.SKIP)]
    if own.status is not Status.PASS or not others:
        return None
    impl, other = others[0]
    release = library_release(model)
    details = dict(other.details)
    details.update(attn_implementations=[i for i, _ in verdicts if i], failing_implementations=[i for i, _ in others],
                   configured_implementation=configured, configured_verdict=own.message,
                   status_under_other=other.status.value, library=release)
    return Result.warned(
        f"with attn_implementation={impl!r} (not {configured!r}, the one this model runs, which passes): "
        f"{other.message}",
        f"keep attn_implementation={configured!r}: do not switch to {impl} on this release ({release}); "
        f"re-check after upgrading before you switch", details)
