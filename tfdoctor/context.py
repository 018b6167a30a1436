"""Run-scoped state the runner sets up for the checks: a memo shared between checks, a progress
callback for long work, and the seed. Kept in context variables so that a check keeps the plain
`(subject) -> Result` signature.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol


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
    # {"train_batch": 8, "train_seq": 5000, "budget": "24GiB"}; absent keys mean "not given".
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
