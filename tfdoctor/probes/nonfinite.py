"""Where the first NaN or Inf appears: the op and the module, in the forward or in the backward.

A NaN in the gradient has many possible origins (a softmax over a fully masked row, sqrt or a
power below 1 at exactly zero, a division by zero, log(0)); naming one without looking blames
the wrong line. `first_nonfinite` runs the forward and the backward once under a TorchFunctionMode
that notes, for each op, the module it runs in and whether its output holds a NaN while its inputs
did not (-inf is what masks fill in); in the backward, a hook on each autograd node notes the first node whose input
gradients turn non-finite while its output gradients were finite.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

# Ops named in the verdict as a softmax (forward name, or the backward node's name).
_SOFTMAX = ("softmax", "log_softmax", "_softmax", "SoftmaxBackward0", "LogSoftmaxBackward0")


@dataclass
class Origin:
    phase: str  # "forward" or "backward"
    op: str  # the forward op ("softmax", "__truediv__", "pow") that made it or whose gradient did
    module: str  # qualified name of the innermost module running the op ("" for the model itself)
    node: str = ""  # the autograd node, in the backward ("PowBackward0")

    @property
    def at_softmax(self) -> bool:
        return self.op in _SOFTMAX or self.node in _SOFTMAX

    def describe(self) -> str:
        where = f"module {self.module}" if self.module else "the model's own forward"
        op = f"{self.op} ({self.node})" if self.node else self.op
        return f"in the {self.phase} at {op} in {where}"

    def to_dict(self) -> dict:
        return {"phase": self.phase, "op": self.op, "module": self.module, "node": self.node}


def _finite(value, test=torch.isfinite) -> bool:
    """No tensor in value (a tensor, or a list of tensors and lists) fails `test` anywhere."""
    values = list(value) if isinstance(value, (tuple, list)) else [value]
    flat = [t for v in values for t in (v if isinstance(v, (tuple, list)) else [v])]
    return all(bool(test(t).all()) for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point())


def _no_nan(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isnan(t)


# Calls the locator must not take for forward ops: the backward itself.
_NOT_FORWARD = (torch.autograd.grad, torch.Tensor.backward)


class _NonfiniteLocator(TorchFunctionMode):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.names = {id(m): name for name, m in model.named_modules()}
        self.stack: list[str] = []
        self.forward: Optional[Origin] = None
        self.backward: Optional[Origin] = None
        self.seen: set = set()  # autograd nodes hooked
        self.handles: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        module = self.stack[-1] if self.stack else ""
        # (the mode is off while this runs: the checks below are not watched themselves)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            node = t.grad_fn if isinstance(t, torch.Tensor) else None
            if node is not None and node not in self.seen:
                self.seen.add(node)
                self.handles.append(node.register_hook(self._hook(node, name, module)))
        # In the forward only NaN counts: -inf is what a mask legitimately fills in.
        if (self.forward is None and func not in _NOT_FORWARD and not _finite(out, _no_nan)
                and _finite(list(args) + list(kwargs.values()), _no_nan)):
            self.forward = Origin("forward", name, module)
        return out

    def _hook(self, node, op: str, module: str):
        def hook(grad_inputs, grad_outputs):
            if self.backward is None and not _finite(list(grad_inputs)) and _finite(list(grad_outputs)):
                self.backward = Origin("backward", op, module, node.name())
        return hook


@contextlib.contextmanager
def _module_stack(locator: _NonfiniteLocator) -> Iterator[None]:
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    def pre(module, args):
        locator.stack.append(locator.names.get(id(module), type(module).__name__))

    def post(module, args, output):
        if locator.stack:
            locator.stack.pop()

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    try:
        yield
    finally:
        for handle in handles + locator.handles:
            handle.remove()


def first_nonfinite(model: torch.nn.Module, run: Callable[[], object]) -> Optional[Origin]:
    """Where run() (a forward and a backward of `model`) first made a NaN/Inf: in the forward when
    the forward made one, else in the backward; None when neither did (or it could not be seen)."""
    locator = _NonfiniteLocator(model)
    with _module_stack(locator), locator:
        run()
    return locator.forward or locator.backward


# What makes a first NaN/Inf at each kind of op, for the verdict (autograd node names included).
_ROOTS = ("pow", "__pow__", "sqrt", "rsqrt", "norm", "PowBackward0", "PowBackward1", "SqrtBackward0",
          "RsqrtBackward0", "NormBackward1", "LinalgVectorNormBackward0")
_DIVISIONS = ("div", "__truediv__", "__rtruediv__", "reciprocal", "DivBackward0", "ReciprocalBackward0")
_LOGS = ("log", "LogBackward0")


def explained(origin: Optional[Origin]) -> tuple[str, str]:
    """(the cause the origin points at, the fix) in words; candidates when it does not tell."""
    if origin is None:
        return ("the op that made it could not be located; candidates: a softmax over a row with every key "
                "masked, a root or a division at exactly zero, log(0), an overflow",
                "find the first non-finite value with torch.autograd.set_detect_anomaly(True, check_nan=True)")
    where = f"the first NaN/Inf appears {origin.describe()}"
    names = (origin.op, origin.node)
    if origin.at_softmax:
        return (f"{where}: queries with every key masked give softmax(-inf, ..., -inf) = NaN",
                "fill masked scores with torch.finfo(scores.dtype).min instead of float('-inf') (a fully masked "
                "row then averages instead of dividing 0 by 0)")
    if any(n in _ROOTS for n in names):
        return (f"{where}, not at an attention softmax: a root of exactly zero (x ** 0.5, sqrt, a norm of a zero "
                "vector such as a zero pad embedding) has an infinite derivative",
                "put the epsilon inside the root: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)")
    if any(n in _DIVISIONS for n in names):
        return (f"{where}, not at an attention softmax: a division by zero (a zero norm, count or sum)",
                "add an epsilon to the denominator, or clamp it: x / y.clamp(min=eps)")
    if any(n in _LOGS for n in names):
        return f"{where}, not at an attention softmax: log(0)", "use log(x.clamp(min=eps)) or log_softmax"
    return (f"{where}, not at an attention softmax; candidates: an overflow, a root, division or log at zero",
            f"look at what {origin.op} receives there")
