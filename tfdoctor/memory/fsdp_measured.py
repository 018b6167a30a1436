"""One FSDP2 training step measured on this rank: the live tensor bytes at the step's peak, by component.

This is what bench/memory_accuracy.py and the tests hold the analytic and traced modes'
`--gpus N --shard zero2|zero3` figures to. Two independent measurements of the same steady-state step
(optimizer states allocated, as after a first step):

- `ComponentBytes`, our own counter: after every aten op it sums the bytes of every tensor storage alive on
  this rank and, at each new maximum, sorts them by what holds them now (a parameter shard, an
  unsharded parameter or an all-gather buffer; a gradient or a reduce-scatter buffer; an optimizer state;
  anything else is an activation or a backward temporary). A storage that nothing claims yet at the peak
  but that becomes a gradient or a collective buffer later (a weight gradient before autograd assigns
  it to .grad, the reduce-scatter input before the collective) is counted as what it becomes, as the
  analytic ledger counts it.
- torch's own `FSDPMemTracker` (torch_compat.fsdp2_memory_tracker_class), its peak snapshot folded into
  the same four components.

Both run on a real process group (gloo on the CPU) or on torch's fake one
(the "fake" backend of torch's testing package: one process plays rank r of N, collectives do nothing) with
fake tensors, which is how a GPT-2-small-size model is measured without allocating it.

Sharding follows the FSDP2 documentation's idiom: `fully_shard` on every block of the `nn.ModuleList`,
then on the root. zero3 leaves `reshard_after_forward` at its default (blocks reshard after forward,
the root does not, since its parameters would be all-gathered again at once for backward); zero2 passes
`reshard_after_forward=False` everywhere. ZeRO-1 (optimizer states sharded, gradients and parameters
whole) has no FSDP2 setting, so there is nothing to measure it against.

Used by the bench and the tests; imports torch and torch.distributed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tfdoctor.usercode.torch_compat import (
    dispatch_mode_base,
    dtensor_class,
    fsdp2_memory_tracker_class,
    fsdp2_param_tensors,
    fsdp2_params,
    fully_shard_function,
    local_tensor,
    storage_id,
    tree_leaves,
)

PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS = "parameters", "gradients", "optimizer states", "activations"
COMPONENTS = (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS)
SHARDS_WITH_FSDP2 = ("zero2", "zero3")

# FSDPMemTracker's reference types, by the component they belong to. BUFFER is the causal mask, which
# the analytic mode counts with the parameters.
_TRACKER_COMPONENTS = {
    "Sharded Param": PARAMETERS, "Unsharded Param": PARAMETERS, "All Gather": PARAMETERS, "Buffer": PARAMETERS,
    "Sharded Grad": GRADIENTS, "Unsharded Grad": GRADIENTS, "Reduce Scatter": GRADIENTS,
    "OptState": OPTIMIZER,
    "Activation": ACTIVATIONS, "Temp": ACTIVATIONS, "Inputs": ACTIVATIONS,
}


@dataclass
class RankMemory:
    """The peak of one steady-state step on one rank: ours and FSDPMemTracker's, by component."""

    rank: int
    world: int
    shard: str
    peak_bytes: int
    at_peak: dict[str, int]
    peak_op: str
    tracker_peak_bytes: int
    tracker_at_peak: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def shard_model(model: nn.Module, shard: str, mesh) -> nn.Module:
    """FSDP2 over `mesh` as the docs write it: each block of the model's ModuleList, then the root."""
    fully_shard = fully_shard_function()
    if shard not in SHARDS_WITH_FSDP2:
        raise ValueError(f"shard {shard!r} has no FSDP2 equivalent; one of {SHARDS_WITH_FSDP2}")
    reshard = None if shard == "zero3" else False  # None: FSDP2's default (True, but not for the root)
    blocks = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    for block in (blocks[0] if blocks else []):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _storage(t: torch.Tensor):
    return local_tensor(t).untyped_storage()


def _key(t: torch.Tensor) -> int:
    return storage_id(_storage(t))


class ComponentBytes(dispatch_mode_base()):
    """Live storage bytes after every op; at each new maximum, those bytes by component."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self.live: dict[int, weakref.ref] = {}
        self.comm_buffers: dict[int, str] = {}  # storage -> component, for collective buffers
        self.peak_bytes = 0
        self.at_peak: dict[str, int] = dict.fromkeys(COMPONENTS, 0)
        self.peak_op = ""
        self.unclaimed: dict[int, tuple[weakref.ref, int]] = {}  # activations at the peak, maybe claimed later
        self.fsdp_params = fsdp2_params(model)
        for t in self._held()[0]:
            self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        st = _storage(t)
        key = storage_id(st)
        known = self.live.get(key)
        if known is None or known() is not st:  # new, or a dead storage's address reused
            self.live[key] = weakref.ref(st)

    def _held(self) -> tuple[list[torch.Tensor], dict[int, str]]:
        """Every tensor the model and optimizer hold now, and the component of each storage."""
        where: dict[int, str] = {}
        tensors: list[torch.Tensor] = []

        def put(t, component: str) -> None:
            if isinstance(t, torch.Tensor):
                tensors.append(t)
                where.setdefault(_key(t), component)

        for fp in self.fsdp_params:
            parameters, gradients = fsdp2_param_tensors(fp)
            for t in parameters:
                put(t, PARAMETERS)
            for t in gradients:
                put(t, GRADIENTS)
        for p in self.model.parameters():
            put(p, PARAMETERS)
            put(p.grad, GRADIENTS)
        for b in self.model.buffers():
            put(b, PARAMETERS)
        for state in self.optimizer.state.values():
            for t in state.values():
                put(t, OPTIMIZER)
        return tensors, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtensor = dtensor_class()
        if dtensor is not None and any(t is dtensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which we then see
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket).split(".")[-1]
        if name == "_allgather_base_":  # (output, input): the gathered buffer holds parameters
            self.comm_buffers[_key(args[0])] = PARAMETERS
        elif name == "_reduce_scatter_base_":  # (output, input): both hold gradients
            self.comm_buffers[_key(args[0])] = GRADIENTS
            self.comm_buffers[_key(args[1])] = GRADIENTS
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self._sample(name)
        return out

    def _sample(self, op: str) -> None:
        alive = {}
        for key, ref in list(self.live.items()):
            st = ref()
            if st is None:
                del self.live[key]
                self.comm_buffers.pop(key, None)
            else:
                alive[key] = st.nbytes()
        total = sum(alive.values())
        if total <= self.peak_bytes:
            self._claim_later()
            return
        _, where = self._held()
        by = dict.fromkeys(COMPONENTS, 0)
        self.unclaimed = {}
        for key, nbytes in alive.items():
            component = where.get(key) or self.comm_buffers.get(key, ACTIVATIONS)
            by[component] += nbytes
            if component == ACTIVATIONS:
                self.unclaimed[key] = (self.live[key], nbytes)
        self.peak_bytes, self.at_peak, self.peak_op = total, by, op

    def _claim_later(self) -> None:
        """Move a peak activation that has since become a gradient or a collective buffer to that component."""
        if not self.unclaimed:
            return
        claimed = dict(self.comm_buffers)
        for fp in self.fsdp_params:
            for grad in fsdp2_param_tensors(fp)[1]:
                claimed.setdefault(_key(grad), GRADIENTS)
        for key in [k for k in self.unclaimed if k in claimed]:
            ref, nbytes = self.unclaimed.pop(key)
            if self.live.get(key) is ref:  # the same storage, not a new one at a freed address
                self.at_peak[ACTIVATIONS] -= nbytes
                self.at_peak[claimed[key]] += nbytes


def training_step(model: nn.Module, optimizer, batch: int, seq: int, vocab: int):
    """The analytic mode's steady-state step; returns (logits, loss), held by the caller to the end."""
    ids = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    logits = model(ids)
    loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return logits, loss


def measure(model: nn.Module, shard: str, mesh, batch: int, seq: int, vocab: int) -> RankMemory:
    """Shard `model` over `mesh`, take one step to allocate the optimizer states (and let FSDP2 set
    itself up), then measure one more step with each counter. Runs under the caller's process group and,
    for a fake-tensor model, inside the caller's FakeTensorMode."""
    tracker_class = fsdp2_memory_tracker_class()
    shard_model(model, shard, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    training_step(model, optimizer, batch, seq, vocab)
    counter = ComponentBytes(model, optimizer)
    with counter:
        held = training_step(model, optimizer, batch, seq, vocab)
    del held
    tracker = tracker_class(model, optimizer)
    with tracker:
        held = training_step(model, optimizer, batch, seq, vocab)
    del held
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()  # one device per rank
    folded = dict.fromkeys(COMPONENTS, 0)
    total = 0
    for reftype, nbytes in snapshot.items():
        if reftype == "Total":
            total = nbytes
        else:
            folded[_TRACKER_COMPONENTS[reftype.value]] += nbytes
    import torch.distributed as dist

    return RankMemory(rank=dist.get_rank(), world=dist.get_world_size(), shard=shard,
                      peak_bytes=counter.peak_bytes, at_peak=counter.at_peak, peak_op=counter.peak_op,
                      tracker_peak_bytes=total, tracker_at_peak=folded)
