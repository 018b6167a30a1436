"""A whole, plain copy of a model sharded with FSDP2 (`fully_shard`), so that the model checks can run
it on rank 0 alone.

A sharded model holds DTensor shards and runs only with every rank taking part in its all-gathers,
and FSDP2 refuses `copy.deepcopy`. At the model's first call every rank is at the same point of the
same program, so each parameter's `full_tensor()` (an all-gather) is called by all of them in the
same order; the module tree is then rebuilt from the classes the user wrote (FSDP2 puts
`FSDP<Class>` in front of each), with those whole tensors and without FSDP's hooks.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from tfdoctor.recording.wrappers import users_class
from tfdoctor.usercode.torch_compat import MODULE_HOOK_TABLES, dtensor_class, is_fsdp2_bookkeeping

# Every rank gathers the whole weights once, and rank 0 keeps them: beyond this size (a model sharded
# because it does not fit one device) the model checks skip instead.
MAX_UNSHARDED_BYTES = 2 << 30


class TooLarge(Exception):
    pass


def sharded_bytes(model: torch.nn.Module) -> int:
    """The whole model's parameter bytes (a DTensor reports its global shape)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def unsharded_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model as plain modules holding whole tensors. A collective: every rank must call it at the
    same point. TooLarge (before any collective, the same on every rank) above MAX_UNSHARDED_BYTES."""
    dtensor = dtensor_class()
    size = sharded_bytes(model)
    if size > MAX_UNSHARDED_BYTES:
        raise TooLarge(size)

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if dtensor is not None and isinstance(t, dtensor) else t).detach().clone()

    parameters: dict[int, torch.nn.Parameter] = {}
    for p in model.parameters():  # the same order on every rank: one all-gather each
        parameters[id(p)] = torch.nn.Parameter(whole(p), requires_grad=p.requires_grad)
    made: dict[int, torch.nn.Module] = {}

    def plain(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in made:  # a module used twice stays one module
            return made[id(module)]
        cls = users_class(module)
        copy = cls.__new__(cls)
        made[id(module)] = copy
        # the hook tables emptied: FSDP2 registers its all-gathers and reduce-scatters there
        state = {k: v for k, v in vars(module).items() if not is_fsdp2_bookkeeping(k)}
        state.update({name: OrderedDict() for name in MODULE_HOOK_TABLES if name in state})
        state["_parameters"] = {k: None if v is None else parameters[id(v)] for k, v in module._parameters.items()}
        state["_buffers"] = {k: None if v is None else whole(v) for k, v in module._buffers.items()}
        state["_modules"] = {k: None if v is None else plain(v) for k, v in module._modules.items()}
        copy.__dict__.update(state)
        return copy

    return plain(model)
