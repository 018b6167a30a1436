"""Run a measurement under each attention implementation a Hugging Face model supports.

A model can leak under one kernel and not another (one released model leaked the future under SDPA
only, with eager attention correct), so the masking checks measure each and name the culprit.
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
    """[None] for models that do not choose their attention kernel; else the supported candidates."""
    if not is_hugging_face(model) or not hasattr(model, "set_attn_implementation"):
        return [None]
    supported = [impl for impl in CANDIDATES
                 if impl == "eager" or getattr(model, f"_supports_{impl}", False)]
    return supported or [current_implementation(model)]


@contextlib.contextmanager
def using_implementation(model: torch.nn.Module, implementation: Optional[str]) -> Iterator[None]:
    original = current_implementation(model)
    if implementation is None or implementation == original:
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


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
