"""Runs the selected checks on a subject and turns every outcome, crashes included, into data."""

from __future__ import annotations

import dataclasses
import time
import traceback

from tfdoctor.context import RunContext, running, _no_progress
from tfdoctor.registry import CheckSpec, select
from tfdoctor.result import Report, Result, Status
from tfdoctor.subject import Subject, resolve

# On a busy 2-core machine tiny models ran several times slower with 2 intra-op threads than with
# 1 (thread hand-off costs more than the matmuls). Models below this size are probed on 1 thread.
SINGLE_THREAD_MAX_PARAMS = 20_000_000

_NEEDS_HINTS = {
    "pad_id": "pass --pad-id N or Subject(pad_id=N)",
    "train": "pass --train MODULE:FN or Subject(train=fn)",
}


def as_subject(subject_or_model, **fields) -> Subject:
    """A Subject from a Subject or a bare nn.Module, with the non-None `fields` overriding."""
    subject = subject_or_model if isinstance(subject_or_model, Subject) else Subject(subject_or_model)
    while isinstance(subject.model, Subject):  # Subject(build(), pad_id=0) where build() gave a Subject
        outer = {f.name: getattr(subject, f.name) for f in dataclasses.fields(subject) if f.name != "model"}
        subject = dataclasses.replace(subject.model, **{k: v for k, v in outer.items() if v is not None})
    overrides = {k: v for k, v in fields.items() if v is not None}
    return dataclasses.replace(subject, **overrides) if overrides else subject


def run_checks(subject_or_model, only=None, skip=None, *, seed: int = 0, target: str | None = None,
               progress=None, options: dict | None = None, listener=None, **fields) -> Report:
    """Run the battery (or the `only`/`skip` selection) and return the Report.

    `fields` override Subject fields (vocab_size, seq_len, batch_size, pad_id, kind, forward, train).
    `options` are settings for individual checks (see RunContext.options).
    `listener(event, payload)` hears "start" (the check id) and "result" (the Result) as they happen:
    the worker process streams them to its supervisor, so a run cut short keeps what it finished.
    Raises UsageError or SubjectError when the subject cannot be examined at all.
    """
    import torch

    from tfdoctor.probes.modes import preserved_process_state, training_flags

    specs = select(only, skip)
    ctx = RunContext(seed=seed, progress=progress or _no_progress, options=dict(options or {}))
    with running(ctx), preserved_process_state():
        subject = as_subject(subject_or_model, **fields)
        _refuse_meta(subject.model)
        subject, unusable = _resolved(subject)  # its test forward draws random ids
        if unusable is not None:
            specs = _judging_nonfinite(specs)
        report = Report(target or type(subject.model).__name__)
        if sum(p.numel() for p in subject.model.parameters()) <= SINGLE_THREAD_MAX_PARAMS:
            torch.set_num_threads(1)
        flags = training_flags(subject.model)
        for spec in specs:
            if listener is not None:
                listener("start", spec.id)
            blocked = unusable is not None and spec.id != "finite-logits" and "train" not in spec.needs
            result = _blocked(spec) if blocked else _run_one(spec, subject, seed)
            if listener is not None:
                listener("result", result)
            if training_flags(subject.model) != flags:  # a check must not leave the mode changed
                for module, flag in zip(subject.model.modules(), flags):
                    module.training = flag
            report.results.append(result)
    return report


def _resolved(subject: Subject):
    """(the resolved subject, None), or, when its logits are NaN/Inf on random tokens, (the subject as
    far as it resolved, the NonFiniteLogits): finite-logits then fails and the model checks skip."""
    from tfdoctor.subject import NonFiniteLogits

    try:
        return resolve(subject), None
    except NonFiniteLogits as exc:
        return exc.subject, exc


def _judging_nonfinite(specs: list[CheckSpec]) -> list[CheckSpec]:
    """The selection with finite-logits first whenever a model check is in it (selected or not: the
    report must say why the model checks skip)."""
    if not any("train" not in s.needs for s in specs):
        return specs
    return select("finite-logits") + [s for s in specs if s.id != "finite-logits"]


def _blocked(spec: CheckSpec) -> Result:
    result = Result.skipped("the model's logits are NaN/Inf on valid random tokens, so this check cannot judge "
                            "them (see finite-logits)")
    result.id, result.title = spec.id, spec.title
    return result


def _refuse_meta(model) -> None:
    """Meta tensors have shapes but no values: every probe reads values."""
    from tfdoctor.errors import SubjectError

    tensors = list(getattr(model, "parameters", lambda: [])()) + list(getattr(model, "buffers", lambda: [])())
    if any(getattr(t, "is_meta", False) for t in tensors):
        raise SubjectError("the model is on the meta device (shapes without values), so it cannot be run",
                           "build it on a real device (cpu, cuda); `tfdoctor memory TARGET` traces meta-sized "
                           "models without allocating them")


def _applies(spec: CheckSpec, subject: Subject) -> str | None:
    """Why the check does not apply to this subject, or None when it does."""
    if subject.kind not in spec.kinds:
        return spec.skip_reasons.get(subject.kind, f"does not apply to {subject.kind} models")
    for field in spec.needs:
        if getattr(subject, field) is None:
            return f"needs {field} ({_NEEDS_HINTS.get(field, 'set it on the Subject')})"
    return None


def _run_one(spec: CheckSpec, subject: Subject, seed: int) -> Result:
    import torch

    from tfdoctor.probes.modes import preserved_process_state

    start = time.perf_counter()
    reason = _applies(spec, subject)
    if reason is not None:
        result = Result.skipped(reason)
    else:
        with preserved_process_state():
            torch.manual_seed(seed)
            try:
                result = spec.func(subject)
                if not isinstance(result, Result):
                    raise TypeError(f"check returned {type(result).__name__}, not Result")
            except Exception as exc:  # the runner owns `error`: one check's crash is not the run's
                frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
                result = Result.errored(
                    f"{type(exc).__name__}: {exc}",
                    "the check crashed while running your model; the traceback is in details",
                    {"traceback": "".join(frames[-6:])},
                )
    result.id, result.title = spec.id, spec.title
    result.seconds = time.perf_counter() - start
    return result


def assert_healthy(model_or_subject, only=None, skip=None, *, strict: bool = False, **kwargs) -> Report:
    """For users' own test suites: raise AssertionError listing every failed (or errored) check."""
    report = run_checks(model_or_subject, only, skip, **kwargs)
    problems = report.problems(strict)
    if problems:
        lines = [f"tfdoctor found {len(problems)} problem(s) in {report.target}:"]
        for r in problems:
            lines.append(f"  [{r.status.value}] {r.id}: {r.message}")
            if r.hint:
                lines.append(f"      fix: {r.hint}")
        raise AssertionError("\n".join(lines))
    return report


__all__ = ["run_checks", "assert_healthy", "as_subject", "Status"]
