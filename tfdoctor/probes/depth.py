"""How the signal travels through the stack of blocks at initialisation: per block, the scale (RMS)
of the residual stream it hands on and the norm of its parameters' gradient, from one forward and one
backward on random tokens; and the scale of the token and the position embeddings.

The stack is found by shape, as users and libraries write it: the nn.ModuleList / nn.Sequential whose
children (two or more, all of one class) hold the most parameters: Hugging Face `model.layers`, `h`,
`layer`, `block`; nanoGPT's `transformer.h`; nn.TransformerEncoder's `.layers`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn

from tfdoctor.probes.process_state import DropoutOff, preserved_process_state
from tfdoctor.probes.stochastic import first_tensor

# Containers: a child of these classes has no forward of its own to watch (x-transformers' layers
# are ModuleLists of [norms, block, residual]).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


class ModelRaised(Exception):
    """The model's own forward or backward raised: a model this probe cannot drive, not a crash of tfdoctor's."""

    def __init__(self, phase: str, error: Exception):
        from tfdoctor.errors import first_line

        self.phase, self.error = phase, error
        super().__init__(f"{phase} raised {first_line(error)}")


@dataclass
class Stack:
    name: str  # "transformer.h"
    blocks: list[tuple[str, nn.Module]]  # ("transformer.h.0", block), ...
    block_class: str


@dataclass
class DepthSignal:
    """What one forward and backward at initialisation showed."""

    stack: str
    block_class: str
    input_rms: Optional[float]  # the residual stream entering the first block
    output_rms: list[float]  # per block, in order
    grad_norms: list[float]  # per block: the norm of all its parameters' gradients
    calls: list[int]  # how often each block ran in the forward
    token_rms: Optional[float] = None  # RMS of the token embedding table
    position_rms: Optional[float] = None  # RMS of the learned position table, where there is one
    embeddings: dict = field(default_factory=dict)  # {"token": name, "position": name}
    mode: str = "eval"  # "train" (every dropout at 0) for a model whose backward refuses eval()
    trainable: int = 0  # the blocks' parameters that require grad
    input_at: str = ""  # where input_rms is read: the first block's input, or a norm of its own (RWKV's pre_ln)


def find_stack(model: nn.Module) -> Optional[Stack]:
    """The repeated blocks: among the ModuleLists and Sequentials whose children (two or more) are all
    of one non-container class, hold parameters and have submodules, the one holding the most parameters (then the
    longest, then the first)."""
    best, best_key = None, None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        classes = {type(child) for _, child in children}
        if len(children) < 2 or len(classes) != 1 or issubclass(next(iter(classes)), _CONTAINERS):
            continue
        sizes = [sum(p.numel() for p in child.parameters()) for _, child in children]
        if not all(sizes) or not any(True for _ in children[0][1].children()):
            continue  # a block holds weights and modules of its own; a list of bare Linear heads is not a stack
        key = (sum(sizes), len(children))
        if best_key is None or key > best_key:
            prefix = f"{name}." if name else ""
            best = Stack(name or "(model)", [(prefix + child_name, child) for child_name, child in children],
                         type(children[0][1]).__name__)
            best_key = key
    return best


def _rms(tensor: torch.Tensor) -> float:
    return float(tensor.detach().float().pow(2).mean().sqrt())


def first_block_norm(stack: Stack) -> Optional[tuple[str, nn.Module]]:
    """A norm the first block has and the second lacks, where the first block normalises the embeddings
    it is handed before its residual path (RWKV's `pre_ln`: embeddings drawn at ~1e-4 leave it at RMS 0.03,
    its eps 1e-5 outweighing their variance); the stream then enters the stack at that norm's output (when
    shaped like the block's output: a hybrid's extra q_norm is not the stream). None for alike blocks."""
    (prefix, first), (_, second) = stack.blocks[0], stack.blocks[1]
    others = {name for name, _ in second.named_modules()}
    return next(((f"{prefix}.{name}", module) for name, module in first.named_modules()
                 if name and name not in others and "norm" in type(module).__name__.lower()), None)


@contextlib.contextmanager
def _watched(stack: Stack, signal: dict) -> Iterator[None]:
    """Record each block's output RMS and call count, and the first block's input RMS."""

    entering: list[torch.Tensor] = []  # the first block's floating-point arguments, at its first call

    def on_output(index):
        def hook(module, args, output):
            tensor = first_tensor(output)
            signal["calls"][index] += 1
            if tensor is not None:
                signal["output"][index] = _rms(tensor)
                if index == 0 and signal["input"] is None and entering:
                    # the stream is the argument shaped like the output (not a float attention mask before it)
                    stream = next((t for t in entering if t.shape == tensor.shape), None if own_norm else entering[0])
                    signal["input"] = None if stream is None else _rms(stream)
        return hook

    def on_input(module, args, kwargs):
        if not entering:
            entering.extend(t for t in (first_tensor(a) for a in list(args) + list(kwargs.values())) if t is not None)

    def on_own_norm(module, args, output):
        tensor = first_tensor(output)
        if tensor is not None and not entering:
            entering.append(tensor)

    handles = [block.register_forward_hook(on_output(i)) for i, (_, block) in enumerate(stack.blocks)]
    own_norm = first_block_norm(stack)
    if own_norm is not None:
        handles.append(own_norm[1].register_forward_hook(on_own_norm))
    else:
        handles.append(stack.blocks[0][1].register_forward_pre_hook(on_input, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def embedding_tables(model: nn.Module, vocab_size: Optional[int],
                     called: Optional[set] = None) -> dict[str, tuple[str, torch.Tensor]]:
    """{"token": (name, weight), "position": (name, weight)} for the tables found: the token table is the
    model's input embedding (Hugging Face) or the first nn.Embedding with vocab_size rows; the position
    table is a learned nn.Embedding or parameter whose name says "pos" (nanoGPT's `wpe`) and whose width
    is the token table's and, with `called` (ids of the embeddings a forward ran), one the forward used
    (not a vision tower's beside a language model, Gemma 3); a fixed sinusoidal table (by its class
    name where its weight is left trainable, FSMT) (Pegasus, Marian: RMS 0.71 beside tokens at 0.02,
    which the model scales by sqrt(d_model) in its forward) is not drawn at init and not compared."""
    found: dict[str, tuple[str, torch.Tensor]] = {}
    names = {id(module): name for name, module in model.named_modules()}
    getter = getattr(model, "get_input_embeddings", None)
    try:
        token = getter() if callable(getter) else None
    except Exception:  # a model that does not say (NotImplementedError): found by shape below
        token = None
    if not isinstance(token, nn.Embedding):
        token = next((m for m in model.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == vocab_size),
                     None)
    if token is None:
        return found
    found["token"] = (names.get(id(token), "?"), token.weight)
    width = token.weight.shape[-1]
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if module is not token and isinstance(module, nn.Embedding) and (leaf == "wpe" or "pos" in leaf) \
                and module.weight.shape[-1] == width and module.weight.requires_grad \
                and "sinusoidal" not in type(module).__name__.lower() and (called is None or id(module) in called):
            found["position"] = (name, module.weight)
            return found
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1].lower()
        if param is not token.weight and "pos" in leaf and param.dim() >= 2 and param.shape[-1] == width \
                and param.requires_grad:
            found["position"] = (name, param)
            return found
    return found


def measure_depth(model: nn.Module, stack: Stack, loss: Callable[[], torch.Tensor],
                  vocab_size: Optional[int]) -> DepthSignal:
    """One forward and one backward of `loss()` with dropout off (eval(), or train() with every dropout
    at 0 where the backward refuses eval()). Gradients come from torch.autograd.grad, so no .grad is
    touched; the RNG, grad mode and the modes are put back."""
    count = len(stack.blocks)
    signal = {"input": None, "output": [math.nan] * count, "calls": [0] * count}
    params = [[p for p in block.parameters() if p.requires_grad] for _, block in stack.blocks]
    flat = [p for group in params for p in group]

    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    called: set = set()

    def step():
        signal.update(input=None, output=[math.nan] * count, calls=[0] * count)
        called.clear()
        handles = [m.register_forward_hook(lambda module, args, out: called.add(id(module))) for m in embeddings]
        try:
            with _watched(stack, signal):
                value = loss()
        finally:
            for handle in handles:
                handle.remove()
        try:
            return torch.autograd.grad(value, flat, allow_unused=True) if flat else ()
        except Exception as exc:  # the model's own backward (xLSTM's chunkwise kernel edits its state in place)
            raise ModelRaised("backward", exc) from exc

    own = first_block_norm(stack)
    with preserved_process_state(), torch.enable_grad(), DropoutOff(model) as off:
        grads = off.step(step)
    norms, at = [], 0
    for group in params:
        squares = [float(g.detach().float().pow(2).sum()) for g in grads[at:at + len(group)] if g is not None]
        norms.append(math.sqrt(sum(squares)))
        at += len(group)
    tables = embedding_tables(model, vocab_size, called)
    with torch.no_grad():
        rms = {role: _rms(weight) for role, (_, weight) in tables.items()}
    return DepthSignal(stack.name, stack.block_class, signal["input"], signal["output"], norms, signal["calls"],
                       rms.get("token"), rms.get("position"), {role: name for role, (name, _) in tables.items()},
                       off.mode, len(flat), own[0] if own else f"{stack.blocks[0][0]} (its input)")
