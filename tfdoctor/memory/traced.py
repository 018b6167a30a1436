"""Traced mode: run one real training step of the user's model on fake tensors and count the bytes
of every tensor storage alive after each aten op.

Fake tensors (torch._subclasses.fake_tensor) carry shapes, dtypes and storages of the right size but
no data, so a billion-parameter model at a sequence length of 8192 traces on a laptop. The same
counter run on real tensors is the ground truth the bench compares against: the two agree exactly,
because they see the same ops create the same storages.

The step is the steady-state step the analytic mode models: optimizer states already allocated,
forward, cross-entropy on float32 logits, backward, optimizer step, zero_grad(set_to_none=True),
with `logits` and `loss` held by the caller until the step returns.

Imports torch; the analytic mode never imports this module.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tfdoctor.errors import SubjectError, UsageError

PHASES = ("setup", "forward", "loss", "backward", "optimizer")
# What is alive at the peak, by the phase that created it (see TraceResult.peak_breakdown).
_ORIGIN_NAMES = {
    "parameters": "parameters and buffers",
    "setup": "optimizer states",
    "forward": "forward: activations and logits",
    "loss": "loss: float32 logits and softmax",
    "backward": "backward: gradients and temporaries",
    "optimizer": "optimizer step temporaries",
}
_NODE_KEY = "tfdoctor.module"  # where a forward op's autograd node remembers its module
LARGEST_KEPT = 6


@dataclass
class TraceResult:
    """What one traced step measured. Bytes are per process (one device)."""

    peak_bytes: int
    peak_phase: str
    peak_op: str
    peak_node: str  # the autograd node being run at the peak ("" outside backward)
    peak_module: str  # the module whose op (or whose op's backward) made the peak
    attention_scores_bytes: Optional[int]  # the largest [..., T, T] tensor of the forward, if any
    logits_bytes: int
    peak_breakdown: dict[str, int]  # bytes alive at the peak, by origin (see _ORIGIN_NAMES)
    parameter_bytes: int
    gradient_bytes_at_peak: int
    optimizer_bytes: int
    phase_peaks: dict[str, int]
    kept_by_module: list[tuple[str, int]]  # forward activations alive when backward starts
    largest: list[dict[str, Any]]  # the largest single allocations
    ops: int
    seconds: float
    batch: int = 0
    seq: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase, "peak_op": self.peak_op,
            "peak_node": self.peak_node, "peak_module": self.peak_module,
            "attention_scores_bytes": self.attention_scores_bytes, "logits_bytes": self.logits_bytes,
            "peak_breakdown": dict(self.peak_breakdown), "parameter_bytes": self.parameter_bytes,
            "gradient_bytes_at_peak": self.gradient_bytes_at_peak, "optimizer_bytes": self.optimizer_bytes,
            "phase_peaks": dict(self.phase_peaks),
            "kept_by_module": [{"module": m, "bytes": b} for m, b in self.kept_by_module],
            "largest_tensors": list(self.largest), "ops": self.ops, "seconds": round(self.seconds, 3),
            "batch": self.batch, "seq": self.seq, "notes": list(self.notes),
        }


class LiveBytes(TorchDispatchMode):
    """Sum of the storages alive after each op, and where the maximum happened.

    A storage is counted once however many views share it, and uncounted by a weakref finalizer the
    moment it is freed (torch keeps one Python object per live storage, so the finalizer fires
    exactly when the memory would be released).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, str, str]] = {}  # storage id -> (bytes, origin, module)
        self.by_origin: dict[str, int] = {}
        self.now = 0
        self.peak = 0
        self.peak_at: tuple[str, str, str, str] = ("setup", "", "", "")
        self.peak_breakdown: dict[str, int] = {}
        self.peak_grad_bytes = 0
        self.phase = "setup"
        self.phase_peaks: dict[str, int] = {}
        self.modules: list[str] = []  # forward module stack, innermost last
        self.largest: dict[tuple, dict[str, Any]] = {}
        self.params: list[torch.Tensor] = []
        self.kept: list[tuple[str, int]] = []
        self.seq = 0  # an allocation whose last two dims are [seq, seq] is an attention score tensor
        self.scores_bytes = 0
        self.logits_bytes = 0
        self.ops = 0

    # -- counting ------------------------------------------------------------------------------

    def add(self, tensor: torch.Tensor, origin: Optional[str] = None, op: str = "") -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage to count
            return
        key = storage._cdata
        if key in self.live:
            return
        nbytes = storage.nbytes()
        origin = origin or self.phase
        module = self.where()
        self.live[key] = (nbytes, origin, module)
        self.by_origin[origin] = self.by_origin.get(origin, 0) + nbytes
        self.now += nbytes
        finalizer = weakref.finalize(storage, self._drop, key)
        finalizer.atexit = False
        if op and nbytes >= 1 << 20:
            self._note_large(tensor, nbytes, op, module)
        if op and self.phase == "forward" and tensor.dim() >= 3 and tuple(tensor.shape[-2:]) == (self.seq, self.seq):
            self.scores_bytes = max(self.scores_bytes, nbytes)

    def where(self) -> str:
        """The module the current op belongs to: the forward stack, or in backward the module whose
        forward op created the autograd node being run."""
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            return node.metadata.get(_NODE_KEY, "") if node is not None else ""
        return self.modules[-1] if self.modules else ""

    def _drop(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.now -= entry[0]
            self.by_origin[entry[1]] -= entry[0]

    def _note_large(self, tensor, nbytes: int, op: str, module: str) -> None:
        shape = list(tensor.shape)
        where = _module_pattern(module)
        key = (op, tuple(shape), str(tensor.dtype), where, self.phase)
        if key in self.largest:
            self.largest[key]["count"] += 1
            return
        self.largest[key] = {"bytes": nbytes, "shape": shape, "dtype": str(tensor.dtype).replace("torch.", ""),
                             "op": op, "module": where, "phase": self.phase, "count": 1}
        if len(self.largest) > 4 * LARGEST_KEPT:
            for drop in sorted(self.largest, key=lambda k: self.largest[k]["bytes"])[:LARGEST_KEPT]:
                del self.largest[drop]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        op = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.add(leaf, op=op)
        if self.now > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.now
        if self.now > self.peak:
            self._new_peak(op)
        return out

    def _new_peak(self, op: str) -> None:
        self.peak = self.now
        node_name, module = "", self.where()
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            node_name = node.name() if node is not None else ""
            grads = {p.grad.untyped_storage()._cdata: p.grad.untyped_storage().nbytes()
                     for p in self.params if p.grad is not None}
            self.peak_grad_bytes = sum(grads.values())
        else:
            self.peak_grad_bytes = 0
        self.peak_at = (self.phase, op, node_name, module)
        self.peak_breakdown = {k: v for k, v in self.by_origin.items() if v}

    def kept_by_module(self) -> list[tuple[str, int]]:
        totals: dict[str, int] = {}
        for nbytes, origin, module in self.live.values():
            if origin == "forward":
                totals[module or "(model)"] = totals.get(module or "(model)", 0) + nbytes
        return sorted(totals.items(), key=lambda kv: -kv[1])


class _NodeTagger(TorchFunctionMode):
    """Write the current module's name on the autograd node of every forward result, so that the
    backward of that op can be traced back to the module (node.metadata lives on the C++ node and
    holds no tensor)."""

    def __init__(self, counter: LiveBytes) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counter.modules and self.counter.phase == "forward":
            for leaf in tree_leaves(out):
                node = getattr(leaf, "grad_fn", None) if isinstance(leaf, torch.Tensor) else None
                if node is not None and _NODE_KEY not in node.metadata:
                    node.metadata[_NODE_KEY] = self.counter.modules[-1]
        return out


def _module_pattern(name: str) -> str:
    """h.3.attn -> h.*.attn: the same module in every layer reads as one row."""
    return ".".join("*" if part.isdigit() else part for part in name.split(".")) if name else name


@contextlib.contextmanager
def module_stack(model: nn.Module, counter: LiveBytes) -> Iterator[None]:
    names = {id(m): name for name, m in model.named_modules() if name}

    def push(module, args):
        name = names.get(id(module))
        if name is not None:
            counter.modules.append(name)

    def pop(module, args, output):
        name = names.get(id(module))
        if name is not None and counter.modules and counter.modules[-1] == name:
            counter.modules.pop()

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(push), register_module_forward_hook(pop)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        counter.modules.clear()


@contextlib.contextmanager
def swapped_tensors(model: nn.Module, convert) -> Iterator[list[nn.Parameter]]:
    """Every parameter and buffer of `model` replaced by `convert(tensor)` for the block, sharing
    kept (a tied weight stays one tensor), and the originals put back in `finally`."""
    saved: list[tuple[dict, str, Any]] = []
    made: dict[int, Any] = {}
    params: list[nn.Parameter] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    saved.append((table, name, tensor))
                    if id(tensor) not in made:
                        new = convert(tensor.detach())
                        if isinstance(tensor, nn.Parameter):
                            new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                            params.append(new)
                        made[id(tensor)] = new
                    table[name] = made[id(tensor)]
        yield params
    finally:
        for table, name, tensor in reversed(saved):
            table[name] = tensor


def make_optimizer(name: str, params: list[nn.Parameter]):
    trainable = [p for p in params if p.requires_grad]
    if name == "none" or not trainable:
        return None
    if name == "sgd":
        return torch.optim.SGD(trainable, lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(trainable, lr=1e-3)


def allocate_states(optimizer) -> None:
    """Steady state: the optimizer's states exist before the step, as after the first one. One step on
    zero gradients makes them with whatever layout this optimizer uses."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def training_step(subject, batch: int, seq: int, optimizer, counter: LiveBytes, autocast_dtype=None,
                  device=None):
    """One steady-state step; returns (logits, loss) so that the caller holds them to the end."""
    from tfdoctor.subject import call

    vocab = subject.vocab_size
    counter.phase = "forward"
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    inputs = (ids, ids) if subject.kind == "seq2seq" else (ids,)
    autocast = (torch.autocast(device_type=(device or torch.device("cpu")).type, dtype=autocast_dtype)
                if autocast_dtype is not None else contextlib.nullcontext())
    grad = torch.enable_grad() if optimizer is not None else torch.no_grad()
    with grad:
        with autocast:
            logits = call(subject, *inputs)
        if tuple(logits.shape) != (batch, seq, vocab):
            raise SubjectError(f"logits of shape {list(logits.shape)}, expected [{batch}, {seq}, {vocab}]",
                               "return logits [B, T, V] for every position, or pass --vocab")
        counter.logits_bytes = logits.numel() * logits.element_size()
        counter.phase = "loss"
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))  # float32 logits
        if optimizer is not None:
            counter.kept = counter.kept_by_module()  # what the forward left for backward
            counter.phase = "backward"
            loss.backward()
            counter.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return logits, loss


def trace_step(subject, batch: int, seq: int, *, optimizer: str = "adamw", autocast_dtype=None,
               fake: bool = True) -> TraceResult:
    """Trace one steady-state training step of `subject` (a resolved-enough tfdoctor Subject with
    vocab_size set) at [batch, seq]. fake=False runs it for real (the bench's ground truth) and uses
    the model's own tensors, which the step then updates."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from tfdoctor.probes.modes import preserved_process_state

    model = subject.model
    if not isinstance(model, nn.Module):
        raise SubjectError(f"expected an nn.Module, got {type(model).__name__}")
    if subject.vocab_size is None:
        raise SubjectError("cannot tell the vocabulary size", "pass --vocab N or Subject(vocab_size=N)")
    start = time.perf_counter()
    counter = LiveBytes()
    counter.seq = seq
    flags = [(m, m.training) for m in model.modules()]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    convert = fake_mode.from_tensor if fake else (lambda t: t)
    already = next((t for t in model.parameters() if isinstance(t, FakeTensor)), None)
    if fake and already is not None:  # built under a FakeTensorMode already (e.g. too big to build for real)
        fake_mode, convert = already.fake_mode, (lambda t: t)
    model.train()
    try:
        with preserved_process_state(), swapped_tensors(model, convert) as params:
            if not fake:  # the real model: its own parameters, grads cleared as a step would leave them
                params = [p for p in model.parameters()]
                for p in params:
                    p.grad = None
            device = params[0].device if params else None
            with contextlib.ExitStack() as stack:
                if fake_mode is not None:
                    stack.enter_context(fake_mode)
                stack.enter_context(counter)
                for p in params:
                    counter.add(p, origin="parameters")
                for b in model.buffers():
                    counter.add(b, origin="parameters")
                counter.params = params
                opt = make_optimizer(optimizer, params)
                allocate_states(opt)
                optimizer_bytes = counter.by_origin.get("setup", 0)
                counter.peak, counter.phase_peaks = counter.now, {}
                stack.enter_context(module_stack(model, counter))
                stack.enter_context(_NodeTagger(counter))
                logits, loss = training_step(subject, batch, seq, opt, counter, autocast_dtype, device)
                kept = counter.kept or counter.kept_by_module()
                del logits, loss
    finally:
        for module, training in flags:
            module.training = training
    parameter_bytes = sum(_storage_bytes(p) for p in params) + sum(_storage_bytes(b) for b in model.buffers())
    phase, op, node, module = counter.peak_at
    largest = sorted(counter.largest.values(), key=lambda d: -d["bytes"])[:LARGEST_KEPT]
    return TraceResult(
        peak_bytes=counter.peak, peak_phase=phase, peak_op=op, peak_node=node, peak_module=module,
        attention_scores_bytes=counter.scores_bytes or None, logits_bytes=counter.logits_bytes,
        peak_breakdown={_ORIGIN_NAMES.get(k, k): v for k, v in counter.peak_breakdown.items()},
        parameter_bytes=parameter_bytes, gradient_bytes_at_peak=counter.peak_grad_bytes,
        optimizer_bytes=optimizer_bytes, phase_peaks={k: v for k, v in counter.phase_peaks.items()},
        kept_by_module=kept[:12], largest=largest, ops=counter.ops,
        seconds=time.perf_counter() - start, batch=batch, seq=seq,
    )


def _storage_bytes(tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0



@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module) -> Iterator[int]:
    """Wrap every child of every nn.ModuleList (the layers, in nearly every Transformer) in
    non-reentrant activation checkpointing for the block; the instance attribute goes in `finally`."""
    from torch.utils.checkpoint import checkpoint

    wrapped = []
    try:
        for holder in model.modules():
            if isinstance(holder, nn.ModuleList):
                for block in holder:
                    original = block.forward

                    def forward(*args, _original=original, **kwargs):
                        return checkpoint(_original, *args, use_reentrant=False, preserve_rng_state=False,
                                          **kwargs)

                    block.forward = forward
                    wrapped.append(block)
        yield len(wrapped)
    finally:
        for block in wrapped:
            del block.forward


# ----------------------------------------------------------------------------------------------------
# Judging a traced step against the budget: the same verdict and remedies as the analytic mode


def _sharded(trace: TraceResult, gpus: int, shard: str) -> int:
    """Per-device peak when ZeRO shards optimizer states (zero1), gradients (zero2), parameters (zero3)."""
    if gpus <= 1 or shard == "none":
        return trace.peak_bytes
    parts = trace.optimizer_bytes
    if shard in ("zero2", "zero3"):
        parts += trace.gradient_bytes_at_peak
    if shard == "zero3":
        parts += trace.parameter_bytes
    return trace.peak_bytes - parts + parts // gpus


def judge_traced(subject, target: str, batch: int, seq: int, budget: int, budget_source: str, *,
                 dtype: str = "fp32", optimizer: str = "adamw", gpus: int = 1, shard: str = "none",
                 remedies: bool = True, remedies_if_fits: bool = True):
    """Trace the step, judge it, and trace again the remedies that are cheap to trace (with
    remedies_if_fits=False, only when the step does not fit: the battery's check needs them then)."""
    from tfdoctor.memory.analytic import Remedy, Verdict
    from tfdoctor.subject import max_positions_of, vocab_size_of

    model = subject.model
    if subject.vocab_size is None:
        vocab = vocab_size_of(model)
        if not vocab:
            raise SubjectError("cannot tell the vocabulary size: no config.vocab_size and no nn.Embedding",
                               "pass --vocab N")
        import dataclasses

        subject = dataclasses.replace(subject, vocab_size=vocab)
    positions = max_positions_of(model)
    if positions and seq > positions:
        raise UsageError(f"--seq {seq} is longer than the model's {positions} positions",
                         f"pass --seq {positions} or less, or build the model with more positions")
    autocast = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    def run(b: int, t: int, autocast_dtype=autocast) -> TraceResult:
        return trace_step(subject, b, t, optimizer=optimizer, autocast_dtype=autocast_dtype)

    def per_device(trace: TraceResult) -> int:
        return _sharded(trace, gpus, shard)

    main = run(batch, seq)
    peak = per_device(main)
    found: list = []
    notes: list[str] = []
    largest_batch = largest_seq = 0
    if remedies and (remedies_if_fits or peak > budget):
        # Peak is close to linear in the batch and to quadratic in the sequence length: two more traces
        # place the largest batch, two more the largest length, and each proposal is traced once more.
        at_one = per_device(run(1, seq)) if batch > 1 else peak
        slope = (peak - at_one) / (batch - 1) if batch > 1 else 0
        largest_batch = _largest_linear(at_one, slope, budget)
        lengths = sorted({seq, max(2, seq // 2), max(2, seq // 4)})
        peaks = {t: per_device(run(batch, t)) if t != seq else peak for t in lengths}
        largest_seq = _largest_quadratic(peaks, budget, limit=positions)
        if autocast is None:
            half = run(batch, seq, torch.bfloat16)
            found.append(Remedy("mixed precision", "torch.autocast(dtype=torch.bfloat16) around the forward "
                                "(traced)", per_device(half), per_device(half) <= budget))
        try:
            with checkpointed_blocks(model) as blocks:
                traced_ckpt = run(batch, seq) if blocks else None
        except Exception as exc:  # the user's blocks may not survive wrapping; the remedy is then untraced
            traced_ckpt = None
            notes.append(f"activation checkpointing could not be traced ({type(exc).__name__}: {exc})")
        if traced_ckpt is not None:
            value = per_device(traced_ckpt)
            found.append(Remedy("activation checkpointing", "torch.utils.checkpoint around each block of the "
                                "nn.ModuleList (traced)", value, value <= budget))
        if batch > 1:
            micro = max(1, min(largest_batch, batch - 1))
            while batch % micro:
                micro -= 1
            value = per_device(run(micro, seq))
            found.append(Remedy("gradient accumulation", f"micro-batch {micro} x {batch // micro} accumulation "
                                "steps (traced)", value, value <= budget))
        if optimizer != "none":
            n = gpus if gpus > 1 else 8
            value = _sharded(main, n, "zero3")
            found.append(Remedy("ZeRO-3 / FSDP sharding", f"shard parameters, gradients and optimizer states "
                                f"over {n} GPUs (computed from the trace)", value, value <= budget))
        if largest_seq < seq:
            shorter = max(largest_seq, 2)
            value = per_device(run(batch, shorter))
            for _ in range(3):  # the fit is close, not exact: step down until the traced peak fits
                if value <= budget or shorter <= 2:
                    break
                shorter = max(2, int(shorter * 0.97))
                value = per_device(run(batch, shorter))
            largest_seq = shorter if value <= budget else largest_seq
            found.append(Remedy("shorter sequences", f"--seq {shorter} (largest that fits; traced)", value,
                                value <= budget, changes_training=True))
        if main.attention_scores_bytes:
            notes.append("fused attention (F.scaled_dot_product_attention) is a change to your model's code and "
                         "is not traced; `tfdoctor memory --attention sdpa` estimates it")
    trace = main.to_dict()
    trace.update(target=target, dtype=dtype, optimizer=optimizer, gpus=gpus, shard=shard,
                 parameter_count=sum(p.numel() for p in model.parameters()), per_device_peak_bytes=peak)
    trace["peak_bytes"] = peak
    trace["notes"] = trace["notes"] + notes
    return Verdict(estimate=None, budget_bytes=budget, budget_source=budget_source, largest_seq=largest_seq,
                   largest_batch=largest_batch, remedies=found, mode="traced", traced=trace)


def _largest_linear(at_one: int, slope: float, budget: int) -> int:
    if at_one > budget:
        return 0
    if slope <= 0:
        return 1 << 20
    return 1 + int((budget - at_one) // slope)


def _largest_quadratic(peaks: dict[int, int], budget: int, limit: Optional[int]) -> int:
    """Fit peak(T) = c0 + c1 T + c2 T^2 through the traced points and solve peak(T) = budget."""
    points = sorted(peaks.items())
    if len(points) < 3:
        ts = [t for t, p in points if p <= budget]
        return max(ts) if ts else 0
    (t0, p0), (t1, p1), (t2, p2) = points[:3]
    # Newton's divided differences: exact for three points.
    d01 = (p1 - p0) / (t1 - t0)
    d12 = (p2 - p1) / (t2 - t1)
    c2 = (d12 - d01) / (t2 - t0)
    c1 = d01 - c2 * (t0 + t1)
    c0 = p0 - c1 * t0 - c2 * t0 * t0

    def value(t: int) -> float:
        return c0 + c1 * t + c2 * t * t

    cap = limit or (1 << 24)
    if value(1) > budget:
        return 0
    low, high = 1, 2
    while high <= cap and value(high) <= budget:
        low, high = high, high * 2
    high = min(high, cap + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if value(mid) <= budget else (low, mid)
    return min(low, cap)
