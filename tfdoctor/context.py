"""Run-scoped state the runner sets up for the checks: a memo shared between checks, a progress
callback for long work, the seed and each check's time budget. Kept in context variables so that a
check keeps the plain `(subject) -> Result` signature.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol


class Progress(Protocol):
    def __call__(self, description: str, total: int) -> Callable[[int], None]:
        """Start a task; the returned function advances it by n."""


def _no_progress(description: str, total: int) -> Callable[[int], None]:
    return lambda n=1: None


@dataclass
class RunContext:
    seed: int = 0
    progress: Progress = _no_progress
    memo: dict[Any, Any] = field(default_factory=dict)
    # Settings for checks that are not Subject fields, e.g. the memory check's
    # {"train_batch": 8, "train_seq": 5000, "budget": "24GiB"}, or "timeout_per_check" (seconds a long
    # check may take, see time_budget); absent keys mean "not given".
    options: dict[str, Any] = field(default_factory=dict)


_current: contextvars.ContextVar[RunContext] = contextvars.ContextVar("tfdoctor_run")


def current() -> RunContext:
    try:
        return _current.get()
    except LookupError:  # a check called directly, outside run_checks
        ctx = RunContext()
        _current.set(ctx)
        return ctx


@contextlib.contextmanager
def running(ctx: RunContext) -> Iterator[RunContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


class _Raised:
    def __init__(self, error: Exception) -> None:
        self.error = error


def memo(key: Any, compute: Callable[[], Any]) -> Any:
    """Compute once per run: e.g. the dependency map that future-leak and mask-direction share.

    An exception is remembered too and raised again to every later caller, so that a user's loop
    that crashes runs once and each check that needs it reports the same error."""
    store = current().memo
    if key not in store:
        try:
            store[key] = compute()
        except Exception as error:
            store[key] = _Raised(error)
    value = store[key]
    if isinstance(value, _Raised):
        raise value.error
    return value


def progress(description: str, total: int) -> Callable[[int], None]:
    return current().progress(description, total)


@dataclass
class Budget:
    """A check's cooperative time budget. Long checks consult `exceeded()` between units of work
    (a training step, a batch) and, once it says so, stop and report what they measured so far as a
    skip. Nothing else may depend on the clock: a budget that is not exceeded changes no number, so
    the verdict stays the same on a loaded machine."""

    seconds: Optional[float]  # None: unlimited
    started: float = field(default_factory=time.perf_counter)

    def spent(self) -> float:
        return time.perf_counter() - self.started

    def exceeded(self) -> bool:
        return self.seconds is not None and self.spent() > self.seconds

    def describe(self) -> dict[str, Any]:
        """JSON-safe evidence for a result cut short: the budget and the time spent."""
        return {"timeout_per_check": self.seconds, "spent_seconds": round(self.spent(), 3)}


def time_budget() -> Budget:
    """The running check's budget: options["timeout_per_check"] seconds (unlimited when not given),
    counted from this call, which a check makes first thing."""
    seconds = current().options.get("timeout_per_check")
    return Budget(float(seconds) if seconds is not None and float(seconds) > 0 else None)
