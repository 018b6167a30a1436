"""Run a measurement under each attention implementation a Hugging Face model supports.

A model can leak under one kernel and not another (one released model leaked the future under SDPA
only, with eager attention correct), so the masking checks measure each and name the culprit. A
model is judged by the implementation it runs (the resolved config._attn_implementation, the
library's default included); the others are reported as what would happen if it were switched.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, TypeVar

import torch

from tfdoctor.subject import is_hugging_face

T = TypeVar("T")
# The implementations every transformers install has; flash-attention needs CUDA and a package.
CANDIDATES = ("eager", "sdpa")


def current_implementation(model: torch.nn.Module) -> Optional[str]:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def attention_implementations(model: torch.nn.Module) -> list[Optional[str]]:
    """[None] for models that do not choose their attention kernel; else the supported candidates:
    those the class declares and the model accepts when switched to them."""
    if not is_hugging_face(model) or not hasattr(model, "set_attn_implementation"):
        return [None]
    supported = [impl for impl in CANDIDATES
                 if (impl == "eager" or getattr(model, f"_supports_{impl}", False)) and _switchable(model, impl)]
    return supported or [current_implementation(model)]


def _switchable(model: torch.nn.Module, implementation: str) -> bool:
    """Whether the model can be switched to `implementation` and back: a class can declare SDPA
    while one of its sub-models refuses it (VibeVoice's acoustic tokenizer raises ValueError), which
    is the library saying the model cannot run it, not a kernel to judge. Leaves the model as found."""
    original = current_implementation(model)
    if implementation == original:
        return True
    saved = _implementation_state(model)
    try:
        model.set_attn_implementation(implementation)
        model.set_attn_implementation(original)
        return True
    except (ValueError, ImportError, NotImplementedError):
        return False
    finally:
        _restore_implementation_state(saved)


def _implementation_state(model: torch.nn.Module) -> list[tuple[object, object]]:
    """(config, its own attention implementation) for every config in the model and their
    sub-configs: set_attn_implementation writes them all, and a switch back can refuse."""
    seen, state, stack = set(), [], [m.config for m in model.modules() if hasattr(m, "config")]
    while stack:
        config = stack.pop()
        if id(config) in seen or not hasattr(config, "_attn_implementation_internal"):
            continue
        seen.add(id(config))
        state.append((config, config._attn_implementation_internal))
        stack.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {})
    return state


def _restore_implementation_state(state: list[tuple[object, object]]) -> None:
    for config, value in state:
        config._attn_implementation_internal = value


def configured_implementation(model: torch.nn.Module) -> Optional[str]:
    """The implementation the model runs: `config._attn_implementation` as transformers resolved it,
    the library's default included (sdpa where the model supports it, else eager). A model is
    judged by this one; a failure under another implementation only is a warning not to switch.
    None for a model with a single implementation (nothing to tell apart)."""
    candidates = attention_implementations(model)
    if len(candidates) < 2:
        return None
    current = current_implementation(model)
    return current if current in candidates else None


def library_release(model: torch.nn.Module) -> str:
    """The package the model's class comes from, with its version: e.g. "transformers 5.2.0"."""
    import sys

    for cls in type(model).__mro__:  # a user's subclass lives in their module, its base in the library
        package = cls.__module__.split(".")[0]
        version = getattr(sys.modules.get(package), "__version__", None)
        if version:
            return f"{package} {version}"
    return type(model).__module__.split(".")[0]


@contextlib.contextmanager
def using_implementation(model: torch.nn.Module, implementation: Optional[str]) -> Iterator[None]:
    original = current_implementation(model)
    if implementation is None or implementation == original:
        yield
        return
    saved = _implementation_state(model)
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        _restore_implementation_state(saved)  # exactly as found, also where a switch back would refuse


def per_implementation(model: torch.nn.Module, measure: Callable[[Optional[str]], T]) -> list[tuple[Optional[str], T]]:
    """[(implementation, measure(implementation))] for each attention implementation."""
    results = []
    for implementation in attention_implementations(model):
        with using_implementation(model, implementation):
            results.append((implementation, measure(implementation)))
    return results


def label(implementation: Optional[str], count: int) -> str:
    """A message prefix naming the implementation, when there is more than one to tell apart."""
    return f"with attn_implementation={implementation!r}: " if implementation and count > 1 else ""
