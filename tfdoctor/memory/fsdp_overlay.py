"""One rank of a sharded job, laid over the traced single-device step: the traced mode's per-device
figures for `--gpus N --shard zero1|zero2|zero3`.

The traced step (fake_step.py) runs the user's whole model in one process. What one rank of an FSDP2 job
holds differs from it by what FSDP2's hooks allocate and free, which fsdp_shards.Fsdp2Schedule writes down
once for both modes; a view plays that schedule at the same points of the traced step and keeps, per
origin, how many bytes the rank holds more (or fewer) than the trace:

- groups as the FSDP2 documentation's idiom builds them: `fully_shard` on each top-level block (the
  children of the model's nn.ModuleList, blocks.top_blocks), then on the root, which holds the rest;
- persistent bytes: each parameter as rank 0's padded dim-0 shard (ceil(rows / N) rows, as
  fsdp_shards.sharded_bytes), each optimizer state likewise; 0-dim states (AdamW's step) and buffers whole,
  as FSDP2 leaves them;
- the schedule's all-gather buffers, unsharded parameters, reduce-scatter inputs and gradient shards;
- hooks where FSDP2 has its own: the root's and each block's forward pre- and post-hooks; a block's
  pre-backward when the gradient of its outputs arrives, the root's when that of the model's outputs
  does; a block's post-backward when the gradient of its inputs is whole (an identity autograd Function
  on the inputs, as FSDP2 registers its own), every group still pending at the end of backward, the root
  first. At a group's reduce-scatter its whole gradients stop counting: FSDP2 frees them, the trace
  keeps them until zero_grad;
- the optimizer step works on shards: every storage it makes counts as its dim-0 shard.

zero1 (optimizer states sharded, parameters and gradients whole) has no FSDP2 setting: its view shards
the optimizer states and the step's storages, as the analytic mode does, and plays no schedule.

Several views can watch one trace (the requested sharding, and ZeRO-3 for the remedy), so the remedies
still come from one trace. Imports torch; the analytic mode never imports this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from tfdoctor.memory import fsdp_shards
from tfdoctor.usercode.torch_compat import tensor_storage_id, tree_flatten, tree_leaves, tree_unflatten

FSDP2_SHARDS = ("zero2", "zero3")
_GRADS = "whole gradients of "  # what the schedule is told to free at a group's reduce-scatter
_VIRTUAL_ORIGIN = {fsdp_shards.PARAMETERS: "parameters", fsdp_shards.GRADIENTS: "backward"}  # fake_step.py's origins


def _key(tensor: torch.Tensor) -> int:
    return tensor_storage_id(tensor)


def _rows_cols(tensor: torch.Tensor) -> tuple[int, int]:
    """(rows, elements per row) as FSDP2 chunks a parameter along dim 0; a 0-dim one is one row."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return 1, tensor.numel()
    return tensor.shape[0], tensor.numel() // tensor.shape[0]


def parameter_shard_bytes(param: torch.Tensor, world: int) -> int:
    return fsdp_shards.sharded_bytes([_rows_cols(param)], world, param.element_size())


def shard_of(tensor: torch.Tensor, nbytes: int, world: int) -> int:
    """Rank 0's share of a storage of `nbytes` behind a tensor split along dim 0 (0-dim: whole)."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return nbytes
    rows = tensor.shape[0]
    return nbytes * fsdp_shards.shard_rows(rows, world) // rows


def fsdp2_groups(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> dict[str, list[nn.Parameter]]:
    """The parameters of each `fully_shard` group: the root first (what no block holds), then each block
    that holds any. A parameter shared by two blocks goes with the first, as fully_shard would take it."""
    groups: dict[str, list[nn.Parameter]] = {fsdp_shards.ROOT: []}
    taken: set[int] = set()
    for name, block in blocks:
        mine = [p for p in block.parameters() if id(p) not in taken]
        taken.update(id(p) for p in mine)
        if mine:
            groups[name] = mine
    groups[fsdp_shards.ROOT] = [p for p in model.parameters() if id(p) not in taken]
    return groups


class ShardedView:
    """One rank of `world` under `shard`, as bytes by origin added to (or taken off) the traced step.

    Implements fsdp_shards.Ledger for the schedule: its buffers are bytes of no tensor, its marks are
    samples of the counter (`counter.sample(op)`), and freeing a group's whole gradients stops counting
    their storages.
    """

    def __init__(self, counter, shard: str, world: int, groups: dict[str, list[nn.Parameter]]) -> None:
        self.counter, self.shard, self.world, self.groups = counter, shard, world, groups
        self.delta: dict[str, int] = {}  # origin -> bytes this rank holds beyond the trace (negative: fewer)
        self.gradient_delta = 0  # of those, gradients and reduce-scatter buffers
        self.recounted: dict[int, tuple[str, int, bool]] = {}  # storage -> (origin, bytes added, a gradient)
        self.buffers: dict[str, tuple[str, int, bool]] = {}  # the schedule's buffers alive
        self.peak = 0
        self.schedule: fsdp_shards.Fsdp2Schedule | None = None
        if shard in FSDP2_SHARDS:
            sizes = {}
            for name, params in groups.items():
                shard_bytes = sum(parameter_shard_bytes(p, world) for p in params)
                sizes[name] = (world * shard_bytes, shard_bytes)  # as fsdp_shards.unsharded_bytes
            self.schedule = fsdp_shards.Fsdp2Schedule(self, shard == "zero3", sizes)

    @property
    def total(self) -> int:
        return sum(self.delta.values())

    def describe(self) -> str:
        if self.schedule is None:
            return f"per device under ZeRO-1 on {self.world} devices: optimizer states and step sharded"
        blocks = len(self.groups) - 1
        return (f"per device under FSDP2 {self.shard} on {self.world} devices: fully_shard on each of {blocks} "
                "blocks, then the root")

    def _shift(self, origin: str, nbytes: int, gradient: bool) -> None:
        self.delta[origin] = self.delta.get(origin, 0) + nbytes
        if gradient:
            self.gradient_delta += nbytes

    def _recount(self, tensor: torch.Tensor, counted, gradient: bool = False) -> None:
        """Count the storage behind `tensor` as counted(its traced bytes) on this rank."""
        key = _key(tensor)
        entry = self.counter.live.get(key)
        if entry is None:
            return
        self.dropped(key)
        extra = counted(entry.nbytes) - entry.nbytes
        if extra:
            self.recounted[key] = (entry.origin, extra, gradient)
            self._shift(entry.origin, extra, gradient)

    def dropped(self, key: int) -> None:
        """The trace freed a storage: what this view added for it goes too."""
        recounted = self.recounted.pop(key, None)
        if recounted is not None:
            origin, extra, gradient = recounted
            self._shift(origin, -extra, gradient)

    def shard_persistent(self, params: list[nn.Parameter], optimizer) -> None:
        """Parameters as their shards (FSDP2 only), optimizer states as theirs (every stage)."""
        if self.schedule is not None:
            for p in params:
                self._recount(p, lambda _, p=p: parameter_shard_bytes(p, self.world))
        for state in (optimizer.state.values() if optimizer is not None else ()):
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.dim():
                    self._recount(t, partial(self._shard_of, t))

    def _shard_of(self, tensor: torch.Tensor, nbytes: int) -> int:
        return shard_of(tensor, nbytes, self.world)

    def step_made(self, tensor: torch.Tensor) -> None:
        """The optimizer step made this storage: on a rank it is the shard's."""
        if tensor.dim():
            self._recount(tensor, partial(self._shard_of, tensor))

    def observe(self, now: int) -> None:
        self.peak = max(self.peak, now + self.total)

    # -- fsdp_shards.Ledger, for the schedule ------------------------------------------------------

    def alloc(self, name: str, nbytes: int, category: str) -> None:
        gradient = category == fsdp_shards.GRADIENTS
        self.buffers[name] = (_VIRTUAL_ORIGIN[category], nbytes, gradient)
        self._shift(_VIRTUAL_ORIGIN[category], nbytes, gradient)

    def free(self, *names: str) -> None:
        for name in names:
            if name.startswith(_GRADS):
                for p in self.groups[name[len(_GRADS):]]:
                    if p.grad is not None:
                        self._recount(p.grad, lambda _: 0, gradient=True)
            else:
                origin, nbytes, gradient = self.buffers.pop(name)
                self._shift(origin, -nbytes, gradient)

    def mark(self, op: str) -> None:
        self.counter.sample(f"FSDP2 {op}")

    # -- the events, from the hooks --------------------------------------------------------------

    def post_backward(self, group: str) -> None:
        if group not in self.schedule.reduced:
            self.schedule.post_backward(group, [_GRADS + group])

    def end_backward(self) -> None:
        """FSDP2's end-of-backward callback: every group not reduce-scattered yet, then the last buffer."""
        if self.schedule is None:
            return
        for group in self.schedule.pending():
            self.post_backward(group)
        self.schedule.end_backward()


class _PostBackward(torch.autograd.Function):
    """Identity on a block's inputs whose backward runs once their gradients are whole: FSDP2's own
    post-backward point (its inputs' gradient is the last thing the block's backward computes)."""

    @staticmethod
    def forward(ctx, hook, *inputs):
        ctx.hook = hook
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None,) + grads


def _needing_grad(output) -> list[torch.Tensor]:
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


@contextlib.contextmanager
def fsdp2_hooks(model: nn.Module, views: list[ShardedView], counter) -> Iterator[None]:
    """FSDP2's hook points on `model` for the block, each event played on every view with a schedule;
    every hook is removed in `finally`. Forward hooks act in the step's forward only (not in a
    recomputation during backward, where the schedule has already unsharded the block)."""
    scheduled = [v for v in views if v.schedule is not None]
    if not scheduled:
        yield
        return
    groups = scheduled[0].groups
    modules = dict(model.named_modules())
    seen: set[str] = set()  # events that happen once a step

    def once(event: str) -> bool:
        if event in seen:
            return False
        seen.add(event)
        return True

    def root_pre_forward(module, args):
        if counter.phase == "forward" and once("root forward"):
            for v in scheduled:
                v.schedule.root_pre_forward()

    def root_pre_backward(grad):
        if once("root backward"):
            for v in scheduled:
                v.schedule.root_pre_backward()

    def root_post_forward(module, args, output):
        if counter.phase == "forward" and once("root forward done"):
            for v in scheduled:
                v.schedule.root_post_forward()
            for t in _needing_grad(output):
                t.register_hook(root_pre_backward)

    def pre_forward(name, module, args, kwargs):
        if counter.phase != "forward" or not once(f"{name} forward"):
            return None
        for v in scheduled:
            v.schedule.pre_forward(name)
        if not torch.is_grad_enabled():
            return None
        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            return None
        wrapped = _PostBackward.apply(partial(post_backward, name), *(leaves[i] for i in at))
        for i, t in zip(at, wrapped):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def pre_backward(name, grad):
        if once(f"{name} backward"):
            for v in scheduled:
                v.schedule.pre_backward(name)

    def post_forward(name, module, args, output):
        if counter.phase != "forward" or not once(f"{name} forward done"):
            return
        for v in scheduled:
            v.schedule.post_forward(name)
        for t in _needing_grad(output):
            t.register_hook(partial(pre_backward, name))

    def post_backward(name):
        for v in scheduled:
            v.post_backward(name)

    handles = [model.register_forward_pre_hook(root_pre_forward), model.register_forward_hook(root_post_forward)]
    try:
        for name in groups:
            if name == fsdp_shards.ROOT:
                continue
            block = modules[name]
            handles.append(block.register_forward_pre_hook(partial(pre_forward, name), with_kwargs=True))
            handles.append(block.register_forward_hook(partial(post_forward, name)))
        yield
    finally:
        for handle in handles:
            handle.remove()
