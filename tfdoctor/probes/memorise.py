"""Memorise one batch: train a private copy of the model on it with one optimizer after another, and
know the loss the model's measured context allows (overfit-batch without --train).

- `trainable_copy`: the model copied for training; a module holding a non-leaf tensor (an attention
  map kept from the last forward, as The Annotated Transformer's `self.attn`, or old-style
  weight_norm's computed weight) cannot be deep-copied, so those tensors are copied detached.
- `plans`: the optimizers tried, in order: the script's own (recorded under `tfdoctor run`, at its
  base rate and hyperparameters), then AdamW at the rates a user would try, downwards.
- `memorise`: one attempt; dropout off (eval(), or train() with every dropout at p=0 for a model
  whose backward refuses eval()).
- `context_floor`: the loss a model that reads only some of its past tokens can reach on the batch
  (a bigram model reads only its current token: its floor is H(next | current) on the batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from tfdoctor.probes.isolation import isolated_copy
from tfdoctor.probes.loss import LMBatch, lm_loss
from tfdoctor.probes.process_state import DropoutOff
from tfdoctor.subject import Subject, call
from tfdoctor.tasks import pooled
from tfdoctor.usercode.torch_compat import adam_update

# AdamW rates tried one after another until one memorises: tfdoctor's own, then what a user would
# try next. x-transformers' enwik8 model stalls at 4.5 nats at 3e-3 and memorises in 7 steps at 3e-4.
ADAMW_RATES = (3e-3, 1e-3, 3e-4)
# A loss that fell by this share over the last this many steps is still being learned: the attempt
# goes on past its steps (a tiny Inkling falls 6.24 -> 0.69 in 300 steps at 3e-3, ~1% a step at the
# end; a model that cannot read its tokens sits on a plateau).
FALLING_WINDOW = 50
FALLING_SHARE = 0.1


@dataclass
class Plan:
    label: str  # "AdamW lr 3e-03", "your AdamW (lr 6e-04, weight_decay 0.1)"
    lr: float
    build: Callable[[list], torch.optim.Optimizer | AdamW]
    recorded: bool = False  # the script's own optimizer


@dataclass
class Attempt:
    plan: Plan
    steps: int = 0  # the most steps it was allowed
    curve: list[float] = field(default_factory=list)
    mode: str = "eval"  # how dropout was switched off: eval(), or train() with every dropout at p=0
    out_of_time: bool = False
    detached: bool = False  # the loss did not require grad after a forward with gradients on
    # A pooled head's rows that ended with the same scores although their labels differ (row, row): no
    # rate can fit both (MobileBERT's tiny classifier: its tanh pooler saturates, every unit at +-1).
    collapsed: list[tuple[int, int]] = field(default_factory=list)

    @property
    def best(self) -> float:
        finite = [v for v in self.curve if math.isfinite(v)]
        return min(finite) if finite else float("nan")


def _non_leaf(value) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_leaf


def _held(value) -> list:
    """The tensors an attribute holds: itself, or the items of a list, tuple or dict."""
    return (list(value.values()) if isinstance(value, dict)
            else list(value) if isinstance(value, (list, tuple)) else [value])


@contextlib.contextmanager
def detached_attributes(model: torch.nn.Module) -> Iterator[int]:
    """For the block, every non-leaf tensor a module holds as a plain attribute (directly or in a
    list, tuple or dict) is replaced by its detached self, which deepcopy accepts; then put back.
    Yields how many were replaced."""
    swapped: list[tuple[dict, str, object]] = []
    count = 0
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            held = _held(value)
            if not any(_non_leaf(v) for v in held):
                continue
            count += sum(_non_leaf(v) for v in held)
            if isinstance(value, dict):
                new = {k: v.detach() if _non_leaf(v) else v for k, v in value.items()}
            elif isinstance(value, (list, tuple)):
                new = type(value)(v.detach() if _non_leaf(v) else v for v in value)
            else:
                new = value.detach()
            swapped.append((module.__dict__, name, value))
            module.__dict__[name] = new
    try:
        yield count
    finally:
        for owner, name, value in reversed(swapped):
            owner[name] = value


def isolated_trainable_copy(model: torch.nn.Module) -> torch.nn.Module:
    """isolation.isolated_copy (function attributes rebuilt on the copy) of a model that may hold
    non-leaf tensors kept from a forward (copied detached)."""
    with detached_attributes(model):
        return isolated_copy(model)[0]


def trainable_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, Optional[str]]:
    """A deep copy of `model` whose function attributes call the copy (isolation.isolated_copy: a forward
    wrapped as `model.forward = wrapper` around `original = model.forward`, TRL's fused LM head, would
    otherwise train the original's weights and leave the copy's still), and a note when non-leaf
    tensors it holds had to be copied detached."""
    with detached_attributes(model) as detached:
        clone = isolated_copy(model)[0]
    note = (f"{detached} non-leaf tensor(s) the model holds as attributes (kept from a forward) were "
            "copied detached" if detached else None)
    return clone, note


def _hyperparameters(cls, group: dict) -> dict:
    """The recorded group's values that the optimizer's constructor takes by name."""
    accepted = inspect.signature(cls.__init__).parameters
    out = {}
    for name, value in group.items():
        if name in ("params", "lr") or name not in accepted or isinstance(value, str):
            continue
        out[name] = tuple(value) if isinstance(value, list) else value
    return out


def recorded_plan(recorded: Optional[tuple[str, dict]]) -> Optional[Plan]:
    """The script's first optimizer as recorded by `tfdoctor run`, given as (its class name, its first
    param group's hyperparameters) (torch.optim classes only), at the base rate of that group (a
    scheduler's initial_lr, else the rate at the stop point)."""
    if recorded is None:
        return None
    class_name, group = recorded
    cls = getattr(torch.optim, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.LBFGS:
        return None
    lr = group.get("initial_lr", group.get("lr"))
    if not isinstance(lr, (int, float)) or not lr > 0:
        return None
    kwargs = _hyperparameters(cls, group)
    shown = ", ".join(f"{k} {v:g}" for k, v in kwargs.items() if k == "weight_decay")
    label = f"your {cls.__name__} (lr {lr:.0e}{', ' + shown if shown else ''})"
    return Plan(label, float(lr), lambda params: cls(params, lr=float(lr), **kwargs), recorded=True)


class AdamW:
    """torch.optim.AdamW's update at its defaults (betas 0.9 / 0.999, eps 1e-8), here without weight
    decay, written out with foreach ops (torch_compat.adam_update). Why not torch.optim's: constructing
    the process's first torch.optim optimizer imports TorchDynamo (Optimizer methods are wrapped in a
    lazy disable-dynamo decorator), which takes about as long as `import torch` itself, and `check`
    makes no other optimizer. The same arithmetic as torch's single-tensor AdamW, step for step; every
    parameter gets a gradient at every step here (one model, one batch), so one step count serves."""

    def __init__(self, params: list, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.params, self.lr, self.betas, self.eps = list(params), lr, betas, eps
        self.steps = 0
        self.state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        params = [p for p in self.params if p.grad is not None]
        if not params:
            return
        for p in params:
            if id(p) not in self.state:
                self.state[id(p)] = (torch.zeros_like(p), torch.zeros_like(p))
        grads = [p.grad for p in params]
        means, squares = [self.state[id(p)][0] for p in params], [self.state[id(p)][1] for p in params]
        self.steps += 1
        adam_update(params, grads, means, squares, self.lr, self.betas, self.eps, self.steps)


def plans(recorded: Optional[tuple[str, dict]] = None) -> list[Plan]:
    """The optimizers to memorise with: the script's own first (see recorded_plan), then AdamW's rates."""
    out = [p for p in [recorded_plan(recorded)] if p is not None]
    for rate in ADAMW_RATES:
        out.append(Plan(f"AdamW lr {rate:.0e}", rate, lambda params, rate=rate: AdamW(params, lr=rate)))
    return out


def still_falling(curve: list[float]) -> bool:
    """The loss fell by at least FALLING_SHARE over the last FALLING_WINDOW steps: it is learning."""
    return len(curve) > FALLING_WINDOW and curve[-1] < (1 - FALLING_SHARE) * curve[-1 - FALLING_WINDOW]


def memorise(subject: Subject, model: torch.nn.Module, batch: LMBatch, plan: Plan, goal: float, steps: int,
             exceeded: Callable[[], bool], advance: Callable[[int], None], extra: int = 0) -> Attempt:
    """Train `model` (a private copy) on `batch` with `plan`'s optimizer until the loss is under
    `goal`, `steps` losses are measured (up to `extra` more while the loss is still falling), the
    loss is non-finite or the budget is spent."""
    attempt = Attempt(plan, steps)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = plan.build(params)
    clone = dataclasses.replace(subject, model=model)

    def forward_backward() -> tuple[torch.Tensor, float]:
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(clone, batch)
        value = float(loss.detach())
        if loss.requires_grad and math.isfinite(value) and value >= goal:
            loss.backward()
        return loss, value

    with DropoutOff(model) as dropout_off, torch.enable_grad():
        for step in range(steps + extra):
            if step >= steps and not still_falling(attempt.curve):
                break
            loss, value = dropout_off.step(forward_backward)
            attempt.mode = dropout_off.mode
            attempt.curve.append(value)
            advance(1)
            if not math.isfinite(value) or value < goal:
                break
            if not loss.requires_grad:
                attempt.detached = True
                break
            if exceeded():
                attempt.out_of_time = True
                break
            optimizer.step()
        if attempt.curve and attempt.curve[-1] >= goal and pooled(subject.task):
            attempt.collapsed = collapsed_rows(clone, batch)
    return attempt


# Two rows' scores are one output when they differ by less than this share of the scores' scale.
COLLAPSED_SHARE = 1e-6


def collapsed_rows(subject: Subject, batch: LMBatch) -> list[tuple[int, int]]:
    """Pairs of rows whose labels differ but whose scores ([B, C], one row each) are the same."""
    with torch.no_grad():
        scores = call(subject, *batch.inputs).float().reshape(batch.targets.shape[0], -1).cpu()
    labels = batch.targets.reshape(batch.targets.shape[0], -1).cpu()
    tolerance = COLLAPSED_SHARE * max(float(scores.abs().max()), 1e-30)
    return [(i, j) for i in range(len(scores)) for j in range(i + 1, len(scores))
            if not torch.equal(labels[i], labels[j]) and float((scores[i] - scores[j]).abs().max()) <= tolerance]


def context_offsets(depends: torch.Tensor) -> Optional[list[int]]:
    """The offsets i - j of the past tokens j output i reads, from a dependency map (T, T) bool;
    None when it reads a later token (not causal) or no token at all (nothing to floor)."""
    pairs = depends.nonzero().tolist()
    offsets = sorted({i - j for i, j in pairs})
    if not offsets or offsets[0] < 0:
        return None
    return offsets


def context_floor(inputs: torch.Tensor, targets: torch.Tensor, offsets: list[int]) -> float:
    """H(target | the input tokens at `offsets` before it), in nats per graded token, on the batch:
    the lowest mean cross-entropy a model reading only those tokens can reach on it."""
    ids, targets = inputs.tolist(), targets.tolist()
    counts: dict[tuple, Counter] = defaultdict(Counter)
    for row, graded in zip(ids, targets):
        for t, target in enumerate(graded):
            if target == -100:
                continue
            # A position near the row's start reads fewer tokens: it is told apart by how many.
            key = tuple(row[t - o] if t - o >= 0 else -1 for o in offsets)
            counts[key][target] += 1
    total = sum(sum(c.values()) for c in counts.values())
    nats = 0.0
    for c in counts.values():
        n = sum(c.values())
        nats -= sum(k * math.log(k / n) for k in c.values())
    return nats / total if total else 0.0
