"""Record what a user's training loop really does, so that the loop checks judge behaviour, not code.

`record_loop(subject, batches)` runs `subject.train(copy_of_model, batches)` once and returns a
`Trace`: the ordered events of the run (forward, loss call, backward, GradScaler scale / unscale_ /
step / update, clip, optimizer step, zero_grad, scheduler step, autocast region), each stamped with
the optimizer-step window it fell in. Variable names and code layout do not matter: only calls do.

How each thing is seen, hooks first and patches only where PyTorch offers no hook:
- loss functions and `Tensor.backward`: a TorchFunctionMode (sees a loss computed inside a library
  model's own forward too); a tensor hook on each loss output records the gradient the user's
  backward sent to it;
- what each token was graded on: a tensor hook on the scores over the vocabulary (the model's
  logits, or the input of a softmax / cross-entropy over the vocabulary when the model returns
  something else) reads the gradient that reached them, whatever the loss (see `read_scores`);
- optimizer steps: the global optimizer step pre/post hooks; a loop with no optimizer object is seen
  changing the parameters between two backward calls (a manual update);
- the model's forward: module pre/post hooks on the (copied) model;
- GradScaler, clip_grad_*, zero_grad, LR scheduler steps and autocast regions: patched on their
  classes or modules (no hooks exist) and restored in `finally`, also when the loop raises.

Autocast and GradScaler record what the loop *requested* (device, dtype, enabled), so a loop written
for CUDA is audited on a CPU machine where both quietly disable themselves.

The loop trains a copy (`isolated_copy`); the user's own model is snapshot before and compared after,
and anything the copy still shared with it is put back (`guarded`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import math
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tfdoctor.probes.fused_head import watch_log_probs
from tfdoctor.sites import call_site
from tfdoctor.subject import Subject, extract_logits

# Loss functions whose calls are recorded. The nn losses (CrossEntropyLoss, NLLLoss) call these.
LOSS_FUNCTIONS = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}
# Functions whose input is a row of scores over the classes, and where their class dimension is
# (an int, or the name of the argument that holds it). Their input is watched when the model's own
# output is not the logits (a model that returns only the loss, a loop that applies the output layer
# itself, as the Annotated Transformer's `generator` does).
SCORE_FUNCTIONS = {
    F.cross_entropy: 1, F.nll_loss: 1, F.kl_div: -1,
    F.log_softmax: "dim", torch.log_softmax: "dim", torch.Tensor.log_softmax: "dim",
    F.softmax: "dim", torch.softmax: "dim", torch.Tensor.softmax: "dim",
}
# How far back from a backward's root to look for the GradScaler's multiply (it is the root itself
# or a few nodes away: `scaler.scale(loss / k)`, `scaler.scale(loss) / k`), and from a scored
# tensor for one already watched (`logits.float().view(-1, V)` is two nodes from the logits).
SCALE_SEARCH_NODES = 64
# Schedule projection: at least this many steps, then until twice the step of the peak so far,
# never beyond the cap (a LambdaLR step costs ~7 us here, so the cap costs ~0.3 s).
PROJECT_MIN_STEPS = 200
PROJECT_MAX_STEPS = 40_000

# read_scores. Any loss of log_softmax(z) (cross-entropy, label smoothing, KL to a smoothed target,
# a library's own cross-entropy) sends z a gradient that sums to zero over the classes: this share
# of its L1 norm is left for rounding and small extra terms (a 1e-4 z-loss adds about 1e-3).
SHIFT_TOLERANCE = 2e-2
# Below this relative spread of the softmax over the classes (a zero-initialised output layer) the
# weight cannot be told from a uniform smoothing term and is read as plain cross-entropy's.
P_SPREAD_MIN = 1e-3
# Classes whose residual from the fit is this many times the mean residual are left out of it (the
# pad column a smoothed target zeroes, an extra term on a few classes).
TRIM_FACTOR = 4.0
# A target distribution whose top class holds less than this share is soft (distillation, mixup):
# it has a weight but no single graded token. Label smoothing up to 0.5 stays hard.
HARD_TARGET_SHARE = 0.5
# Manual updates: elements sampled per parameter tensor to see the weights change between backward
# calls (every tensor with a gradient moves, so a few per tensor are plenty).
SAMPLE_PER_TENSOR = 32
# read_scores works in float64 on this many elements at a time (8 MB per temporary).
READ_CHUNK_ELEMENTS = 1 << 20
# Watched scored tensors kept for the "already watched?" search; older ones have been backpropagated.
WATCHED_KEEP = 8
# Events that carry the user's file:line of the call (see tfdoctor/sites.py), which the
# loop checks name in their findings. Forwards and batches are many and judged by content only.
LOCATED_EVENTS = frozenset({"loss", "backward", "scale", "unscale", "scaler_step", "clip", "opt_step",
                            "zero_grad", "sched_step", "autocast"})


# Whether torch.compile (dynamo) is tracing the running code. The recorder's hooks and patches are
# Python with side effects dynamo cannot trace (fullgraph=True fails on them): inside a compiled
# region they step aside, and what runs around the region (the outermost call, backward, the steps)
# is recorded as usual. torch < 2.3 has no torch.compiler.is_compiling.
compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


@dataclass
class Event:
    kind: str  # batch forward loss backward scale unscale scaler_step scaler_update clip opt_step zero_grad
    #            sched_step autocast
    window: int  # optimizer steps taken before this event
    data: dict = field(default_factory=dict)


@dataclass
class Trace:
    events: list[Event]
    batches_fed: int
    optimizers: list[dict]  # per optimizer stepped: class name, id, per-group hyperparameters and contents
    schedules: list[dict]  # per scheduler stepped by the loop: name, snapshot (or None), steps, optimizer id
    warnings: list[str]
    param_count: int
    # What the gradient reaching the scores over the vocabulary says, one entry per watched tensor and
    # backward (see read_scores): forward, backward, source, rows_shape and per-row tensors.
    scores: list[dict] = field(default_factory=list)
    # Parameters that received a gradient, and which of them no optimizer holds (names).
    coverage: dict = field(default_factory=dict)
    # rebound: function attributes of the copy rebuilt to use the copy's modules (minGPT's `mlpf`);
    # restored: the user's own tensors the loop still changed through the copy, put back afterwards.
    isolation: dict = field(default_factory=dict)
    # window -> factor by which the loop rescaled the accumulated gradients between its last backward
    # and the step (`p.grad.mul_(1 / num_tokens)`, torchtune's scale_grads); absent: not rescaled.
    grad_rescale: dict = field(default_factory=dict)
    # A distributed run (torchrun): every rank's digest of what it did (see recording/ranks.py), rank 0
    # first, gathered to rank 0 at the stop point (recording/distributed.py); empty in one process.
    ranks: list = field(default_factory=list)

    def of(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]

    @property
    def steps(self) -> int:
        """Optimizer steps of the loop (several optimizers stepped together count once)."""
        return len({e.window for e in self.of("opt_step")})

    def training_losses(self) -> list[Event]:
        """Loss calls whose value reached a backward (their gradient hook fired)."""
        return [e for e in self.of("loss") if e.data.get("grad") is not None]

    @property
    def manual(self) -> bool:
        """Whether the loop updates the parameters itself, with no optimizer object."""
        return any(e.data.get("manual") for e in self.of("opt_step"))


def _grad_norm(params) -> tuple[float, bool]:
    """Global L2 norm of the gradients present, and whether all of them are finite."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return 0.0, True
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    total = float(torch.linalg.vector_norm(norms))
    if math.isfinite(total):  # a NaN or inf element makes the norm NaN or inf: no per-tensor scan needed
        return total, True
    # Not finite: either a non-finite element or finite ones whose squares overflow; tell them apart.
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    return total, finite


def _int_tensors(args, kwargs) -> list[tuple[str, torch.Tensor]]:
    found = [(str(i), a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_floating_point()
             and a.dim() == 2]
    found += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()
              and v.dim() == 2]
    return [(k, v.detach()) for k, v in found]


def _near(root, limit: int = SCALE_SEARCH_NODES) -> set[int]:
    """ids of the first `limit` autograd nodes met walking breadth-first back from `root`."""
    seen: set[int] = set()
    if root is None:
        return seen
    queue = collections.deque([root])
    while queue and len(seen) < limit:
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        queue.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return seen


def _reaches(root, targets: list, limit: int = SCALE_SEARCH_NODES) -> bool:
    """Whether any of the autograd nodes `targets` lies within `limit` nodes of `root`."""
    wanted = {id(t) for t in targets if t is not None}
    if root is None or not wanted:
        return False
    queue, seen = collections.deque([root]), set()
    while queue and len(seen) < limit:
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        if id(node) in wanted:
            return True
        seen.add(id(node))
        queue.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return False


def _class_dim(func, tensor: torch.Tensor, args, kwargs) -> Optional[int]:
    """The class dimension of a SCORE_FUNCTIONS call's input, or None when it has none to speak of."""
    where = SCORE_FUNCTIONS[func]
    if isinstance(where, int):
        if tensor.dim() < 2:
            return None
        return where % tensor.dim()
    dim = kwargs.get(where, args[1] if len(args) > 1 else None)
    return dim % tensor.dim() if isinstance(dim, int) and tensor.dim() >= 1 else None


def read_scores(values: torch.Tensor, grad: torch.Tensor) -> dict:
    """What the gradient that reached scores [N, V] says about each row (see `_read_rows`), read a
    few rows at a time so that a 50k vocabulary needs tens of MB, not GB."""
    V = values.shape[-1]
    step = max(1, READ_CHUNK_ELEMENTS // max(1, V))
    parts = [_read_rows(values[i:i + step], grad[i:i + step]) for i in range(0, values.shape[0], step)]
    if len(parts) == 1:
        return parts[0]
    merged = {k: torch.cat([part[k] for part in parts]) for k in parts[0] if k != "log_probs"}
    merged["log_probs"] = all(part["log_probs"] for part in parts)
    return merged


def _read_rows(values: torch.Tensor, grad: torch.Tensor) -> dict:
    """What the gradient that reached scores [N, V] says about each row: the class it grades, its
    weight in the update and the model's loss on it, for any loss that backpropagates into them.

    At logits z, every loss of log_softmax(z) against a target distribution y with weight w sends
    g = w * (softmax(z) - y): the gradient sums to zero over the classes. y is mostly one class (the
    graded token) on top of a constant (label smoothing, 0 for plain cross-entropy), so over the other
    classes g is a straight line in p = softmax(z) whose slope is the weight w; then w * y = w * p - g
    and the graded class is its largest entry. At log-probabilities (a model or loss that applies
    log_softmax first, NLL or KL on top) the gradient is -w * y directly: no entry is positive.
    Rows with no gradient were not graded (ignore_index, a masked pad); rows that fit neither form
    (a loss on the logits that is not a softmax loss) are left unread.
    """
    z, g = values.double(), grad.double()
    N, V = g.shape
    rows = torch.arange(N)
    l1 = g.abs().sum(-1)
    reached = l1 > 0
    logit_rows = reached & (g.sum(-1).abs() <= SHIFT_TOLERANCE * l1)
    logprob_rows = reached & ~logit_rows & (g <= 1e-12 * l1[:, None]).all(-1)
    p = z.softmax(-1)
    # Least-squares line g_j = w * p_j + b over the classes other than the most negative, twice: the
    # second fit leaves out the classes the first one could not explain.
    keep = torch.ones_like(g, dtype=torch.bool)
    first = g.argmin(-1)
    keep[rows, first] = False
    for _ in range(2):
        n = keep.sum(-1).clamp_min(2)
        p_mean = (p * keep).sum(-1) / n
        g_mean = (g * keep).sum(-1) / n
        dp = (p - p_mean[:, None]) * keep
        var = (dp * dp).sum(-1)
        slope = (dp * (g - g_mean[:, None])).sum(-1) / var.clamp_min(1e-300)
        resid = (g - slope[:, None] * p - (g_mean - slope * p_mean)[:, None]).abs()
        limit = TRIM_FACTOR * (resid * keep).sum(-1) / n + 1e-9 * g.abs().amax(-1)
        keep &= resid <= limit[:, None]
    spread = (var / n).sqrt() / p_mean.clamp_min(1e-300)
    plain = -g[rows, first] / (1 - p[rows, first]).clamp_min(1e-12)  # the plain cross-entropy reading
    w = torch.where(spread >= P_SPREAD_MIN, slope, plain)
    mass = torch.where(logit_rows[:, None], w[:, None] * p - g, -g)  # w * y: the weighted target
    weight = torch.where(logit_rows | logprob_rows, mass.sum(-1), torch.zeros_like(l1))
    target = mass.argmax(-1)
    share = mass[rows, target] / weight.clamp_min(1e-300)
    readable = (logit_rows | logprob_rows) & (weight > 0)
    nll = torch.where(logit_rows, -z.log_softmax(-1)[rows, target], -z[rows, target])
    return {"targets": target, "weights": torch.where(readable, weight, torch.zeros_like(weight)).float(),
            "hard": readable & (share >= HARD_TARGET_SHARE), "readable": readable, "reached": reached,
            "nll": nll.float(), "log_probs": bool(logprob_rows.any() and not logit_rows.any()),
            "logit_rows": logit_rows, "logprob_rows": logprob_rows}


def _sample(tensors) -> torch.Tensor:
    """A few elements of every tensor, flattened: enough to see any of them change."""
    parts = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        parts.append(flat[::max(1, flat.numel() // SAMPLE_PER_TENSOR)][:SAMPLE_PER_TENSOR].float())
    return torch.cat(parts).cpu() if parts else torch.zeros(0)


# The torch functions __torch_function__ does anything with; every other call is passed through.
_WATCHED_FUNCTIONS = frozenset([torch.Tensor.backward, *SCORE_FUNCTIONS, *LOSS_FUNCTIONS])


class _Feed(list):
    """The batches as a list (len() works, epochs re-iterate) that records each one handed out."""

    def __init__(self, batches, on_batch: Callable[[int], None]):
        super().__init__(batches)
        self._on_batch = on_batch

    def __iter__(self):
        for i, batch in enumerate(list.__iter__(self)):
            self._on_batch(i)
            yield batch


class _Recorder(TorchFunctionMode):
    def __init__(self, model: torch.nn.Module, vocab: Optional[int] = None, record: bool = True):
        super().__init__()
        self.model = model
        self.vocab = vocab
        self.record = record
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.events: list[Event] = []
        self.window = 0
        self.batches_fed = 0
        self.autocast_stack: list[dict] = []
        self.autocast_requested: dict[int, tuple[Any, bool]] = {}
        self.scaler_requested: dict[int, tuple[Any, bool]] = {}
        self.scale_nodes: list = []
        self.current_backward: Optional[int] = None
        self.forwards = 0
        self.in_forward = 0
        self.pending: list[tuple] = []  # scored tensors met inside the running forward
        self.watched: list = []  # autograd nodes of the tensors watched so far (the latest few)
        self.scores: list[dict] = []
        # Scored rows whose gradient has arrived but is not read yet: a tiny model's few rows per
        # micro-batch are read together (read_scores costs ~60 tensor calls whatever the rows), at the
        # latest when READ_CHUNK_ELEMENTS are waiting, so a large vocabulary is read at once as before.
        self.unread: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        self.unread_elements = 0
        self.busy = False  # our own tensor work inside a hook is not the loop's
        self.in_scaler_step = 0
        self.sched_depth = 0
        self.schedulers: dict[int, dict] = {}
        self.optimizers: dict[int, Any] = {}
        self.optimized: set[int] = set()
        self.with_grad: set[int] = set()
        self.sampled: Optional[tuple] = None  # (weights sample, gradient sample, norm, finite) after a backward
        self.clip_seen_window = -1
        self.stepped = False  # an optimizer has stepped
        self.backward_since_step = False  # a backward ran since the last optimizer step
        self.advance: Callable[[int], None] = lambda n=1: None
        self.after_backward: Optional[torch.Tensor] = None  # gradient sample after the latest backward
        self.grad_rescale: dict[int, float] = {}
        self.closure_step_pending = False  # inside `optimizer.step(closure)`, before the closure returned

    # ------------------------------------------------------------------ events

    def event(self, kind: str, **data) -> dict:
        if kind in LOCATED_EVENTS:
            data["where"] = call_site()
        self.events.append(Event(kind, self.window, data))
        return data

    def amp(self) -> Optional[str]:
        """The dtype the innermost autocast region asks for, or None when none is asked for."""
        if not self.autocast_stack:
            return None
        region = self.autocast_stack[-1]
        return region["dtype"] if region["requested"] else None

    def on_batch(self, i: int) -> None:
        self.batches_fed += 1
        self.event("batch", index=i)
        self.advance(1)

    # ------------------------------------------------------------------ torch functions

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Every torch call of the script passes here: one lookup decides, the rest goes straight through.
        if func not in _WATCHED_FUNCTIONS or self.busy:
            return func(*args, **kwargs)
        if not self.record or compiling():
            return self.unrecorded(func, args, kwargs)
        if func is torch.Tensor.backward:
            return self._backward(func, args, kwargs)
        if func in SCORE_FUNCTIONS and isinstance(args[0] if args else kwargs.get("input"), torch.Tensor):
            self._scored(func, args, kwargs)
        name = LOSS_FUNCTIONS.get(func)
        if name is not None:
            return self._loss(name, func, args, kwargs)
        return func(*args, **kwargs)

    def unrecorded(self, func, args, kwargs):
        """A watched call made while nothing is recorded (a driver may act on it: see script.py)."""
        return func(*args, **kwargs)

    def _backward(self, func, args, kwargs):
        self._manual_update()
        root = args[0]
        value = float(root.detach().float().sum())
        # judged on what the optimizers update: a parameter in none of them is optimizer-coverage's
        updated = [p for p in self.params if id(p) in self.optimized] if self.optimized else self.params
        clear = all(p.grad is None or not bool(p.grad.detach().any()) for p in updated)
        near = _near(root.grad_fn) if self.scale_nodes else set()  # one walk serves every scale call
        scaled = any(node is not None and id(node) in near for node, _ in self.scale_nodes)
        scale = next((s for node, s in reversed(self.scale_nodes) if node is not None and id(node) in near), None) \
            if scaled else None
        data = self.event("backward", value=value, grads_clear=clear, scaled=scaled, scale=scale, amp=self.amp())
        self.backward_since_step = True
        self.current_backward = len(self.events) - 1
        try:
            return func(*args, **kwargs)
        finally:
            self.current_backward = None
            self.after_backward = _sample(p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params)
            data["grads_after"] = bool(self.after_backward.any())  # seen non-zero on a sample after it
            if not self.optimizers:  # no optimizer seen yet: watch for the loop updating weights itself
                norm, finite = _grad_norm(self.params)
                self.sampled = (_sample(self.params), _sample(p.grad if p.grad is not None else torch.zeros_like(p)
                                                              for p in self.params), norm, finite)

    def _manual_update(self) -> None:
        """A loop without an optimizer object (`p.data.add_(p.grad, alpha=-lr)`): the weights changed
        since the last backward and no optimizer stepped. Recorded as an optimizer step of its own,
        with the learning rate read off the change (exact for plain SGD)."""
        if self.sampled is None or self.optimizers:
            return
        before, grads, norm, finite = self.sampled
        self.sampled = None
        delta = _sample(self.params) - before
        if not bool((delta != 0).any()):
            return
        moved = grads != 0
        g = grads[moved].double()
        lr = float(-(delta[moved].double() @ g) / (g @ g)) if g.numel() and float(g @ g) > 0 else None
        if lr is not None and math.isfinite(lr) and lr != 0:
            lr = float(f"{lr:.3g}")  # an estimate: float rounding must not read as a schedule
        self.event("opt_step", optimizer=None, manual=True, lrs=[lr] if lr is not None and math.isfinite(lr) else [],
                   grad_norm=norm, finite=finite, in_scaler=False)
        self.window += 1
        self.stepped, self.backward_since_step = True, False

    def quiet(self):
        """Our own tensor work from a hook or a patched call, with this mode off: every torch call
        made under it would otherwise pass through __torch_function__ (~2 us each)."""
        current = getattr(torch.overrides, "_get_current_function_mode", None)  # private: absent, stay on
        if current is not None and current() is self:
            return torch.overrides._pop_mode_temporarily()
        return contextlib.nullcontext()

    def _step_begins(self) -> None:
        """The loop hands its gradients to the step (unscale_, a clip, scaler.step or optimizer.step):
        how much it rescaled them since its last backward, read on a sample of their elements."""
        if self.after_backward is None or not self.record:
            return
        before, self.after_backward = self.after_backward, None
        with self.quiet():
            now = _sample(p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params)
        norm = float(before.double() @ before.double())
        if norm > 0:
            factor = float(now.double() @ before.double()) / norm
            if abs(factor - 1.0) > 1e-6:
                self.grad_rescale[self.window] = factor

    _signatures: dict = {}

    def _loss(self, name, func, args, kwargs):
        out = func(*args, **kwargs)
        sig = self._signatures.setdefault(name, inspect.signature(func))
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        target = bound.arguments["target"]
        data = self.event("loss", function=name, forward=self.forwards - 1, amp=self.amp(),
                          requires_grad=bool(out.requires_grad), reduction=bound.arguments.get("reduction"),
                          ignore_index=int(bound.arguments.get("ignore_index", -100)),
                          label_smoothing=float(bound.arguments.get("label_smoothing", 0.0) or 0.0),
                          value=float(out.detach().float().sum()), grad=None, backward=None)
        if not target.is_floating_point():
            data["targets"] = target.detach().reshape(-1).cpu()
        if out.requires_grad:
            def hook(grad, data=data):
                if grad is None:  # DDP hands back outputs the loss never read with no gradient
                    return
                data["grad"] = grad.detach().float().reshape(-1).cpu()
                data["backward"] = self.current_backward
            out.register_hook(hook)
        return out

    # ------------------------------------------------------------------ scored tensors

    def _scored(self, func, args, kwargs) -> None:
        """A softmax-family call over the vocabulary: its input holds scores the loss grades. Inside a
        forward it waits for the forward's end (the model's own output is preferred); outside, it is
        watched at once unless it is computed from a tensor already watched."""
        tensor = args[0] if args else kwargs["input"]
        if self.vocab is None or not tensor.is_floating_point() or not tensor.requires_grad:
            return
        dim = _class_dim(func, tensor, args, kwargs)
        if dim is None or tensor.shape[dim] != self.vocab:
            return
        name = getattr(func, "__name__", str(func))
        if self.in_forward:
            self.pending.append((tensor, dim, name))
        else:
            self._watch(tensor, dim, self.forwards - 1, name)

    def _watch(self, tensor: torch.Tensor, dim: int, forward: int, source: str) -> None:
        if tensor.grad_fn is None or _reaches(tensor.grad_fn, self.watched):
            return
        values = tensor.detach()
        recorder = self

        def hook(grad):
            if grad is None:  # these scores are not what the loss read (DDP's copy of an output, find_unused_parameters)
                return
            recorder.busy = True
            try:
                with torch.no_grad():
                    rows = values.movedim(dim, -1)
                    shape = list(rows.shape[:-1])
                    V = rows.shape[-1]
                    z, g = rows.reshape(-1, V).cpu(), grad.detach().movedim(dim, -1).reshape(-1, V).cpu()
                    info = dict(forward=forward, backward=recorder.current_backward, source=source,
                                rows_shape=shape)
                    if z.numel() >= READ_CHUNK_ELEMENTS:  # large: read now, as it is, no copy kept
                        recorder.read_unread()
                        recorder.unread = [(z, g, info)]
                    else:  # copies: the loop may change its logits in place, autograd reuse the buffer
                        recorder.unread.append((z.clone(), g.clone(), info))
                        recorder.unread_elements += z.numel()
                    if recorder.unread_elements >= READ_CHUNK_ELEMENTS or z.numel() >= READ_CHUNK_ELEMENTS:
                        recorder.read_unread()
            finally:
                recorder.busy = False

        tensor.register_hook(hook)
        self.watched = (self.watched + [tensor.grad_fn])[-WATCHED_KEEP:]

    def read_unread(self) -> None:
        """Read the waiting scored rows in one read_scores call and append one entry per watched
        tensor and backward, in the order their gradients arrived."""
        waiting, self.unread, self.unread_elements = self.unread, [], 0
        if not waiting:
            return
        with torch.no_grad():  # read_scores turns a few rows at a time into float64
            read = read_scores(*waiting[0][:2]) if len(waiting) == 1 else \
                read_scores(torch.cat([v for v, _, _ in waiting]), torch.cat([g for _, g, _ in waiting]))
        start = 0
        for values, _, info in waiting:
            end = start + values.shape[0]
            entry = {k: v[start:end] for k, v in read.items() if isinstance(v, torch.Tensor)}
            entry["log_probs"] = bool(entry.pop("logprob_rows").any() and not entry.pop("logit_rows").any())
            entry.update(info)
            self.scores.append(entry)
            start = end

    # ------------------------------------------------------------------ module and optimizer hooks

    def forward_pre(self, module, args, kwargs):
        if not self.record or compiling():
            return
        with self.quiet():
            inputs = _int_tensors(args, kwargs)
        self.event("forward", index=self.forwards, inputs=inputs, kwargs=sorted(kwargs), amp=self.amp())
        self.forwards += 1
        self.in_forward += 1

    def forward_post(self, module, args, kwargs, output):
        if not self.record or compiling():
            return
        self.in_forward = max(0, self.in_forward - 1)
        if self.in_forward:
            return
        with self.quiet():
            self._forward_ends(output)

    def _forward_ends(self, output) -> None:
        """The model's outermost forward returned: watch its scores (or the scored calls inside it)."""
        forward = next(e for e in reversed(self.events) if e.kind == "forward")
        try:
            logits = extract_logits(output)
        except Exception:  # an output we cannot read logits from (a bare loss): the scored calls decide
            logits = None
        if logits is None and isinstance(getattr(output, "log_probs", None), torch.Tensor):
            forward.data["fused_head"] = type(output).__name__  # per-token log-probs, no scores (TRL)
            watch_log_probs(self, output, forward.data["index"])  # their gradient still weighs each token
        output_node = None
        if (isinstance(logits, torch.Tensor) and logits.dim() >= 2 and logits.is_floating_point()
                and logits.shape[-1] == self.vocab):
            self._watch(logits, logits.dim() - 1, forward.data["index"], "output")
            output_node = logits.grad_fn
            if type(output_node).__name__ == "_DDPSinkBackward":  # DDP(find_unused_parameters=True): every
                # output passes one node, the i-th output from its i-th input: the logits' own node is that one
                inputs = output_node.next_functions
                output_node = inputs[logits.output_nr][0] if logits.output_nr < len(inputs) else output_node
        for tensor, dim, name in self.pending:
            # a softmax over the scores the model returns (log-probabilities out) scores the same rows
            # (computed from a watched tensor, `logits.view(-1, V)`, is skipped by _watch anyway: that
            # short walk goes first, the long one from the output only when it finds nothing)
            if _reaches(tensor.grad_fn, self.watched):
                continue
            if output_node is None or not _reaches(output_node, [tensor.grad_fn]):
                self._watch(tensor, dim, forward.data["index"], name)
        self.pending = []

    def direct_forward(self, original: Callable) -> Callable:
        recorder = self

        @functools.wraps(original)
        def forward(module, *args, **kwargs):
            if module is not recorder.model or recorder.in_forward or not recorder.record or compiling():
                return original(module, *args, **kwargs)
            recorder.forward_pre(module, args, kwargs)
            try:
                output = original(module, *args, **kwargs)
            except BaseException:
                recorder.in_forward = max(0, recorder.in_forward - 1)
                raise
            recorder.forward_post(module, args, kwargs, output)
            return output

        return forward

    def opt_pre(self, optimizer, args, kwargs):
        if not self.record:
            return
        self.optimizers[id(optimizer)] = optimizer
        # args are step's own: (optimizer, closure) or (optimizer,) with closure= in kwargs
        positional = len(args) > 1
        closure = args[1] if positional else kwargs.get("closure")
        self.closure_step_pending = False
        if not callable(closure):
            self._record_step(optimizer)
            return None
        # `optimizer.step(closure)` (Lightning, LBFGS): the window's last forward and backward (and
        # Lightning's clip) run inside the step, after this hook. The step is recorded when the
        # closure returns, with the gradients it hands over (see _closure_step).
        self.closure_step_pending = True
        wrapped = self._closure_step(optimizer, closure)
        if positional:
            return (args[0], wrapped, *args[2:]), kwargs
        return args, {**kwargs, "closure": wrapped}

    def _closure_step(self, optimizer, closure: Callable) -> Callable:
        recorder = self

        @functools.wraps(closure)
        def evaluated_then_stepped(*args, **kwargs):
            if not recorder.closure_step_pending:
                # A second evaluation within one step (LBFGS's iterations, a line search): the same
                # batch again at trial weights, the optimizer's doing, not the loop's. Not recorded.
                recorder.record = False
                try:
                    return closure(*args, **kwargs)
                finally:
                    recorder.record = True
            result = closure(*args, **kwargs)  # a closure that raises aborts the step: nothing recorded
            recorder.closure_step_pending = False
            recorder._record_step(optimizer)
            return result

        return evaluated_then_stepped

    def _record_step(self, optimizer) -> None:
        """The gradients reach the optimizer step: their norm, which parameters hold one, the rates."""
        self._step_begins()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with self.quiet():
            norm, finite = _grad_norm(params)
            self.with_grad.update(id(p) for p in self.params
                                  if id(p) not in self.with_grad and p.grad is not None and bool(p.grad.detach().any()))
        self.optimizers[id(optimizer)] = optimizer
        self.optimized.update(id(p) for p in params)
        # Several optimizers stepped one after another (Muon for the matrices, AdamW for the rest) make
        # one step of the loop: a step with no backward since the previous one joins its window.
        joins = self.stepped and not self.backward_since_step
        self.events.append(Event("opt_step", self.window - 1 if joins else self.window, dict(
            optimizer=id(optimizer), lrs=[float(g["lr"]) for g in optimizer.param_groups], grad_norm=norm,
            finite=finite, in_scaler=bool(self.in_scaler_step), joins=joins, where=call_site())))

    def opt_post(self, optimizer, args, kwargs):
        if not self.record:
            return
        if self.closure_step_pending:  # an optimizer that never called the closure it was given
            self.closure_step_pending = False
            self._record_step(optimizer)
        if self.backward_since_step or not self.stepped:
            self.window += 1
        self.stepped, self.backward_since_step = True, False

    # ------------------------------------------------------------------ patched callables

    def clip(self, how: str, original: Callable) -> Callable:
        recorder = self

        def clipped(parameters, *args, **kwargs):
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            recorder._step_begins()
            if recorder.record:
                with_grad = {id(p) for p in recorder.params if p.grad is not None}
                given = {id(p) for p in params}
                limit = args[0] if args else kwargs.get("max_norm", kwargs.get("clip_value"))
                with recorder.quiet():
                    pre_norm, pre_finite = _grad_norm(params)
                data = recorder.event("clip", how=how, params=len(params), covers_all=with_grad <= given,
                                      model_params_with_grad=len(with_grad), limit=float(limit),
                                      pre_norm=pre_norm)
                if recorder.clip_seen_window != recorder.window:  # the whole model's pre-clip norm, once
                    recorder.clip_seen_window = recorder.window
                    # the usual clip over all the model's parameters has just measured it
                    same = with_grad == {id(p) for p in params if p.grad is not None}
                    with recorder.quiet():
                        data["global_pre_norm"], data["finite"] = (pre_norm, pre_finite) if same \
                            else _grad_norm(recorder.params)
            return original(params, *args, **kwargs)

        clipped.__wrapped__ = original
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
                enabled = bool(scaler._enabled)
                value = float(scaler.get_scale()) if enabled else 1.0
                recorder.scale_nodes.append((result.grad_fn, value if enabled else None))
                recorder.event("scale", scaler=id(scaler), enabled=enabled, requested=recorder._requested(scaler),
                               device=str(getattr(scaler, "_device", "cuda")), scale=value,
                               init_scale=float(getattr(scaler, "_init_scale", 2.0 ** 16) or 2.0 ** 16))
            return result

        def unscale_(scaler, optimizer):
            if not recorder.in_scaler_step:
                recorder._step_begins()
            if recorder.record:
                recorder.event("unscale", scaler=id(scaler), optimizer=id(optimizer),
                               internal=bool(recorder.in_scaler_step))
            return original(scaler, optimizer)

        def step(scaler, optimizer, *args, **kwargs):
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
        wrapper.__wrapped__ = original
        return wrapper

    def _requested(self, scaler) -> bool:
        """Whether the loop asked for loss scaling (a CUDA scaler disables itself on a CPU machine)."""
        held = self.scaler_requested.get(id(scaler))
        if held is not None and held[0] is scaler:
            return held[1]
        # Built before the trace started: a disabled CUDA scaler on a machine without CUDA was asked for.
        return bool(scaler._enabled) or (getattr(scaler, "_device", "cuda") == "cuda" and not torch.cuda.is_available())

    def zero_grad(self, owner: str, original: Callable) -> Callable:
        recorder = self

        def zero_grad(obj, *args, **kwargs):
            if recorder.record and (owner == "optimizer" or obj is recorder.model):
                recorder.event("zero_grad", owner=owner)
            return original(obj, *args, **kwargs)

        zero_grad.__wrapped__ = original
        return zero_grad

    def sched_step(self, original: Callable) -> Callable:
        recorder = self

        def step(scheduler, *args, **kwargs):
            outer = recorder.sched_depth == 0 and not getattr(scheduler, "_is_initial", False)
            if outer and recorder.record:
                held = recorder.schedulers.get(id(scheduler))
                if held is None:
                    recorder.schedulers[id(scheduler)] = held = {
                        "name": type(scheduler).__name__, "snapshot": _snapshot(scheduler), "steps": 0,
                        "optimizer": id(getattr(scheduler, "optimizer", None)), "ref": scheduler}
                held["steps"] += 1
                recorder.event("sched_step", scheduler=id(scheduler), name=type(scheduler).__name__)
            recorder.sched_depth += 1
            try:
                return original(scheduler, *args, **kwargs)
            finally:
                recorder.sched_depth -= 1

        step.__wrapped__ = original
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
            requested = held[1] if held is not None and held[0] is region else bool(region._enabled)
            dtype = str(region.fast_dtype).replace("torch.", "") if region.fast_dtype is not None else None
            info = {"device": str(region.device), "dtype": dtype, "requested": requested,
                    "enabled": bool(region._enabled)}
            recorder.autocast_stack.append(info)
            if recorder.record:
                recorder.event("autocast", **info)
            return original(region, *args, **kwargs)

        def exit_(region, *args, **kwargs):
            if recorder.autocast_stack:
                recorder.autocast_stack.pop()
            return original(region, *args, **kwargs)

        wrapper = {"__init__": init, "__enter__": enter, "__exit__": exit_}[name]
        wrapper.__wrapped__ = original
        return wrapper

    # ------------------------------------------------------------------ install / restore

    @contextlib.contextmanager
    def installed(self, train_fn) -> Iterator[None]:
        from torch.amp.autocast_mode import autocast
        from torch.nn.utils import clip_grad
        from torch.optim import lr_scheduler
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        patches: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) in the order applied

        def patch(owner, attr, make):
            original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            patches.append((owner, attr, original))
            setattr(owner, attr, make(original))

        handles = []
        restore_forward = None
        try:
            clip_originals = {}
            for attr, how in (("clip_grad_norm_", "norm"), ("clip_grad_value_", "value"),
                              ("clip_grads_with_norm_", "norm")):
                original = getattr(torch.nn.utils, attr, None)
                if original is None:
                    continue
                clip_originals[id(original)] = self.clip(how, original)
                for owner in (clip_grad, torch.nn.utils):
                    if getattr(owner, attr, None) is original:
                        patch(owner, attr, lambda orig, w=clip_originals[id(original)]: w)
            # `from torch.nn.utils import clip_grad_norm_` in the loop's module binds the original.
            namespace = getattr(train_fn, "__globals__", None)
            if isinstance(namespace, dict):
                for name, value in list(namespace.items()):
                    if id(value) in clip_originals and value is not None:
                        patch_dict = namespace
                        patches.append((patch_dict, name, value))
                        patch_dict[name] = clip_originals[id(value)]
            scaler_cls = torch.amp.GradScaler
            for name in ("__init__", "scale", "unscale_", "step", "update"):
                patch(scaler_cls, name, lambda orig, n=name: self.scaler_method(n, orig))
            patch(torch.optim.Optimizer, "zero_grad", lambda orig: self.zero_grad("optimizer", orig))
            patch(torch.nn.Module, "zero_grad", lambda orig: self.zero_grad("model", orig))
            for cls in _with_own_step(lr_scheduler.LRScheduler):
                patch(cls, "step", self.sched_step)
            for name in ("__init__", "__enter__", "__exit__"):
                patch(autocast, name, lambda orig, n=name: self.autocast_method(n, orig))
            handles += [register_optimizer_step_pre_hook(self.opt_pre),
                        register_optimizer_step_post_hook(self.opt_post),
                        self.model.register_forward_pre_hook(self.forward_pre, with_kwargs=True),
                        self.model.register_forward_hook(self.forward_post, with_kwargs=True)]
            # `model.forward(...)` called directly (The Annotated Transformer does) skips module hooks:
            # the class's forward is wrapped too, recording only for this copy and only when no hook did.
            cls = type(self.model)
            own_forward = cls.__dict__.get("forward")
            setattr(cls, "forward", self.direct_forward(cls.forward))
            restore_forward = (cls, own_forward)
            with self:
                yield
        finally:
            for handle in reversed(handles):
                handle.remove()
            if restore_forward is not None:
                cls, own_forward = restore_forward
                if own_forward is None:
                    delattr(cls, "forward")
                else:
                    setattr(cls, "forward", own_forward)
            for owner, attr, original in reversed(patches):
                if isinstance(owner, dict):
                    owner[attr] = original
                else:
                    setattr(owner, attr, original)


def _with_own_step(base: type) -> list[type]:
    """`base` and every subclass that defines its own `step` (SequentialLR, ReduceLROnPlateau, ...)."""
    found, queue = [base], list(base.__subclasses__())
    while queue:
        cls = queue.pop()
        queue.extend(cls.__subclasses__())
        if "step" in cls.__dict__ and cls not in found:
            found.append(cls)
    return found


class _ScheduleOptimizer(torch.optim.SGD):
    """Stands in for the user's optimizer when a scheduler is projected forward: same param-group
    hyperparameters, one dummy parameter each, never stepped."""

    def __init__(self, groups: list[dict]):
        dummy = [dict(g, params=[torch.zeros(1, requires_grad=True)]) for g in groups]
        super().__init__(dummy, lr=float(groups[0].get("lr", 1e-3)))


def _snapshot(scheduler):
    """A copy of the scheduler bound to a stand-in optimizer, or None when it cannot be copied."""
    try:
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                  for g in scheduler.optimizer.param_groups]
        stand_in = _ScheduleOptimizer(groups)
        return copy.deepcopy(scheduler, memo={id(scheduler.optimizer): stand_in})
    except Exception:  # an exotic scheduler: the lr-schedule check falls back on the recorded rates
        return None


def project_groups(snapshot) -> Optional[list[list[float]]]:
    """The learning rate of each param group at each optimizer step from the scheduler's start, far
    enough to see the peak. None for schedulers that need a metric (ReduceLROnPlateau)."""
    if snapshot is None or isinstance(snapshot, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return None
    scheduler = copy.deepcopy(snapshot)
    groups: list[list[float]] = [[] for _ in scheduler.optimizer.param_groups]
    peak, peak_at, steps = -math.inf, 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while steps < PROJECT_MAX_STEPS:
            for rates, group in zip(groups, scheduler.optimizer.param_groups):
                rates.append(float(group["lr"]))
            top = max(rates[-1] for rates in groups)
            if top > peak:
                peak, peak_at = top, steps
            steps += 1
            if steps >= PROJECT_MIN_STEPS and steps > 2 * peak_at + 1:
                break
            scheduler.step()
    return groups


def project_schedule(snapshot) -> Optional[list[float]]:
    """The learning rate (max over param groups) at each optimizer step from the scheduler's start."""
    groups = project_groups(snapshot)
    return [max(step) for step in zip(*groups)] if groups else None


# ------------------------------------------------------------------------------------------------
# Isolation: the loop trains a copy, and the user's model must come out as it went in


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


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
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
                moved = not _same(t.detach(), value)
                if moved:
                    t.copy_(value)
                if isinstance(t, torch.nn.Parameter) and (t.grad is not grad or (
                        grad is not None and not _same(grad, grad_value))):
                    if grad is not None:
                        grad.copy_(grad_value)
                    t.grad = grad
                    moved = True
                if moved:
                    changed.append(name)
        for module, training in flags:
            module.training = training


def record_loop(subject: Subject, batches: list, advance: Callable[[int], None] = lambda n=1: None) -> Trace:
    """Run the user's loop once on a copy of the model and return what it did.

    The user's exception, if the loop raises, propagates after every patch and hook is removed and
    the user's model is put back as it was."""
    model, rebuilt = isolated_copy(subject.model)
    for p in model.parameters():
        p.grad = None
    recorder = _Recorder(model, subject.vocab_size)
    recorder.advance = advance
    feed = _Feed(batches, recorder.on_batch)
    with guarded(subject.model) as restored:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorder.installed(subject.train), torch.enable_grad():
                subject.train(model, feed)
                recorder._manual_update()  # a manual update after the last backward
    trace = _finish(recorder, caught)
    trace.isolation = {"rebound": rebuilt, "restored": restored}
    if not recorder.stepped:  # no step seen: whether anything unseen (torch.autograd.grad) trained it
        with torch.no_grad():
            trace.isolation["weights_changed"] = any(
                not _same(a.detach(), b.detach()) for a, b in zip(model.parameters(), subject.model.parameters()))
    return trace


def run_loop(subject: Subject, model: torch.nn.Module, batches: list,
             advance: Callable[[int], None] = lambda n=1: None) -> list[str]:
    """Run the user's loop on `model` (a copy: see `isolated_copy`) without recording; its warnings
    are swallowed. Returns the names of the user's own tensors it still changed, which are put back."""
    with guarded(subject.model) if model is not subject.model else contextlib.nullcontext([]) as restored:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.enable_grad():
                subject.train(model, _Feed(batches, lambda i: advance(1)))
    return restored


def _composition(model: torch.nn.Module, optimizer) -> list[dict]:
    """What each param group holds: embedding tables, weight matrices, vectors (norm gains, biases,
    scalars), in elements, and a few names."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    names = {id(p): name for name, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        held = {"embedding": 0, "matrix": 0, "vector": 0, "tensors": len(group["params"]), "names": []}
        for p in group["params"]:
            kind = "embedding" if id(p) in embeddings else "matrix" if p.dim() >= 2 else "vector"
            held[kind] += p.numel()
            if len(held["names"]) < 3 and id(p) in names:
                held["names"].append(names[id(p)])
        groups.append(held)
    return groups


def _finish(recorder: _Recorder, caught) -> Trace:
    recorder.read_unread()
    optimizers = []
    for optimizer in recorder.optimizers.values():
        groups = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizers.append({"class": type(optimizer).__name__, "id": id(optimizer), "groups": groups,
                           "composition": _composition(recorder.model, optimizer)})
    schedules = [{"name": s["name"], "snapshot": s["snapshot"], "steps": s["steps"], "optimizer": s["optimizer"]}
                 for s in recorder.schedulers.values()]
    messages = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
    names = recorder.names
    trainable = recorder.params
    coverage = {"with_grad": sum(id(p) in recorder.with_grad for p in trainable), "trainable": len(trainable),
                "not_optimized": [names[id(p)] for p in trainable
                                  if id(p) in recorder.with_grad and id(p) not in recorder.optimized],
                "never_reached": [names[id(p)] for p in trainable
                                  if id(p) in recorder.optimized and id(p) not in recorder.with_grad],
                "optimizers": len(recorder.optimizers)}
    trace = Trace(recorder.events, recorder.batches_fed, optimizers, schedules, messages,
                  sum(p.numel() for p in recorder.params), recorder.scores, coverage,
                  grad_rescale=dict(recorder.grad_rescale))
    return trace


def _plain(value):
    """A JSON-safe copy of a hyperparameter (tensors and tuples become numbers and lists)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value if not (isinstance(value, float) and math.isnan(value)) else None
    return repr(value)
