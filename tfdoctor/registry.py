"""The catalogue of checks: `@check` registers one, `select` picks them for a run.

Check modules are imported here by name and must not import torch at module level, so that
`tfdoctor checks` can print the catalogue without paying for torch. They import their probes
inside the check function instead.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

from tfdoctor.errors import UsageError

KINDS = ("causal", "encoder", "seq2seq")

# One module per family. A new family adds its module here; order is the report's order.
CHECK_MODULES = (
    "tfdoctor.checks.masking",
    "tfdoctor.checks.numerics",
    "tfdoctor.checks.padding",
    "tfdoctor.checks.invariance",
    "tfdoctor.checks.decoding",
    "tfdoctor.checks.learning",
    "tfdoctor.checks.memory",
    "tfdoctor.checks.trainloop",
    "tfdoctor.checks.ranks",
)


@dataclass(frozen=True)
class CheckSpec:
    id: str
    title: str
    func: Callable
    kinds: tuple[str, ...] = KINDS
    needs: tuple[str, ...] = ()  # Subject fields that must be set, e.g. ("pad_id",)
    skip_reasons: dict[str, str] = field(default_factory=dict)  # kind -> why it does not apply

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


def check(id: str, title: str, kinds: tuple[str, ...] = KINDS, needs: tuple[str, ...] = (),
          skip_reasons: dict[str, str] | None = None):
    """Register a check function `(subject) -> Result` under a stable id."""

    def register(func: Callable) -> Callable:
        if id in _REGISTRY and _REGISTRY[id].func.__qualname__ != func.__qualname__:
            raise RuntimeError(f"check id {id!r} registered twice")
        _REGISTRY[id] = CheckSpec(id, title, func, tuple(kinds), tuple(needs), dict(skip_reasons or {}))
        return func

    return register


def all_checks() -> list[CheckSpec]:
    """Every registered check in catalogue order: by family (CHECK_MODULES), then as written."""
    for module in CHECK_MODULES:
        importlib.import_module(module)
    family = {module: rank for rank, module in enumerate(CHECK_MODULES)}
    written = {check_id: rank for rank, check_id in enumerate(_REGISTRY)}
    return sorted(_REGISTRY.values(),
                  key=lambda spec: (family.get(spec.func.__module__, len(family)), written[spec.id]))


def _split(ids: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if ids is None:
        return []
    if isinstance(ids, str):
        ids = [ids]
    return [part.strip() for item in ids for part in item.split(",") if part.strip()]


def select(only=None, skip=None) -> list[CheckSpec]:
    """The checks to run, in catalogue order. Unknown ids are a usage error."""
    specs = all_checks()
    known = {spec.id for spec in specs}
    wanted, unwanted = _split(only), _split(skip)
    for check_id in wanted + unwanted:
        if check_id not in known:
            raise UsageError(f"unknown check id {check_id!r}", "run `tfdoctor checks` for the available ids")
    return [s for s in specs if (not wanted or s.id in wanted) and s.id not in unwanted]
