"""Open a model's zero-initialised paths for a measurement that asks what the architecture can do.

Modern GPT recipes start every block as the identity: nanochat and modded-nanoGPT zero each
attention and MLP output projection (and the lm_head), ReZero multiplies each residual branch by a
gate that starts at 0. The fresh model then mixes no positions however its mask is written, and the
first optimizer step opens the paths. Jittering the trainable tensors that sit at zero (or at one
constant value) gives a model with the same wiring whose every path carries signal, so a map of
what depends on what describes the architecture rather than the init.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

# An exactly-zero entry is replaced by a random sign times a magnitude drawn uniformly from this
# range, in units of its tensor's natural scale (below): an opened path then carries a signal of the
# same order as the paths that were never closed, far above the dependency map's 1e-5 tolerance.
# Bounded away from 0 because a scalar gate (ReZero) is one draw: a draw near 0 would leave its
# whole layer nearly closed.
ZERO_JITTER_RANGE = (0.5, 1.5)
# Natural scale of a gate (a 0-d or 1-d parameter not named bias: ReZero's residual weight,
# LayerScale, modded-nanoGPT's lambdas): a multiplier on a branch, fully open at 1. Weight matrices
# and biases use the median std of the model's own randomly initialised matrices instead; a gate
# opened to that std (0.02 on GPT-2-like models) moves the outputs by ~1e-5 only, the tolerance.
GATE_SCALE = 1.0
# The std used when no weight matrix is randomly initialised: GPT-2's init std.
FALLBACK_STD = 0.02
# A tensor with one constant nonzero value (a norm gain of 1, a gate of 0.5 in every slot) is
# jittered by this fraction of its value: it breaks the symmetry, not the scale.
CONSTANT_JITTER = 0.01
# Names kept in the evidence; the count is always given.
NAMED_TENSORS = 6


@dataclass
class Perturbation:
    """What was jittered: the trainable tensors with zero entries or one constant value."""

    tensors: list[str] = field(default_factory=list)
    gates: list[str] = field(default_factory=list)  # the ones opened at GATE_SCALE
    zero_entries: int = 0
    weight_scale: float = FALLBACK_STD

    def details(self) -> dict:
        return {"jittered_tensors": len(self.tensors), "examples": self.tensors[:NAMED_TENSORS],
                "gates": self.gates[:NAMED_TENSORS], "zero_entries": self.zero_entries,
                "weight_scale": self.weight_scale, "gate_scale": GATE_SCALE,
                "zero_jitter_range": list(ZERO_JITTER_RANGE), "constant_jitter": CONSTANT_JITTER}


def _constant(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 1 and bool((tensor == tensor.reshape(-1)[0]).all())


def _gate(name: str, param: torch.Tensor) -> bool:
    return param.dim() < 2 and not name.rsplit(".", 1)[-1].startswith("bias")


def held_at_init(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable floating-point parameters with an exactly-zero entry, or with one constant value.

    Frozen parameters and buffers are left alone: training never moves them, so they are part of
    the architecture (a mask kept as a frozen parameter must stay a mask)."""
    held = []
    for name, param in model.named_parameters():  # shared (tied) tensors are listed once
        if not param.requires_grad or not param.is_floating_point() or param.numel() == 0:
            continue
        if bool((param == 0).any()) or _constant(param):
            held.append((name, param))
    return held


def typical_std(model: torch.nn.Module) -> float:
    """Median std of the trainable weight matrices that were drawn at random (not constant)."""
    stds = [float(p.detach().float().std()) for p in model.parameters()
            if p.requires_grad and p.is_floating_point() and p.dim() >= 2 and not _constant(p)]
    stds = [s for s in stds if s > 0 and s == s]
    return statistics.median(stds) if stds else FALLBACK_STD


@contextlib.contextmanager
def opened_paths(model: torch.nn.Module, generator: torch.Generator) -> Iterator[Optional[Perturbation]]:
    """The model with its held-at-init tensors jittered for the block (None when it has none), then
    every one of them written back bit for bit.

    In place rather than on a deepcopy: only the jittered tensors are copied, tied weights stay
    tied, and a model whose deepcopy shares modules with the original cannot leak the jitter."""
    held = held_at_init(model)
    if not held:
        yield None
        return
    perturbation = Perturbation(weight_scale=typical_std(model))
    saved = [(param, param.detach().clone()) for _, param in held]
    try:
        with torch.no_grad():
            for name, param in held:
                if _constant(param) and bool(param.reshape(-1)[0] != 0):
                    noise = torch.randn(param.shape, generator=generator)
                    param.mul_(1 + CONSTANT_JITTER * noise.to(param.device, param.dtype))
                else:
                    scale = GATE_SCALE if _gate(name, param) else perturbation.weight_scale
                    if _gate(name, param):
                        perturbation.gates.append(name)
                    low, high = ZERO_JITTER_RANGE
                    sign = torch.randint(0, 2, param.shape, generator=generator) * 2 - 1
                    size = low + (high - low) * torch.rand(param.shape, generator=generator)
                    jitter = (sign * size * scale).to(param.device, param.dtype)
                    zero = param == 0
                    perturbation.zero_entries += int(zero.sum())
                    param.add_(torch.where(zero, jitter, torch.zeros_like(param)))
                perturbation.tensors.append(name)
        yield perturbation
    finally:
        with torch.no_grad():
            for param, value in saved:
                param.copy_(value)
