"""The loop trains a copy, and the user's model must come out as it went in.

`isolated_copy(model)` is copy.deepcopy with the function attributes of its modules (minGPT's `mlpf`
lambda, a wrapper holding the original's forward) rebuilt to call the copy's submodules;
`guarded(model)` snapshots the user's model and puts back whatever a loop still changed through the
copy. Used by the loop recorders and by the memorisation probe.
"""

from __future__ import annotations

import contextlib
import copy
import types
from typing import Iterator

import torch


def _rebound(value, memo: dict, done: dict):
    """`value` with what deepcopy copied replaced by its copy (memo: id(original) -> copy) and every
    function in it rebuilt the same way. Functions are atomic to deepcopy, so a lambda attribute that
    captured submodules (minGPT's `self.mlpf = lambda x: m.c_proj(...)`) still calls the original's.
    Returns `value` itself when nothing in it had to change."""
    copied = memo.get(id(value))
    if copied is not None and copied is not value and value is not memo:
        return copied
    if isinstance(value, types.FunctionType):
        return _rebound_function(value, memo, done)
    if isinstance(value, types.MethodType):  # `original = model.forward` kept by a wrapper (TRL's fused head)
        func, owner = _rebound(value.__func__, memo, done), memo.get(id(value.__self__), value.__self__)
        return value if func is value.__func__ and owner is value.__self__ else types.MethodType(func, owner)
    if callable(value) and hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
        return _rebound_callable(value, memo, done)  # a wrapper object (accelerate's ConvertOutputsToFp32)
    if type(value) in (list, tuple):
        items = [_rebound(v, memo, done) for v in value]
        changed = any(a is not b for a, b in zip(items, value))
        return type(value)(items) if changed else value
    if type(value) is dict:
        items = {k: _rebound(v, memo, done) for k, v in value.items()}
        return items if any(items[k] is not value[k] for k in value) else value
    return value


def _rebound_function(fn: types.FunctionType, memo: dict, done: dict):
    if id(fn) in done:
        return done[id(fn)]
    done[id(fn)] = fn  # a function that reaches itself keeps itself until it is rebuilt
    cells = fn.__closure__ or ()
    contents = []
    for cell in cells:
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # an empty cell (a name not yet bound)
            contents.append(cell)
    mapped = [c if c is cell else _rebound(c, memo, done) for c, cell in zip(contents, cells)]
    defaults = fn.__defaults__ or ()
    new_defaults = tuple(_rebound(d, memo, done) for d in defaults)
    kwdefaults = fn.__kwdefaults__ or {}
    new_kwdefaults = {k: _rebound(v, memo, done) for k, v in kwdefaults.items()}
    if (all(a is b for a, b in zip(mapped, contents)) and all(a is b for a, b in zip(new_defaults, defaults))
            and all(new_kwdefaults[k] is v for k, v in kwdefaults.items())):
        return fn
    new_cells = tuple(cell if c is cell else types.CellType(c) for c, cell in zip(mapped, cells))
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, new_defaults or None, new_cells or None)
    new.__kwdefaults__ = new_kwdefaults or None
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    done[id(fn)] = new
    return new


def _rebound_callable(obj, memo: dict, done: dict):
    """A shallow copy of a callable object whose attributes had to be rebuilt (a forward wrapper
    holding the function it wraps), else `obj` itself."""
    if id(obj) in done:
        return done[id(obj)]
    done[id(obj)] = obj
    attrs = vars(obj)
    new_attrs = {k: _rebound(v, memo, done) for k, v in attrs.items()}
    if all(new_attrs[k] is v for k, v in attrs.items()):
        return obj
    try:  # not copy.copy: accelerate's wrapper refuses to be pickled, which copy.copy asks of it
        new = object.__new__(type(obj))
        new.__dict__.update(new_attrs)
    except Exception:  # an object with state outside its __dict__ keeps calling the original's
        return obj
    done[id(obj)] = new
    return new


def isolated_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, list[str]]:
    """copy.deepcopy(model), with the function attributes of its modules (and their hook tables)
    rebuilt to call the copy's submodules. Returns the copy and the attributes rebuilt."""
    memo: dict = {}
    clone = copy.deepcopy(model, memo)
    done: dict = {}
    rebuilt = []
    for name, module in clone.named_modules():
        for attr, value in list(vars(module).items()):
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            new = _rebound(value, memo, done)
            if new is not value:
                module.__dict__[attr] = new
                rebuilt.append(f"{name}.{attr}" if name else attr)
            elif isinstance(value, dict) and attr.startswith("_"):  # hook tables: rebuilt in place
                for key, hook in list(value.items()):
                    new_hook = _rebound(hook, memo, done)
                    if new_hook is not hook:
                        value[key] = new_hook
                        rebuilt.append(f"{name}.{attr}" if name else attr)
    return clone, sorted(set(rebuilt))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else (a == b)).all())


@contextlib.contextmanager
def guarded(model: torch.nn.Module) -> Iterator[list[str]]:
    """Snapshot `model` (parameters, buffers, gradients, train/eval flags); on exit put back whatever
    changed and list its names in the yielded list. The loop trains a copy, so normally nothing does;
    a copy that still shares tensors with the original (a module reached through a closure that
    could not be rebuilt) would otherwise leave the user's weights trained and gradients on them."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    with torch.no_grad():
        saved = [(name, t, t.detach().clone(), t.grad,
                  None if t.grad is None else t.grad.detach().clone()) for name, t in tensors]
    flags = [(m, m.training) for m in model.modules()]
    changed: list[str] = []
    try:
        yield changed
    finally:
        with torch.no_grad():
            for name, t, value, grad, grad_value in saved:
                moved = not same_values(t.detach(), value)
                if moved:
                    t.copy_(value)
                if isinstance(t, torch.nn.Parameter) and (t.grad is not grad or (
                        grad is not None and not same_values(grad, grad_value))):
                    if grad is not None:
                        grad.copy_(grad_value)
                    t.grad = grad
                    moved = True
                if moved:
                    changed.append(name)
        for module, training in flags:
            module.training = training
