"""The script recorder: the loop recorder (recorder.py) bound late to whichever model the script
trains, since which one is not known in advance:
- the first top-level `nn.Module` call with trainable parameters under grad mode (a frozen teacher
  run under no_grad is passed over) becomes the recorded model, and a copy of it is taken right
  then, before its first forward (snapshot.py: the state the model checks judge, init-loss sees the
  real init; a model sharded with FSDP2 is gathered whole first);
- at the first optimizer step the model is settled: the outermost module called whose parameters
  the stepped optimizer holds (a different module than the one bound is rebound, with a warning);
  DDP, torch.compile and similar wrappers are unwrapped for the checks (wrappers.py);
- after K optimizer steps (all optimizers of the step stepped) it stops the script (recording/stopping.py).

It also sees how the script calls its model (the recorded forward), which LM a wrapper module
holds, and whether a checkpoint was loaded first; discovery.py turns that into facts.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from typing import Any, Callable, Optional

import torch

from tfdoctor.recording.collectives import watching_collectives
from tfdoctor.recording.events import EventKind
from tfdoctor.recording.grads import params_of
from tfdoctor.recording.pretrained import pretrained_loads
from tfdoctor.recording.recorder import Recorder, compiling
from tfdoctor.recording.script_objects import find_eos_ids, find_tokenizers, script_objects
from tfdoctor.recording.snapshot import snapshot_model, why_uncopied
from tfdoctor.recording.stopping import Stopper
from tfdoctor.recording.wrappers import lightning_module_on_stack, redirected, unwrap
from tfdoctor.subject import extract_logits, vocab_size_of
from tfdoctor.usercode.call_sites import call_site
from tfdoctor.usercode.patches import Patches


class _Unbound(torch.nn.Module):
    """Stands in for the model until the script calls one: no parameters, never called."""

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise RuntimeError("unbound")


def _describe_value(value) -> dict:
    """What one argument of the recorded forward was, enough to rebuild it for other ids."""
    if isinstance(value, torch.Tensor):
        return {"tensor": True, "dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape),
                "floating": value.is_floating_point(), "value": value.detach()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"tensor": False, "value": value}
    return {"tensor": False, "value": value, "opaque": type(value).__name__}


def _describe_call_args(args, kwargs) -> dict:
    return {"args": [_describe_value(a) for a in args], "kwargs": {k: _describe_value(v) for k, v in kwargs.items()}}


class ScriptRecorder(Recorder):
    """The loop recorder, bound to whichever model the script trains, stopping after `steps` steps.

    A script may train several models, each with its own optimizer (an LM and a value head, a GAN's
    pair, a draft model beside the main one). One of them is audited: `wanted` (the class name or
    the script's variable name, `--model NAME`), else the one with the most trained parameters among
    the models called before the first optimizer step. The others' steps, backwards, forwards,
    clips and zero_grads are left out of the trace, so the loop checks judge the audited model's
    loop alone; they are named in `others`."""

    def __init__(self, steps: int, wanted: Optional[str] = None):
        super().__init__(_Unbound())
        self.stop_after = steps
        self.wanted = wanted
        self.built = weakref.WeakSet()  # every optimizer the script constructed, stepped or not yet
        self.others: list[dict] = []  # the other trained models: class, names, trained parameters
        self.unmatched: Optional[str] = None  # `wanted` matched no model: the line that says so
        self.tokenizers: list[tuple[str, Any]] = []  # (where it was found, object with pad_token_id)
        self.eos_ids: list[tuple[str, int]] = []  # (where, eos_token_id) of the tokenizers it holds
        self.param_ids: set[int] = set()  # the bound model's parameters
        self.other_ids: set[int] = set()  # the other candidates' parameters (not the bound model's)
        self.calls: dict[int, dict] = {}  # id(module) -> its first forward under grad, described
        self.reaching: Optional[frozenset] = None  # parameters the running backward reaches
        self.bound: Optional[torch.nn.Module] = None
        self.top: dict[int, torch.nn.Module] = {}  # top-level modules called with trainable parameters
        self.depth = 0
        self.forward_collectives: dict[str, str] = {}  # collectives called inside a forward -> the user's line
        self.loaded: dict[int, str] = {}  # id(module) -> where load_state_dict was called on it
        self.snapshot: Optional[torch.nn.Module] = None
        self.uncopied: Optional[str] = None  # why there is no snapshot (a sharded model): model checks skip
        self.snapshot_loaded: Optional[str] = None  # a checkpoint loaded into the model before its copy
        self.settled = False
        self.rebound: Optional[str] = None
        self.stopped_at: Optional[str] = None
        self.bound_forward = Patches()  # the bound model's class forward, wrapped (bind), undone at a rebind
        self.on_stop: Optional[Callable[[], None]] = None  # called at the stop point, before unwinding
        self.stop_error: Optional[BaseException] = None
        self.stopper = Stopper()  # raises the stop, again when the script catches it
        self.hooks: dict[int, list] = {}  # id(module) -> the forward hooks on each candidate model
        self.audited: Optional[dict] = None  # the settled model: class, names, trained parameters
        self.redirected: list[bool] = []  # per running hooked forward: Lightning's redirection?
        self.lightning: Optional[torch.nn.Module] = None  # the LightningModule stepping, in a Lightning script
        # A candidate whose forward returns no logits (a LightningModule's forward(x, y) -> loss) but calls
        # an LM it holds that does: per candidate, seen during its first forward under grad (`opening`).
        self.opening: Optional[torch.nn.Module] = None
        self.logits_returned: dict[int, bool] = {}  # id(module) -> whether its first forward returned logits
        self.held_lm: dict[int, tuple[torch.nn.Module, dict]] = {}  # id(module) -> (the LM, its call described)
        self.vocab_of: dict[int, Optional[int]] = {}  # id(candidate) -> its vocabulary size, read once
        self.logits_shapes: dict[int, list[int]] = {}  # id(module) -> shape of the logits its first forward gave
        # A candidate returning neither logits nor a directly called LM: the outermost module deeper inside
        # its first forward that returned [B, T, V] scores (x-transformers' XTransformer -> decoder -> net).
        self.deep_lm: dict[int, tuple] = {}  # id(module) -> (depth, that module or None, its output until read)

    # ------------------------------------------------------------------ binding

    @property
    def call(self) -> Optional[dict]:
        """The first forward of the bound model under grad mode: args and kwargs described."""
        return self.calls.get(id(self.bound)) if self.bound is not None else None

    def bind(self, module: torch.nn.Module) -> None:
        self.bound_forward.undo()
        self.model = module
        self.bound = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = {id(p): name for name, p in module.named_parameters()}
        self._split_parameters()
        self.after_backward = self.sampled = None  # samples of the former model's gradients
        inner = unwrap(module)
        self.vocab = vocab_size_of(inner)
        self.busy = True  # the copy's tensor calls are not the script's
        self.unhook_candidate(module)  # the copy must not carry (nor deep-copy) the recorder's own hooks
        self.uncopied = None
        try:
            self.snapshot = snapshot_model(inner)
        except Exception as error:  # noqa: BLE001 - a model that refuses a copy: its model checks skip
            self.snapshot, self.uncopied = None, why_uncopied(inner, error)
        finally:
            self.busy = False
            self.hook_candidate(module)
        self.snapshot_loaded = next((where for m in inner.modules() for where in [self.loaded.get(id(m))]
                                     if where), None)
        # `model.forward(x)` called directly skips module hooks: as record_loop does, the class's
        # forward is wrapped, recording only for this module and only when no hook did.
        self.bound_forward.wrap(type(module), "forward", self.direct_forward)

    def _split_parameters(self) -> None:
        self.param_ids = {id(p) for p in self.bound.parameters()} if self.bound is not None else set()
        self.other_ids = {id(p) for m in self.top.values() if m is not self.bound
                          for p in m.parameters()} - self.param_ids

    def hook_candidate(self, module: torch.nn.Module) -> None:
        """Every candidate's forwards are recorded, tagged with it: which one is audited is settled
        at the first optimizer step, and the others' forwards are dropped then (keep_own_events)."""
        if id(module) in self.hooks:
            return
        self.hooks[id(module)] = [module.register_forward_pre_hook(self.forward_pre, with_kwargs=True),
                                  module.register_forward_hook(self.forward_post, with_kwargs=True)]

    def unhook_candidate(self, module: torch.nn.Module) -> None:
        for handle in self.hooks.pop(id(module), []):
            handle.remove()

    def forward_pre(self, module, args, kwargs):
        if not self.record or compiling():
            return
        self.redirected.append(redirected(module))
        if self.redirected[-1]:  # Lightning calling training_step through a wrapper: the model's call is inside
            return
        grad = torch.is_grad_enabled()
        if grad and id(module) not in self.calls:
            self.calls[id(module)] = dict(_describe_call_args(args, kwargs), where=call_site())  # SARIF's line
            if self.opening is None and not self.in_forward:
                self.opening = module
        super().forward_pre(module, args, kwargs)
        self.events[-1].data["module"] = id(module)
        if not self.in_forward > 1:
            self.events[-1].data["grad"] = grad  # an evaluation forward under no_grad is not a batch

    def forward_post(self, module, args, kwargs, output):
        if compiling():
            return
        if self.record and self.redirected and self.redirected.pop():
            return
        if module is self.opening and self.in_forward <= 1:
            self.opening = None
            logits = self._logits(output, module)
            self.logits_returned[id(module)] = logits is not None
            if logits is not None:
                self.logits_shapes[id(module)] = list(logits.shape)
            deep = self.deep_lm.get(id(module))
            if deep is not None:
                if logits is None and deep[1] is not None:
                    self.inner_scores(deep[1], deep[2])
                self.deep_lm[id(module)] = deep[:2] + (None,)  # no hold on that forward's graph
        super().forward_post(module, args, kwargs, output)

    def inner_call(self, module: torch.nn.Module, args, kwargs, output) -> None:
        """A module called directly from a candidate's first forward: the first one with trainable
        parameters that returns scores over the vocabulary is the LM the candidate runs."""
        opening = self.opening
        if id(opening) in self.held_lm or not any(p.requires_grad for p in module.parameters()):
            return
        logits = self._logits(output, opening)
        if logits is not None:
            self.held_lm[id(opening)] = (module, _describe_call_args(args, kwargs))
            self.logits_shapes.setdefault(id(module), list(logits.shape))
            self.inner_scores(module, output)

    def deep_call(self, module: torch.nn.Module, output) -> None:
        """A module called further down a candidate's first forward: the outermost one returning logits
        [B, T, V] is kept (see logits.py), in case neither the candidate nor a module it calls does."""
        held = self.deep_lm.get(id(self.opening))
        logits = self._logits(output, self.opening)
        if logits is None or logits.dim() != 3:
            # A trained module returning after the kept one, outside it: the kept one's [B, T, d] output was
            # a hidden state whose width happens to equal V (an MLP's), not the logits the loss read.
            if held is not None and held[1] is not None and any(p.requires_grad for p in module.parameters()) \
                    and not any(m is held[1] for m in module.modules()):
                self.deep_lm[id(self.opening)] = (held[0], None, None)
            return
        if held is None or held[1] is None or any(m is held[1] for m in module.modules()):
            self.deep_lm[id(self.opening)] = (self.depth, module, output)  # the outermost module returning them

    def inner_scores(self, module: torch.nn.Module, output) -> None:
        """Logits returned by the LM inside the running forward (held, or deeper): scored rows the loop
        grades even when the loss is computed without a softmax call tfdoctor sees (x-transformers'
        logsumexp cross-entropy). Rows the model's own output also reaches are left to it (_forward_ends)."""
        if not self.record or not self.in_forward:
            return
        try:
            logits = extract_logits(output)
        except Exception:  # noqa: BLE001 - no logits in this call's output
            return
        if isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.requires_grad \
                and logits.dim() >= 2 and logits.shape[-1] == self.vocab:
            self.pending.append((logits, logits.dim() - 1, f"{type(module).__name__} output"))

    def graded_classes(self, tensor: torch.Tensor, dim: int, output=None) -> bool:
        """The vocabulary, or a token classifier's labels: scores over C classes (not the vocabulary)
        with one row per position of the bound model's last training input ids ([B, T, C], [B * T, C]
        or [B, C, T]), graded by a loss outside the model or returned beside the loss the model
        computed from them (`labels=`): what discovery.discover_task calls token classification.
        Under `run` the labels are not known before the scores show them, as under check --train."""
        if super().graded_classes(tensor, dim):
            return True
        classes = tensor.shape[dim]
        # Inside a forward only the vocabulary (a softmax there over [B, T, T] is attention), and a bare
        # [B, T, d] the model returns is as likely a hidden state its loop feeds a head as labels' scores.
        if self.in_forward or self.bound is None or classes < 2 or classes == self.vocab:
            return False
        if output is not None and _carried_loss(output) is None:
            return False
        forward = next((e.data for e in reversed(self.events) if e.kind == "forward"
                        and e.data.get("module") == id(self.bound) and e.data.get("grad")), None)
        if forward is None:
            return False
        rows = tensor.numel() // classes
        per_position = tuple(tensor.shape[:dim] + tensor.shape[dim + 1:])
        return any(ids.numel() == rows and (tensor.dim() == 2 or per_position == tuple(ids.shape))
                   for _, ids in forward["inputs"])

    @property
    def scoring(self) -> set:
        """ids of the modules inside the audited model whose outputs are its logits."""
        if self.bound is None:
            return set()
        held, deep = self.held_lm.get(id(self.bound)), self.deep_lm.get(id(self.bound))
        return {id(m) for m in (held[0] if held else None, deep[1] if deep else None) if m is not None}

    @property
    def deep(self) -> Optional[torch.nn.Module]:
        """The module deeper inside the bound model's first forward whose output is its logits, or None."""
        held = self.deep_lm.get(id(self.bound)) if self.bound is not None else None
        return held[1] if held is not None else None

    @property
    def returns_logits(self) -> Optional[bool]:
        """Whether the bound model's first forward returned logits (None: not seen)."""
        return self.logits_returned.get(id(self.bound)) if self.bound is not None else None

    @property
    def inner(self) -> Optional[tuple[torch.nn.Module, dict]]:
        """The LM the bound model called from its first forward, and how, or None."""
        return self.held_lm.get(id(self.bound)) if self.bound is not None else None

    def _logits(self, output, owner: torch.nn.Module) -> Optional[torch.Tensor]:
        """`output`'s scores over the vocabulary of `owner` (the candidate whose first forward is open)."""
        try:
            logits = extract_logits(output)
        except Exception:  # a bare loss, an output with no logits in it
            return None
        vocab = self.vocab_of.get(id(owner))
        if vocab is None:  # read once per candidate: a first forward makes hundreds of module calls
            vocab = self.vocab_of[id(owner)] = vocab_size_of(unwrap(owner))
        ok = isinstance(logits, torch.Tensor) and logits.dim() >= 2 and logits.shape[-1] == vocab
        return logits if ok else None

    def top_call(self, module: torch.nn.Module) -> None:
        """A module called from outside any other module's forward."""
        if isinstance(module, _Unbound):
            return
        if id(module) not in self.top:
            if not any(p.requires_grad for p in module.parameters()):
                return  # a loss module, a frozen encoder
            self.top[id(module)] = module
            self.hook_candidate(module)
            self._split_parameters()
        if self.bound is None and torch.is_grad_enabled():  # an evaluation under no_grad comes first
            self.bind(module)

    def settle(self, optimizer) -> None:
        """At the first optimizer step, once a module was called: the model is the called module with
        the most parameters that an optimizer holds (this one or any the script built), or the one
        `wanted` names. A step that runs its loop inside (`optimizer.step(closure)`, Lightning without
        accumulation) may come before any call: then it is settled when the closure returns, before
        that step is recorded (_record_step)."""
        if self.lightning is None:
            self.lightning = lightning_module_on_stack()
        candidates = list(self.top.values())
        if not candidates:
            return
        self.settled = True
        objects = script_objects()
        self.tokenizers = find_tokenizers(objects)
        self.eos_ids = find_eos_ids(objects)
        held = {id(p) for opt in [optimizer, *self.built] for p in params_of(opt)}
        trained = {id(m): sum(p.numel() for p in m.parameters() if id(p) in held) for m in candidates}
        models = [m for m in candidates if trained[id(m)]]
        if not models:
            return
        names = {id(m): _names_of(m, objects) for m in models}

        def described(m) -> dict:
            return {"model": type(unwrap(m)).__name__, "names": names[id(m)], "trained_parameters": trained[id(m)]}

        if self.wanted is not None:
            matches = [m for m in models if self.wanted == type(unwrap(m)).__name__ or self.wanted in names[id(m)]]
            if len(matches) != 1:
                listing = "; ".join(_listed(described(m)) for m in models)
                how = "matches none" if not matches else f"matches {len(matches)}"
                self.unmatched = f"--model {self.wanted} {how} of the models the script trains: {listing}"
                self.stop()
            best = matches[0]
        else:
            best = max(models, key=lambda m: (trained[id(m)], m is self.bound))
        # A module sharing parameters with the audited one is part of it (the LM a LightningModule holds,
        # called on its own in training_step), not another model.
        own = {id(p) for p in best.parameters()}
        self.others = [described(m) for m in models if m is not best and not any(id(p) in own for p in m.parameters())]
        if best is not self.bound:
            if not self.others:
                before = type(unwrap(self.bound)).__name__ if self.bound is not None else "nothing"
                self.rebound = (f"the first module called with trainable parameters ({before}) is not the one "
                                f"the optimizer trains ({type(unwrap(best)).__name__}); the first micro-batches "
                                "were recorded on the former")
            self.bind(best)
        self.audited = described(best)

    def owns(self, params) -> bool:
        """False for another trained model's parameters, none of the audited one's: its clip,
        zero_grad, scaler and scheduler calls (and its optimizer steps) pass unrecorded."""
        return self._owns_ids({id(p) for p in params})

    def _owns_ids(self, ids) -> bool:
        return not self.other_ids or bool(ids & self.param_ids) or not ids & self.other_ids

    # ------------------------------------------------------------------ other models' calls pass unrecorded

    def event(self, kind: EventKind, **data: Any) -> dict[str, Any]:
        if kind == "backward" and self.reaching is not None:
            data["reaches"] = self.reaching
        return super().event(kind, **data)

    def _backward(self, func, args, kwargs):
        # Until the model is settled, or while several are trained, a backward carries the parameters
        # it reaches: another model's backward is dropped from the trace at the end.
        several = not self.settled or len(self.top) > 1
        self.reaching = _reached(args[0]) if several and isinstance(args[0], torch.Tensor) else None
        try:
            return super()._backward(func, args, kwargs)
        finally:
            self.reaching = None

    def keep_own_events(self) -> None:
        """Drop what concerns the other modules called: their forwards (and the losses and scores read
        off them) and the backwards that reach only another model's parameters; the backward indices
        the losses and scores carry are renumbered."""
        self.read_unread()
        own = id(self.bound) if self.bound is not None else None
        dropped_forwards = {e.data["index"] for e in self.events
                            if e.kind == "forward" and e.data.get("module") not in (None, own)}
        dropped = {i for i, e in enumerate(self.events)
                   if (e.kind == "forward" and e.data["index"] in dropped_forwards)
                   or (e.kind == "backward" and self._foreign_reach(e.data.pop("reaches", None)))}
        for i, e in enumerate(self.events):
            if e.kind == "loss":
                backward = e.data.get("backward")
                if (e.data.get("forward") in dropped_forwards) if backward is None else backward in dropped:
                    dropped.add(i)
        if not dropped:
            return
        renumbered, kept = {}, []
        for i, e in enumerate(self.events):
            if i not in dropped:
                renumbered[i] = len(kept)
                kept.append(e)
        for e in kept:
            if e.kind == "loss" and e.data.get("backward") is not None:
                e.data["backward"] = renumbered[e.data["backward"]]
        scores = []
        for entry in self.scores:
            if entry.get("forward") in dropped_forwards or entry.get("backward") in dropped:
                continue
            if entry.get("backward") is not None:
                entry["backward"] = renumbered.get(entry["backward"])
            scores.append(entry)
        self.events, self.scores = kept, scores

    def _foreign_reach(self, reaches: Optional[frozenset]) -> bool:
        """A backward whose graph reached another trained model's parameters only (ids, see reached)."""
        return reaches is not None and not self._owns_ids(reaches)

    # ------------------------------------------------------------------ stopping

    def opt_pre(self, optimizer, args, kwargs):
        if self.stopper.raised:  # the script caught the stop and trains on: stop it before this step
            self.stopper.stop()
        if self.record and not self.settled:
            self.settle(optimizer)
        if not self.owns(params_of(optimizer)):
            return None  # another model's step: not a step of the audited loop
        return super().opt_pre(optimizer, args, kwargs)

    def _record_step(self, optimizer) -> None:
        if self.record and not self.settled:  # a closure step whose closure made the first calls
            self.settle(optimizer)
            if not self.owns(params_of(optimizer)):
                self.optimizers.pop(id(optimizer), None)  # another model's step, known only now
                return
        super()._record_step(optimizer)

    def opt_post(self, optimizer, args, kwargs):
        if not self.owns(params_of(optimizer)):
            return
        super().opt_post(optimizer, args, kwargs)
        if self.window < self.stop_after:
            return
        per_step = Counter(e.window for e in self.of_kind("opt_step"))
        # Several optimizers stepped together (Muon + AdamW) make one step: stop after the last of them.
        if per_step.get(self.stop_after - 1, 0) >= per_step.get(0, 1):
            self.stop()

    def _manual_update(self) -> None:
        super()._manual_update()
        if self.window >= self.stop_after and not self.optimizers:
            self.stop()

    def stop(self) -> None:
        if not self.stopper.raised:
            self.stopped_at = call_site()
            self.meet()
            self.record = False  # whatever the script does after the stop (if it catches it) is not judged
        self.stopper.stop()

    def unrecorded(self, func, args, kwargs):
        if self.stopper.raised and func is torch.Tensor.backward:  # the script caught the stop
            self.stopper.stop()
        return func(*args, **kwargs)

    def meet(self) -> None:
        """A distributed run: the ranks meet here (see RankSession.gather), once."""
        if self.on_stop is not None:
            self.busy = True
            try:
                with self.quiet():
                    self.on_stop()
            except BaseException as error:  # raised after the script unwound, past its own handlers
                self.stop_error = error
            finally:
                self.busy = False
            self.on_stop = None

    def of_kind(self, kind: str):
        return (e for e in self.events if e.kind == kind)

    # ------------------------------------------------------------------ install

    def installed_process_wide(self):
        """The recorder's patches and hooks, plus the two this driver needs: Module.__call__ (to bind
        the model at its first call) and Module.load_state_dict (to see a checkpoint loaded)."""
        import contextlib

        recorder = self

        @contextlib.contextmanager
        def installed():
            module_cls = torch.nn.Module
            call_original = module_cls.__dict__["__call__"]
            load_original = module_cls.__dict__["load_state_dict"]
            optimizer_init = torch.optim.Optimizer.__dict__["__init__"]

            @functools.wraps(call_original)
            def __call__(module, *args, **kwargs):
                if compiling() or recorder.current_backward is not None:
                    # torch.compile tracing the model's inside (the outermost call is recorded), or gradient
                    # checkpointing recomputing its segments inside backward(), stopped early by an
                    # exception: not the script's forwards, and no candidates (Trainer, TRL's default)
                    return call_original(module, *args, **kwargs)
                if recorder.depth == 0 and recorder.record and not recorder.busy:
                    if redirected(module):  # not counted: the model called inside it is the top-level call
                        return call_original(module, *args, **kwargs)
                    recorder.top_call(module)
                # model.compile() in place: its hooks run inside the compiled region, where they step
                # aside, so they run here, around it
                around = module.__dict__.get("_compiled_call_impl") is not None and id(module) in recorder.hooks
                if around:
                    recorder.forward_pre(module, args, kwargs)
                recorder.depth += 1
                try:
                    output = call_original(module, *args, **kwargs)
                finally:
                    recorder.depth -= 1
                if around:
                    recorder.forward_post(module, args, kwargs, output)
                if recorder.depth == 1 and recorder.opening is not None:  # called by a candidate's first forward
                    recorder.inner_call(module, args, kwargs, output)
                elif recorder.depth > 1 and recorder.opening is not None:
                    recorder.deep_call(module, output)
                elif recorder.in_forward and recorder.opening is None and id(module) in recorder.scoring:
                    recorder.inner_scores(module, output)
                return output

            @functools.wraps(load_original)
            def load_state_dict(module, *args, **kwargs):
                recorder.loaded.setdefault(id(module), call_site() or "a library call")
                return load_original(module, *args, **kwargs)

            @functools.wraps(optimizer_init)
            def init_optimizer(optimizer, *args, **kwargs):
                optimizer_init(optimizer, *args, **kwargs)
                recorder.built.add(optimizer)  # which models are trained is known before they step

            try:
                with Patches() as patches:
                    patches.setattr(module_cls, "__call__", __call__)
                    patches.setattr(module_cls, "load_state_dict", load_state_dict)
                    patches.setattr(torch.optim.Optimizer, "__init__", init_optimizer)
                    with recorder.installed(None), pretrained_loads(recorder.loaded), \
                            watching_collectives(lambda: recorder.depth > 0, recorder.forward_collectives):
                        yield
            finally:
                recorder.bound_forward.undo()
                for handles in recorder.hooks.values():
                    for handle in handles:
                        handle.remove()
                recorder.hooks = {}
                recorder.keep_own_events()

        return installed()


def _reached(root: torch.Tensor) -> frozenset:
    """ids of the leaf tensors (parameters) the autograd graph below `root` accumulates into."""
    reached, seen = set(), set()
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: its parameter
        if variable is not None:
            reached.add(id(variable))
        stack.extend(nxt for nxt, _ in node.next_functions)
    return frozenset(reached)


def _names_of(module: torch.nn.Module, objects) -> list[str]:
    inner = unwrap(module)
    names = [name for name, value in objects if isinstance(value, torch.nn.Module)
             and (value is module or unwrap(value) is inner)]
    return list(dict.fromkeys(names))


def _listed(model: dict) -> str:
    names = f" ({', '.join(model['names'])})" if model["names"] else ""
    return f"{model['model']}{names}, {model['trained_parameters']:,} trained parameters"


def _carried_loss(output) -> Optional[torch.Tensor]:
    """The loss a model returned beside its scores (a Hugging Face output's `.loss`, a dict's "loss"), or None."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None
