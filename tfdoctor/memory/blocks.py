"""How the traced step walks the user's model: its top-level blocks (the layers checkpointing would wrap),
the module each op runs in, and its tensors swapped for fake ones for the length of the trace.

Imports torch; the analytic mode never imports this module.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.nn as nn


def top_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of every nn.ModuleList not inside another such child: the layers of nearly
    every Transformer (an encoder-decoder has two lists), not the heads or experts within a layer."""
    found: list[tuple[str, nn.Module]] = []
    for name, holder in model.named_modules():
        if not isinstance(holder, nn.ModuleList):
            continue
        if any(name == root or name.startswith(root + ".") for root, _ in found):
            continue
        for index, block in enumerate(holder):
            found.append((f"{name}.{index}" if name else str(index), block))
    return found


def block_map(model: nn.Module) -> dict[str, int]:
    """Every module name inside a top-level block -> the block's index."""
    mapping: dict[str, int] = {}
    for index, (root, block) in enumerate(top_blocks(model)):
        for sub_name, _ in block.named_modules():
            mapping[f"{root}.{sub_name}" if sub_name else root] = index
    return mapping


@contextlib.contextmanager
def module_stack(model: nn.Module, counter) -> Iterator[None]:
    """counter (counter.LiveBytes) keeps the forward module stack; a top-level block's output is reported to it."""
    names = {id(m): name for name, m in model.named_modules() if name}
    roots = {id(block): index for index, (_, block) in enumerate(top_blocks(model))} if counter.block_of else {}

    def push(module, args):
        name = names.get(id(module))
        if name is not None:
            counter.modules.append(name)

    def pop(module, args, output):
        name = names.get(id(module))
        if name is not None and counter.modules and counter.modules[-1] == name:
            counter.modules.pop()
        index = roots.get(id(module))
        if index is not None and counter.phase == "forward":
            counter.block_returned(index, output)

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(push), register_module_forward_hook(pop)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        counter.modules.clear()


@contextlib.contextmanager
def swapped_tensors(model: nn.Module, convert) -> Iterator[list[nn.Parameter]]:
    """Every parameter and buffer of `model` replaced by `convert(tensor)` for the block, sharing
    kept (a tied weight stays one tensor), and the originals put back in `finally`."""
    saved: list[tuple[dict, str, Any]] = []
    made: dict[int, Any] = {}
    params: list[nn.Parameter] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    saved.append((table, name, tensor))
                    if id(tensor) not in made:
                        new = convert(tensor.detach())
                        if isinstance(tensor, nn.Parameter):
                            new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                            params.append(new)
                        made[id(tensor)] = new
                    table[name] = made[id(tensor)]
        yield params
    finally:
        for table, name, tensor in reversed(saved):
            table[name] = tensor


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module) -> Iterator[int]:
    """Wrap each top-level block (see top_blocks) in non-reentrant activation checkpointing for the
    block; the instance attribute goes in `finally`. The bench traces this to hold the derived
    checkpointing peak to account."""
    from torch.utils.checkpoint import checkpoint

    wrapped = []
    try:
        for _, block in top_blocks(model):
            original = block.forward

            def forward(*args, _original=original, **kwargs):
                return checkpoint(_original, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

            block.forward = forward
            wrapped.append(block)
        yield len(wrapped)
    finally:
        for block in wrapped:
            del block.forward
