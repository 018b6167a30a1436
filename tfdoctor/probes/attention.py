"""What attention does during one forward, seen from inside: the softmax weights that reach V, the
fused kernels called, and the numeric constants that do not fit a reduced-precision dtype.

Both watchers are TorchFunctionModes: they see every torch function and Tensor method the model
calls, whatever it is spelt like (`torch.softmax`, `F.softmax`, `x.softmax`, `a @ b`, `einsum`),
without patching anything. Module forward hooks name the module each call happens in.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from tfdoctor.usercode.call_sites import call_site
from tfdoctor.usercode.torch_compat import tree_flatten

# Function and method names, as `func.__name__` gives them (Tensor properties come as `__get__`).
SOFTMAX_NAMES = {"softmax", "_softmax", "special_softmax"}
PRODUCT_NAMES = {"matmul", "__matmul__", "__rmatmul__", "bmm", "einsum"}
# Attention computed in one call that masks before its softmax: fused kernels, and torch.nn's
# MultiheadAttention / TransformerEncoderLayer paths (a mode sees them as one call, not their inside).
FUSED_NAMES = {"scaled_dot_product_attention", "flex_attention", "multi_head_attention_forward",
               "_native_multi_head_attention", "_transformer_encoder_layer_fwd"}
# Ops that swap two dims (the last two when none are given).
SWAP_LAST_TWO = {"mT", "mH", "transpose", "transpose_", "swapaxes", "swapdims", "t", "t_"}
RESHAPE_NAMES = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as",
                 "reshape_as", "unsqueeze_", "squeeze_"}
# Ops whose integer arguments are values rather than sizes or dims.
FILL_NAMES = {"masked_fill", "masked_fill_", "fill", "fill_", "full", "full_like", "new_full", "where"}


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a Tensor property such as .mT: the descriptor knows its own name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


@contextlib.contextmanager
def module_scope(model: torch.nn.Module) -> Iterator[list[str]]:
    """A stack of the qualified names of the modules whose forward is running; hooks removed after."""
    stack: list[str] = []
    handles = []

    def enter(name):
        return lambda module, args: stack.append(name)

    def leave(module, args, output):
        if stack:
            stack.pop()

    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(enter(name or type(model).__name__)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        yield stack
    finally:
        for handle in handles:
            handle.remove()


# ----------------------------------------------------------------------------------------------
# Softmax weights that reach V


@dataclass
class WeightsUse:
    """One product of softmax weights with another tensor, contracted over the softmax's axis."""

    site: str  # module where the softmax ran
    product: str  # matmul, bmm, einsum...
    shape: list[int]  # of the weights as they entered the product
    dtype: str
    rows: int  # rows of weights (every index but the contracted one)
    zero_rows: int  # rows of all zeros: fully masked, left to masked-row-nan
    nonfinite_rows: int  # rows with NaN/Inf: left to masked-row-nan
    row_sums: torch.Tensor  # (rows,) float32, the sums of the finite, non-zero rows
    # (rows,) float32, the sums of those rows' magnitudes: signed attention (Cog attention, x-transformers'
    # attn_cog_signed) multiplies softmax weights by the sign of their scores, by design, so its rows
    # sum to 1 only in magnitude, where weights masked after the softmax fall short either way.
    abs_row_sums: torch.Tensor

    def off_rows(self, tolerance: float) -> int:
        return int(((self.row_sums - 1).abs() > tolerance).sum())

    def off_rows_in_magnitude(self, tolerance: float) -> int:
        return int(((self.abs_row_sums - 1).abs() > tolerance).sum())


@dataclass
class AttentionCapture:
    softmaxes: int = 0  # softmax calls seen
    fused_calls: dict[str, int] = field(default_factory=dict)  # fused attention kernel -> calls
    uses: list[WeightsUse] = field(default_factory=list)
    # With keep_weights: each use's weights, their softmax (key) axis moved last.
    weights: list[torch.Tensor] = field(default_factory=list)
    keep_weights: bool = False
    # The user's "path:line" where attention is computed: the first softmax (or fused kernel) call made
    # from the user's own code (none for a library's model: its lines are not the user's to fix).
    sites: dict[str, str] = field(default_factory=dict)


@dataclass
class _Tracked:
    tensor: torch.Tensor  # kept alive so that its id() is not reused during the forward
    axis: int  # where the softmax's axis sits in this tensor
    site: str


def _moved_axis(name: str, args, kwargs, source: torch.Tensor, axis: int, out: torch.Tensor) -> int | None:
    """Where `axis` of `source` went in `out`, or None when the op is not one we can follow."""
    if out.numel() != source.numel() or not out.is_floating_point():
        return None
    if name in SWAP_LAST_TWO or name in ("permute", "movedim", "moveaxis"):
        order = _reorder(name, args[1:], kwargs, source.ndim)
        return order.index(axis) if order is not None and axis in order else None
    if name in RESHAPE_NAMES:
        # A reshape keeps the axis when its length and everything to its right stay the same.
        inner = math.prod(source.shape[axis + 1:])
        for candidate in range(out.ndim):
            if out.shape[candidate] == source.shape[axis] and math.prod(out.shape[candidate + 1:]) == inner:
                return candidate
        return None
    if tuple(out.shape) == tuple(source.shape):  # elementwise: masked_fill, mul, dropout, to, where...
        return axis
    return None


def _reorder(name: str, rest, kwargs, ndim: int) -> list[int] | None:
    """For a dimension-reordering op: out's dims as a list of the input dims they come from."""
    values = list(rest) + list(kwargs.values())
    order = list(range(ndim))
    if name == "permute":
        dims = values[0] if len(values) == 1 and isinstance(values[0], (tuple, list)) else values
        return [d % ndim for d in dims] if len(dims) == ndim else None
    if name in ("movedim", "moveaxis"):
        if len(values) != 2 or not all(isinstance(v, int) for v in values):
            return None  # several dims moved at once: not followed
        source, destination = values[0] % ndim, values[1] % ndim
        order.remove(source)
        order.insert(destination, source)
        return order
    if ndim < 2:
        return order
    d0, d1 = (values[0] % ndim, values[1] % ndim) if len(values) >= 2 else (ndim - 2, ndim - 1)
    order[d0], order[d1] = order[d1], order[d0]
    return order


def _einsum_axes(args) -> tuple[list[torch.Tensor], list[set[int]]]:
    """For torch.einsum(equation, *operands): each operand and the axes it has summed away."""
    equation, operands = args[0], list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    equation = equation.replace(" ", "")
    inputs, _, output = equation.partition("->")
    terms = inputs.split(",")
    if "->" not in equation:  # implicit output: the letters used once, sorted
        letters = re.sub(r"[^A-Za-z]", "", inputs)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    contracted = []
    for term, operand in zip(terms, operands):
        head, ellipsis, tail = term.partition("...")
        positions = {c: i for i, c in enumerate(head)}
        if ellipsis:
            positions.update({c: operand.ndim - len(tail) + i for i, c in enumerate(tail)})
        contracted.append({i for c, i in positions.items() if c not in output})
    return operands, contracted


def _contracted(name: str, args, kwargs) -> list[tuple[torch.Tensor, set[int]]]:
    """(operand, axes it is summed over) for each tensor operand of a product."""
    if name == "einsum":
        return list(zip(*_einsum_axes(args))) if args and isinstance(args[0], str) else []
    operands = list(args) + [kwargs[key] for key in ("input", "other", "mat2") if key in kwargs]
    if len(operands) < 2:
        return []
    a, b = operands[0], operands[1]
    if name == "__rmatmul__":  # b @ a
        a, b = b, a
    pairs = []
    if isinstance(a, torch.Tensor):
        pairs.append((a, {a.ndim - 1}))
    if isinstance(b, torch.Tensor):
        pairs.append((b, {max(b.ndim - 2, 0)}))
    return pairs


def _softmax_axis(args, kwargs) -> int:
    source = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:  # F.softmax's legacy implicit dim
        dim = 0 if source.ndim in (0, 1, 3) else 1
    return dim % max(source.ndim, 1)


class _WeightsMode(TorchFunctionMode):
    """Follows each softmax output through masking, dropout, casts and reshapes into a product."""

    def __init__(self, scope: list[str], capture: AttentionCapture):
        super().__init__()
        self.scope = scope
        self.capture = capture
        self.tracked: dict[int, _Tracked] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        if (name in SOFTMAX_NAMES or name in FUSED_NAMES) and name not in self.capture.sites:
            where = call_site()
            if where:
                self.capture.sites[name] = where
        if name in SOFTMAX_NAMES and isinstance(out, torch.Tensor) and out.ndim >= 1:
            self.capture.softmaxes += 1
            site = self.scope[-1] if self.scope else "?"
            self.tracked[id(out)] = _Tracked(out, _softmax_axis(args, kwargs), site)
        elif name in FUSED_NAMES:
            self.capture.fused_calls[name] = self.capture.fused_calls.get(name, 0) + 1
        elif name in PRODUCT_NAMES:
            for operand, axes in _contracted(name, args, kwargs):
                seen = self.tracked.get(id(operand))
                if seen is not None and axes == {seen.axis}:
                    self.capture.uses.append(_weights_use(operand, seen, name))
                    if self.capture.keep_weights:
                        self.capture.weights.append(operand.detach().float().movedim(seen.axis, -1))
        elif isinstance(out, torch.Tensor) and self.tracked:
            flat, _ = tree_flatten((args, kwargs))
            for arg in flat:
                seen = self.tracked.get(id(arg)) if isinstance(arg, torch.Tensor) else None
                if seen is None:
                    continue
                axis = _moved_axis(name, args, kwargs, arg, seen.axis, out)
                if axis is not None:
                    self.tracked[id(out)] = _Tracked(out, axis, seen.site)
                break
        return out


def _weights_use(weights: torch.Tensor, seen: _Tracked, product: str) -> WeightsUse:
    rows = weights.detach().float().movedim(seen.axis, -1).reshape(-1, weights.shape[seen.axis])
    finite = torch.isfinite(rows).all(dim=-1)
    zero = finite & (rows == 0).all(dim=-1)
    kept = finite & ~zero
    return WeightsUse(site=seen.site, product=product, shape=list(weights.shape), dtype=str(weights.dtype),
                      rows=rows.shape[0], zero_rows=int(zero.sum()), nonfinite_rows=int((~finite).sum()),
                      row_sums=rows[kept].sum(dim=-1).cpu(), abs_row_sums=rows[kept].abs().sum(dim=-1).cpu())


def capture_attention(model: torch.nn.Module, forward, keep_weights: bool = False) -> AttentionCapture:
    """Run `forward()` once and record every softmax output that is multiplied, over the softmax's
    axis, with another tensor (the attention weights meeting V), and every fused attention call;
    with keep_weights, the weights themselves too."""
    capture = AttentionCapture(keep_weights=keep_weights)
    with module_scope(model) as scope:
        mode = _WeightsMode(scope, capture)
        try:
            with mode:
                forward()
        finally:
            mode.tracked.clear()
    return capture


def attention_calls(subject) -> AttentionCapture:
    """The softmaxes, fused attention kernels and their sites of one eval forward on random tokens,
    once per run and attention implementation (mask-direction asks whether the model attends at all,
    every located model finding where it does)."""
    from tfdoctor.context import memo
    from tfdoctor.modes import evaluation
    from tfdoctor.subject import call, random_tokens

    def capture() -> AttentionCapture:
        ids = [random_tokens(subject, 1, subject.seq_len)] * (2 if subject.kind == "seq2seq" else 1)
        with torch.no_grad(), evaluation(subject.model):
            return capture_attention(subject.model, lambda: call(subject, *ids))

    from tfdoctor.probes.implementations import current_implementation

    # per attention implementation: mask-direction judges a Hugging Face model under eager and sdpa
    return memo(("attention-calls", id(subject.model), current_implementation(subject.model)), capture)


def attention_site(capture: AttentionCapture) -> tuple[str, str] | None:
    """(the user's "path:line", what is called there) where the model computes attention: a fused
    kernel's call first (where its mask is given), else the softmax's; None when no user line was seen."""
    for name in (*sorted(FUSED_NAMES & set(capture.sites)), *sorted(SOFTMAX_NAMES & set(capture.sites))):
        called = "F.scaled_dot_product_attention" if name == "scaled_dot_product_attention" else \
            "the attention softmax" if name in SOFTMAX_NAMES else name
        return capture.sites[name], called
    return None


def pad_attention(model: torch.nn.Module, forward, pads: torch.Tensor) -> float | None:
    """The largest share of attention any real query of a batch gives to pad keys, measured on the
    softmax weights of one `forward()` over ids with `pads` [B, T] True at pad positions; None when
    no weights over those keys were seen (a fused kernel such as SDPA keeps them inside). A Hugging
    Face model running a fused kernel is measured under its eager implementation, same masks."""
    from tfdoctor.probes.implementations import attention_implementations, current_implementation, using_implementation

    share = _pad_attention(model, forward, pads)
    if share is None and current_implementation(model) != "eager" and "eager" in attention_implementations(model):
        with using_implementation(model, "eager"):
            share = _pad_attention(model, forward, pads)
    return share


def _pad_attention(model: torch.nn.Module, forward, pads: torch.Tensor) -> float | None:
    capture = capture_attention(model, forward, keep_weights=True)
    B, T = pads.shape
    largest = None
    for weights in capture.weights:  # (B, ..., T_q, T_k) where batch-first self-attention over the ids
        if weights.ndim < 3 or weights.shape[0] != B or weights.shape[-1] != T or weights.shape[-2] != T:
            continue
        keys = pads.to(weights.device).float().view(B, *([1] * (weights.ndim - 2)), T)  # (B, 1, .., 1, T_k)
        queries = (~pads).to(weights.device).view(B, *([1] * (weights.ndim - 3)), T)  # (B, 1, .., T_q)
        share = torch.nan_to_num((weights * keys).sum(-1), nan=0.0)  # (B, ..., T_q)
        share = share.masked_fill(~queries, 0.0)
        largest = max(largest or 0.0, float(share.max()))
    return largest


# ----------------------------------------------------------------------------------------------
# Constants that do not fit a reduced-precision dtype


@dataclass
class OutOfRangeConstant:
    value: float
    dtype: str  # the dtype it was meant to become
    op: str  # masked_fill, where, full...
    site: str  # module it was used in
    raised: bool  # True: the op raised an overflow error; False: it silently became +-inf

    def to_dict(self) -> dict:
        return {"value": self.value, "dtype": self.dtype, "op": self.op, "module": self.site,
                "raised": self.raised}


def _scalars(name: str, args, kwargs) -> list[float]:
    """Python floats and 0-dim floating tensors among a call's arguments, and ints for fill ops
    (elsewhere ints are sizes and dims)."""
    flat, _ = tree_flatten((args, kwargs))
    numbers = (int, float) if name in FILL_NAMES else (float,)
    values = []
    for item in flat:
        if isinstance(item, numbers) and not isinstance(item, bool):
            values.append(float(item))
        elif isinstance(item, torch.Tensor) and item.ndim == 0 and item.is_floating_point() and not item.is_meta:
            values.append(float(item))
    return values


def _too_big(values: list[float], dtype: torch.dtype) -> list[float]:
    top = torch.finfo(dtype).max
    return [v for v in values if math.isfinite(v) and abs(v) > top]


class _ConstantsMode(TorchFunctionMode):
    """Records every numeric constant that does not fit the reduced-precision tensor it goes into,
    whether the op raises an overflow error (masked_fill, fill_, full) or saturates to +-inf (where,
    arithmetic)."""

    def __init__(self, scope: list[str], dtypes: tuple[torch.dtype, ...]):
        super().__init__()
        self.scope = scope
        self.dtypes = dtypes
        self.found: list[OutOfRangeConstant] = []

    def _record(self, func, values: list[float], dtype: torch.dtype, raised: bool) -> None:
        for value in _too_big(values, dtype):
            self.found.append(OutOfRangeConstant(value, str(dtype).removeprefix("torch."), _name(func),
                                                 self.scope[-1] if self.scope else "?", raised))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except RuntimeError as exc:
            if "overflow" in str(exc):
                flat, _ = tree_flatten((args, kwargs))
                dtypes = [kwargs["dtype"]] if isinstance(kwargs.get("dtype"), torch.dtype) else []
                dtypes += [t.dtype for t in flat if isinstance(t, torch.Tensor) and t.dtype in self.dtypes]
                if dtypes:
                    self._record(func, _scalars(_name(func), args, kwargs), dtypes[0], raised=True)
            raise
        if isinstance(out, torch.Tensor) and out.dtype in self.dtypes:
            self._record(func, _scalars(_name(func), args, kwargs), out.dtype, raised=False)
        return out


@contextlib.contextmanager
def watching_constants(model: torch.nn.Module,
                       dtypes: tuple[torch.dtype, ...]) -> Iterator[list[OutOfRangeConstant]]:
    """Within the block, collect the constants that do not fit `dtypes` into the yielded list."""
    with module_scope(model) as scope:
        mode = _ConstantsMode(scope, dtypes)
        with mode:
            yield mode.found
