"""Traced mode: run one real training step of the user's model on fake tensors and count the bytes
of every tensor storage alive after each aten op.

Fake tensors (torch's FakeTensorMode, see usercode/torch_compat.py) carry shapes, dtypes and storages
of the right size but no data, so a billion-parameter model at a sequence length of 8192 traces on a
laptop. The same counter run on real tensors is the ground truth the bench compares against: the two
agree exactly, because they see the same ops create the same storages.

The step is the steady-state step the analytic mode models: optimizer states already allocated,
forward, cross-entropy on float32 logits, backward, optimizer step, zero_grad(set_to_none=True),
with `logits` and `loss` held by the caller until the step returns.

The remedies are derived from that one trace (torch.profiler's "record once, analyse many ways"):
each storage is tagged, when it is made, with how its size would change under each remedy, and the
counter keeps the live bytes of every tag after each op. A remedy's peak is then the largest value,
over the step, of the live bytes recomputed with the remedy's arithmetic:

- batch size: a storage is per-sample when it is computed from the token ids (or leads with the
  batch dimension); per-sample bytes scale with the batch, the rest (weights, gradients, optimizer
  states, shared masks and position tables) stays. Gradient accumulation and the largest batch.
- sequence length: the storage's shape says whether it grows with T (one axis of length T, or B*T
  flattened) or with T^2 (a trailing [T, T] pair: attention scores, causal masks). Shorter
  sequences and the largest length. Where T coincides with the head size the shape cannot tell
  [.., T, hs] from [.., T, T] apart, and the lengths are traced again instead.
- mixed precision: each storage's dtype under CPU autocast (torch's lower-precision op list, type
  promotion elsewhere, a 16-bit copy of each weight a matmul reads, the float32 upcast of logits).
- activation checkpointing: what each top-level block (a child of an nn.ModuleList) made in its
  forward and still holds is dropped outside that block's own forward and backward, and that
  block's forward is counted again at the start of its backward (the recomputation).

Under `--gpus N --shard zero1|zero2|zero3` every figure, the derived ones included, is one rank's: the
analytic mode's FSDP2 schedule is played over the traced step (fsdp_overlay.py), and the ZeRO-3 remedy is
a second such view of the same trace.

This module runs the step (fake_step -> StepMeasure, plain data); counter.py counts its live bytes and
tags; the step runs the attention kernels of the device the model trains on, whatever device its factory
built it on (kernels.py); traced_judge.py judges the step against the budget and derives the remedies.

Imports torch; the analytic mode never imports this module.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tfdoctor.errors import SubjectError, UsageError
from tfdoctor.memory import derive
from tfdoctor.memory.blocks import block_map, module_stack, swapped_tensors, top_blocks
from tfdoctor.memory.counter import LARGEST_KEPT, LiveBytes, NodeTagger
from tfdoctor.memory.fsdp_overlay import ShardedView, fsdp2_groups, fsdp2_hooks
from tfdoctor.memory.kernels import attention_kernels, onto
from tfdoctor.probes.process_state import preserved_process_state
from tfdoctor.subject import call
from tfdoctor.usercode.torch_compat import fake_tensor_mode, is_fake_tensor

PHASES = ("setup", "forward", "loss", "backward", "optimizer")
# What is alive at the peak, by the phase that created it (see StepMeasure.peak_breakdown).
_ORIGIN_NAMES = {
    "parameters": "parameters and buffers",
    "setup": "optimizer states",
    "forward": "forward: activations and logits",
    "loss": "loss: float32 logits and softmax",
    "backward": "backward: gradients and temporaries",
    "optimizer": "optimizer step temporaries",
}


@dataclass
class Derivation:
    """What the one trace recorded to derive the remedies without tracing them (see derive.py).

    points: after each op, live bytes by tag: index 3*s + p, s = 1 for per-sample storages (scale
    with the batch), p = 0, 1, 2 the power of the sequence length they grow with.
    """

    batch: int
    seq: int
    points: list[tuple[int, ...]]
    mixed_peak: Optional[int]  # the step's peak under bf16 autocast; None when already autocast
    checkpoint_peak: Optional[int]  # under checkpointing of each top-level block; None without blocks
    blocks: int
    seq_ambiguous: str = ""  # why the shapes cannot tell T apart ("" when they can)
    zero3_gpus: Optional[int] = None  # the step was also watched as one rank of FSDP2 zero3 on this many devices
    zero3_peak: Optional[int] = None  # and that rank's peak (fsdp_overlay.ShardedView)

    def peak_at(self, batch: int, seq: int) -> int:
        return derive.peak_at(self.points, self.batch, self.seq, batch, seq)

    def summary(self) -> dict[str, Any]:
        return {"points": len(self.points), "blocks": self.blocks, "seq_ambiguous": self.seq_ambiguous,
                "mixed_precision_peak_bytes": self.mixed_peak, "checkpointing_peak_bytes": self.checkpoint_peak,
                "zero3_gpus": self.zero3_gpus, "zero3_peak_bytes": self.zero3_peak}


@dataclass
class StepMeasure:
    """What one traced step measured. Bytes are per device: the one process, or under --shard one rank
    of the sharded job (fsdp_overlay.py)."""

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
    derivation: Optional[Derivation] = None
    attention: Optional[dict[str, Any]] = None  # the SDPA kernels the step ran and on which device (kernels.py)

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
            "derivation": self.derivation.summary() if self.derivation else None, "attention": self.attention,
        }


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
                  device=None, on_phase: Optional[Callable[[], None]] = None):
    """One steady-state step; returns (logits, loss) so that the caller holds them to the end."""
    done = on_phase or (lambda: None)
    vocab = subject.vocab_size
    counter.phase = "forward"
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    targets = torch.randint(0, vocab, (batch, seq), device=device)
    counter.mark_per_sample(ids, targets)
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
        done()
        counter.logits_bytes = logits.numel() * logits.element_size()
        counter.phase = "loss"
        counter.upcast_logits(logits)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))  # float32 logits
        counter.end_upcast(logits)
        done()
        if optimizer is not None:
            counter.kept = counter.kept_by_module()  # what the forward left for backward
            counter.phase = "backward"
            loss.backward()
            for view in counter.views:  # FSDP2's callback at the end of backward
                view.end_backward()
            done()
            counter.phase = "optimizer"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            done()
        done()
    return logits, loss


def fake_step(subject, batch: int, seq: int, *, optimizer: str = "adamw", autocast_dtype=None,
              fake: bool = True, on_phase: Optional[Callable[[], None]] = None, gpus: int = 1,
              shard: str = "none", zero3_gpus: Optional[int] = None, target: Optional[str] = None) -> StepMeasure:
    """Trace one steady-state training step of `subject` (a resolved-enough tfdoctor Subject with
    vocab_size set) at [batch, seq]. fake=False runs it for real (the bench's ground truth) and uses
    the model's own tensors, which the step then updates. on_phase() is called as each of the
    len(PHASES) phases ends.

    shard zero1|zero2|zero3: the figures are one rank's of `gpus` (fsdp_overlay.py). zero3_gpus: also
    watch the step as one rank of FSDP2 zero3 on that many devices (Derivation.zero3_peak). target: the
    device (cpu, cuda) whose attention kernels the step runs, default the weights' (kernels.py)."""
    model = subject.model
    if not isinstance(model, nn.Module):
        raise SubjectError(f"expected an nn.Module, got {type(model).__name__}")
    if subject.vocab_size is None:
        raise SubjectError("cannot tell the vocabulary size", "pass --vocab N or Subject(vocab_size=N)")
    start = time.perf_counter()
    done = on_phase or (lambda: None)
    blocks = block_map(model) if optimizer != "none" else {}
    counter = LiveBytes(batch, seq, mixed=autocast_dtype is None, blocks=blocks)
    flags = [(m, m.training) for m in model.modules()]
    fake_mode, convert, kernels = _step_tensors(model, target, fake)
    hooks = []
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
                zero3_view = _watch_shards(counter, model, optimizer, gpus, shard, zero3_gpus)
                opt, parameter_bytes, optimizer_bytes = _steady_state(counter, model, params, optimizer)
                hooks = [p.register_post_accumulate_grad_hook(counter.gradient_ready)
                         for p in params if p.requires_grad]
                counter.start_step()
                done()
                stack.enter_context(module_stack(model, counter))
                stack.enter_context(kernels.on(device))  # under NodeTagger: the kernel it wraps is the routed one
                stack.enter_context(NodeTagger(counter))
                stack.enter_context(fsdp2_hooks(model, counter.views, counter))
                if blocks:
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t))
                try:
                    logits, loss = training_step(subject, batch, seq, opt, counter, autocast_dtype, device, done)
                except (SubjectError, UsageError):
                    raise
                except Exception as exc:  # the user's forward on fake tensors
                    raise _untraceable(exc, counter, fake) from exc
                kept = counter.kept or counter.kept_by_module()
                del logits, loss
    finally:
        for hook in hooks:
            hook.remove()
        for module, training in flags:
            module.training = training
    derivation = _derivation(counter, blocks, zero3_gpus, zero3_view)
    return _measure(counter, kept, parameter_bytes, optimizer_bytes, derivation, kernels, start)


def _step_tensors(model: nn.Module, target: Optional[str], fake: bool):
    """(fake mode or None, converter of the model's tensors, attention kernels watcher) for one step."""
    fake_mode = fake_tensor_mode(allow_non_fake_inputs=True) if fake else None
    convert = fake_mode.from_tensor if fake else (lambda t: t)
    already = next((t for t in model.parameters() if is_fake_tensor(t)), None)
    if fake and already is not None:  # built under a FakeTensorMode already (e.g. too big to build for real)
        fake_mode, convert = already.fake_mode, (lambda t: t)
    kernels, moved = attention_kernels(model, target, fake)
    if moved:  # built on meta (or another device than the target's): traced as CPU tensors
        convert = onto(torch.device("cpu"), fake_mode, convert)
    return fake_mode, convert, kernels


def _watch_shards(counter: LiveBytes, model: nn.Module, optimizer: str, gpus: int, shard: str,
                  zero3_gpus: Optional[int]):
    """Attach the sharded views (fsdp_overlay.py): the rank the figures describe (--shard), and the
    ZeRO-3 rank the remedy reads, which is returned (None when not watched)."""
    groups = fsdp2_groups(model, top_blocks(model))
    if shard != "none":
        counter.sharded = ShardedView(counter, shard, gpus, groups)
        counter.views.append(counter.sharded)
    zero3_view = None
    if zero3_gpus and optimizer != "none":
        zero3_view = (counter.sharded if (shard, gpus) == ("zero3", zero3_gpus)
                      else ShardedView(counter, "zero3", zero3_gpus, groups))
        if zero3_view is not counter.sharded:
            counter.views.append(zero3_view)
    return zero3_view


def _steady_state(counter: LiveBytes, model: nn.Module, params: list, optimizer: str):
    """Make the optimizer and its states (sharded on every view); returns (optimizer, parameter bytes,
    optimizer-state bytes), per device."""
    opt = make_optimizer(optimizer, params)
    allocate_states(opt)
    for view in counter.views:
        view.shard_persistent(params, opt)
    shift = counter.sharded.delta if counter.sharded is not None else {}
    optimizer_bytes = counter.by_origin.get("setup", 0) + shift.get("setup", 0)
    parameter_bytes = (sum(_storage_bytes(p) for p in params) + shift.get("parameters", 0)
                       + sum(_storage_bytes(b) for b in model.buffers()))
    return opt, parameter_bytes, optimizer_bytes


def _measure(counter: LiveBytes, kept: list, parameter_bytes: int, optimizer_bytes: int, derivation: Derivation,
             kernels, start: float) -> StepMeasure:
    """What the counter saw, as data."""
    phase, op, node, module = counter.peak_at
    largest = sorted(counter.largest.values(), key=lambda d: -d["bytes"])[:LARGEST_KEPT]
    notes = [counter.sharded.describe()] if counter.sharded is not None else []
    return StepMeasure(
        peak_bytes=counter.peak, peak_phase=phase, peak_op=op, peak_node=node, peak_module=module,
        attention_scores_bytes=counter.scores_bytes or None, logits_bytes=counter.logits_bytes,
        peak_breakdown={_ORIGIN_NAMES.get(k, k): v for k, v in counter.peak_breakdown.items()},
        parameter_bytes=parameter_bytes, gradient_bytes_at_peak=counter.peak_grad_bytes,
        optimizer_bytes=optimizer_bytes, phase_peaks={k: v for k, v in counter.phase_peaks.items()},
        kept_by_module=kept[:12], largest=largest, ops=counter.ops,
        seconds=time.perf_counter() - start, batch=counter.batch, seq=counter.seq, notes=notes,
        derivation=derivation, attention=kernels.summary())


def _derivation(counter: LiveBytes, blocks: dict[str, int], zero3_gpus, zero3_view) -> Derivation:
    return Derivation(
        batch=counter.batch, seq=counter.seq, points=counter.points,
        mixed_peak=counter.mixed_peak if counter.mixed else None,
        checkpoint_peak=counter.checkpoint_peak if blocks else None,
        blocks=len(set(blocks.values())), seq_ambiguous=counter.seq_ambiguous,
        zero3_gpus=zero3_gpus if zero3_view is not None else None,
        zero3_peak=zero3_view.peak if zero3_view is not None else None)


def _untraceable(error: Exception, counter: "LiveBytes", fake: bool) -> SubjectError:
    """Name what stopped the trace in the user's terms: their line, the module, the operation."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(here) and f"{os.sep}torch{os.sep}" not in f.filename]
    where = f" at {os.path.relpath(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    module = f" in module {counter.modules[-1]}" if counter.modules else ""
    name = type(error).__name__
    if fake and name in ("DataDependentOutputException", "DynamicOutputShapeException"):
        op = str(error).split(":")[-1].strip() or name
        reads = ("reads a tensor's value (.item(), .tolist(), bool(tensor) or an if on a tensor)"
                 if "_local_scalar_dense" in op else f"makes a tensor whose shape depends on its values ({op})")
        return SubjectError(f"the forward{module}{where} {reads}, which a trace on fake tensors (shapes without "
                            "values) cannot follow",
                            "use the analytic mode (tfdoctor memory --batch B --seq T --d-model ...) or move that "
                            "value check out of forward")
    return SubjectError(f"the training step raised {name}{module}{where} while being traced: {error}",
                        "run the model once for real at this shape to see the error, or use the analytic mode")


def _storage_bytes(tensor) -> int:
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0


