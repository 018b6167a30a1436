"""Is the forward random? The same ids through the model twice under different RNG seeds, compared
on the logits and module by module (forward hooks), in eval() and, where the model declares dropout,
in train().

In eval() the two must agree: a difference comes from dropout that ignores the module's mode
(`F.dropout(x, p)`, whose `training` defaults to True) or another random op left in the forward. A
third run under the first seed tells randomness (it agrees with the first run) from state carried
between calls (it does not). In train() a model that declares dropout must give two different
forwards, else the dropout it declares is never applied.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from tfdoctor.modes import evaluation, training
from tfdoctor.probes.isolation import same_values
from tfdoctor.probes.process_state import _DROP_WORDS, DROPOUT_MODULES, preserved_process_state
from tfdoctor.tolerances import RELATIVE_TOLERANCE

# Words that name a dropout rate held as a float attribute: probes/process_state.py's list and GPT-2's
# `resid_pdrop` / `attn_pdrop` spelling, which nanoGPT-style models copy.
DROP_WORDS = _DROP_WORDS + ("pdrop",)


# train() forwards tried, each under its own seed, before "never random" is concluded. Elementwise
# dropout differs on the first pair; a per-row stochastic depth over the probe's 2 rows can agree on a
# pair. Whole-layer drops (LayerDrop) at small p keep every layer in most draws (p = 0.1 over 4 layers:
# 66% of draws), so no number of seeds settles them: the check does not judge those alone.
TRAIN_SEEDS = 4
# Rates that drop whole layers or rows rather than elements (see TRAIN_SEEDS).
LAYER_DROP_WORDS = ("layerdrop", "layer_drop", "drop_path", "stochastic_depth")


@dataclass
class Difference:
    """Two forwards of the same ids, compared."""

    max_abs: float  # largest |a - b| over the logits
    scale: float  # largest |logit| of the first run
    first_module: Optional[str] = None  # the first module, in the order modules finished, whose output differs
    origin: Optional[str] = None  # the module whose own forward code holds the random op (see _compared)
    modules_differing: int = 0
    modules_compared: int = 0

    @property
    def relative(self) -> float:
        if self.max_abs == 0:
            return 0.0
        return self.max_abs / self.scale if self.scale > 0 else float("inf")

    @property
    def differs(self) -> bool:
        return self.relative > RELATIVE_TOLERANCE

    def to_dict(self) -> dict:
        return {"max_abs_difference": self.max_abs, "largest_logit": self.scale, "relative": self.relative,
                "first_module": self.first_module, "origin": self.origin, "modules_differing": self.modules_differing,
                "modules_compared": self.modules_compared}


@dataclass
class Randomness:
    """What the probe measured."""

    eval_pair: Difference
    # eval(): the first seed again, against the first run; only run when the eval pair differs
    eval_same_seed: Optional[Difference] = None
    declared: list[str] = field(default_factory=list)  # "blocks.0.attn_drop: nn.Dropout(p=0.1)", ...
    train_pair: Optional[Difference] = None  # only run when dropout is declared
    train_seeds: int = 0  # train() forwards run, each under its own seed
    train_error: Optional[str] = None  # a train() forward that raised (the pair is then not measured)


def declared_dropout(model: torch.nn.Module, ran: Optional[set] = None) -> list[str]:
    """Every dropout the model's modules declare: dropout modules with p > 0, and float dropout rates
    (`self.dropout = 0.1`, `self.attention_dropout = config.attention_dropout`) held as attributes.
    Configs are not read: a config may name rates its model never uses (GPT-2's summary dropout).
    With `ran` (the names of the modules a forward ran, "(model)" for the root), only those: the
    speech encoder of a speech-and-text model declares dropout a text forward never reaches."""
    found = []
    for name, module in model.named_modules():
        if ran is not None and (name or "(model)") not in ran:
            continue
        where = name or type(module).__name__
        if isinstance(module, DROPOUT_MODULES) and module.p > 0:
            found.append(f"{where}: nn.{type(module).__name__}(p={module.p:g})")
        found.extend(f"{where}.{attr} = {value:g}" for attr, value in vars(module).items()
                     if isinstance(value, float) and value > 0 and any(word in attr.lower() for word in DROP_WORDS))
    return found


def first_tensor(output) -> Optional[torch.Tensor]:
    """The first floating-point tensor in what a module returned (a tensor, tuple, list or dict)."""
    if isinstance(output, torch.Tensor):  # a nested tensor (nn.TransformerEncoder's fast path) has no shape
        return output if output.is_floating_point() and not output.is_nested else None
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def _module_outputs(model: torch.nn.Module, into: list) -> Iterator[None]:
    """Append (module name, input tensor, output tensor) to `into` as each module finishes its forward
    (the input: the first floating tensor among its arguments, None when it takes none)."""

    def hook(name):
        def record(module, args, kwargs, output):
            out = first_tensor(output)
            if out is not None:
                given = first_tensor(list(args) + list(kwargs.values()))
                into.append((name, None if given is None else given.detach().clone(), out.detach().clone()))
        return record

    handles = [module.register_forward_hook(hook(name or "(model)"), with_kwargs=True)
               for name, module in model.named_modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return True
    if a.numel() == 0:  # an empty output (a routing module no token reached) has nothing to differ in
        return False
    a, b = a.float(), b.float()
    gap = (a - b).abs().nan_to_num(nan=float("inf")).max()
    return bool(gap > RELATIVE_TOLERANCE * a.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).max())


def _compared(first: tuple, second: tuple) -> Difference:
    (logits_a, modules_a), (logits_b, modules_b) = first, second
    a, b = logits_a.float(), logits_b.float()
    max_abs = float((a - b).abs().max()) if a.shape == b.shape and a.numel() else 0.0 if a.shape == b.shape \
        else float("inf")
    differing = [(name_a, x_in is not None and y_in is not None and _differ(x_in, y_in))
                 for (name_a, x_in, x), (name_b, y_in, y) in zip(modules_a, modules_b)
                 if name_a != name_b or _differ(x, y)]
    found = Difference(max_abs, float(a.abs().max()) if a.numel() else 0.0, modules_differing=len(differing),
                       modules_compared=min(len(modules_a), len(modules_b)))
    if differing:
        found.first_module, input_differs = differing[0]
        # Its input agreed: the random op is inside it. Its input already differed, yet no module that
        # finished earlier did: the op runs in the code of the module that encloses it.
        found.origin = found.first_module
        if input_differs:
            found.origin = found.first_module.rsplit(".", 1)[0] if "." in found.first_module else "(model)"
    return found


def _run(model: torch.nn.Module, forward: Callable[[], torch.Tensor], seed: int, hooks: bool) -> tuple:
    outputs: list = []
    torch.manual_seed(seed)
    with _module_outputs(model, outputs) if hooks else contextlib.nullcontext():
        logits = forward().detach().clone()
    return logits, outputs


@contextlib.contextmanager
def _buffers_kept(model: torch.nn.Module) -> Iterator[None]:
    """Put back every buffer's values afterwards (a train() forward moves BatchNorm's running
    statistics). Parameters need no copy: nothing here runs a backward or an optimizer."""
    saved = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                if not same_values(buffer, value):
                    buffer.copy_(value)



def measure_randomness(model: torch.nn.Module, forward: Callable[[], torch.Tensor], seed: int) -> Randomness:
    """Two eval() forwards under seeds `seed` and `seed + 1` (a third under `seed` when they differ);
    where the model declares dropout, train() forwards under `seed`, `seed + 1`, ... until two differ
    (TRAIN_SEEDS at most). No gradients; the RNG, the modes and the buffers (a train() forward moves
    BatchNorm's statistics) are put back."""
    with preserved_process_state(), torch.no_grad(), _buffers_kept(model):
        with evaluation(model):
            first = _run(model, forward, seed, hooks=True)
            measured = Randomness(_compared(first, _run(model, forward, seed + 1, hooks=True)))
            if measured.eval_pair.differs:
                measured.eval_same_seed = _compared(first, _run(model, forward, seed, hooks=True))
        measured.declared = declared_dropout(model, ran={name for name, _, _ in first[1]})
        if measured.declared:
            with training(model):
                try:
                    train_first = _run(model, forward, seed, hooks=False)
                    for offset in range(1, TRAIN_SEEDS):  # until one differs: layer-level drops often agree
                        measured.train_pair = _compared(train_first, _run(model, forward, seed + offset, hooks=False))
                        measured.train_seeds = offset + 1
                        if measured.train_pair.differs:
                            break
                except Exception as exc:  # a forward that refuses train() (Reformer's axial positions)
                    measured.train_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return measured
