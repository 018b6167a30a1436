"""The catalogue of checks: `@check` registers one, `select` picks them for a run.

Check modules are imported here by name and must not import torch at module level, so that
`tfdoctor checks` can print the catalogue without paying for torch. They import their probes
inside the check function instead.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tfdoctor.errors import UsageError

if TYPE_CHECKING:
    from tfdoctor.result import Result

KINDS = ("causal", "encoder", "seq2seq")
# What the model predicts (tfdoctor/tasks.py infers it): logits over the vocabulary at every position
# (next-token, masked or seq2seq LM: the kind says which), one score vector per row from a pooled state,
# one per token over labels unrelated to the vocabulary, real-valued outputs per row, a span's start and
# end scores at every position (extractive question answering), or one score per (question, choice)
# sequence, compared across the choices (multiple choice).
TASKS = ("lm", "sequence-classification", "token-classification", "regression", "question-answering",
         "multiple-choice")
# Tasks whose prediction is one vector per row: no per-position output to read a mask from.
POOLED_TASKS = ("sequence-classification", "regression", "multiple-choice")

# One module per family. A new family adds its module here (and its ids to CATALOGUE).
CHECK_MODULES = (
    "tfdoctor.checks.masking",
    "tfdoctor.checks.numerics",
    "tfdoctor.checks.padding",
    "tfdoctor.checks.invariance",
    "tfdoctor.checks.decoding",
    "tfdoctor.checks.init_loss",
    "tfdoctor.checks.learning",
    "tfdoctor.checks.memory",
    "tfdoctor.checks.targets",
    "tfdoctor.checks.boundaries",
    "tfdoctor.checks.accumulation",
    "tfdoctor.checks.step",
    "tfdoctor.checks.train_mode",
    "tfdoctor.checks.schedule",
    "tfdoctor.checks.ranks",
    "tfdoctor.checks.determinism",
    "tfdoctor.checks.depth",
    "tfdoctor.checks.curves",
    "tfdoctor.checks.grad_norm",
    "tfdoctor.checks.run_health",
    "tfdoctor.checks.run_schedule",
    "tfdoctor.checks.run_mode",
    "tfdoctor.checks.pooled",  # how padding-mask and padding-equivalence judge a pooled classifier
    "tfdoctor.checks.token_labels",  # how ignore-index judges a token classifier's labels
)

# The catalogue's order, which is the report's order: stated here, so that moving a check to another
# family module does not move it in `tfdoctor checks` or in a report. A check registered elsewhere
# (a user's own) follows these, in the order it was registered.
CATALOGUE = (
    "future-leak", "mask-direction", "bidirectional-encoder", "cross-attention-mask", "finite-logits",
    "softmax-mask-order", "half-precision-mask", "padding-mask", "masked-row-nan", "padding-equivalence",
    "packing-isolation", "cache-consistency", "init-loss", "eval-determinism", "depth-signal",
    "overfit-batch", "generation", "memory", "objective", "ignore-index", "eos-trained", "packing-labels",
    "unscale-before-clip", "accumulation-scaling", "token-weighting", "scheduler-placement", "zero-grad",
    "clip-global-norm", "lr-schedule", "amp-loss-scaling", "grad-health", "optimizer-coverage", "stale-update",
    "trained-in-eval",
    "rank-data", "rank-sync", "ddp-accumulation", "rank-uniform", "rank-equivalence",
    # the judges of a whole watched run (`tfdoctor watch`, the callbacks): they read a RunSeries
    "loss-spike", "loss-divergence", "loss-plateau", "grad-norm-trend", "scaler-overflow", "lr-trajectory",
    "data-wait", "memory-growth", "eval-gap", "eval-mode-steps",
)


@dataclass(frozen=True)
class CheckSpec:
    id: str
    title: str
    func: Callable
    kinds: tuple[str, ...] = KINDS
    # Subject fields that must be set, e.g. ("pad_id",). "train" is the loop: set on the Subject (the
    # runner records it once) or recorded by another driver and handed to run_checks(trace=...). A
    # check that takes a `trace` parameter needs "train" without saying so (see derived_inputs).
    needs: tuple[str, ...] = ()
    skip_reasons: dict[str, str] = field(default_factory=dict)  # kind or task -> why it does not apply
    # The recorded calls whose user's line the finding names (details "location" and "call"): the first
    # kind recorded with a location wins, e.g. ("loss", "backward"). The runner adds them.
    located: tuple[str, ...] = ()
    # What the check reads besides the Subject's fields: "model" (the model's outputs), "trace" (the
    # recorded loop), "series" (a whole watched run), "initial_weights" (the model as initialised).
    # Read off the function's signature (derived_inputs) unless @check names them. run_checks(absent=
    # {input: why}) skips every check that reads an input it cannot have, with that reason.
    inputs: tuple[str, ...] = ()
    # The tasks whose predictions the check judges (see TASKS); any other is skipped with its reason.
    tasks: tuple[str, ...] = TASKS
    # Reads per-position outputs: a pooled classifier (POOLED_TASKS) is judged on its backbone's
    # per-position states where the model exposes them (probes/backbone.py), else skipped with why.
    per_position: bool = False

    def stamp(self, result: Result) -> Result:
        """The result under this check's id and title: the one place a Result gets them, called by the
        runner's one core, runner.protected, for the checks and the run judges alike."""
        result.id, result.title = self.id, self.title
        return result

    def func_for(self, task: str) -> Callable:
        """The function that judges this task: a task's own variant (registered with @judges) or the
        check's own function."""
        return _VARIANTS.get(self.id, {}).get(task, self.func)

    @property
    def fixtures(self) -> tuple[str, ...]:
        """The check function's parameters after the subject, each handed in by the runner by name
        (as pytest hands fixtures to tests): today only `trace`."""
        return _parameters(self.func)[1:]

    @property
    def judges_run(self) -> bool:
        """A judge of a whole watched run: `(series: RunSeries) -> Result`, run by `tfdoctor watch` and
        the callbacks, never by `check` / `run` (which record only the first steps)."""
        return "series" in self.inputs

    @property
    def doc(self) -> str:
        return inspect.cleandoc(self.func.__doc__ or "")

    @property
    def summary(self) -> str:
        """First paragraph of the docstring: what the check catches."""
        return self.doc.split("\n\n")[0].replace("\n", " ")

    @property
    def fix(self) -> str:
        """The docstring's paragraph that starts with "Fix:": the one-line fix, as the catalogue shows it."""
        for paragraph in self.doc.split("\n\n"):
            if paragraph.startswith("Fix:"):
                return " ".join(paragraph[len("Fix:"):].split())
        return ""


_REGISTRY: dict[str, CheckSpec] = {}
_VARIANTS: dict[str, dict[str, Callable]] = {}  # check id -> {task: the function judging that task}


# What a check function may ask for by parameter name, as pytest hands a test its fixtures: its first
# parameter is what it judges, the ones after it are handed in by the runner (runner.CheckInputs).
JUDGED = {"subject": "a model check or a loop check: the Subject", "series": "a judge of a whole watched run"}
FIXTURES = {"trace": "the recorded training loop (needs train: --train, or the script tfdoctor run records)"}


def derived_inputs(func: Callable) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(inputs, needs) read off a check function's signature, as pytest reads a test's fixtures off its
    parameters: `(series)` reads a watched run; `(subject, trace)` reads the recorded loop and so needs
    "train"; `(subject)` reads the model's outputs. A parameter name the runner cannot hand in is an
    error at registration, not a crash when the check first runs."""
    names = _parameters(func)
    if not names or names[0] not in JUDGED or any(name not in FIXTURES for name in names[1:]):
        raise TypeError(f"check function {func.__qualname__}{inspect.signature(func)}: the first parameter is "
                        f"one of {', '.join(JUDGED)}, the others among {', '.join(FIXTURES)}")
    if names[0] == "series":
        return ("series",), ()
    if "trace" in names:
        return ("trace",), ("train",)
    return ("model",), ()


def check(id: str, title: str, kinds: tuple[str, ...] = KINDS, needs: tuple[str, ...] = (),
          skip_reasons: dict[str, str] | None = None, located: tuple[str, ...] = (),
          inputs: tuple[str, ...] | None = None, tasks: tuple[str, ...] = TASKS, per_position: bool = False):
    """Register a check function under a stable id: `(subject) -> Result` judges the model,
    `(subject, trace) -> Result` the recorded loop, `(series) -> Result` a whole watched run. What it
    reads and the loop it needs come from those parameter names (derived_inputs); `needs` adds the
    Subject fields it needs besides ("pad_id",), `inputs` replaces what it reads where the signature
    cannot say (("model", "initial_weights"): judged on the model as initialised)."""

    def register(func: Callable) -> Callable:
        if id in _REGISTRY and _REGISTRY[id].func.__qualname__ != func.__qualname__:
            raise RuntimeError(f"check id {id!r} registered twice")
        read, loop = derived_inputs(func)
        if "train" in needs and not loop:
            raise TypeError(f"check {id!r} needs train: take the recorded loop as a `trace` parameter")
        needed = loop + tuple(field for field in needs if field not in loop)
        _REGISTRY[id] = CheckSpec(id, title, func, tuple(kinds), needed, dict(skip_reasons or {}),
                                  tuple(located), tuple(inputs) if inputs is not None else read, tuple(tasks),
                                  per_position)
        return func

    return register


def _parameters(func: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)


def judges(id: str, tasks: tuple[str, ...]):
    """Register `func(subject) -> Result` as how check `id` judges these tasks (the same problem, seen
    in another prediction's shape: padding-equivalence on a pooled classifier's class scores). The
    check keeps its id, title and place in the catalogue."""

    def register(func: Callable) -> Callable:
        for task in tasks:
            _VARIANTS.setdefault(id, {})[task] = func
        return func

    return register


def all_checks() -> list[CheckSpec]:
    """Every registered check in catalogue order (CATALOGUE), then any other as registered."""
    for module in CHECK_MODULES:
        importlib.import_module(module)
    rank = {check_id: i for i, check_id in enumerate(CATALOGUE)}
    written = {check_id: i for i, check_id in enumerate(_REGISTRY)}
    return sorted(_REGISTRY.values(), key=lambda spec: (rank.get(spec.id, len(rank)), written[spec.id]))


def _split(ids: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if ids is None:
        return []
    if isinstance(ids, str):
        ids = [ids]
    return [part.strip() for item in ids for part in item.split(",") if part.strip()]


def select(only=None, skip=None, run_judges: bool = False) -> list[CheckSpec]:
    """The checks to run, in catalogue order: the model and loop checks, or with `run_judges` the
    judges of a whole watched run. Unknown ids, and ids of the other set, are a usage error."""
    specs = all_checks()
    known = {spec.id for spec in specs}
    ours = {spec.id for spec in specs if spec.judges_run == run_judges}
    wanted, unwanted = _split(only), _split(skip)
    for check_id in wanted + unwanted:
        if check_id not in known:
            raise UsageError(f"unknown check id {check_id!r}", "run `tfdoctor checks` for the available ids")
        if check_id in wanted and check_id not in ours:
            where = ("`tfdoctor check` or `tfdoctor run`" if run_judges
                     else "`tfdoctor watch` (or a TfdoctorCallback)")
            raise UsageError(f"{check_id!r} is not judged here", f"{check_id} runs under {where}")
    return [s for s in specs if s.id in ours and (not wanted or s.id in wanted) and s.id not in unwanted]
