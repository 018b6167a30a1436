"""What one rank of a distributed run did, as the rank checks compare it across ranks.

The script recorder (recording/recorder.py, driven by recording/script.py) already sees each rank's
forwards, backward, clip, scaler and optimizer calls. `RankRecorder` adds what only matters when
there are several ranks, with global hooks and a few patches of its own, removed on exit:
- parameters: per-tensor float64 sum and sum of squares of every optimizer parameter before its
  first step and after each step (checksums, not copies: a few numbers per tensor); sharded
  parameters (DTensor, FSDP's flat parameters) hold a different shard on each rank by design and are
  marked, never summed;
- DDP: at each forward of a DistributedDataParallel module, whether gradient sync was on
  (`require_backward_grad_sync`, which `no_sync()` turns off) and where the forward was called;
- samplers: each iteration of a DistributedSampler (or a subclass): its epoch, shuffle flag, the head
  of the index order and a hash of all of it, whether it ran to the end; and each set_epoch call;
- data loaders: where each DataLoader was made and iterated, and which sampler it draws from (the
  evidence when ranks read the same batches).

`digest(events, model)` turns that and the script recorder's events (batch fingerprints, calls per
optimizer-step window) into plain Python data, small and picklable, which the distributed driver
gathers to rank 0 for the checks in tfdoctor/checks/ranks.py.

Enter it before the script recorder installs its hooks: global hooks run in registration order, so
its step post-hook then records the last step before the script recorder stops the script there
(if it is entered later, `digest` reads the weights of that last step itself).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from tfdoctor.recording.windows import micro_batch_weights
from tfdoctor.recording.wrappers import is_shard, unwrap
from tfdoctor.usercode.call_sites import call_site
from tfdoctor.usercode.patches import Patches

# Indices of each sampler iteration kept in the digest. Two different shuffles of N items agree on
# their first m indices with chance ~1/N^m, so a few are enough; 64 keep a partial epoch comparable.
ORDER_HEAD = 64
# Script-recorder calls counted per optimizer-step window (rank-uniform); unscale_ calls made inside
# scaler.step are the scaler's own and are left out.
COUNTED_CALLS = ("backward", "clip", "unscale", "scaler_step", "scaler_update", "opt_step")
# Hex digits kept of each fingerprint: 64 bits, so distinct batches never collide in practice.
FINGERPRINT_HEX = 16


def fingerprint(tensors) -> str:
    """A hash of named integer tensors' dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=FINGERPRINT_HEX // 2)
    for name, t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _layout(p: torch.Tensor) -> Optional[str]:
    """A DTensor's placements, e.g. "(Shard(dim=0),)" for FSDP2 on a 1-D mesh; None for others."""
    placements = getattr(p, "placements", None)
    return str(tuple(placements)) if placements is not None and is_shard(p) else None


def _checksums(params: list[torch.Tensor], sharded: list[bool]) -> list[Optional[list[float]]]:
    """[sum, sum of squares] in float64 per tensor (None for a sharded one), with one host sync per
    device rather than two per tensor."""
    out: list[Optional[list[float]]] = [None] * len(params)
    by_device: dict[Any, list[tuple[int, torch.Tensor]]] = {}
    with torch.no_grad():
        for i, (p, skip) in enumerate(zip(params, sharded)):
            if skip:
                continue
            flat = p.detach().reshape(-1).double()
            by_device.setdefault(flat.device, []).append((i, torch.stack([flat.sum(), flat.dot(flat)])))
        for items in by_device.values():
            values = torch.stack([v for _, v in items]).cpu().tolist()
            for (i, _), pair in zip(items, values):
                out[i] = pair
    return out


@dataclass
class _Optimizer:
    cls: str
    params: list[torch.Tensor]
    sharded: list[bool]
    layouts: list[str]  # the DTensor placements among its parameters
    states: list[list] = field(default_factory=list)  # checksums before the first step, after each one
    pending: bool = False  # its step began and its post-hook has not run yet


@dataclass
class _Iteration:
    epoch: Any
    shuffle: Any
    where: Optional[str]
    at_step: int
    length: Optional[int]
    head: list = field(default_factory=list)
    consumed: int = 0
    finished: bool = False
    order: Any = field(default_factory=lambda: hashlib.blake2b(digest_size=FINGERPRINT_HEX // 2))


@dataclass
class _Sampler:
    cls: str
    made_at: Optional[str]
    iterations: list[_Iteration] = field(default_factory=list)
    set_epoch: list[dict] = field(default_factory=list)


class RankRecorder:
    """What one rank did that the rank checks compare across ranks. A context manager: installs its own
    hooks/patches on __enter__, removes them in __exit__ (also on exceptions)."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.optimizers: dict[int, _Optimizer] = {}  # by id, in the order of their first step
        self.ddp: list[dict] = []  # one per DDP forward under grad mode
        self.samplers: dict[int, _Sampler] = {}
        self.loaders: dict[int, dict] = {}
        self.steps = 0  # optimizer steps taken; optimizers stepped with no forward between count once
        self.forward_since_step = False
        self._stepping: set[int] = set()  # optimizers whose step has begun and not ended
        self._nested: set[int] = set()  # optimizers stepped inside another's step
        self._inside: set[int] = set()  # samplers whose patched method is running (super() calls)
        self._hooks: list = []  # the handles of the global hooks
        self._patches = Patches()
        self._patched: set[tuple[type, str]] = set()  # (class, name) wrapped already

    # ------------------------------------------------------------------ install

    def __enter__(self) -> "RankRecorder":
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        try:
            self._hooks += [register_optimizer_step_pre_hook(self._step_begins),
                            register_optimizer_step_post_hook(self._step_ends),
                            register_module_forward_pre_hook(self._forward)]
            self._patch(DistributedSampler, "__init__", self._made)
            self._patch(DataLoader, "__init__", self._loader_made)
            self._patch(DataLoader, "__iter__", self._loader_iterated)
            # subclasses known now; ones the script defines later are patched when an instance is made
            queue = [DistributedSampler]
            while queue:
                cls = queue.pop()
                queue.extend(cls.__subclasses__())
                self._patch_sampler_class(cls)
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        try:
            self._patches.undo()
        finally:
            while self._hooks:
                self._hooks.pop().remove()
            self._patched = set()

    def _patch(self, owner: type, name: str, wrap: Callable[[Callable], Callable]) -> None:
        if (owner, name) in self._patched or name not in owner.__dict__:
            return
        self._patches.wrap(owner, name, wrap)
        self._patched.add((owner, name))

    def _patch_sampler_class(self, cls: type) -> None:
        self._patch(cls, "__iter__", self._iterated)
        self._patch(cls, "set_epoch", self._epoch_set)

    # ------------------------------------------------------------------ optimizer steps

    def _step_begins(self, optimizer, args, kwargs) -> None:
        # Stepped inside another optimizer's step (ZeroRedundancyOptimizer steps this rank's shard of
        # the parameters through an inner one, then broadcasts): the outer one holds them all. Its own
        # id still open is no nesting: its previous step raised before reaching the post-hook.
        if self._stepping - {id(optimizer)} or id(optimizer) in self._nested:
            self._nested.add(id(optimizer))
            return
        self._stepping.add(id(optimizer))
        held = self.optimizers.get(id(optimizer))
        if held is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            sharded = [is_shard(p) for p in params]
            layouts = sorted({layout for layout in map(_layout, params) if layout})
            held = self.optimizers[id(optimizer)] = _Optimizer(type(optimizer).__name__, params, sharded, layouts)
            held.states.append(_checksums(params, sharded))
        held.pending = True

    def _step_ends(self, optimizer, args, kwargs) -> None:
        if id(optimizer) in self._nested:
            return
        self._stepping.discard(id(optimizer))
        held = self.optimizers.get(id(optimizer))
        if held is not None:
            held.states.append(_checksums(held.params, held.sharded))
            held.pending = False
        if self.forward_since_step or not self.steps:
            self.steps += 1
        self.forward_since_step = False

    # ------------------------------------------------------------------ forwards

    def _forward(self, module, args) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation forward neither trains nor all-reduces
        self.forward_since_step = True
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            # `steps` is the window this forward's gradients are stepped in
            self.ddp.append({"window": self.steps, "sync": bool(module.require_backward_grad_sync),
                             "where": call_site()})

    # ------------------------------------------------------------------ data loaders and samplers

    def _loader_made(self, original: Callable) -> Callable:
        recorder = self

        def __init__(loader, *args, **kwargs):
            original(loader, *args, **kwargs)
            if id(loader) not in recorder.loaders:
                recorder.loaders[id(loader)] = {"made_at": call_site(), "sampler": _sampler_name(loader),
                                                "iterated_at": None, "iterations": 0}

        return __init__

    def _loader_iterated(self, original: Callable) -> Callable:
        recorder = self

        def __iter__(loader):
            held = recorder.loaders.setdefault(id(loader), {"made_at": None, "sampler": _sampler_name(loader),
                                                            "iterated_at": None, "iterations": 0})
            held["iterations"] += 1
            held["iterated_at"] = held["iterated_at"] or call_site()
            return original(loader)

        return __iter__

    def _sampler(self, sampler) -> _Sampler:
        held = self.samplers.get(id(sampler))
        if held is None:
            held = self.samplers[id(sampler)] = _Sampler(type(sampler).__name__, None)
        return held

    def _made(self, original: Callable) -> Callable:
        recorder = self

        def __init__(sampler, *args, **kwargs):
            outer = id(sampler) not in recorder._inside
            recorder._inside.add(id(sampler))
            try:
                original(sampler, *args, **kwargs)
            finally:
                if outer:
                    recorder._inside.discard(id(sampler))
            if outer:
                recorder.samplers[id(sampler)] = _Sampler(type(sampler).__name__, call_site())
                for cls in type(sampler).__mro__:  # a subclass defined after __enter__
                    recorder._patch_sampler_class(cls)

        return __init__

    def _epoch_set(self, original: Callable) -> Callable:
        recorder = self

        def set_epoch(sampler, epoch, *args, **kwargs):
            if id(sampler) in recorder._inside:
                return original(sampler, epoch, *args, **kwargs)
            recorder._sampler(sampler).set_epoch.append({"epoch": _plain(epoch), "where": call_site(),
                                                         "at_step": recorder.steps})
            recorder._inside.add(id(sampler))
            try:
                return original(sampler, epoch, *args, **kwargs)
            finally:
                recorder._inside.discard(id(sampler))

        return set_epoch

    def _iterated(self, original: Callable) -> Callable:
        recorder = self

        def __iter__(sampler):
            if id(sampler) in recorder._inside:  # a subclass's __iter__ calling super().__iter__()
                return original(sampler)
            try:
                length = len(sampler)
            except TypeError:
                length = None
            iteration = _Iteration(_plain(getattr(sampler, "epoch", None)), _plain(getattr(sampler, "shuffle", None)),
                                   call_site(), recorder.steps, length)
            recorder._sampler(sampler).iterations.append(iteration)
            recorder._inside.add(id(sampler))
            try:
                inner = iter(original(sampler))
            finally:
                recorder._inside.discard(id(sampler))
            return recorder._follow(sampler, inner, iteration)

        return __iter__

    def _follow(self, sampler, inner, iteration: _Iteration):
        """Yields what `inner` yields, noting each index as it is consumed (lazily: a sampler may be
        long or endless, and the run stops part-way through an epoch)."""
        key = id(sampler)
        while True:
            self._inside.add(key)  # a generator __iter__ runs its super() call inside next()
            try:
                index = next(inner)
            except StopIteration:
                iteration.finished = True
                return
            finally:
                self._inside.discard(key)
            plain = _plain(index)
            if len(iteration.head) < ORDER_HEAD:
                iteration.head.append(plain)
            iteration.consumed += 1
            iteration.order.update(repr(plain).encode() + b",")
            yield index

    # ------------------------------------------------------------------ digest

    def digest(self, events: list, model, scores: list = ()) -> dict:
        """Small, picklable (plain Python data, no tensors): called at the stop point on every rank with
        the ScriptRecorder's events so far (tfdoctor.recording.trace.Event list), the module the script
        trains (maybe wrapped in DDP) and the scored rows read so far (Recorder.scores). Must take well
        under a second on a tiny model."""
        return {"rank": self.rank, "world_size": self.world_size,
                "tokens": _token_weights(events, scores), "clips": _clip_norms(events),
                "batches": _batches(events), "windows": _windows(events), "calls_at": _calls_at(events),
                "steps": len({e.window for e in events if e.kind == "opt_step"}),
                "params": self._params(model), "ddp": [dict(f) for f in self.ddp],
                "loaders": [dict(held) for held in self.loaders.values() if held["iterations"]],
                "samplers": [self._sampler_digest(s) for s in self.samplers.values() if s.iterations or s.set_epoch]}

    def _params(self, model) -> list[dict]:
        names: dict[int, str] = {}
        if isinstance(model, torch.nn.Module):
            wrapped_fsdp = any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())
            names = {id(p): name for name, p in unwrap(model).named_parameters()}
        else:
            wrapped_fsdp = False
        found = []
        for held in self.optimizers.values():
            states = [list(s) for s in held.states]
            if held.pending:  # its last step ran but the post-hook never did (the script was stopped first)
                states.append(_checksums(held.params, held.sharded))
            sharded = [s or wrapped_fsdp for s in held.sharded]
            if wrapped_fsdp:  # FSDP1 with use_orig_params: the tensors are views of this rank's shard
                states = [[None] * len(held.params) for _ in states]
            found.append({"class": held.cls, "sharded": sharded, "states": states, "layouts": list(held.layouts),
                          "numel": [p.numel() for p in held.params],
                          "names": [names.get(id(p), f"param[{i}] {list(p.shape)}")
                                    for i, p in enumerate(held.params)]})
        return found

    @staticmethod
    def _sampler_digest(sampler: _Sampler) -> dict:
        return {"class": sampler.cls, "made_at": sampler.made_at, "set_epoch": [dict(s) for s in sampler.set_epoch],
                "iterations": [{"epoch": it.epoch, "shuffle": it.shuffle, "where": it.where, "at_step": it.at_step,
                                "length": it.length, "head": list(it.head), "consumed": it.consumed,
                                "finished": it.finished, "order": it.order.hexdigest()}
                               for it in sampler.iterations]}


def _sampler_name(loader) -> Optional[str]:
    """The class of the sampler a DataLoader draws indices from (through its batch sampler, if custom)."""
    sampler = getattr(loader, "sampler", None)
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if inner is not None and type(inner).__name__ != type(sampler).__name__ and type(sampler).__name__ in (
            "SequentialSampler", "_InfiniteConstantSampler"):
        sampler = inner  # DataLoader(batch_sampler=BatchSampler(DistributedSampler(...), ...))
    return type(sampler).__name__ if sampler is not None else None


def _plain(value):
    """An epoch, flag or index as plain Python data (a tensor index becomes its number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def _batches(events: list) -> list[dict]:
    """A fingerprint of the integer inputs (token ids, targets) of each training forward, with its window."""
    return [{"window": e.window, "fingerprint": fingerprint(e.data["inputs"])} for e in events
            if e.kind == "forward" and e.data.get("grad", True) and e.data.get("inputs")]


def _counted(event) -> bool:
    return event.kind in COUNTED_CALLS and not (event.kind == "unscale" and event.data.get("internal"))


def _windows(events: list) -> list[dict]:
    """How many times each counted call ran in each optimizer-step window (window i: before step i+1)."""
    windows: dict[int, dict] = {}
    for e in events:
        if _counted(e):
            counts = windows.setdefault(e.window, {})
            counts[e.kind] = counts.get(e.kind, 0) + 1
    last = max(windows, default=-1)
    return [windows.get(w, {}) for w in range(last + 1)]


def _calls_at(events: list) -> dict:
    """The user's file:line of the first call of each counted kind."""
    found: dict[str, str] = {}
    for e in events:
        if _counted(e) and e.data.get("where") and e.kind not in found:
            found[e.kind] = e.data["where"]
    return found


def _token_weights(events: list, scores: list) -> list[dict]:
    """Per optimizer-step window, this rank's graded targets and the total weight its loss gave them
    (windows.micro_batch_weights summed over the window's micro-batches: read from the gradient that
    reached the scores, the GradScaler's scale divided out). A loss averaged over the tokens of all
    ranks gives a target the same weight on every rank; a loss averaged over each rank's own tokens
    gives it 1 / (that rank's count)."""
    recorded = SimpleNamespace(events=events, scores=scores)  # what micro_batch_weights reads of a Trace
    return [{"window": w, "graded": sum(m["tokens"] for m in micro), "weight": sum(m["sum"] for m in micro)}
            for w, micro in sorted(micro_batch_weights(recorded).items())]


def _clip_norms(events: list) -> list[dict]:
    """The whole model's pre-clip gradient norm each window's first clip measured (patched_calls.py)."""
    return [{"window": e.window, "norm": e.data["global_pre_norm"], "how": e.data.get("how")}
            for e in events if e.kind == "clip" and e.data.get("global_pre_norm") is not None]
