"""The recorder's wrappers of what PyTorch offers no hook for: GradScaler's methods, clip_grad_*,
zero_grad, LR scheduler steps and autocast regions, and `installed`, which puts every patch and hook
of the recorder in place (in a fixed order: the recorder is order-sensitive) and removes them when
the block ends (usercode/patches.py). A mixin of recorder.Recorder, whose state and events the
wrappers record into. Each wrapper first asks the recorder whether it `owns` the parameters
concerned: another model's clip, zero_grad, scaler or scheduler call passes through unrecorded.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import weakref
from typing import Callable, Iterator

import torch

from tfdoctor.modes import outermost_mode_calls
from tfdoctor.recording.grads import grad_norm, params_of
from tfdoctor.recording.schedule import snapshot_scheduler
from tfdoctor.usercode.call_sites import is_library
from tfdoctor.usercode.patches import Patches
from tfdoctor.usercode.torch_compat import (
    autocast_enabled,
    scaler_device,
    scaler_enabled,
    scaler_init_scale,
    scheduler_is_initial,
)


class PatchedCalls:
    """The patched callables and their installation; see recorder.Recorder for the state they use."""

    # ------------------------------------------------------------------ patched callables

    def clip(self, how: str, original: Callable) -> Callable:
        recorder = self

        def clipped(parameters, *args, **kwargs):
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if not recorder.owns(params):
                return original(params, *args, **kwargs)
            recorder._step_begins()
            if recorder.record:
                with_grad = {id(p) for p in recorder.params if p.grad is not None}
                given = {id(p) for p in params}
                limit = args[0] if args else kwargs.get("max_norm", kwargs.get("clip_value"))
                with recorder.quiet():
                    pre_norm, pre_finite = grad_norm(params)
                data = recorder.event("clip", how=how, params=len(params), covers_all=with_grad <= given,
                                      model_params_with_grad=len(with_grad), limit=float(limit),
                                      pre_norm=pre_norm)
                if recorder.clip_seen_window != recorder.window:  # the whole model's pre-clip norm, once
                    recorder.clip_seen_window = recorder.window
                    # the usual clip over all the model's parameters has just measured it
                    same = with_grad == {id(p) for p in params if p.grad is not None}
                    with recorder.quiet():
                        data["global_pre_norm"], data["finite"] = (pre_norm, pre_finite) if same \
                            else grad_norm(recorder.params)
            return original(params, *args, **kwargs)

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
                enabled = scaler_enabled(scaler)
                value = float(scaler.get_scale()) if enabled else 1.0
                recorder.scale_nodes.append((result.grad_fn, value if enabled else None))
                recorder.event("scale", scaler=id(scaler), enabled=enabled, requested=recorder._requested(scaler),
                               device=scaler_device(scaler), scale=value, init_scale=scaler_init_scale(scaler))
            return result

        def unscale_(scaler, optimizer):
            if not recorder.owns(params_of(optimizer)):
                return original(scaler, optimizer)
            if not recorder.in_scaler_step:
                recorder._step_begins()
            if recorder.record:
                recorder.event("unscale", scaler=id(scaler), optimizer=id(optimizer),
                               internal=bool(recorder.in_scaler_step))
            return original(scaler, optimizer)

        def step(scaler, optimizer, *args, **kwargs):
            if not recorder.owns(params_of(optimizer)):
                return original(scaler, optimizer, *args, **kwargs)
            recorder._step_begins()
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
        return wrapper

    def _requested(self, scaler) -> bool:
        """Whether the loop asked for loss scaling (a CUDA scaler disables itself on a CPU machine)."""
        held = self.scaler_requested.get(id(scaler))
        if held is not None and held[0] is scaler:
            return held[1]
        # Built before the trace started: a disabled CUDA scaler on a machine without CUDA was asked for.
        return scaler_enabled(scaler) or (scaler_device(scaler) == "cuda" and not torch.cuda.is_available())

    def zero_grad(self, owner: str, original: Callable) -> Callable:
        recorder = self

        def zero_grad(obj, *args, **kwargs):
            if not recorder.owns(params_of(obj) if owner == "optimizer" else obj.parameters()):
                return original(obj, *args, **kwargs)
            if recorder.record and (owner == "optimizer" or obj is recorder.model):
                recorder.event("zero_grad", owner=owner)
            return original(obj, *args, **kwargs)

        return zero_grad

    def module_mode(self, original: Callable) -> Callable:
        """`Module.train(mode)` (and `eval()`, which calls it): the outermost call, where it was made,
        and a weak reference to the module, resolved at the end against the recorded model."""
        recorder = self

        def heard(module, mode) -> None:
            if recorder.record:
                data = recorder.event("mode", training=bool(mode), module=type(module).__name__,
                                      by_library=_called_by_library())
                recorder.mode_calls.append((data, weakref.ref(module)))

        return outermost_mode_calls(original, heard)

    def sched_step(self, original: Callable) -> Callable:
        recorder = self

        def step(scheduler, *args, **kwargs):
            optimizer = getattr(scheduler, "optimizer", None)
            if optimizer is not None and not recorder.owns(params_of(optimizer)):
                return original(scheduler, *args, **kwargs)
            outer = recorder.sched_depth == 0 and not scheduler_is_initial(scheduler)
            if outer and recorder.record:
                held = recorder.schedulers.get(id(scheduler))
                if held is None:
                    recorder.schedulers[id(scheduler)] = held = {
                        "name": type(scheduler).__name__, "snapshot": snapshot_scheduler(scheduler), "steps": 0,
                        "optimizer": id(getattr(scheduler, "optimizer", None)), "ref": scheduler}
                held["steps"] += 1
                recorder.event("sched_step", scheduler=id(scheduler), name=type(scheduler).__name__)
            recorder.sched_depth += 1
            try:
                return original(scheduler, *args, **kwargs)
            finally:
                recorder.sched_depth -= 1

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
            requested = held[1] if held is not None and held[0] is region else autocast_enabled(region)
            dtype = str(region.fast_dtype).replace("torch.", "") if region.fast_dtype is not None else None
            info = {"device": str(region.device), "dtype": dtype, "requested": requested,
                    "enabled": autocast_enabled(region)}
            recorder.autocast_stack.append(info)
            if recorder.record:
                recorder.event("autocast", **info)
            return original(region, *args, **kwargs)

        def exit_(region, *args, **kwargs):
            if recorder.autocast_stack:
                recorder.autocast_stack.pop()
            return original(region, *args, **kwargs)

        wrapper = {"__init__": init, "__enter__": enter, "__exit__": exit_}[name]
        return wrapper

    # ------------------------------------------------------------------ install / restore

    @contextlib.contextmanager
    def installed(self, train_fn) -> Iterator[None]:
        """Every patch and hook of the recorder, in a fixed order (the recorder is order-sensitive), all
        taken off again when the block ends, however it ends: the hooks, then the patches in reverse."""
        from torch.amp.autocast_mode import autocast
        from torch.nn.utils import clip_grad
        from torch.optim import lr_scheduler
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        with Patches() as patches, contextlib.ExitStack() as hooks:
            clip_wrappers = {}
            for attr, how in (("clip_grad_norm_", "norm"), ("clip_grad_value_", "value"),
                              ("clip_grads_with_norm_", "norm")):
                original = getattr(torch.nn.utils, attr, None)
                if original is None:
                    continue
                clip_wrappers[id(original)] = wrapper = self.clip(how, original)
                for owner in (clip_grad, torch.nn.utils):
                    if getattr(owner, attr, None) is original:
                        patches.wrap(owner, attr, lambda orig, w=wrapper: w)
            # `from torch.nn.utils import clip_grad_norm_` in the loop's module binds the original.
            namespace = getattr(train_fn, "__globals__", None)
            if isinstance(namespace, dict):
                for name, value in list(namespace.items()):
                    if id(value) in clip_wrappers and value is not None:
                        patches.setitem(namespace, name, clip_wrappers[id(value)])
            for name in ("__init__", "scale", "unscale_", "step", "update"):
                patches.wrap(torch.amp.GradScaler, name, lambda orig, n=name: self.scaler_method(n, orig))
            patches.wrap(torch.optim.Optimizer, "zero_grad", lambda orig: self.zero_grad("optimizer", orig))
            patches.wrap(torch.nn.Module, "zero_grad", lambda orig: self.zero_grad("model", orig))
            patches.wrap(torch.nn.Module, "train", self.module_mode)
            for cls in with_own_step(lr_scheduler.LRScheduler):
                patches.wrap(cls, "step", self.sched_step)
            for name in ("__init__", "__enter__", "__exit__"):
                patches.wrap(autocast, name, lambda orig, n=name: self.autocast_method(n, orig))
            for handle in (register_optimizer_step_pre_hook(self.opt_pre),
                           register_optimizer_step_post_hook(self.opt_post),
                           self.model.register_forward_pre_hook(self.forward_pre, with_kwargs=True),
                           self.model.register_forward_hook(self.forward_post, with_kwargs=True)):
                hooks.callback(handle.remove)
            # `model.forward(...)` called directly (The Annotated Transformer does) skips module hooks:
            # the class's forward is wrapped too, recording only for this copy and only when no hook did.
            patches.wrap(type(self.model), "forward", self.direct_forward)
            with self:
                yield


def _called_by_library() -> bool:
    """Whether the train()/eval() call being recorded was made by a library (from_pretrained's eval(),
    Lightning's validation loop), not the user's own code: the first frame outside torch's Module."""
    frame = sys._getframe(1)
    module_file = torch.nn.modules.module.__file__
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # tfdoctor/: the patch itself
    while frame is not None and (frame.f_code.co_filename == module_file
                                 or os.path.abspath(frame.f_code.co_filename).startswith(ours)):
        frame = frame.f_back
    return frame is None or is_library(frame.f_code.co_filename)


def with_own_step(base: type) -> list[type]:
    """`base` and every subclass that defines its own `step` (SequentialLR, ReduceLROnPlateau, ...)."""
    found, queue = [base], list(base.__subclasses__())
    while queue:
        cls = queue.pop()
        queue.extend(cls.__subclasses__())
        if "step" in cls.__dict__ and cls not in found:
            found.append(cls)
    return found
