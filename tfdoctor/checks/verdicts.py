"""Shared ways of turning several measurements into one check verdict (not a check family)."""

from __future__ import annotations

from typing import Callable, Optional

from tfdoctor.result import Result, Status


def judged_per_implementation(subject, judge: Callable[[Optional[str]], Result]) -> Result:
    """judge(implementation) under each attention implementation the model supports (eager and
    sdpa for Hugging Face models, the model as it is otherwise). The first verdict that is not a
    pass is returned, naming its implementation; a skip only when every implementation skips."""
    from tfdoctor.probes.implementations import label, per_implementation

    verdicts = per_implementation(subject.model, judge)
    implementations = [impl for impl, _ in verdicts if impl]
    bad = [(impl, r) for impl, r in verdicts if r.status not in (Status.PASS, Status.SKIP)]
    passed = [(impl, r) for impl, r in verdicts if r.status is Status.PASS]
    impl, result = (bad or passed or verdicts)[0]
    if implementations:
        result.details["attn_implementations"] = implementations
        result.details["failing_implementations"] = [i for i, _ in bad]
    if bad:
        result.message = label(impl, len(verdicts)) + result.message
    elif len(implementations) > 1 and result.status is Status.PASS:
        result.message += f"; same with attn_implementation {' and '.join(implementations)}"
    return result
