"""Record what a user's training loop really does, so that the loop checks judge behaviour, not code.

`record_loop(subject, batches)` runs `subject.train(copy_of_model, batches)` once and returns a
`Trace`: the ordered events of the run (forward, loss call, backward, GradScaler scale / unscale_ /
step / update, clip, optimizer step, zero_grad, scheduler step, autocast region), each stamped with
the optimizer-step window it fell in. Variable names and code layout do not matter: only calls do.

How each thing is seen, hooks first and patches only where PyTorch offers no hook:
- loss functions and `Tensor.backward`: a TorchFunctionMode (sees a loss computed inside a library
  model's own forward too); a tensor hook on each loss output records the gradient the user's
  backward sent to it, i.e. the weight every token had in the update;
- optimizer steps: the global optimizer step pre/post hooks;
- the model's forward: module pre/post hooks on the (copied) model;
- GradScaler, clip_grad_*, zero_grad, LR scheduler steps and autocast regions: patched on their
  classes or modules (no hooks exist) and restored in `finally`, also when the loop raises.

Autocast and GradScaler record what the loop *requested* (device, dtype, enabled), so a loop written
for CUDA is audited on a CPU machine where both quietly disable themselves.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tfdoctor.subject import Subject, extract_logits

# Loss functions whose calls are recorded. The nn losses (CrossEntropyLoss, NLLLoss) call these.
LOSS_FUNCTIONS = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}
# The first few forwards and loss calls keep their logits so that the objective check can find which
# model position each scored row came from; later ones keep only small per-token summaries.
ALIGN_MAX_FORWARDS = 4
# How far back from a backward's root to look for the GradScaler's multiply (it is the root itself
# or a few nodes away: `scaler.scale(loss / k)`, `scaler.scale(loss) / k`).
SCALE_SEARCH_NODES = 64
# Schedule projection: at least this many steps, then until twice the step of the peak so far,
# never beyond the cap (a LambdaLR step costs ~7 us here, so the cap costs ~0.3 s).
PROJECT_MIN_STEPS = 200
PROJECT_MAX_STEPS = 40_000


@dataclass
class Event:
    kind: str  # batch forward loss backward scale unscale scaler_step scaler_update clip opt_step zero_grad
    #            sched_step autocast
    window: int  # optimizer steps taken before this event
    data: dict = field(default_factory=dict)


@dataclass
class Trace:
    events: list[Event]
    batches_fed: int
    optimizers: list[dict]  # per optimizer stepped: class name and per-group hyperparameters
    schedules: list[dict]  # per scheduler stepped by the loop: name, snapshot (or None), steps
    warnings: list[str]
    param_count: int

    def of(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]

    @property
    def steps(self) -> int:
        return len(self.of("opt_step"))

    def training_losses(self) -> list[Event]:
        """Loss calls whose value reached a backward (their gradient hook fired)."""
        return [e for e in self.of("loss") if e.data.get("grad") is not None]


def _grad_norm(params) -> tuple[float, bool]:
    """Global L2 norm of the gradients present, and whether all of them are finite."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return 0.0, True
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    total = float(torch.linalg.vector_norm(norms))
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    return total, finite


def _int_tensors(args, kwargs) -> list[tuple[str, torch.Tensor]]:
    found = [(str(i), a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_floating_point()
             and a.dim() == 2]
    found += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()
              and v.dim() == 2]
    return [(k, v.detach()) for k, v in found]


def _reaches(root, targets: list, limit: int = SCALE_SEARCH_NODES) -> bool:
    """Whether any of the autograd nodes `targets` lies within `limit` nodes of `root`."""
    if root is None or not targets:
        return False
    wanted = {id(t) for t in targets if t is not None}
    queue, seen = [root], set()
    while queue and len(seen) < limit:
        node = queue.pop(0)
        if node is None or id(node) in seen:
            continue
        if id(node) in wanted:
            return True
        seen.add(id(node))
        queue.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return False


class _Feed(list):
    """The batches as a list (len() works, epochs re-iterate) that records each one handed out."""

    def __init__(self, batches, on_batch: Callable[[int], None]):
        super().__init__(batches)
        self._on_batch = on_batch

    def __iter__(self):
        for i, batch in enumerate(list.__iter__(self)):
            self._on_batch(i)
            yield batch


class _Recorder(TorchFunctionMode):
    def __init__(self, model: torch.nn.Module, record: bool = True):
        super().__init__()
        self.model = model
        self.record = record
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.events: list[Event] = []
        self.window = 0
        self.batches_fed = 0
        self.autocast_stack: list[dict] = []
        self.autocast_requested: dict[int, tuple[Any, bool]] = {}
        self.scaler_requested: dict[int, tuple[Any, bool]] = {}
        self.scale_nodes: list = []
        self.current_backward: Optional[int] = None
        self.forwards = 0
        self.in_scaler_step = 0
        self.sched_depth = 0
        self.schedulers: dict[int, dict] = {}
        self.optimizers: dict[int, Any] = {}
        self.clip_seen_window = -1
        self.advance: Callable[[int], None] = lambda n=1: None

    # ------------------------------------------------------------------ events

    def event(self, kind: str, **data) -> dict:
        self.events.append(Event(kind, self.window, data))
        return data

    def amp(self) -> Optional[str]:
        """The dtype the innermost autocast region asks for, or None when none is asked for."""
        if not self.autocast_stack:
            return None
        region = self.autocast_stack[-1]
        return region["dtype"] if region["requested"] else None

    def on_batch(self, i: int) -> None:
        self.batches_fed += 1
        self.event("batch", index=i)
        self.advance(1)

    # ------------------------------------------------------------------ torch functions

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward and self.record:
            return self._backward(func, args, kwargs)
        name = LOSS_FUNCTIONS.get(func)
        if name is not None and self.record:
            return self._loss(name, func, args, kwargs)
        return func(*args, **kwargs)

    def _backward(self, func, args, kwargs):
        root = args[0]
        value = float(root.detach().float().sum())
        clear = all(p.grad is None or not bool(p.grad.detach().any()) for p in self.params)
        scaled = _reaches(root.grad_fn, [node for node, _ in self.scale_nodes])
        scale = next((s for node, s in reversed(self.scale_nodes) if _reaches(root.grad_fn, [node])), None) \
            if scaled else None
        self.event("backward", value=value, grads_clear=clear, scaled=scaled, scale=scale, amp=self.amp())
        self.current_backward = len(self.events) - 1
        try:
            return func(*args, **kwargs)
        finally:
            self.current_backward = None

    _signatures: dict = {}

    def _loss(self, name, func, args, kwargs):
        out = func(*args, **kwargs)
        sig = self._signatures.setdefault(name, inspect.signature(func))
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        logits, target = bound.arguments["input"], bound.arguments["target"]
        data = self.event("loss", function=name, forward=self.forwards - 1, amp=self.amp(),
                          requires_grad=bool(out.requires_grad), reduction=bound.arguments.get("reduction"),
                          ignore_index=int(bound.arguments.get("ignore_index", -100)),
                          label_smoothing=float(bound.arguments.get("label_smoothing", 0.0) or 0.0),
                          value=float(out.detach().float().sum()), grad=None, backward=None)
        if target.is_floating_point() or logits.dim() < 2:  # soft labels: nothing to align
            data["soft"] = True
            return out
        with torch.no_grad():
            rows = logits.detach()
            if rows.dim() > 2:  # (N, C, d1, ...) -> (N * d1 * ..., C)
                rows = rows.movedim(1, -1).reshape(-1, rows.shape[1])
            targets = target.detach().reshape(-1)
            if name == "cross_entropy":
                per_token = F.cross_entropy(rows.float(), targets, ignore_index=data["ignore_index"],
                                            label_smoothing=data["label_smoothing"], reduction="none")
            else:
                per_token = F.nll_loss(rows.float(), targets, ignore_index=data["ignore_index"], reduction="none")
        data.update(targets=targets.cpu(), per_token=per_token.float().cpu(),
                    valid=int((targets != data["ignore_index"]).sum()),
                    output_shape=list(out.shape))
        if data["forward"] < ALIGN_MAX_FORWARDS:
            data["rows"] = rows
        if out.requires_grad:
            def hook(grad, data=data):
                data["grad"] = grad.detach().float().reshape(-1).cpu()
                data["backward"] = self.current_backward
            out.register_hook(hook)
        return out

    # ------------------------------------------------------------------ module and optimizer hooks

    def forward_pre(self, module, args, kwargs):
        if not self.record:
            return
        self.event("forward", index=self.forwards, inputs=_int_tensors(args, kwargs),
                   kwargs=sorted(kwargs), amp=self.amp())
        self.forwards += 1

    def forward_post(self, module, args, kwargs, output):
        if not self.record:
            return
        forward = next(e for e in reversed(self.events) if e.kind == "forward")
        if forward.data["index"] < ALIGN_MAX_FORWARDS:
            try:
                forward.data["logits"] = extract_logits(output).detach()
            except Exception:  # an output we cannot read logits from: the objective check skips it
                forward.data["logits"] = None

    def opt_pre(self, optimizer, args, kwargs):
        if not self.record:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm, finite = _grad_norm(params)
        self.optimizers[id(optimizer)] = optimizer
        self.event("opt_step", optimizer=id(optimizer), lrs=[float(g["lr"]) for g in optimizer.param_groups],
                   grad_norm=norm, finite=finite, in_scaler=bool(self.in_scaler_step))

    def opt_post(self, optimizer, args, kwargs):
        self.window += 1

    # ------------------------------------------------------------------ patched callables

    def clip(self, how: str, original: Callable) -> Callable:
        recorder = self

        def clipped(parameters, *args, **kwargs):
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if recorder.record:
                with_grad = {id(p) for p in recorder.params if p.grad is not None}
                given = {id(p) for p in params}
                limit = args[0] if args else kwargs.get("max_norm", kwargs.get("clip_value"))
                data = recorder.event("clip", how=how, params=len(params), covers_all=with_grad <= given,
                                      model_params_with_grad=len(with_grad), limit=float(limit),
                                      pre_norm=_grad_norm(params)[0])
                if recorder.clip_seen_window != recorder.window:  # the whole model's pre-clip norm, once
                    recorder.clip_seen_window = recorder.window
                    data["global_pre_norm"], data["finite"] = _grad_norm(recorder.params)
            return original(params, *args, **kwargs)

        clipped.__wrapped__ = original
        return clipped

    def scaler_method(self, name: str, original: Callable) -> Callable:
        recorder = self

        def init(scaler, *args, **kwargs):
            original(scaler, *args, **kwargs)
            bound = inspect.signature(original).bind(scaler, *args, **kwargs)
            bound.apply_defaults()
            recorder.scaler_requested[id(scaler)] = (scaler, bool(bound.arguments.get("enabled", True)))

        def scale(scaler, outputs):
            result = original(scaler, outputs)
            if recorder.record and isinstance(result, torch.Tensor):
                enabled = bool(scaler._enabled)
                value = float(scaler.get_scale()) if enabled else 1.0
                recorder.scale_nodes.append((result.grad_fn, value if enabled else None))
                recorder.event("scale", scaler=id(scaler), enabled=enabled, requested=recorder._requested(scaler),
                               device=str(getattr(scaler, "_device", "cuda")), scale=value,
                               init_scale=float(getattr(scaler, "_init_scale", 2.0 ** 16) or 2.0 ** 16))
            return result

        def unscale_(scaler, optimizer):
            if recorder.record:
                recorder.event("unscale", scaler=id(scaler), optimizer=id(optimizer),
                               internal=bool(recorder.in_scaler_step))
            return original(scaler, optimizer)

        def step(scaler, optimizer, *args, **kwargs):
            data = recorder.event("scaler_step", scaler=id(scaler), optimizer=id(optimizer)) if recorder.record \
                else {}
            before = recorder.window
            recorder.in_scaler_step += 1
            try:
                return original(scaler, optimizer, *args, **kwargs)
            finally:
                recorder.in_scaler_step -= 1
                data["skipped"] = recorder.window == before

        def update(scaler, *args, **kwargs):
            if recorder.record:
                recorder.event("scaler_update", scaler=id(scaler))
            recorder.scale_nodes.clear()
            return original(scaler, *args, **kwargs)

        wrapper = {"__init__": init, "scale": scale, "unscale_": unscale_, "step": step, "update": update}[name]
        wrapper.__wrapped__ = original
        return wrapper

    def _requested(self, scaler) -> bool:
        """Whether the loop asked for loss scaling (a CUDA scaler disables itself on a CPU machine)."""
        held = self.scaler_requested.get(id(scaler))
        if held is not None and held[0] is scaler:
            return held[1]
        # Built before the trace started: a disabled CUDA scaler on a machine without CUDA was asked for.
        return bool(scaler._enabled) or (getattr(scaler, "_device", "cuda") == "cuda" and not torch.cuda.is_available())

    def zero_grad(self, owner: str, original: Callable) -> Callable:
        recorder = self

        def zero_grad(obj, *args, **kwargs):
            if recorder.record and (owner == "optimizer" or obj is recorder.model):
                recorder.event("zero_grad", owner=owner)
            return original(obj, *args, **kwargs)

        zero_grad.__wrapped__ = original
        return zero_grad

    def sched_step(self, original: Callable) -> Callable:
        recorder = self

        def step(scheduler, *args, **kwargs):
            outer = recorder.sched_depth == 0 and not getattr(scheduler, "_is_initial", False)
            if outer and recorder.record:
                held = recorder.schedulers.get(id(scheduler))
                if held is None:
                    recorder.schedulers[id(scheduler)] = held = {
                        "name": type(scheduler).__name__, "snapshot": _snapshot(scheduler), "steps": 0,
                        "ref": scheduler}
                held["steps"] += 1
                recorder.event("sched_step", scheduler=id(scheduler), name=type(scheduler).__name__)
            recorder.sched_depth += 1
            try:
                return original(scheduler, *args, **kwargs)
            finally:
                recorder.sched_depth -= 1

        step.__wrapped__ = original
        return step

    def autocast_method(self, name: str, original: Callable) -> Callable:
        recorder = self

        def init(region, *args, **kwargs):
            original(region, *args, **kwargs)
            bound = inspect.signature(original).bind(region, *args, **kwargs)
            bound.apply_defaults()
            recorder.autocast_requested[id(region)] = (region, bool(bound.arguments.get("enabled", True)))

        def enter(region, *args, **kwargs):
            held = recorder.autocast_requested.get(id(region))
            requested = held[1] if held is not None and held[0] is region else bool(region._enabled)
            dtype = str(region.fast_dtype).replace("torch.", "") if region.fast_dtype is not None else None
            info = {"device": str(region.device), "dtype": dtype, "requested": requested,
                    "enabled": bool(region._enabled)}
            recorder.autocast_stack.append(info)
            if recorder.record:
                recorder.event("autocast", **info)
            return original(region, *args, **kwargs)

        def exit_(region, *args, **kwargs):
            if recorder.autocast_stack:
                recorder.autocast_stack.pop()
            return original(region, *args, **kwargs)

        wrapper = {"__init__": init, "__enter__": enter, "__exit__": exit_}[name]
        wrapper.__wrapped__ = original
        return wrapper

    # ------------------------------------------------------------------ install / restore

    @contextlib.contextmanager
    def installed(self, train_fn) -> Iterator[None]:
        from torch.amp.autocast_mode import autocast
        from torch.nn.utils import clip_grad
        from torch.optim import lr_scheduler
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        patches: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) in the order applied

        def patch(owner, attr, make):
            original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            patches.append((owner, attr, original))
            setattr(owner, attr, make(original))

        handles = []
        try:
            clip_originals = {}
            for attr, how in (("clip_grad_norm_", "norm"), ("clip_grad_value_", "value"),
                              ("clip_grads_with_norm_", "norm")):
                original = getattr(torch.nn.utils, attr, None)
                if original is None:
                    continue
                clip_originals[id(original)] = self.clip(how, original)
                for owner in (clip_grad, torch.nn.utils):
                    if getattr(owner, attr, None) is original:
                        patch(owner, attr, lambda orig, w=clip_originals[id(original)]: w)
            # `from torch.nn.utils import clip_grad_norm_` in the loop's module binds the original.
            namespace = getattr(train_fn, "__globals__", None)
            if isinstance(namespace, dict):
                for name, value in list(namespace.items()):
                    if id(value) in clip_originals and value is not None:
                        patch_dict = namespace
                        patches.append((patch_dict, name, value))
                        patch_dict[name] = clip_originals[id(value)]
            scaler_cls = torch.amp.GradScaler
            for name in ("__init__", "scale", "unscale_", "step", "update"):
                patch(scaler_cls, name, lambda orig, n=name: self.scaler_method(n, orig))
            patch(torch.optim.Optimizer, "zero_grad", lambda orig: self.zero_grad("optimizer", orig))
            patch(torch.nn.Module, "zero_grad", lambda orig: self.zero_grad("model", orig))
            for cls in _with_own_step(lr_scheduler.LRScheduler):
                patch(cls, "step", self.sched_step)
            for name in ("__init__", "__enter__", "__exit__"):
                patch(autocast, name, lambda orig, n=name: self.autocast_method(n, orig))
            handles += [register_optimizer_step_pre_hook(self.opt_pre),
                        register_optimizer_step_post_hook(self.opt_post),
                        self.model.register_forward_pre_hook(self.forward_pre, with_kwargs=True),
                        self.model.register_forward_hook(self.forward_post, with_kwargs=True)]
            with self:
                yield
        finally:
            for handle in reversed(handles):
                handle.remove()
            for owner, attr, original in reversed(patches):
                if isinstance(owner, dict):
                    owner[attr] = original
                else:
                    setattr(owner, attr, original)


def _with_own_step(base: type) -> list[type]:
    """`base` and every subclass that defines its own `step` (SequentialLR, ReduceLROnPlateau, ...)."""
    found, queue = [base], list(base.__subclasses__())
    while queue:
        cls = queue.pop()
        queue.extend(cls.__subclasses__())
        if "step" in cls.__dict__ and cls not in found:
            found.append(cls)
    return found


class _ScheduleOptimizer(torch.optim.SGD):
    """Stands in for the user's optimizer when a scheduler is projected forward: same param-group
    hyperparameters, one dummy parameter each, never stepped."""

    def __init__(self, groups: list[dict]):
        dummy = [dict(g, params=[torch.zeros(1, requires_grad=True)]) for g in groups]
        super().__init__(dummy, lr=float(groups[0].get("lr", 1e-3)))


def _snapshot(scheduler):
    """A copy of the scheduler bound to a stand-in optimizer, or None when it cannot be copied."""
    try:
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                  for g in scheduler.optimizer.param_groups]
        stand_in = _ScheduleOptimizer(groups)
        return copy.deepcopy(scheduler, memo={id(scheduler.optimizer): stand_in})
    except Exception:  # an exotic scheduler: the lr-schedule check falls back on the recorded rates
        return None


def project_schedule(snapshot) -> Optional[list[float]]:
    """The learning rate (max over param groups) at each optimizer step from the scheduler's start,
    far enough to see its peak. None for schedulers that need a metric (ReduceLROnPlateau)."""
    if snapshot is None or isinstance(snapshot, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return None
    scheduler = copy.deepcopy(snapshot)
    rates: list[float] = []
    peak_at = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while len(rates) < PROJECT_MAX_STEPS:
            rates.append(max(float(g["lr"]) for g in scheduler.optimizer.param_groups))
            if rates[-1] > rates[peak_at]:
                peak_at = len(rates) - 1
            if len(rates) >= PROJECT_MIN_STEPS and len(rates) > 2 * peak_at + 1:
                break
            scheduler.step()
    return rates


def _align(loss: dict, forward: dict) -> None:
    """For each row the loss scored, the flat model position (b * T + t) whose logits it is, or -1.

    Rows are matched by value: a random projection finds the nearest model row, which must then equal
    the scored row to within rounding (casts such as .float() keep the values)."""
    rows, logits = loss.pop("rows", None), forward.get("logits")
    if rows is None or logits is None or logits.dim() != 3 or rows.shape[-1] != logits.shape[-1]:
        return
    reference = logits.float().reshape(-1, logits.shape[-1])
    if loss["function"] == "nll_loss":  # it scores log-probabilities
        reference = reference.log_softmax(-1)
    rows = rows.float()
    generator = torch.Generator(device=rows.device).manual_seed(0)
    direction = torch.randn(rows.shape[-1], generator=generator, device=rows.device)
    candidate = ((rows @ direction)[:, None] - (reference @ direction)[None, :]).abs().argmin(-1)
    matched = reference[candidate]
    finite = torch.isfinite(rows).all(-1) & torch.isfinite(matched).all(-1)
    close = ((rows - matched).abs().amax(-1) <= 1e-3 * (1 + matched.abs().amax(-1))) & finite
    loss["positions"] = torch.where(close, candidate, torch.full_like(candidate, -1)).cpu()
    loss["logits_shape"] = list(logits.shape)


def record_loop(subject: Subject, batches: list, advance: Callable[[int], None] = lambda n=1: None) -> Trace:
    """Run the user's loop once on a deep copy of the model and return what it did.

    The user's exception, if the loop raises, propagates after every patch and hook is removed."""
    model = copy.deepcopy(subject.model)
    for p in model.parameters():
        p.grad = None
    recorder = _Recorder(model)
    recorder.advance = advance
    feed = _Feed(batches, recorder.on_batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recorder.installed(subject.train), torch.enable_grad():
            subject.train(model, feed)
    return _finish(recorder, caught)


def run_loop(subject: Subject, model: torch.nn.Module, batches: list,
             advance: Callable[[int], None] = lambda n=1: None) -> None:
    """Run the user's loop on `model` without recording (its warnings are swallowed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.enable_grad():
            subject.train(model, _Feed(batches, lambda i: advance(1)))


def _finish(recorder: _Recorder, caught) -> Trace:
    forwards = {e.data["index"]: e.data for e in recorder.events if e.kind == "forward"}
    for event in recorder.events:
        if event.kind == "loss":
            forward = forwards.get(event.data["forward"])
            if forward is not None:
                _align(event.data, forward)
            event.data.pop("rows", None)
    for data in forwards.values():
        data.pop("logits", None)
    optimizers = []
    for optimizer in recorder.optimizers.values():
        groups = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizers.append({"class": type(optimizer).__name__, "groups": groups})
    schedules = [{"name": s["name"], "snapshot": s["snapshot"], "steps": s["steps"]}
                 for s in recorder.schedulers.values()]
    messages = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
    return Trace(recorder.events, recorder.batches_fed, optimizers, schedules, messages,
                 sum(p.numel() for p in recorder.params))


def _plain(value):
    """A JSON-safe copy of a hyperparameter (tensors and tuples become numbers and lists)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value if not (isinstance(value, float) and math.isnan(value)) else None
    return repr(value)
