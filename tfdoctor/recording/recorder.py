"""The loop recorder: what a user's training loop really does, so that the loop checks judge
behaviour, not code. Whichever driver runs the loop (recording/loop.py, recording/script.py), the
`Recorder` installed around it turns its calls into the events of a `Trace` (recording/trace.py),
each stamped with the optimizer-step window it fell in, and `finish` hands the Trace over. Variable
names and code layout do not matter: only calls do.

How each thing is seen, hooks first and patches only where PyTorch offers no hook:
- loss functions and `Tensor.backward`: a TorchFunctionMode (sees a loss computed inside a library
  model's own forward too); a tensor hook on each loss output records the gradient the user's
  backward sent to it;
- what each token was graded on: a tensor hook on the scores over the vocabulary (the model's
  logits, or the input of a softmax / cross-entropy over the vocabulary when the model returns
  something else) reads the gradient that reached them, whatever the loss (see scores.read_scores);
- optimizer steps: the global optimizer step pre/post hooks; a loop with no optimizer object is seen
  changing the parameters between two backward calls (a manual update);
- the model's forward: module pre/post hooks on the (copied) model;
- GradScaler, clip_grad_*, zero_grad, LR scheduler steps and autocast regions: patched on their
  classes or modules (no hooks exist; recording/patched_calls.py) and restored in `finally`, also when
  the loop raises.

Autocast and GradScaler record what the loop *requested* (device, dtype, enabled), so a loop written
for CUDA is audited on a CPU machine where both quietly disable themselves.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tfdoctor.probes.fused_head import hook_log_probs
from tfdoctor.probes.process_state import BATCH_NORM_MODULES, DROPOUT_MODULES
from tfdoctor.recording.events import EventKind
from tfdoctor.recording.grads import grad_norm, int_tensors, nodes_near, reaches, sample
from tfdoctor.recording.patched_calls import PatchedCalls
from tfdoctor.recording.schedule import schedule_record
from tfdoctor.recording.scores import READ_CHUNK_ELEMENTS, SCORE_FUNCTIONS, class_dim, read_scores
from tfdoctor.recording.trace import LOCATED_EVENTS, Event, OptimizerRecord, Trace
from tfdoctor.recording.updates import UpdateProbe
from tfdoctor.subject import extract_logits
from tfdoctor.usercode.call_sites import call_site
from tfdoctor.usercode.torch_compat import is_compiling_function, outside_function_mode

# Loss functions whose calls are recorded. The nn losses (CrossEntropyLoss, NLLLoss) call these.
LOSS_FUNCTIONS = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}
# Watched scored tensors kept for the "already watched?" search; older ones have been backpropagated.
WATCHED_KEEP = 8
# Whether torch.compile (dynamo) is tracing the running code. The recorder's hooks and patches are
# Python with side effects dynamo cannot trace (fullgraph=True fails on them): inside a compiled
# region they step aside, and what runs around the region (the outermost call, backward, the steps)
# is recorded as usual.
compiling: Callable[[], bool] = is_compiling_function()


# The torch functions __torch_function__ does anything with; every other call is passed through.
_WATCHED_FUNCTIONS = frozenset([torch.Tensor.backward, *SCORE_FUNCTIONS, *LOSS_FUNCTIONS])


class Recorder(PatchedCalls, TorchFunctionMode):
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
        self.mode_dependent: dict[int, tuple] = {}  # id(model) -> (model, its dropout / batch norm modules)
        self.mode_calls: list[tuple[dict, Any]] = []  # (a "mode" event's data, weakref to its module)
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
        self.updates = UpdateProbe()  # what the first steps did to low-precision weights (stale-update)

    # ------------------------------------------------------------------ events

    def event(self, kind: EventKind, **data: Any) -> dict[str, Any]:
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

    def owns(self, params) -> bool:
        """Whether calls on these parameters (a clip, zero_grad, the scaler's unscale_ / step, a
        scheduler's step) are the recorded loop's: every one is here; a driver that watches several
        models lets another model's calls pass unrecorded (see script_recorder.py)."""
        return True

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
        near = nodes_near(root.grad_fn) if self.scale_nodes else set()  # one walk serves every scale call
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
            self.after_backward = sample(p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params)
            data["grads_after"] = bool(self.after_backward.any())  # seen non-zero on a sample after it
            if not self.optimizers:  # no optimizer seen yet: watch for the loop updating weights itself
                norm, finite = grad_norm(self.params)
                self.sampled = (sample(self.params), sample(p.grad if p.grad is not None else torch.zeros_like(p)
                                                              for p in self.params), norm, finite)

    def _manual_update(self) -> None:
        """A loop without an optimizer object (`p.data.add_(p.grad, alpha=-lr)`): the weights changed
        since the last backward and no optimizer stepped. Recorded as an optimizer step of its own,
        with the learning rate read off the change (exact for plain SGD)."""
        if self.sampled is None or self.optimizers:
            return
        before, grads, norm, finite = self.sampled
        self.sampled = None
        delta = sample(self.params) - before
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
        return outside_function_mode(self)

    def _step_begins(self) -> None:
        """The loop hands its gradients to the step (unscale_, a clip, scaler.step or optimizer.step):
        how much it rescaled them since its last backward, read on a sample of their elements."""
        if self.after_backward is None or not self.record:
            return
        before, self.after_backward = self.after_backward, None
        with self.quiet():
            now = sample(p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params)
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
                          value=float(out.detach().float().sum()), grad=None, backward=None,
                          input_shape=list(bound.arguments["input"].shape))  # [B, C]: a classifier's scores
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
        dim = class_dim(func, tensor, args, kwargs)
        if dim is None or not self.graded_classes(tensor, dim):
            return
        name = getattr(func, "__name__", str(func))
        if self.in_forward:
            self.pending.append((tensor, dim, name))
        else:
            self._hook_scores(tensor, dim, self.forwards - 1, name)

    def graded_classes(self, tensor: torch.Tensor, dim: int, output=None) -> bool:
        """Whether the class dimension of a softmax-family call's input, or of the model's `output`'s
        logits, is the one the loss grades: the vocabulary, or the labels the driver passed in its
        place (a token classifier's C under check --train)."""
        return tensor.shape[dim] == self.vocab

    def _hook_scores(self, tensor: torch.Tensor, dim: int, forward: int, source: str) -> None:
        if tensor.grad_fn is None or reaches(tensor.grad_fn, self.watched):
            return
        values = tensor.detach()
        recorder = self

        def hook(grad):
            # no gradient: these scores are not what the loss read (DDP's copy of an output, find_unused_parameters)
            if grad is None:
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
            inputs = int_tensors(args, kwargs)
        data = self.event("forward", index=self.forwards, inputs=inputs, kwargs=sorted(kwargs), amp=self.amp())
        if torch.is_grad_enabled() and not self.in_forward:  # a training forward: the modes it ran in
            data["training"] = module.training
            held = self.mode_dependent.get(id(module))
            if held is None or held[0] is not module:  # found once per model, read at every training forward
                held = self.mode_dependent[id(module)] = (module, find_mode_dependent(module))
            data["mode_off"] = [name for name, m in held[1] if not m.training]
            if data["mode_off"]:
                data["mode_off_kinds"] = sorted({"batch norm" if isinstance(m, BATCH_NORM_MODULES) else "dropout"
                                                 for _, m in held[1] if not m.training})
            data["mode_dependent"] = len(held[1])
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
            hook_log_probs(self, output, forward.data["index"])  # their gradient still weighs each token
        output_node = None
        if (isinstance(logits, torch.Tensor) and logits.dim() >= 2 and logits.is_floating_point()
                and self.graded_classes(logits, logits.dim() - 1, output)):
            self._hook_scores(logits, logits.dim() - 1, forward.data["index"], "output")
            output_node = logits.grad_fn
            if type(output_node).__name__ == "_DDPSinkBackward":  # DDP(find_unused_parameters=True): every
                # output passes one node, the i-th output from its i-th input: the logits' own node is that one
                inputs = output_node.next_functions
                output_node = inputs[logits.output_nr][0] if logits.output_nr < len(inputs) else output_node
        for tensor, dim, name in self.pending:
            # a softmax over the scores the model returns (log-probabilities out) scores the same rows
            # (computed from a watched tensor, `logits.view(-1, V)`, is skipped by _hook_scores anyway:
            # that short walk goes first, the long one from the output only when it finds nothing)
            if reaches(tensor.grad_fn, self.watched):
                continue
            if output_node is None or not reaches(output_node, [tensor.grad_fn]):
                self._hook_scores(tensor, dim, forward.data["index"], name)
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
        with self.quiet():
            self.updates.before(optimizer, self.params, self.step_window())
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

    def step_window(self) -> int:
        """The loop step an optimizer step now belongs to: a step with no backward since the previous
        one joins its window (Muon for the matrices, AdamW for the rest, make one step)."""
        return self.window - 1 if self.stepped and not self.backward_since_step else self.window

    def _record_step(self, optimizer) -> None:
        """The gradients reach the optimizer step: their norm, which parameters hold one, the rates."""
        self._step_begins()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with self.quiet():
            norm, finite = grad_norm(params)
            self.with_grad.update(id(p) for p in self.params
                                  if id(p) not in self.with_grad and p.grad is not None and bool(p.grad.detach().any()))
        self.optimizers[id(optimizer)] = optimizer
        self.optimized.update(id(p) for p in params)
        # Several optimizers stepped one after another (Muon for the matrices, AdamW for the rest) make
        # one step of the loop: a step with no backward since the previous one joins its window.
        joins = self.stepped and not self.backward_since_step
        data = dict(optimizer=id(optimizer), lrs=[float(g["lr"]) for g in optimizer.param_groups], grad_norm=norm,
                    finite=finite, in_scaler=bool(self.in_scaler_step), joins=joins, where=call_site(),
                    params=len(params), frozen=sum(1 for p in params if not p.requires_grad))
        if not self.stepped or joins:  # the weights' size before the first update: how far that moves them
            with self.quiet():
                embeddings = {id(m.weight) for m in self.model.modules() if isinstance(m, torch.nn.Embedding)}
                data["matrix_rms"] = matrix_rms(optimizer, embeddings)
        self.events.append(Event("opt_step", self.window - 1 if joins else self.window, data))

    def opt_post(self, optimizer, args, kwargs):
        if not self.record:
            return
        with self.quiet():
            self.updates.after(optimizer, self.names, self.step_window())
        if self.closure_step_pending:  # an optimizer that never called the closure it was given
            self.closure_step_pending = False
            self._record_step(optimizer)
        if self.backward_since_step or not self.stepped:
            self.window += 1
        self.stepped, self.backward_since_step = True, False


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




def find_mode_dependent(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules of `model` that train differently from how they evaluate, in its trained part:
    dropout with p > 0 and batch norm, each whose parent holds a parameter that requires grad (a frozen
    encoder kept in eval() on purpose, as a linear probe does, is not the trained part)."""
    found = []
    for parent_name, parent in model.named_modules():
        trained = None
        for name, child in parent.named_children():
            if not ((isinstance(child, DROPOUT_MODULES) and float(child.p) > 0)
                    or isinstance(child, BATCH_NORM_MODULES)):
                continue
            if trained is None:
                trained = any(p.requires_grad for p in parent.parameters())
            if trained:
                found.append((f"{parent_name}.{name}" if parent_name else name, child))
    return found


# Elements read per weight matrix for its typical size: a strided sample (a 7B model's first step
# would otherwise read every weight once more).
RMS_SAMPLE = 65_536


def matrix_rms(optimizer, embeddings: set = frozenset()) -> list:
    """Per param group, the median RMS of the trainable weight matrices it holds (2-D and up, embedding
    tables, ids in `embeddings`, left out: nn.Embedding starts at std 1), or None for a group with none:
    the typical size the first update is compared with (lr-schedule)."""
    out = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            sizes = []
            for p in group["params"]:
                if p.dim() < 2 or not p.requires_grad or p.is_meta or type(p.data) is not torch.Tensor \
                        or id(p) in embeddings:
                    continue
                flat = p.detach().reshape(-1)
                sample = flat[::max(1, flat.numel() // RMS_SAMPLE)].float()
                sizes.append(float(sample.pow(2).mean().sqrt()))
            out.append(sorted(sizes)[len(sizes) // 2] if sizes else None)
    return out


def finish(recorder: Recorder, caught) -> Trace:
    """The Trace of what `recorder` saw, with the warnings `caught` while it recorded: called once,
    when the loop returned (record_loop) or the script stopped (record_script)."""
    recorder.read_unread()
    for data, ref in recorder.mode_calls:  # which train()/eval() calls reached the recorded model
        module = ref()
        data["on_model"] = module is not None and (any(m is recorder.model for m in module.modules())
                                                   or any(m is module for m in recorder.model.modules()))
    recorder.mode_calls = []
    optimizers = []
    for optimizer in recorder.optimizers.values():
        groups = [{k: _plain(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizers.append(OptimizerRecord(type(optimizer).__name__, id(optimizer), groups,
                                          _composition(recorder.model, optimizer)))
    schedules = [schedule_record(s["name"], s["steps"], s["optimizer"], s["snapshot"])
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
                  grad_rescale=dict(recorder.grad_rescale), updates=recorder.updates.steps)
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
