"""The floating-point precision a model computes in, how far rounding alone can move its logits,
and a way to measure it again in float32 when a difference is too close to that reach to judge."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch

# How far two computations of the same logits in one low precision (different batch shapes, one
# token at a time against the whole sequence) may drift apart, in units of the dtype's epsilon,
# relative to the logits' scale. Measured on tiny GPT-2 and Llama on the CPU: float16 up to 0.74
# eps (7.3e-4), bfloat16 0; accumulated over deeper models and GPU kernels a few eps. 16 eps
# (bfloat16 0.125, float16 0.016) sits a decade above what we measured; a difference between the
# float32 tolerance and this reach is a close call, measured again in float32.
ROUNDING_REACH_EPS = 16
# The float32 re-measurement upcasts the parameters in place (bfloat16 -> float32 -> bfloat16 is
# exact); beyond this many bytes in float32 it is not attempted and the close call is reported.
FLOAT32_COPY_LIMIT = 2 * 2**30


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes in: autocast's when it is on for the model's device, else the
    dtype most of its floating parameters hold (weighted by size)."""
    parameters = [p for p in model.parameters() if p.is_floating_point()]
    if not parameters:
        return torch.float32
    device = parameters[0].device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    sizes = Counter()
    for p in parameters:
        sizes[p.dtype] += p.numel()
    return sizes.most_common(1)[0][0]


def is_low_precision(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def rounding_reach(dtype: torch.dtype) -> float:
    """The relative difference rounding in `dtype` may reach (0 for float32 and wider: their
    tolerance is the float32 one)."""
    return ROUNDING_REACH_EPS * torch.finfo(dtype).eps if is_low_precision(dtype) else 0.0


def can_upcast(model: torch.nn.Module) -> bool:
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.device.type == "meta" for t in tensors):
        return False
    return sum(t.numel() * 4 for t in tensors if t.is_floating_point()) <= FLOAT32_COPY_LIMIT


@contextlib.contextmanager
def in_float32(model: torch.nn.Module) -> Iterator[None]:
    """The model's low-precision parameters and buffers in float32 for the block (autocast off),
    then back to their own dtype: an exact round trip, so the model is left as found."""
    changed = []
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point() and is_low_precision(tensor.dtype):
            changed.append((tensor, tensor.dtype))
            tensor.data = tensor.data.float()
    device = next((t.device.type for t, _ in changed), "cpu")
    try:
        with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) \
                else contextlib.nullcontext():
            yield
    finally:
        for tensor, dtype in changed:
            tensor.data = tensor.data.to(dtype)


def close_call(model: torch.nn.Module, relative: float, tolerance: float) -> tuple[str, dict]:
    """How to judge a difference `relative` (of the logits' scale) measured in the model's own
    precision: "as measured" (float32, within tolerance, or beyond what rounding reaches),
    "float32" (a close call: measure again with in_float32), or "close" (a close call that cannot
    be measured again: a note, not a verdict). Evidence for the report with it."""
    dtype = compute_dtype(model)
    reach = rounding_reach(dtype)
    name = str(dtype).replace("torch.", "")
    if not reach:
        return "as measured", {}
    evidence = {"compute_dtype": name}
    if relative <= tolerance or relative > reach:
        return "as measured", evidence
    evidence.update(relative_difference_in_compute_dtype=relative, rounding_reach=reach)
    said = f"in {name} the logits differ by {relative:.2g} of their scale, within {name} rounding's reach ({reach:.2g})"
    if can_upcast(model):
        evidence["close_call"] = f"{said}: measured again in float32"
        return "float32", evidence
    evidence["close_call"] = f"{said}; not measured again in float32 (too large to upcast): not judged"
    return "close", evidence
