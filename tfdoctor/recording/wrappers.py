"""The wrapper zoo in one place: which model a wrapper (DDP, FSDP1/FSDP2, torch.compile, accelerate,
a Lightning strategy) stands for, and which parameters are one rank's shard. Used by the script
recorder, the rank recorder, the FSDP2 unsharding and discovery alike.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from tfdoctor.usercode.torch_compat import compiled_inner, fsdp2_module_class

# Parameter classes whose value on a rank is that rank's shard (FSDP2 / tensor parallel, FSDP1).
SHARDED_CLASSES = {"DTensor", "FlatParameter"}


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside DDP / FSDP (`.module`), torch.compile (`._orig_mod`) and accelerate's
    wrappers, which forward to it."""
    seen = set()
    while id(module) not in seen:
        seen.add(id(module))
        inner = compiled_inner(module)
        if not isinstance(inner, torch.nn.Module):
            name = type(module).__name__
            inner = getattr(module, "module", None) if name in WRAPPERS else None
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner
    return module


# Wrappers whose `.module` is the model (a user's own module may also name a submodule `module`).
WRAPPERS = {"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "OptimizedModule"}


def lightning_module_on_stack() -> Optional[torch.nn.Module]:
    """The LightningModule whose hook is running the optimizer step (Lightning steps from inside
    `LightningModule.optimizer_step`), or None outside Lightning. Walked once, at the first step."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and any(
                c.__name__ == "LightningModule" and c.__module__.startswith(("lightning.", "pytorch_lightning."))
                for c in type(owner).__mro__):
            return owner
        frame = frame.f_back
    return None


def redirected(module: torch.nn.Module) -> bool:
    """Whether calling `module` runs Lightning's training_step rather than the model: a Lightning
    strategy that wraps the LightningModule (DDP, FSDP) calls training_step through the wrapper's
    forward, swapping the LightningModule's `forward` for one call (lightning.pytorch.strategies.
    strategy._ForwardRedirection). The model's own call comes inside, from training_step."""
    inner = getattr(module, "module", None) if type(module).__name__ in WRAPPERS else module
    forward = inner.__dict__.get("forward") if isinstance(inner, torch.nn.Module) else None
    return forward is not None and "_ForwardRedirection" in getattr(forward, "__qualname__", "")


def is_shard(p: torch.Tensor) -> bool:
    """A parameter whose value on this rank is only its shard (FSDP2's DTensors, FSDP1's flat parameters)."""
    return any(cls.__name__ in SHARDED_CLASSES for cls in type(p).__mro__)


def users_class(module: torch.nn.Module) -> type:
    """The class the user wrote: fully_shard puts an `FSDP<Class>` (and FSDPModule) in front of it."""
    cls, fsdp_module = type(module), fsdp2_module_class()
    if fsdp_module is None or not issubclass(cls, fsdp_module):
        return cls
    return next(c for c in cls.__mro__ if not issubclass(c, fsdp_module))
