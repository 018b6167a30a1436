"""Feed a training loop one batch over and over, watch its loss, and replay its optimizer with a
correct loss, to tell a loop that cannot learn from one whose schedule does not let it learn yet.
Measures only: `overfit_loop` returns an OverfitRun and `replay` a loss curve; overfit-batch
(tfdoctor/checks/learning.py) judges them.

- `Feed` (recording/loop.py, the one `check --train` records with too): the batches as a list that
  stops handing them out once told to (the loss has already fallen far enough, or the check's time
  budget is spent) by raising `FeedStopped` out of the loop. Ending
  the iteration early instead would make it disagree with len(): a loop that draws
  `len(batches) // k` times from one iterator would get StopIteration from its own next().
- `StepLog`: a global optimizer-step pre-hook. At every step of every optimizer the loop steps it
  records the rate of each param group and which parameters carry a non-zero gradient. At the first
  step it copies the model as it is then (built and frozen the way the loop wants, not yet updated)
  and, at each optimizer's first step, the optimizer itself (class, groups, hyperparameters and any
  attribute it holds, with empty state) bound to that copy. Nothing is patched.
- `overfit_loop`: drives the user's loop on a copy of the model with a Feed of one batch and a StepLog
  installed, measuring the next-token loss on that batch every few batches: an `OverfitRun`.
- `replay`: trains the copy with the copied optimizers at the recorded rates, one update per update
  the loop made, on the same batch with the plain next-token loss: what the loop's own update rule
  and schedule allow a correct loss to reach.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import random
import sys
import warnings
from typing import Callable, Iterator, Optional

import torch

from tfdoctor.probes.isolation import guarded
from tfdoctor.probes.loss import LMBatch, eval_loss, lm_batch_of, lm_loss
from tfdoctor.probes.memorise import isolated_trainable_copy
from tfdoctor.probes.process_state import DropoutOff
from tfdoctor.recording.loop import Feed, train_batches
from tfdoctor.subject import Subject


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed every generator a user's loop may draw from (torch, Python's random, NumPy when it is
    loaded) for the block, then put each back: the same --seed gives the same run in every process."""
    python_state = random.getstate()
    torch_state = torch.random.get_rng_state()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    random.seed(seed)
    torch.manual_seed(seed)
    if numpy is not None:
        numpy.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(python_state)
        torch.random.set_rng_state(torch_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _copy_optimizer(optimizer: torch.optim.Optimizer, memo: dict) -> torch.optim.Optimizer:
    """The optimizer with every attribute deep-copied and its parameters swapped for the reference
    model's (`memo` maps id(loop tensor) to the copy). Copied through __dict__, not __getstate__,
    which keeps only defaults, state and groups and would drop what a custom optimizer adds.

    Instance attributes that shadow the class's methods are left out: an LR scheduler replaces
    `optimizer.step` with a wrapper that calls the original optimizer through a weak reference, so a
    copy of it would step the loop's parameters, not the copy's."""
    own = {k: v for k, v in optimizer.__dict__.items() if not (callable(v) and hasattr(type(optimizer), k))}
    clone = object.__new__(type(optimizer))
    clone.__dict__.update(copy.deepcopy(own, dict(memo)))
    return clone


class StepLog:
    """What a loop's optimizers did, step by step, and what is needed to replay it (see module doc)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.steps: list[tuple[int, list[float]]] = []  # (optimizer index, rate of each param group)
        self.optimizers: list[torch.optim.Optimizer] = []  # the loop's, in order of first step
        self.copies: list[torch.optim.Optimizer] = []  # the same, bound to `reference`
        self.reference: Optional[torch.nn.Module] = None  # the model at the loop's first step
        self.memo: dict[int, torch.Tensor] = {}
        self.with_grad: set[int] = set()  # ids of the loop's parameters that had a non-zero gradient
        self.params: set[int] = set()  # ids of the loop's parameters some optimizer steps

    @contextlib.contextmanager
    def installed(self) -> Iterator["StepLog"]:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        handle = register_optimizer_step_pre_hook(self._pre)
        try:
            yield self
        finally:
            handle.remove()

    def _pre(self, optimizer, args, kwargs) -> None:
        index = next((i for i, known in enumerate(self.optimizers) if known is optimizer), None)
        if index is None:
            if self.reference is None:
                self._copy_model()
            self.optimizers.append(optimizer)
            self.copies.append(_copy_optimizer(optimizer, self.memo))
            index = len(self.optimizers) - 1
        self.steps.append((index, [float(group["lr"]) for group in optimizer.param_groups]))
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.params.add(id(p))
                # Checked until seen once: normally every parameter is seen at the first step, so
                # this costs one pass over the gradients for the whole run.
                if id(p) not in self.with_grad and p.grad is not None and bool(p.grad.detach().ne(0).any()):
                    self.with_grad.add(id(p))

    def _copy_model(self) -> None:
        self.reference = isolated_trainable_copy(self.model)  # an attention map kept from a forward included
        pairs = list(zip(self.model.parameters(), self.reference.parameters()))
        pairs += list(zip(self.model.buffers(), self.reference.buffers()))
        self.memo = {id(mine): theirs for mine, theirs in pairs}
        for p in self.reference.parameters():
            p.grad = None

    def iterations(self) -> list[list[tuple[int, list[float]]]]:
        """The steps grouped into training iterations: an iteration ends when an optimizer that
        already stepped in it steps again (two optimizers stepped after one backward, as Muon with
        AdamW is, make one iteration)."""
        out: list[list[tuple[int, list[float]]]] = []
        current: list[tuple[int, list[float]]] = []
        for index, rates in self.steps:
            if any(index == i for i, _ in current):
                out.append(current)
                current = []
            current.append((index, rates))
        if current:
            out.append(current)
        return out

    def peak_rate(self) -> float:
        return max((max(rates) for _, rates in self.steps if rates), default=0.0)

    def rate_curve(self) -> list[float]:
        """The largest rate over param groups and optimizers at each iteration."""
        return [max((max(rates) for _, rates in it if rates), default=0.0) for it in self.iterations()]


@dataclasses.dataclass
class OverfitRun:
    """What the user's loop did with one batch fed over and over, on a copy of the model."""

    batch: LMBatch  # the batch, as the next-token loss reads it
    batch_shape: list[int]  # the token ids' shape, as the loop was fed them
    start: float  # the next-token loss on the batch before the loop ran
    final: float  # ... once the loop stopped
    probes: list[list[float]]  # [batches handed out, loss] at each measurement
    handed: int  # batches the loop took
    learned: bool  # stopped early: `learned(loss, start)` held at a measurement
    out_of_time: bool  # stopped because the time budget was spent
    log: StepLog  # the loop's optimizer steps (for replay)
    weights_changed: Optional[bool]  # measured only when the loop took no optimizer step, else None


def overfit_loop(subject: Subject, batches: int, probe_every: int, learned: Callable[[float, float], bool],
                 exceeded: Callable[[], bool], advance: Callable[[int], None], seed: int) -> OverfitRun:
    """Feed `subject.train` one random batch up to `batches` times on a copy of the model (the user's
    stays as it was), measuring the next-token loss on it (one forward, dropout off) every
    `probe_every` batches: the feed stops once `learned(loss, start)` holds or `exceeded()` says the
    time budget is spent."""
    model = isolated_trainable_copy(subject.model)
    for p in model.parameters():
        p.grad = None
    raw = train_batches(subject, 1, torch.Generator().manual_seed(seed + 2))[0]
    batch = lm_batch_of(subject, raw)
    start = eval_loss(subject, model, batch)
    probes: list[list[float]] = [[0, start]]
    state = {"out_of_time": False, "learned": False}

    def before(handed: int) -> bool:
        if exceeded():
            state["out_of_time"] = True
            return False
        if handed and handed % probe_every == 0:
            probes.append([handed, eval_loss(subject, model, batch)])
            if learned(probes[-1][1], start):
                state["learned"] = True
                return False
        advance(1)
        return True

    feed = Feed([raw] * batches, lambda index, handed: before(handed))
    log = StepLog(model)
    with guarded(subject.model), seeded(seed), warnings.catch_warnings(), log.installed(), torch.enable_grad():
        warnings.simplefilter("ignore")
        feed.drive(subject.train, model)
    advance(max(0, batches - feed.handed))
    final = probes[-1][1] if state["learned"] else eval_loss(subject, model, batch)
    if not state["learned"]:
        probes.append([feed.handed, final])
    changed = None
    if not log.steps:
        changed = any(not torch.equal(a.detach(), b.detach())
                      for a, b in zip(model.parameters(), subject.model.parameters()))
    return OverfitRun(batch, list((raw[1] if isinstance(raw, tuple) else raw).shape), start, final, probes,
                      feed.handed, state["learned"], state["out_of_time"], log, changed)


def _set_rate(group: dict, rate: float) -> None:
    if isinstance(group["lr"], torch.Tensor):  # capturable / fused optimizers keep lr as a tensor
        group["lr"].fill_(rate)
    else:
        group["lr"] = rate


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step takes a closure it cannot do without (LBFGS)."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def replay(subject: Subject, log: StepLog, batch: LMBatch, stop: Callable[[list[float]], bool],
           advance: Callable[[int], None] = lambda n=1: None) -> list[float]:
    """Train `log.reference` on `batch` with the plain next-token loss, replaying the loop's
    optimizers at the recorded rates. Only the parameters that had a gradient in the loop are
    updated (a backbone the loop froze on purpose stays frozen). Dropout is off, so the loss
    before each update is the loss of the model as it is, and no random draw is made.

    Returns the loss before each update and, unless `stop(curve)` ended it early, after the last."""
    model = log.reference
    clone = dataclasses.replace(subject, model=model)
    trained = {id(log.memo[i]) for i in log.with_grad if i in log.memo}
    params = [p for opt in log.copies for group in opt.param_groups for p in group["params"]]
    curve: list[float] = []

    def forward_backward() -> float:
        """The reference loss backpropagated, on the parameters the loop trained only."""
        for p in list(model.parameters()) + params:
            p.grad = None
        loss = lm_loss(clone, batch)
        loss.backward()
        for p in params:
            if id(p) not in trained:
                p.grad = None
        return float(loss.detach())

    def gradients() -> torch.Tensor:  # LBFGS's closure
        return torch.tensor(forward_backward())

    with torch.enable_grad(), DropoutOff(model) as dropout_off, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for iteration in log.iterations():
            curve.append(dropout_off.step(forward_backward))
            if stop(curve):
                return curve
            for index, rates in iteration:
                optimizer = log.copies[index]
                for group, rate in zip(optimizer.param_groups, rates):
                    _set_rate(group, rate)
                # LBFGS re-evaluates the loss at trial weights: its step cannot run without a closure
                optimizer.step(gradients) if _needs_closure(optimizer) else optimizer.step()
            advance(1)
    for p in model.parameters():
        p.grad = None
    curve.append(eval_loss(subject, model, batch))
    return curve
