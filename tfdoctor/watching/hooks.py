"""Puts the watch monitor's hooks and patches in place, process-wide, and takes every one off again
in `finally` (also when the run raises or is stopped). Each is a call made a few times per step at
most, never per torch operation: see monitor.py for what each one records.

Why a second hook set beside the recorder's (recording/patched_calls.py, recorder.py): the recorder's
TorchFunctionMode sees every torch call and costs ~1.3x on its own (bench/run_overhead.py), while
the monitor runs for a whole training run within 3% of its step time (bench/watch_overhead.py)."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from tfdoctor.modes import outermost_mode_calls
from tfdoctor.usercode.call_sites import call_site
from tfdoctor.usercode.patches import Patches
from tfdoctor.usercode.torch_compat import dataloader_iterator_base, scaler_enabled, scheduler_is_initial
from tfdoctor.watching.monitor import Monitor

# cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
# and nll_loss(input, target, weight, size_average, ignore_index, reduce, reduction): positions.
_IGNORE_AT, _REDUCTION_AT = 4, 6


@contextlib.contextmanager
def watching(monitor: Monitor) -> Iterator[Monitor]:
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim import lr_scheduler
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.utils.data import dataloader

    patches = Patches()
    handles: list = []
    patch = functools.partial(patches.wrap, raising=False)  # get_total_norm: only in newer torch

    stepping: list = []  # the optimizer steps under way: a post hook closes the watched one's row

    def begin(optimizer) -> bool:
        watched = monitor.step_begins(optimizer)
        if monitor.model is not None and everything in handles:  # just bound: hook the model alone from now
            handles.remove(everything)
            everything.remove()
            handles.append(monitor.model.register_forward_pre_hook(monitor.forward_called, with_kwargs=True))
        return watched

    def pre(optimizer, args, kwargs):
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer itself
        if closure is None:
            stepping.append(begin(optimizer))
            return None
        # optimizer.step(closure) (Lightning, LBFGS): the forward and backward run inside the step, so
        # the step begins, for the monitor, when the closure has returned (the gradients are there)
        slot = len(stepping)
        stepping.append(False)

        def closure_then_begin(*a, **k):
            loss = closure(*a, **k)
            stepping[slot] = begin(optimizer)
            return loss

        if len(args) > 1:
            return (args[0], closure_then_begin, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_begin}

    def post(optimizer, args, kwargs) -> None:
        if stepping and stepping.pop():
            monitor.step_ended()

    try:
        for name in ("cross_entropy", "nll_loss"):
            patch(F, name, lambda original: _loss(monitor, original))
        patch(torch.Tensor, "backward", lambda original: _backward(monitor, original))
        patch(torch.nn.Module, "train", lambda original: _mode(monitor, original))
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            patch(owner, "clip_grad_norm_", lambda original: _returns_norm(monitor, original))
        patch(torch.nn.utils, "get_total_norm", lambda original: _returns_norm(monitor, original))
        for name in ("scale", "unscale_", "step", "update"):
            patch(torch.amp.GradScaler, name, lambda original, n=name: _scaler(monitor, n, original))
        patch(dataloader.DataLoader, "__iter__", _tagged_iterator)
        iterator_base = dataloader_iterator_base()
        if iterator_base is not None:
            patch(iterator_base, "__next__", lambda original: _timed_next(monitor, original))
        # the schedulers torch makes without LRScheduler.__init__ (SequentialLR, ChainedScheduler,
        # ReduceLROnPlateau) and those whose step() does not go through LRScheduler.step
        making = [0]  # __init__s under way: the outermost one hands the finished scheduler over
        for cls in _scheduler_classes(lr_scheduler.LRScheduler):
            if "__init__" in cls.__dict__:
                patch(cls, "__init__", lambda original: _scheduler_init(monitor, original, making))
            if "step" in cls.__dict__:
                patch(cls, "step", lambda original: _scheduler_step(monitor, original))
        # every module's calls until the first step tells which module is the model (monitor._bind)
        everything = register_module_forward_pre_hook(lambda module, args: monitor.forward_called(module, args, {}))
        handles += [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post), everything]
        yield monitor
    finally:
        for handle in reversed(handles):
            handle.remove()
        patches.undo()


def _loss(monitor: Monitor, original: Callable) -> Callable:
    def loss(input, target, *args, **kwargs):
        out = original(input, target, *args, **kwargs)
        if isinstance(input, torch.Tensor):
            reduction = kwargs.get("reduction", args[_REDUCTION_AT - 2] if len(args) > _REDUCTION_AT - 2 else "mean")
            ignore = kwargs.get("ignore_index", args[_IGNORE_AT - 2] if len(args) > _IGNORE_AT - 2 else -100)
            if kwargs.get("reduce") is False or kwargs.get("size_average") is not None:
                reduction = "legacy"  # the legacy flags: leave the value as it is
            if reduction != "legacy":
                monitor.loss_called(out, input, target, reduction, ignore)
        return out

    return loss


def _backward(monitor: Monitor, original: Callable) -> Callable:
    def backward(self, *args, **kwargs):
        monitor.backward_called(self)
        return original(self, *args, **kwargs)

    return backward


def _mode(monitor: Monitor, original: Callable) -> Callable:
    """Module.train(mode), which eval() calls: the outermost call on the watched model, with its line (a
    few calls per evaluation, never per step)."""
    def heard(module, mode) -> None:
        if monitor.model is not None:
            monitor.mode_set(module, mode, call_site() or "")

    return outermost_mode_calls(original, heard)


def _returns_norm(monitor: Monitor, original: Callable) -> Callable:
    def measured(*args, **kwargs):
        # The parameters (or gradients) as a list, as clip_grad_norm_ makes them itself (an iterator is
        # read once either way), so that an empty one is seen: its 0 is not the gradients' norm.
        key = next((k for k in ("parameters", "tensors") if k in kwargs), None)
        given = args[0] if args else kwargs.get(key) if key else None
        if given is not None and not isinstance(given, torch.Tensor):
            given = list(given)
            args, kwargs = ((given, *args[1:]), kwargs) if args else (args, {**kwargs, key: given})
        norm = original(*args, **kwargs)
        if not (isinstance(given, list) and not given):
            monitor.clip_returned(norm)
        return norm

    return measured


def _scaler(monitor: Monitor, name: str, original: Callable) -> Callable:
    def scale(scaler, outputs):
        out = original(scaler, outputs)
        monitor.scale_called(scaler, out)
        return out

    def unscale_(scaler, optimizer):
        monitor.unscaled = True
        return original(scaler, optimizer)

    def step(scaler, optimizer, *args, **kwargs):
        before = len(monitor.series) + (monitor.pending is not None)
        out = original(scaler, optimizer, *args, **kwargs)
        watched = (monitor.main is None or optimizer is monitor.main
                   or getattr(optimizer, "optimizer", None) is monitor.main)
        if scaler_enabled(scaler) and watched and len(monitor.series) + (monitor.pending is not None) == before:
            if monitor.main is None:  # skipped before any step was seen: this is the watched optimizer
                monitor.main = getattr(optimizer, "optimizer", optimizer)
            monitor.step_ended(skipped=True)  # found inf/NaN: the optimizer step did not run
        return out

    def update(scaler, *args, **kwargs):
        out = original(scaler, *args, **kwargs)
        monitor.scale_updated(scaler)
        return out

    wrapper = {"scale": scale, "unscale_": unscale_, "step": step, "update": update}[name]
    return wrapper


def _tagged_iterator(original: Callable) -> Callable:
    def __iter__(loader):
        iterator = original(loader)
        try:
            iterator._tfdoctor_loader = loader  # the iterator keeps no reference to its loader
        except AttributeError:
            pass
        return iterator

    return __iter__


def _timed_next(monitor: Monitor, original: Callable) -> Callable:
    def __next__(iterator):
        started = time.perf_counter()
        batch = original(iterator)  # StopIteration at an epoch's end is no batch
        monitor.batch_waited(getattr(iterator, "_tfdoctor_loader", iterator), time.perf_counter() - started)
        return batch

    return __next__


def _scheduler_init(monitor: Monitor, original: Callable, making: list) -> Callable:
    def __init__(scheduler, *args, **kwargs):
        making[0] += 1
        try:
            original(scheduler, *args, **kwargs)
        finally:
            making[0] -= 1
        if not making[0]:
            monitor.scheduler_made(scheduler)

    return __init__


def _scheduler_step(monitor: Monitor, original: Callable) -> Callable:
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    def step(scheduler, *args, **kwargs):
        if not monitor.scheduler_depth and not scheduler_is_initial(scheduler):
            positional = 1 if isinstance(scheduler, ReduceLROnPlateau) else 0  # its metric comes first
            explicit = len(args) > positional or kwargs.get("epoch") is not None
            monitor.scheduler_stepped(scheduler, explicit)
        monitor.scheduler_depth += 1
        try:
            return original(scheduler, *args, **kwargs)
        finally:
            monitor.scheduler_depth -= 1

    return step


def _scheduler_classes(base: type) -> list[type]:
    """`base` and every subclass of it defined so far (torch's, and any a library defined at import)."""
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    return found

