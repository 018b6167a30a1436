"""Runs the selected checks on a subject and turns every outcome, crashes included, into data."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import traceback
from typing import Callable

from tfdoctor.context import RunContext, _no_progress, current, memo, progress as progress_task, running
from tfdoctor.registry import CheckSpec, select
from tfdoctor.result import Report, Result, Status
from tfdoctor.subject import Subject, resolve

# On a busy 2-core machine tiny models ran several times slower with 2 intra-op threads than with
# 1 (thread hand-off costs more than the matmuls). Models below this size are probed on 1 thread.
SINGLE_THREAD_MAX_PARAMS = 20_000_000

_NEEDS_HINTS = {
    "pad_id": "pass --pad-id N or Subject(pad_id=N)",
    "eos_id": "pass --eos-id N or Subject(eos_id=N)",
    "train": "pass --train MODULE:FN or Subject(train=fn)",
}

# Batches fed to the loop: two optimizer steps at accumulation 8, the most common large setting.
DEFAULT_TRAIN_BATCHES = 16

# The call each loop check judges, as the user wrote it: the finding names its file:line (recorded
# from the stack when the call was made). The first kind that was recorded with a location wins.
CALL_NAMES = {"loss": "the loss", "backward": "backward()", "clip": "clip_grad_norm_", "opt_step": "optimizer.step()",
              "sched_step": "scheduler.step()", "autocast": "autocast", "scaler_step": "scaler.step()",
              "unscale": "scaler.unscale_()", "zero_grad": "zero_grad()"}


def as_subject(subject_or_model, **fields) -> Subject:
    """A Subject from a Subject or a bare nn.Module, with the non-None `fields` overriding."""
    subject = subject_or_model if isinstance(subject_or_model, Subject) else Subject(subject_or_model)
    while isinstance(subject.model, Subject):  # Subject(build(), pad_id=0) where build() gave a Subject
        outer = {f.name: getattr(subject, f.name) for f in dataclasses.fields(subject) if f.name != "model"}
        subject = dataclasses.replace(subject.model, **{k: v for k, v in outer.items() if v is not None})
    overrides = {k: v for k, v in fields.items() if v is not None}
    return dataclasses.replace(subject, **overrides) if overrides else subject


def run_checks(subject_or_model, only=None, skip=None, *, seed: int = 0, target: str | None = None,
               progress=None, options: dict | None = None, listener=None, trace=None,
               absent: dict[str, str] | None = None, **fields) -> Report:
    """Run the battery (or the `only`/`skip` selection) and return the Report.

    `fields` override Subject fields (vocab_size, seq_len, batch_size, pad_id, kind, forward, train).
    `options` are settings for individual checks (see RunContext.options).
    `listener(event, payload)` hears "start" (the check id) and "result" (the Result) as they happen:
    the worker process streams them to its supervisor, so a run cut short keeps what it finished.
    `trace`: the loop as another driver recorded it (tfdoctor run SCRIPT); without it the loop checks
    record `subject.train` once, on the first that asks. `absent`: {input: why} for inputs this run
    cannot give (see CheckSpec.inputs); every check that reads one is skipped with that reason.
    Raises UsageError or SubjectError when the subject cannot be examined at all.
    """
    import torch

    from tfdoctor.probes.process_state import preserved_attributes, preserved_process_state, training_flags

    specs = select(only, skip)
    absent = dict(absent or {})
    ctx = RunContext(seed=seed, progress=progress or _no_progress, options=dict(options or {}))
    with running(ctx), preserved_process_state(), contextlib.ExitStack() as leave:
        subject = as_subject(subject_or_model, **fields)
        _refuse_meta(subject.model)
        leave.enter_context(preserved_attributes(subject.model))  # the model as found, after the test forward too
        subject, unusable = _resolved(subject)  # its test forward draws random ids
        if unusable is not None and "model" not in absent:
            specs = _judging_nonfinite(specs)
        check_inputs = CheckInputs(subject, trace)
        report = Report(target or type(subject.model).__name__)
        if sum(p.numel() for p in subject.model.parameters()) <= SINGLE_THREAD_MAX_PARAMS:
            torch.set_num_threads(1)
        flags = training_flags(subject.model)
        for spec in specs:
            if listener is not None:
                listener("start", spec.id)
            missing = next((absent[name] for name in spec.inputs if name in absent), None)
            blocked = unusable is not None and spec.id != "finite-logits" and "train" not in spec.needs
            if missing is not None:
                result = spec.stamp(Result.skipped(missing))
            elif blocked:
                result = spec.stamp(Result.skipped(_BLOCKED))
            else:  # what one check's forwards leave on the model must not reach the next (issue 29)
                with preserved_attributes(subject.model):
                    result = _run_one(spec, subject, seed, check_inputs)
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


_BLOCKED = ("the model's logits are NaN/Inf on valid random tokens, so this check cannot judge them (see "
            "finite-logits)")


def protected(spec: CheckSpec, judge: Callable[[], Result], crashed: Callable[[Exception], Result]) -> Result:
    """`judge()` as the check's Result: timed, under its id and title, and a crash turned into
    `crashed(exc)`, the check's own `error`, never the run's. The one runner core of every command:
    the checks of a subject (run_checks) and the judges of a watched run (run_judges)."""
    started = time.perf_counter()
    try:
        result = judge()
        if not isinstance(result, Result):
            raise TypeError(f"check returned {type(result).__name__}, not Result")
    except Exception as exc:  # noqa: BLE001 - the runner owns `error`: one check's crash is not the run's
        result = crashed(exc)
    result = spec.stamp(result)
    result.seconds = time.perf_counter() - started
    return result


def run_judges(series, only=None, skip=None, listener=None) -> list[Result]:
    """The Results of the selected run judges (registry: inputs=("series",)) on one watched run's
    `series` (watching/series.RunSeries), in catalogue order. `listener(event, payload)` hears "start"
    (the id) and "result" (the Result), as run_checks' listener does. The judges are pure: the same
    series gives the same findings wherever it is judged (the `watch` worker, a callback inside the
    user's Trainer)."""
    results = []
    for spec in select(only, skip, run_judges=True):
        if listener is not None:
            listener("start", spec.id)
        result = protected(spec, functools.partial(spec.func, series), functools.partial(_judge_crashed, spec))
        results.append(result)
        if listener is not None:
            listener("result", result)
    return results


def _judge_crashed(spec: CheckSpec, exc: Exception) -> Result:
    """A run judge reads only tfdoctor's own series, so its crash is tfdoctor's bug, said as such."""
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return Result.errored(f"tfdoctor's own {spec.id} judge crashed: {type(exc).__name__}: {exc} "
                          f"(at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})",
                          "a bug in tfdoctor, not in your run: please report it")


def _check_crashed(exc: Exception) -> Result:
    """A check runs the user's model, so its crash is told with the traceback, whoever's it is."""
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return Result.errored(f"{type(exc).__name__}: {exc}",
                          "the check crashed while running your model; the traceback is in details",
                          {"traceback": "".join(frames[-6:])})


class CheckInputs:
    """What the runner hands a check by parameter name besides the subject, made once per run.

    `trace`: the one recorded run of the user's loop, shared by every loop check. Handed in by another
    driver (tfdoctor run SCRIPT), or recorded from `subject.train` on the first check that asks. A loop
    that raises is recorded once; every check then re-raises the user's exception, which the runner
    reports as that check's error."""

    def __init__(self, subject: Subject, trace=None):
        self.subject = subject
        self.given = trace

    def has_loop(self) -> bool:
        return self.given is not None or self.subject.train is not None

    def trace(self):
        if self.given is not None:
            return self.given
        subject = self.subject
        return memo(("train-trace", id(subject.model), subject.train), functools.partial(_record_loop, subject))

    def __getitem__(self, name: str):
        # by name, as registry.FIXTURES lists them: an explicit table, so no other method resolves
        return {"trace": self.trace}[name]()

    def attention_site(self):
        """Where the model computes attention, in the user's code (probes/attention.py), or None."""
        return _attention_site(self.subject)

    def located(self, spec: CheckSpec, result: Result) -> Result:
        """Adds details["location"] (the user's "path:line" of the first recorded call of the spec's
        `located` kinds) and details["call"] to a loop check's result; skips carry none."""
        if not spec.located or result.status is Status.SKIP or "location" in result.details:
            return result
        if "attention" in spec.located:  # a model finding: the user's line where attention is computed
            found = self.attention_site()
            if found is not None:
                result.details["location"], result.details["call"] = found
            return result
        events = self.trace().events
        for kind in spec.located:
            where = next((e.data["where"] for e in events if e.kind == kind and e.data.get("where")), None)
            if where:
                result.details["location"] = where
                result.details["call"] = CALL_NAMES[kind]
                break
        return result


def _attention_site(subject: Subject):
    """The user's line of the model's first attention call (probes/attention.py)."""
    from tfdoctor.probes.attention import attention_calls, attention_site

    return attention_site(attention_calls(subject))


def _record_loop(subject: Subject):
    """Run `subject.train` once on random batches, recording what it calls (check --train)."""
    import torch

    from tfdoctor.recording.loop import record_loop, train_batches

    count = int(current().options.get("train_batches") or DEFAULT_TRAIN_BATCHES)
    batches = train_batches(subject, count, torch.Generator().manual_seed(current().seed + 5))
    advance = progress_task("training loop", count)
    trace = record_loop(subject, batches, advance)
    advance(max(0, count - trace.batches_fed))
    return trace


def _refuse_meta(model) -> None:
    """Meta tensors have shapes but no values: every probe reads values."""
    from tfdoctor.errors import SubjectError

    tensors = list(getattr(model, "parameters", lambda: [])()) + list(getattr(model, "buffers", lambda: [])())
    if any(getattr(t, "is_meta", False) for t in tensors):
        raise SubjectError("the model is on the meta device (shapes without values), so it cannot be run",
                           "build it on a real device (cpu, cuda); `tfdoctor memory TARGET` traces meta-sized "
                           "models without allocating them")


def _applies(spec: CheckSpec, subject: Subject, check_inputs: CheckInputs) -> str | None:
    """Why the check does not apply to this subject, or None when it does."""
    from tfdoctor.tasks import LM, NAMES, SHAPES

    if subject.kind not in spec.kinds:
        return spec.skip_reasons.get(subject.kind, f"does not apply to {subject.kind} models")
    task = subject.task or LM
    if task not in spec.tasks and spec.func_for(task) is spec.func:
        return spec.skip_reasons.get(task, f"written for language models' logits over the vocabulary; "
                                           f"{NAMES[task]} predicts {SHAPES[task]}")
    for field in spec.needs:
        given = check_inputs.has_loop() if field == "train" else getattr(subject, field) is not None
        if not given:
            return f"needs {field} ({_NEEDS_HINTS.get(field, 'set it on the Subject')})"
    return None


def _run_one(spec: CheckSpec, subject: Subject, seed: int, check_inputs: CheckInputs) -> Result:
    import torch

    from tfdoctor.probes.process_state import preserved_process_state

    def judge() -> Result:
        judged, func, unjudged = _judged_as(spec, subject)
        reason = _applies(spec, subject, check_inputs) or unjudged
        if reason is not None:
            return Result.skipped(reason)
        with preserved_process_state():
            torch.manual_seed(seed)
            result = func(judged, **{name: check_inputs[name] for name in spec.fixtures})
            if not isinstance(result, Result):
                return result  # protected names it
            if judged is not subject and result.status is not Status.SKIP:  # a pooled classifier's backbone
                result.message += (" (measured on the backbone's per-position states: a pooled classifier has "
                                   "none of its own)")
                result.details["measured_on"] = "backbone states"
            return check_inputs.located(spec, result)

    return protected(spec, judge, _check_crashed)


def _judged_as(spec: CheckSpec, subject: Subject) -> tuple:
    """(the subject the check reads, the function judging it, None): the task's own variant, or for a
    check of per-position outputs on a pooled classifier its backbone's states; (None, None, why) when
    a pooled classifier exposes none."""
    from tfdoctor.probes.backbone import backbone_view
    from tfdoctor.tasks import LM, pooled

    task = subject.task or LM
    func = spec.func_for(task)
    if func is spec.func and spec.per_position and pooled(task):
        view, how = backbone_view(subject)
        return (view, func, None) if view is not None else (None, None, how)
    return subject, func, None


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
