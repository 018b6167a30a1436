"""The live-bytes counter of the traced mode: the sum of the bytes of every tensor storage alive after
each aten op of one training step (fake_step.py runs the step), and where the maximum happened.

Each storage is tagged, when it is made, with how its size would change under each remedy, and the
counter keeps the live bytes of every tag after each op (the tags are explained in fake_step.py's
docstring; derive.py and traced_judge.py read them). NodeTagger writes the running module's name on
the autograd nodes of the forward, so that backward's allocations are named after their module too.

Imports torch; the analytic mode never imports this module.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tfdoctor.usercode.torch_compat import (
    SDPA_CUDNN,
    SDPA_EFFICIENT,
    SDPA_FLASH,
    SDPA_FLASH_CPU,
    SDPA_OP_PREFIX,
    autograd_node_number,
    current_autograd_node,
    dispatch_mode_base,
    storage_id,
    tensor_storage_id,
    tree_leaves,
)

_NODE_KEY = "tfdoctor.module"  # where a forward op's autograd node remembers its module
LARGEST_KEPT = 6

# The aten ops CPU autocast runs in 16 bits: torch's lower_precision_fp list for the CPU
# (aten/src/ATen/autocast_mode.cpp), as our dispatch mode sees it: linear, matmul and
# scaled_dot_product_attention arrive decomposed into mm/addmm/bmm and the CPU attention kernel.
# Their backward kernels run in 16 bits too, their inputs being 16-bit.
_LOWER_PRECISION = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "linalg_vecdot", "prelu",
    "convolution", "_convolution", "conv_tbc", "convolution_backward", "_native_multi_head_attention",
    *(op + end for op in (SDPA_FLASH_CPU, SDPA_EFFICIENT, SDPA_FLASH, SDPA_CUDNN) for end in ("", "_backward")),
})
# Norms whose first output keeps the input's dtype even with float32 weights (their statistics
# stay float32), where type promotion would say float32.
_FOLLOWS_INPUT = frozenset({
    "native_layer_norm", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "native_batch_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
})
# Batched matmuls (attention's, over B x heads): one that pairs two [.., T, T]-shaped operands through
# a contraction of length T says the head size equals T, and then the shape of q @ k^T cannot be told
# from that of its scores. (2-D matmuls are linear layers: [B*T, C] @ [C, C'] with C = T is no sign.)
_BATCHED_CONTRACTIONS = frozenset({"bmm", "baddbmm"})
# 2-D matrix products: per-sample only if the tokens survive (see LiveBytes._keeps_the_batch).
_MATRIX_PRODUCTS = frozenset({"mm", "addmm"})


class _Storage:
    """One live storage and its tags (see the module docstring)."""

    __slots__ = ("nbytes", "origin", "module", "sample", "power", "low_dtype", "low_bytes", "block", "saved")

    def __init__(self, nbytes: int, origin: str, module: str) -> None:
        self.nbytes, self.origin, self.module = nbytes, origin, module
        self.sample = False  # per-sample: scales with the batch
        self.power = 0  # grows with T ** power
        self.low_dtype = False  # would be 16-bit under autocast (for type promotion)
        self.low_bytes = False  # counted at half its bytes under autocast (its 16-bit copy is what is kept)
        self.block = -1  # the top-level block whose forward made it (not its output); -1: none
        self.saved = False  # saved for backward: what checkpointing drops and recomputes

    @property
    def group(self) -> int:
        return 3 * self.sample + self.power

    @property
    def mixed_bytes(self) -> int:
        return self.nbytes // 2 if self.low_bytes else self.nbytes


class LiveBytes(dispatch_mode_base()):
    """Sum of the storages alive after each op, and where the maximum happened.

    A storage is counted once however many views share it, and uncounted by a weakref finalizer the
    moment it is freed (torch keeps one Python object per live storage, so the finalizer fires
    exactly when the memory would be released). Each storage carries the tags the remedies are
    derived from, and every running sum is kept per tag.
    """

    def __init__(self, batch: int = 0, seq: int = 0, mixed: bool = False,
                 blocks: Optional[dict[str, int]] = None) -> None:
        super().__init__()
        self.live: dict[int, _Storage] = {}  # storage id -> its entry
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
        self.batch, self.seq = batch, seq
        self.scores_bytes = 0  # an allocation whose last two dims are [seq, seq] is an attention score tensor
        self.logits_bytes = 0
        self.ops = 0
        # tags' running sums
        self.groups = [0] * 6
        self.points: list[tuple[int, ...]] = []
        self.seq_ambiguous = "" if seq > 1 else "the sequence length is 1"
        self.mixed = mixed  # derive the bf16 autocast peak
        self.mixed_now = 0
        self.mixed_extra = 0  # 16-bit weight copies and the float32 upcast of the logits
        self.casts: dict[int, int] = {}  # parameter storage id -> bytes of its 16-bit copy
        self.upcast: Optional[int] = None  # the logits' storage, read as float32 by the loss
        self.mixed_peak = 0
        self.attention_extra: Optional[int] = None  # inside F.scaled_dot_product_attention: its float32 copies
        self.attention_fused = False
        self.float32_nodes: set[int] = set()  # sequence numbers of the math attention's autograd nodes
        self.block_of = blocks or {}  # module name -> index of its top-level block
        self.made_by_block: dict[int, int] = {}  # block -> live bytes its forward made
        self.saved_by_block: dict[int, int] = {}  # block -> of those, the bytes autograd saved for backward
        self.saved_total = 0
        self.forward_made_peak: dict[int, int] = {}
        self.recomputed: set[int] = set()  # blocks whose backward has begun
        self.checkpoint_peak = 0
        # One rank of a sharded job (fsdp_overlay.ShardedView): `sharded` is what the figures describe,
        # every view (it among them) is told of the storages the step makes and frees.
        self.views: list = []
        self.sharded = None

    # -- counting ------------------------------------------------------------------------------

    def _account(self, entry: _Storage, sign: int) -> None:
        self.now += sign * entry.nbytes
        self.by_origin[entry.origin] = self.by_origin.get(entry.origin, 0) + sign * entry.nbytes
        self.groups[entry.group] += sign * entry.nbytes
        self.mixed_now += sign * entry.mixed_bytes
        if entry.block >= 0:
            self.made_by_block[entry.block] = self.made_by_block.get(entry.block, 0) + sign * entry.nbytes
            if entry.saved:
                self.saved_by_block[entry.block] = self.saved_by_block.get(entry.block, 0) + sign * entry.nbytes
                self.saved_total += sign * entry.nbytes

    def retag(self, key: int, **tags) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        self._account(entry, -1)
        for name, value in tags.items():
            setattr(entry, name, value)
        self._account(entry, +1)

    def add(self, tensor: torch.Tensor, origin: Optional[str] = None, op: str = "",
            sample: bool = False, low_dtype: bool = False, bound: Optional[int] = None) -> Optional[_Storage]:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage to count
            return None
        key = storage_id(storage)
        if key in self.live:
            return None
        nbytes = storage.nbytes()
        origin = origin or self.phase
        module = self.where()
        entry = _Storage(nbytes, origin, module)
        if origin not in ("parameters", "setup", "optimizer"):
            shape = tuple(tensor.shape)
            if self.batch > 1:  # a reduction over the batch is no longer per-sample
                sample = sample and tensor.numel() % self.batch == 0
                # made inside the model from the batch size alone (a [B, 1, T, T] mask of ones)
                sample = sample or (self.phase == "forward" and bool(shape) and shape[0] == self.batch)
            entry.sample = sample
            entry.power = seq_power(shape, self.batch, self.seq, sample)
            if bound is not None and entry.power > bound:
                entry.power = bound
            if self.mixed and tensor.dtype == torch.float32:
                entry.low_dtype = entry.low_bytes = low_dtype
            if self.phase == "forward" and self.modules:
                entry.block = self.block_of.get(self.modules[-1], -1)
        self.live[key] = entry
        self._account(entry, +1)
        if self.views and self.phase == "optimizer":  # on a rank, the step works on shards
            for view in self.views:
                view.step_made(tensor)
        finalizer = weakref.finalize(storage, self._drop, key)
        finalizer.atexit = False
        if op and nbytes >= 1 << 20:
            self._note_large(tensor, nbytes, op, module)
        if op and self.phase == "forward" and tensor.dim() >= 3 and entry.power == 2:  # not [B, T, C] with C = T
            self.scores_bytes = max(self.scores_bytes, nbytes)
        return entry

    def where(self) -> str:
        """The module the current op belongs to: the forward stack, or in backward the module whose
        forward op created the autograd node being run."""
        if self.phase == "backward":
            node = current_autograd_node()
            return node.metadata.get(_NODE_KEY, "") if node is not None else ""
        return self.modules[-1] if self.modules else ""

    def _drop(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self._account(entry, -1)
            for view in self.views:
                view.dropped(key)

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

    # -- the tags an op's inputs pass on ---------------------------------------------------------

    def _entry(self, tensor: torch.Tensor) -> Optional[_Storage]:
        try:
            return self.live.get(tensor_storage_id(tensor))
        except (RuntimeError, NotImplementedError):
            return None

    def _is_low(self, tensor: torch.Tensor, entry: Optional[_Storage]) -> bool:
        if entry is not None and tensor.dtype == torch.float32:
            if self.upcast is not None and self.phase == "loss" and tensor_storage_id(tensor) == self.upcast:
                return False  # the loss reads logits.float()
            return entry.low_dtype
        return tensor.dtype in (torch.bfloat16, torch.float16)

    def _in_float32_attention(self) -> bool:
        """Inside the CPU math attention, which computes in float32 whatever its inputs' dtype: its
        forward ops, or in backward the autograd nodes it made."""
        if self.phase == "forward":
            return self.attention_extra is not None and not self.attention_fused
        if self.phase == "backward" and self.float32_nodes:
            node = current_autograd_node()
            return node is not None and autograd_node_number(node) in self.float32_nodes
        return False

    def _would_be_low(self, op: str, kwargs, inputs, entries) -> list[bool]:
        """Per output: would it be 16-bit under autocast?"""
        if self._in_float32_attention():
            return [False]
        if op in _LOWER_PRECISION:
            return [True]
        floats = [(t, e) for t, e in zip(inputs, entries) if t.is_floating_point()]
        if op in _FOLLOWS_INPUT:  # the forward input: the first operand, or in backward the second
            index = 1 if op.endswith("_backward") else 0
            return [len(floats) > index and self._is_low(*floats[index]), False]
        if op == "_to_copy" and kwargs and kwargs.get("dtype") is not None:
            return [False]  # an explicit dtype
        # type promotion: dimensioned tensors decide; zero-dim ones only when there are no others
        ranked = [(t, e) for t, e in floats if t.dim() > 0] or floats
        return [bool(ranked) and all(self._is_low(t, e) for t, e in ranked)]

    @staticmethod
    def _keeps_the_batch(a, entry_a, b, entry_b) -> bool:
        """a @ b keeps the tokens of a per-sample operand as its rows (a: [B*T, C] row-major) or columns
        (b transposed); contracting over them (a weight's gradient, x^T @ grad) sums the batch away."""
        if a.dim() != 2 or b.dim() != 2:
            return True
        rows = entry_a is not None and entry_a.sample and a.stride(0) >= a.stride(1)
        columns = entry_b is not None and entry_b.sample and b.stride(1) > b.stride(0)
        return rows or columns

    def _check_ambiguity(self, op: str, inputs) -> None:
        T = self.seq
        if op in _BATCHED_CONTRACTIONS and len(inputs) >= 2:
            a, b = inputs[-2], inputs[-1]
            if a.dim() >= 2 and b.dim() >= 2 and a.shape[-1] == T and a.shape[-2] == T and b.shape[-1] == T:
                self.seq_ambiguous = f"the sequence length {T} equals the head size"
        elif op.startswith(SDPA_OP_PREFIX) and inputs and inputs[0].dim() >= 2 and inputs[0].shape[-1] == T:
            self.seq_ambiguous = f"the sequence length {T} equals the head size"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        op = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        if self.phase in ("setup", "optimizer"):  # weights, states and gradients: nothing to tag
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.add(leaf, op=op)
            self._sample(op)
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        entries = [self._entry(t) for t in inputs]
        if self.attention_extra is not None and op.startswith(SDPA_OP_PREFIX):
            self.attention_fused = True  # a fused kernel: no float32 copies after all
            self.mixed_extra -= self.attention_extra
            self.attention_extra = 0
        sample = any(e is not None and e.sample for e in entries)
        summed_tokens = False  # a matrix product over the tokens: x^T @ grad, a weight's gradient
        if sample and op in _MATRIX_PRODUCTS and len(inputs) >= 2:
            sample = self._keeps_the_batch(inputs[-2], entries[-2], inputs[-1], entries[-1])
            summed_tokens = not sample
        low = self._would_be_low(op, kwargs, inputs, entries) if self.mixed else [False]
        if not self.seq_ambiguous:
            self._check_ambiguity(op, inputs)
        summed = ({tuple(t.shape[1:]) for t, e in zip(inputs, entries)
                   if e is not None and e.sample and t.dim() >= 2 and t.shape[0] == self.batch} if sample else ())
        # An op multiplies lengths only by pairing its operands (q @ k^T, a broadcast outer product):
        # its output grows with T at most as fast as its inputs together (an embedding lookup of
        # positions is [T, C] even where C = T). Factories decide by their shape alone.
        bound = (sum(e.power for e in entries if e is not None) if entries and not op.startswith("new_")
                 else None)
        if summed_tokens:  # both operands lose their token axis to the contraction
            bound = max(0, sum(e.power for e in entries[-2:] if e is not None) - 2)
        for i, leaf in enumerate(tree_leaves(out)):
            if isinstance(leaf, torch.Tensor):
                # a sum over the batch axis (autograd's sum_to_size for a broadcast [T, C] position
                # embedding) is shared by the batch: [B, T, C] -> [T, C], or [1, T, C] for B > 1
                shape = tuple(leaf.shape)
                shared = bool(summed) and (shape in summed or (
                    self.batch > 1 and shape[:1] == (1,) and shape[1:] in summed))
                self.add(leaf, op=op, sample=sample and not shared, low_dtype=low[min(i, len(low) - 1)],
                         bound=bound)
        if self.mixed and op in _LOWER_PRECISION and not self._in_float32_attention():
            self._cast_inputs(inputs, entries)
        self._sample(op)
        return out

    def _cast_inputs(self, inputs, entries) -> None:
        """Autocast casts a matmul's float32 operands to 16 bits: a weight once (cached for the
        forward), an activation each time, and the 16-bit copy is what backward keeps."""
        for tensor, entry in zip(inputs, entries):
            if entry is None or tensor.dtype != torch.float32 or entry.low_dtype:
                continue
            key = tensor_storage_id(tensor)
            if entry.origin == "parameters":
                if self.phase == "forward" and key not in self.casts:
                    self.casts[key] = entry.nbytes // 2
                    self.mixed_extra += entry.nbytes // 2
            elif not entry.low_bytes:
                self.retag(key, low_bytes=True)

    def attention(self, func, args, kwargs):
        """F.scaled_dot_product_attention under the mixed-precision tags. Autocast hands it 16-bit
        q, k, v; where the CPU takes its math path (dropout in training, an explicit mask), it copies
        them to float32 and computes in float32 (saved tensors included), then casts the output back."""
        qkv = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)][:3]
        low = [t for t in qkv if t.is_floating_point() and self._is_low(t, self._entry(t))]
        self.attention_extra, self.attention_fused = sum(t.numel() * 4 for t in low), False
        self.mixed_extra += self.attention_extra
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.mixed_extra -= self.attention_extra
            math_path, self.attention_extra = not self.attention_fused and bool(low), None
        if math_path and isinstance(out, torch.Tensor):
            self.retag(tensor_storage_id(out), low_dtype=True, low_bytes=True)  # the 16-bit output
            self.float32_nodes |= _nodes_between(out, qkv)
        return out

    def upcast_logits(self, logits: torch.Tensor) -> None:
        """Under autocast the logits are 16-bit and the loss's logits.float() makes a float32 copy."""
        entry = self._entry(logits)
        if self.mixed and entry is not None and entry.low_dtype:
            self.upcast = tensor_storage_id(logits)
            self.mixed_extra += logits.numel() * 4

    def end_upcast(self, logits: torch.Tensor) -> None:
        if self.upcast is not None:
            self.upcast = None
            self.mixed_extra -= logits.numel() * 4

    def gradient_ready(self, param: torch.Tensor) -> None:
        """A parameter's gradient is the weights' size: no batch, no sequence, float32 (the 16-bit
        weight copy its matmuls kept goes with it)."""
        if param.grad is not None:
            self.retag(tensor_storage_id(param.grad), sample=False, power=0, low_dtype=False,
                       low_bytes=False, block=-1)
        self.mixed_extra -= self.casts.pop(tensor_storage_id(param), 0)

    def mark_per_sample(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            self.retag(tensor_storage_id(tensor), sample=True,
                       power=seq_power(tuple(tensor.shape), self.batch, self.seq, True))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks: autograd saves `tensor` for backward (and keeps it, unchanged)."""
        entry = self._entry(tensor)
        if entry is not None and entry.block >= 0 and not entry.saved:
            self.retag(tensor_storage_id(tensor), saved=True)
        return tensor

    def block_returned(self, index: int, output) -> None:
        """A block's outputs are the next block's inputs: checkpointing keeps them."""
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor):
                entry = self._entry(leaf)
                if entry is not None and entry.block == index:
                    self.retag(tensor_storage_id(leaf), block=-1)

    # -- after each op ----------------------------------------------------------------------------

    def start_step(self) -> None:
        """The optimizer states exist: what follows is the step whose peak is measured."""
        self.peak, self.phase_peaks, self.points = self.now + self._shift(), {}, []
        self.mixed_peak = self.checkpoint_peak = 0
        for view in self.views:
            view.peak = self.now + view.total

    def _shift(self) -> int:
        """Bytes the described device holds beyond the traced ones (0 unsharded): all of them weights,
        gradients, states and collective buffers, which neither the batch nor T scale."""
        return self.sharded.total if self.sharded is not None else 0

    def sample(self, op: str) -> None:
        """A point where the peak may fall that is no aten op: a sharded view's collective."""
        self._sample(op)

    def _sample(self, op: str) -> None:
        shift = self._shift()
        now = self.now + shift
        if now > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = now
        if now > self.peak:
            self._new_peak(op, now)
        point = (self.groups[0] + shift, *self.groups[1:])
        if not self.points or self.points[-1] != point:
            self.points.append(point)
        if self.mixed and self.mixed_now + self.mixed_extra + shift > self.mixed_peak:
            self.mixed_peak = self.mixed_now + self.mixed_extra + shift
        if self.block_of:
            self._sample_checkpointed(shift)
        for view in self.views:
            view.observe(self.now)

    def _sample_checkpointed(self, shift: int) -> None:
        """Live bytes had every top-level block been checkpointed: what the other blocks saved for
        backward is gone; entering a block's backward, its forward runs again first."""
        if self.phase == "forward":
            block = self.block_of.get(self.modules[-1], -1) if self.modules else -1
            if block >= 0 and self.made_by_block.get(block, 0) > self.forward_made_peak.get(block, 0):
                self.forward_made_peak[block] = self.made_by_block[block]
        elif self.phase == "backward":
            block = self.block_of.get(self.where(), -1)
        else:
            block = -1
        outside = self.now + shift - self.saved_total
        value = outside + (self.saved_by_block.get(block, 0) if block >= 0 else 0)
        if self.phase == "backward" and block >= 0 and block not in self.recomputed:
            # the recomputation, on top of what backward holds as it begins (less what the block made
            # and holds unsaved, e.g. a KV cache: counted once)
            self.recomputed.add(block)
            unsaved = self.made_by_block.get(block, 0) - self.saved_by_block.get(block, 0)
            value = max(value, outside + self.forward_made_peak.get(block, 0) - unsaved)
        if value > self.checkpoint_peak:
            self.checkpoint_peak = value

    def _new_peak(self, op: str, now: int) -> None:
        self.peak = now
        node_name, module = "", self.where()
        if self.phase == "backward":
            node = current_autograd_node()
            node_name = node.name() if node is not None else ""
            grads = {tensor_storage_id(p.grad): p.grad.untyped_storage().nbytes()
                     for p in self.params if p.grad is not None}
            self.peak_grad_bytes = sum(grads.values())
            if self.sharded is not None:
                self.peak_grad_bytes += self.sharded.gradient_delta
        else:
            self.peak_grad_bytes = 0
        self.peak_at = (self.phase, op, node_name, module)
        breakdown = dict(self.by_origin)
        for origin, extra in (self.sharded.delta.items() if self.sharded is not None else ()):
            breakdown[origin] = breakdown.get(origin, 0) + extra
        self.peak_breakdown = {k: v for k, v in breakdown.items() if v}

    def kept_by_module(self) -> list[tuple[str, int]]:
        totals: dict[str, int] = {}
        for entry in self.live.values():
            if entry.origin == "forward":
                totals[entry.module or "(model)"] = totals.get(entry.module or "(model)", 0) + entry.nbytes
        return sorted(totals.items(), key=lambda kv: -kv[1])


def seq_power(shape: tuple, batch: int, seq: int, per_sample: bool) -> int:
    """The power of T a storage of this shape grows with: 0, 1, or 2 for a trailing [T, T] pair.

    An axis of length T, or B*T (tokens flattened for a matmul), is the sequence. A trailing [T, T]
    pair is a score tensor or a mask only with a head (or other leading) dimension in front: a
    per-sample [B, T, C] whose width C equals T, or a flattened [B*T, C] with B = 1, is not.
    """
    n = len(shape)
    if n == 0 or not any(d == seq or (batch > 1 and d == batch * seq) for d in shape):
        return 0
    if n >= 2 and shape[-1] == seq and shape[-2] == seq:
        if n >= 4 or (n == 3 and shape[0] != batch) or (n == 2 and not per_sample):
            return 2
    return 1


def _nodes_between(out: torch.Tensor, inputs: list[torch.Tensor]) -> set[int]:
    """Sequence numbers of the autograd nodes that made `out` from `inputs` (those made after them)."""
    floor = max((autograd_node_number(t.grad_fn) for t in inputs if t.grad_fn is not None), default=-1)
    found: set[int] = set()
    stack = [out.grad_fn] if out.grad_fn is not None else []
    while stack:
        node = stack.pop()
        number = autograd_node_number(node)
        if number <= floor or number in found or type(node).__name__ == "AccumulateGrad":
            continue
        found.add(number)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


class NodeTagger(TorchFunctionMode):
    """Write the current module's name on the autograd node of every forward result, so that the
    backward of that op can be traced back to the module (node.metadata lives on the C++ node and
    holds no tensor)."""

    def __init__(self, counter: LiveBytes) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention and self.counter.mixed and self.counter.phase == "forward":
            out = self.counter.attention(func, args, kwargs)
        else:
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
