"""The script driver of the recorder: run an unmodified training script as __main__ (`tfdoctor run`),
record its first optimizer steps with the same recorder `check --train` uses, and stop it there.

`record_script(...)` runs the script like `python train.py ARGS` (its own sys.argv, sys.path[0] its
folder, the current directory unchanged) or `python -m pkg.mod ARGS`, with the recording installed
process-wide. Which model is trained is not known in advance, so the recorder binds late:
- the first top-level `nn.Module` call with trainable parameters under grad mode (a frozen teacher
  run under no_grad is passed over) becomes the recorded model, and a copy of it is taken right
  then, before its first forward: the state the model checks judge (init-loss sees the real init);
- at the first optimizer step the model is settled: the outermost module called whose parameters
  the stepped optimizer holds (a different module than the one bound is rebound, with a warning);
  DDP, torch.compile and similar wrappers are unwrapped for the checks;
- after K optimizer steps (all optimizers of the step stepped) a private BaseException is raised
  out of optimizer.step (for a loop that updates the weights by hand: out of the next backward), so
  the script's finally blocks run and nothing it would do after the stop point (a checkpoint, a
  log) is reached.

What the script did also tells how it calls its model (the recorded forward), what its batches look
like (shape, pad id from the -100 / ignore_index masking, the attention mask or runs of one id at
the rows' ends, padding side) and whether it loaded a checkpoint first: `discover` turns that into
the facts the report shows under "discovered" and the Subject the model checks run on.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import runpy
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from tfdoctor.errors import LoadError
from tfdoctor.probes.trace import Trace, _finish, _Recorder, isolated_copy
from tfdoctor.recording.sites import call_site, display_path, raised_at
from tfdoctor.subject import PACKING_POSITION_IDS as PACKING_BY_POSITION_IDS, vocab_size_of

# Probe length for the model checks when the script's batches are longer: the dependency map and
# the padding probes cost one perturbed row per position, and every masking bug they catch shows at
# any length, so the battery stays at seconds on a CPU for a 1024-token script.
MAX_PROBE_SEQ_LEN = 64
# A pad id read off the batches must explain this share of the positions its evidence marks (the
# attention mask's zeros, the targets set to ignore_index): prompt tokens masked with -100 in
# instruction tuning spread over many ids and stay below it.
PAD_SHARE_MIN = 0.9
# Runs of one id at the rows' ends read as padding (a script that does not mask its pads) when at
# least this share of the rows ends in such a run, of at least two tokens, with lengths that differ
# (random or natural text almost never does; padded batches always do).
PAD_RUN_ROWS_MIN = 0.5
PAD_RUN_MIN = 2
# Keyword arguments of the recorded forward that the model checks rebuild for their own ids.
_MASK_WORDS = ("mask",)
_POSITION_WORDS = ("position",)
# Arguments that carry document boundaries in packed training (flash-attention varlen, Mamba, custom
# document masks); seen in a recorded forward, they say the rows are packed.
_DOCUMENT_ARGUMENTS = ("doc_ids", "document_ids", "seq_idx", "segment_ids", "sequence_ids")


class ScriptError(LoadError):
    """The script could not be audited: it raised, exited or ended before its first optimizer step."""


class _StopScript(BaseException):
    """Raised out of the script's optimizer step once the steps asked for are recorded. A BaseException
    so that the script's own `except Exception` handlers let it through, as they do Ctrl-C."""


class _Unbound(torch.nn.Module):
    """Stands in for the model until the script calls one: no parameters, never called."""

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise RuntimeError("unbound")


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside DDP / FSDP (`.module`), torch.compile (`._orig_mod`) and accelerate's
    wrappers, which forward to it."""
    seen = set()
    while id(module) not in seen:
        seen.add(id(module))
        inner = getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            name = type(module).__name__
            inner = getattr(module, "module", None) if name in _WRAPPERS else None
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner
    return module


# Wrappers whose `.module` is the model (a user's own module may also name a submodule `module`).
_WRAPPERS = {"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "OptimizedModule"}


def _describe_value(value) -> dict:
    """What one argument of the recorded forward was, enough to rebuild it for other ids."""
    if isinstance(value, torch.Tensor):
        return {"tensor": True, "dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape),
                "floating": value.is_floating_point(), "value": value.detach()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"tensor": False, "value": value}
    return {"tensor": False, "value": value, "opaque": type(value).__name__}


class ScriptRecorder(_Recorder):
    """The loop recorder, bound to whichever model the script trains, stopping after `steps` steps."""

    def __init__(self, steps: int):
        super().__init__(_Unbound())
        self.stop_after = steps
        self.bound: Optional[torch.nn.Module] = None
        self.top: dict[int, torch.nn.Module] = {}  # top-level modules called with trainable parameters
        self.depth = 0
        self.loaded: dict[int, str] = {}  # id(module) -> where load_state_dict was called on it
        self.snapshot: Optional[torch.nn.Module] = None
        self.snapshot_loaded: Optional[str] = None  # a checkpoint loaded into the model before its copy
        self.call: Optional[dict] = None  # the first forward of the bound model: args and kwargs described
        self.settled = False
        self.rebound: Optional[str] = None
        self.stopped_at: Optional[str] = None
        self.detach: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ binding

    def bind(self, module: torch.nn.Module) -> None:
        for undo in reversed(self.detach):
            undo()
        self.detach = []
        self.model = module
        self.bound = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = {id(p): name for name, p in module.named_parameters()}
        inner = unwrap(module)
        self.vocab = vocab_size_of(inner)
        self.busy = True  # the copy's tensor calls are not the script's
        try:
            self.snapshot = isolated_copy(inner)[0]
            for p in self.snapshot.parameters():
                p.grad = None
        finally:
            self.busy = False
        self.snapshot_loaded = next((where for m in inner.modules() for where in [self.loaded.get(id(m))]
                                     if where), None) or _pretrained(inner)
        handles = [module.register_forward_pre_hook(self.forward_pre, with_kwargs=True),
                   module.register_forward_hook(self.forward_post, with_kwargs=True)]
        self.detach += [h.remove for h in handles]
        # `model.forward(x)` called directly skips module hooks: as record_loop does, the class's
        # forward is wrapped, recording only for this module and only when no hook did.
        cls = type(module)
        own = cls.__dict__.get("forward")
        cls.forward = self.direct_forward(cls.forward)
        self.detach.append(lambda: delattr(cls, "forward") if own is None else setattr(cls, "forward", own))

    def forward_pre(self, module, args, kwargs):
        if not self.record:
            return
        grad = torch.is_grad_enabled()
        if self.call is None and grad:
            self.call = {"args": [_describe_value(a) for a in args],
                         "kwargs": {k: _describe_value(v) for k, v in kwargs.items()}}
        super().forward_pre(module, args, kwargs)
        if not self.in_forward > 1:
            self.events[-1].data["grad"] = grad  # an evaluation forward under no_grad is not a batch

    def top_call(self, module: torch.nn.Module) -> None:
        """A module called from outside any other module's forward."""
        if isinstance(module, _Unbound):
            return
        if id(module) not in self.top:
            if not any(p.requires_grad for p in module.parameters()):
                return  # a loss module, a frozen encoder
            self.top[id(module)] = module
        if self.bound is None and torch.is_grad_enabled():  # an evaluation under no_grad comes first
            self.bind(module)

    def settle(self, optimizer) -> None:
        """At the first optimizer step: the model is the outermost called module holding the most of
        the optimizer's parameters (all of them, for a plain loop)."""
        self.settled = True
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        candidates = list(self.top.values())
        if not candidates:
            return
        best = max(candidates, key=lambda m: (sum(id(p) in held for p in m.parameters()), m is self.bound))
        if best is not self.bound and sum(id(p) in held for p in best.parameters()):
            before = type(unwrap(self.bound)).__name__ if self.bound is not None else "nothing"
            self.rebound = (f"the first module called with trainable parameters ({before}) is not the one "
                            f"the optimizer trains ({type(unwrap(best)).__name__}); the first micro-batches "
                            "were recorded on the former")
            self.bind(best)

    # ------------------------------------------------------------------ stopping

    def opt_pre(self, optimizer, args, kwargs):
        if self.record and not self.settled:
            self.settle(optimizer)
        return super().opt_pre(optimizer, args, kwargs)

    def opt_post(self, optimizer, args, kwargs):
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
        self.stopped_at = call_site()
        raise _StopScript()

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

            @functools.wraps(call_original)
            def __call__(module, *args, **kwargs):
                if recorder.depth == 0 and recorder.record and not recorder.busy:
                    recorder.top_call(module)
                recorder.depth += 1
                try:
                    return call_original(module, *args, **kwargs)
                finally:
                    recorder.depth -= 1

            @functools.wraps(load_original)
            def load_state_dict(module, *args, **kwargs):
                recorder.loaded.setdefault(id(module), call_site() or "a library call")
                return load_original(module, *args, **kwargs)

            module_cls.__call__ = __call__
            module_cls.load_state_dict = load_state_dict
            try:
                with recorder.installed(None):
                    yield
            finally:
                module_cls.__call__ = call_original
                module_cls.load_state_dict = load_original
                for undo in reversed(recorder.detach):
                    undo()
                recorder.detach = []

        return installed()


def _pretrained(model) -> Optional[str]:
    """A Hugging Face model made by from_pretrained names its checkpoint in its config."""
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    return f"from_pretrained({name!r})" if isinstance(name, str) and name else None


# ------------------------------------------------------------------------------------------------
# Running the script


@dataclass
class ScriptRun:
    """What running the script up to its stop point produced."""

    trace: Trace
    recorder: ScriptRecorder
    name: str  # the script as the user named it
    seconds: float  # from the script's start to the stop point
    ended: str  # stopped | finished | exit | raised
    steps_asked: int
    error: Optional[BaseException] = None
    notes: list[str] = field(default_factory=list)


def record_script(path: Optional[str] = None, module: Optional[str] = None, args: tuple = (),
                  steps: int = 2) -> ScriptRun:
    """Run the script (a file `path` or a module `module`) as __main__ with `args` until `steps`
    optimizer steps are recorded. Raises ScriptError when it ends, exits or raises before its first
    step; a KeyboardInterrupt propagates."""
    if (path is None) == (module is None):
        raise ValueError("give a path or a module")
    if path is not None and not os.path.isfile(path):
        raise ScriptError(f"script not found: {path}", "give the path of a Python file, or -m package.module")
    name = path if path is not None else f"-m {module}"
    if module is not None:
        import importlib.util

        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ScriptError(f"module not found: {module}", "run from the folder that holds it, or give a path")
    recorder = ScriptRecorder(steps)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path if path is not None else module, *args]
    if path is not None:  # `python train.py` puts the script's folder first on sys.path
        sys.path[0:1] = [os.path.dirname(os.path.abspath(path))]
    ended, error = "finished", None
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            with recorder.installed_process_wide():
                try:
                    if path is not None:
                        runpy.run_path(path, run_name="__main__")
                    else:
                        runpy.run_module(module, run_name="__main__", alter_sys=True)
                    recorder._manual_update()  # a hand-written update after the last backward
                except _StopScript:
                    ended = "stopped"
        except _StopScript:
            ended = "stopped"
        except SystemExit as exc:
            ended, error = "exit", exc
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # the script's own error: named below, never a traceback
            ended, error = "raised", exc
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
    seconds = time.perf_counter() - started
    trace = _finish(recorder, caught)
    # The script feeds itself: its micro-batches are the forwards of its model under grad mode.
    trace.batches_fed = sum(1 for e in trace.events if e.kind == "forward" and e.data.get("grad", True))
    run = ScriptRun(trace, recorder, name, seconds, ended, steps, error)
    _refuse_unaudited(run)
    if recorder.rebound:
        run.notes.append(recorder.rebound)
    return run


def _refuse_unaudited(run: ScriptRun) -> None:
    trace, recorder, name = run.trace, run.recorder, run.name
    if trace.steps:
        if recorder.bound is None:
            raise ScriptError(f"{name} stepped an optimizer but never called an nn.Module with trainable "
                              "parameters, so there is no model to audit")
        if run.ended != "stopped":
            how = {"finished": "ended", "exit": f"called sys.exit({_exit_code(run.error)!r})",
                   "raised": f"raised {type(run.error).__name__}: {run.error}"}[run.ended]
            where = f" at {raised_at(run.error)}" if run.error is not None and raised_at(run.error) else ""
            run.notes.append(f"the script {how}{where} after {trace.steps} of the {run.steps_asked} "
                             "optimizer steps asked for; judged on those")
        return
    where = f" at {raised_at(run.error)}" if run.error is not None and raised_at(run.error) else ""
    if run.ended == "raised":
        raise ScriptError(f"{name} raised {type(run.error).__name__}: {run.error}{where} before its first "
                          "optimizer step", "fix the script so that `python` runs it (TFDOCTOR_DEBUG=1 shows "
                                            "the traceback)") from run.error
    if run.ended == "exit":
        raise ScriptError(f"{name} called sys.exit({_exit_code(run.error)!r}){where} before its first "
                          "optimizer step", "check the script's arguments (give them after --)") from run.error
    forwards = sum(1 for e in trace.events if e.kind == "forward")
    backwards = sum(1 for e in trace.events if e.kind == "backward")
    raise ScriptError(f"{name} ended without an optimizer step: {forwards} forward(s) of a model and "
                      f"{backwards} backward() call(s) seen",
                      "give it arguments that make it train (after --), e.g. more iterations")


def _exit_code(error) -> Any:
    code = getattr(error, "code", None)
    return code if code is None or isinstance(code, int) else str(code)


# ------------------------------------------------------------------------------------------------
# Discovery


def _training_forwards(trace: Trace) -> list[dict]:
    return [e.data for e in trace.events if e.kind == "forward" and e.data.get("grad", True)]


def _ids_key(call: Optional[dict]) -> Optional[tuple[str, Any]]:
    """Where the token ids sit in the recorded call: ("arg", i) or ("kwarg", name)."""
    if call is None:
        return None
    for i, spec in enumerate(call["args"]):
        if spec["tensor"] and not spec["floating"] and len(spec["shape"]) == 2:
            return ("arg", i)
    for name in ("input_ids", "idx", "ids", "tokens", "x", "src"):
        spec = call["kwargs"].get(name)
        if spec and spec["tensor"] and not spec["floating"] and len(spec["shape"]) == 2:
            return ("kwarg", name)
    return None


def _first_ids(trace: Trace, call: Optional[dict]) -> Optional[torch.Tensor]:
    key = _ids_key(call)
    if key is None:
        return None
    spec = call["args"][key[1]] if key[0] == "arg" else call["kwargs"][key[1]]
    return spec["value"]


def _all_ids(trace: Trace, call: Optional[dict]) -> list[torch.Tensor]:
    """The token ids of every recorded forward (the real batches)."""
    key = _ids_key(call)
    if key is None:
        return []
    name = str(key[1])
    return [dict(f["inputs"])[name] for f in _training_forwards(trace) if name in dict(f["inputs"])]


def _majority(values: torch.Tensor) -> Optional[tuple[int, float]]:
    if values.numel() == 0:
        return None
    ids, counts = values.unique(return_counts=True)
    top = int(counts.argmax())
    return int(ids[top]), float(counts[top]) / values.numel()


def _side(ids: torch.Tensor, pad: int) -> Optional[str]:
    """Where the pads of these rows sit: "right" (after the tokens), "left", or None."""
    is_pad = ids == pad
    rows = is_pad.any(-1)
    if not bool(rows.any()):
        return None
    right = bool((is_pad[:, -1] | ~rows).all())
    left = bool((is_pad[:, 0] | ~rows).all())
    return "right" if right and not left else "left" if left and not right else None


def discover_padding(trace: Trace, call: Optional[dict]) -> dict:
    """pad_id, where it was read from, and padding side, from what the batches show."""
    batches = _all_ids(trace, call)
    if not batches:
        return {}
    found: Optional[tuple[int, str]] = None
    forwards = _training_forwards(trace)
    key = str(_ids_key(call)[1])
    # 1. an attention mask given to the model: the ids where it is 0; 2. labels= set to -100 where the
    # ids are pads (Hugging Face)
    for other, blank, source in (("attention_mask", 0, "attention_mask"), ("labels", -100, "labels == -100")):
        values = [inputs[key][inputs[other] == blank] for inputs in (dict(f["inputs"]) for f in forwards)
                  if key in inputs and other in inputs and inputs[other].shape == inputs[key].shape]
        best = _majority(torch.cat(values)) if values else None
        if best and best[1] >= PAD_SHARE_MIN:
            found = (best[0], source)
            break
    # 3. loss targets equal to the loss's ignore_index: the target of position t is input t+1
    if found is None:
        values = []
        by_forward = {f["index"]: dict(f["inputs"]).get(key) for f in forwards}
        for loss in (e.data for e in trace.events if e.kind == "loss" and "targets" in e.data):
            targets = loss["targets"]
            ids = by_forward.get(loss["forward"])  # the forward whose output this loss graded
            if ids is None or ids.numel() != targets.numel():
                continue
            ignored = (targets.reshape(ids.shape) == loss["ignore_index"])[:, :-1]
            values.append(ids[:, 1:][ignored])
        best = _majority(torch.cat(values)) if values else None
        if best and best[1] >= PAD_SHARE_MIN:
            found = (best[0], "targets set to ignore_index")
    # 4. rows that end (or start) in a run of one id, of differing lengths: padding nobody masks
    if found is None:
        found = _runs(batches)
    if found is None:
        return {}
    pad, source = found
    sides = Counter(s for s in (_side(ids, pad) for ids in batches) if s)
    side = sides.most_common(1)[0][0] if sides else None
    return {"pad_id": pad, "pad_id_source": source, "padding_side": side}


def discover_packing(trace: Trace) -> dict:
    """Whether the script trains on packed rows, as the recorded forwards show it: a document-id
    argument, or position ids that restart inside a row (the Hugging Face flattening collator).
    Either turns packing-isolation on (see _packing_for)."""
    for forward in _training_forwards(trace):
        inputs = dict(forward["inputs"])
        positions = inputs.get("position_ids")
        named = next((name for name in _DOCUMENT_ARGUMENTS if name in inputs), None)
        if named:
            return {"packed": "documents", "packed_source": f"a document-id argument ({named}=...)"}
        if positions is not None and positions.shape[-1] > 1 and bool((positions[:, 1:] <= positions[:, :-1]).any()):
            return {"packed": "position_ids", "packed_source": "position_ids restart inside a row"}
    return {}


def _runs(batches: list[torch.Tensor]) -> Optional[tuple[int, str]]:
    for where, flip in (("end", False), ("start", True)):
        runs = []
        for ids in batches:
            rows = ids.flip(-1) if flip else ids
            for row in rows:
                value = int(row[-1])
                same = (row == value).flip(0).int().cumprod(0)
                runs.append((value, int(same.sum())))
        if not runs:
            continue
        value, _ = Counter(v for v, _ in runs).most_common(1)[0]
        lengths = [n for v, n in runs if v == value and n >= PAD_RUN_MIN]
        if len(lengths) >= PAD_RUN_ROWS_MIN * len(runs) and len(set(lengths)) > 1:
            return value, f"runs of one id at the rows' {where}"
    return None


def _describe_call(call: Optional[dict], ids_key) -> str:
    """model(ids, targets) / model(input_ids=ids, labels=..., attention_mask=...)."""
    if call is None:
        return "(not called)"
    parts = []
    for i, spec in enumerate(call["args"]):
        parts.append("ids" if ids_key == ("arg", i) else _short(spec))
    for name, spec in call["kwargs"].items():
        parts.append(f"{name}=ids" if ids_key == ("kwarg", name) else f"{name}={_short(spec)}")
    return f"model({', '.join(parts)})"


def _short(spec: dict) -> str:
    if spec["tensor"]:
        return f"{spec['dtype']}{spec['shape']}"
    if spec.get("opaque"):
        return spec["opaque"]
    return repr(spec["value"])


def replay_forward(call: Optional[dict], model: torch.nn.Module, pad_id: Optional[int]) -> tuple[Optional[Callable], str]:
    """forward(model, ids) that calls the model the way the script did, with every [B, T] argument
    rebuilt for the probe's ids: targets and labels from the ids, masks from (ids != pad_id) (all ones
    without a pad id), positions 0..T-1; other arguments as recorded. None (with the reason) when the
    plain call model(ids) is the script's, or the model is a Hugging Face one, whose adapter already
    passes attention_mask, or the call cannot be rebuilt."""
    key = _ids_key(call)
    if call is None or key is None:
        return None, "no forward with token ids was recorded"
    if type(model).__module__.startswith("transformers."):
        return None, "Hugging Face model: called as tfdoctor calls them (input_ids, attention_mask)"
    if key == ("arg", 0) and len(call["args"]) == 1 and not call["kwargs"]:
        return None, "called with the ids alone"
    shape = (call["args"][key[1]] if key[0] == "arg" else call["kwargs"][key[1]])["shape"]

    def rebuild(name: str, spec: dict, ids: torch.Tensor):
        if not spec["tensor"]:
            return spec["value"]
        if spec["shape"] != shape:  # not per token: passed as recorded (a fixed buffer, a flag tensor)
            return spec["value"]
        dtype = getattr(torch, spec["dtype"])
        lowered = name.lower()
        if any(w in lowered for w in _MASK_WORDS):
            mask = ids != pad_id if pad_id is not None else torch.ones_like(ids, dtype=torch.bool)
            return mask.to(dtype)
        if any(w in lowered for w in _POSITION_WORDS):
            return torch.arange(ids.shape[1], device=ids.device).expand_as(ids).to(dtype)
        if name in _DOCUMENT_ARGUMENTS:  # a probe row is one document
            return torch.zeros_like(ids, dtype=dtype)
        if spec["floating"]:
            return torch.ones_like(ids, dtype=dtype)
        # targets / labels: the ids themselves (the logits, not the loss, are probed; pads ignored)
        targets = ids.clone().to(dtype)
        if pad_id is not None:
            targets = targets.masked_fill(ids == pad_id, -100)
        return targets

    def forward(m, ids, replaced=None):
        replaced = replaced or {}
        args = [ids if key == ("arg", i) else rebuild(f"arg{i}", spec, ids) for i, spec in enumerate(call["args"])]
        kwargs = {name: ids if key == ("kwarg", name) else replaced[name] if name in replaced
                  else rebuild(name, spec, ids) for name, spec in call["kwargs"].items()}
        return m(*args, **kwargs)

    return forward, "as the script called it"


def replay_packed(call: Optional[dict], model: torch.nn.Module, pad_id: Optional[int]) -> Optional[Callable]:
    """packing-isolation's fn(model, ids, doc_ids, position_ids) for a model the script fed packed
    rows by keyword (position_ids=..., doc_ids=...): the recorded call with those two replaced by the
    probe's own. None for Hugging Face models (the position-ids convention serves them) or when the
    call cannot be rebuilt."""
    forward, _ = replay_forward(call, model, pad_id)
    if forward is None:
        return None
    positions = [name for name in call["kwargs"] if any(w in name.lower() for w in _POSITION_WORDS)]
    documents = [name for name in call["kwargs"] if name in _DOCUMENT_ARGUMENTS]

    def packed(m, ids, doc_ids, position_ids):
        replaced = {**{name: position_ids for name in positions}, **{name: doc_ids for name in documents}}
        return forward(m, ids, replaced)

    return packed


def discover(run: ScriptRun) -> dict:
    """The facts the script showed, JSON-safe (the report's "discovered")."""
    recorder, trace = run.recorder, run.trace
    model = unwrap(recorder.bound)
    call = recorder.call
    key = _ids_key(call)
    ids = _first_ids(trace, call)
    facts: dict[str, Any] = {
        "script": run.name,
        "model": type(model).__name__,
        "model_defined_in": _defined_in(type(model)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "wrapper": type(recorder.bound).__name__ if recorder.bound is not model else None,
        "called_as": _describe_call(call, key),
        "batch_shape": list(ids.shape) if ids is not None else None,
        "vocab_size": recorder.vocab,
        "optimizers": sorted({o["class"] for o in trace.optimizers}) or (["manual update"] if trace.manual else []),
        "steps": trace.steps,
        "steps_asked": run.steps_asked,
        "seconds_to_stop": round(run.seconds, 3),
        "ended": run.ended,
        "stopped_at": recorder.stopped_at,
        "checkpoint": recorder.snapshot_loaded,
    }
    facts.update(discover_padding(trace, call))
    facts.update(discover_packing(trace))
    facts.setdefault("pad_id", None)
    facts.setdefault("padding_side", None)
    if run.notes:
        facts["notes"] = list(run.notes)
    return facts


def _defined_in(cls) -> Optional[str]:
    import inspect

    try:
        path = inspect.getsourcefile(cls)
        line = inspect.getsourcelines(cls)[1]
    except (TypeError, OSError):
        return None
    return f"{display_path(path)}:{line}" if path else None


def _packing_for(facts: dict, recorder, pad_id: Optional[int]):
    """The Subject's packing for the rows the script packed: the position-ids convention for Hugging
    Face models, the recorded call with the probe's documents and positions for the others."""
    if not facts.get("packed"):
        return None
    if type(recorder.snapshot).__module__.startswith("transformers."):
        return PACKING_BY_POSITION_IDS if facts.get("packed") == "position_ids" else None
    return replay_packed(recorder.call, recorder.snapshot, pad_id)


class RecordedLoop:
    """Stands in for `train(model, batches)` when another driver already recorded the loop: the loop
    checks judge `trace`, and nothing can call it again (the script makes its own batches)."""

    def __init__(self, trace: Trace, name: str):
        self.trace = trace
        self.name = name

    def __call__(self, model, batches):
        raise ScriptError(f"{self.name} was recorded as a script and cannot be re-run on tfdoctor's batches")

    def __repr__(self) -> str:
        return f"RecordedLoop({self.name!r})"


def subjects(run: ScriptRun, facts: dict, overrides: dict):
    """The Subject the model checks run on (the snapshot, called as the script called it) and the one
    the loop checks judge (the same, with the recorded trace as its loop). `overrides` are the
    command's flags (vocab_size, seq_len, batch_size, pad_id, kind, padding_side); given ones win."""
    from tfdoctor.subject import Subject

    recorder = run.recorder
    pad_id = overrides.get("pad_id", facts.get("pad_id"))
    forward, why = replay_forward(recorder.call, recorder.snapshot, pad_id)
    facts["probe_call"] = why
    T = (facts.get("batch_shape") or [None, None])[1]
    seq_len = overrides.get("seq_len") or (min(T, MAX_PROBE_SEQ_LEN) if T and T >= 2 else None)
    fields = dict(vocab_size=overrides.get("vocab_size") or facts.get("vocab_size"), seq_len=seq_len,
                  batch_size=overrides.get("batch_size"), pad_id=pad_id, kind=overrides.get("kind"),
                  padding_side=overrides.get("padding_side") or facts.get("padding_side"), forward=forward,
                  packing=overrides.get("packing") or _packing_for(facts, recorder, pad_id))
    given = {"vocab_size": "--vocab", "seq_len": "--seq-len", "batch_size": "--batch", "pad_id": "--pad-id",
             "kind": "--kind", "padding_side": "--padding-side", "packing": "--packing"}
    facts["overridden"] = {flag: overrides[name] for name, flag in given.items() if overrides.get(name) is not None}
    model_subject = Subject(recorder.snapshot, **fields)
    loop_subject = dataclasses.replace(model_subject, train=RecordedLoop(run.trace, run.name))
    return model_subject, loop_subject
