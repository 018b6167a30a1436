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
from tfdoctor.recording.sites import call_site, raised_at
from tfdoctor.subject import vocab_size_of

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
        self.on_stop: Optional[Callable[[], None]] = None  # called at the stop point, before unwinding
        self.stop_error: Optional[BaseException] = None

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
        self.meet()
        raise _StopScript()

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
    session: Any = None  # a distributed run: this rank's RankSession (recording/distributed.py)


def record_script(path: Optional[str] = None, module: Optional[str] = None, args: tuple = (),
                  steps: int = 2, session=None) -> ScriptRun:
    """Run the script (a file `path` or a module `module`) as __main__ with `args` until `steps`
    optimizer steps are recorded. Raises ScriptError when it ends, exits or raises before its first
    step; a KeyboardInterrupt propagates.

    `session` (a RankSession) makes it one rank of a distributed run: the rank's own digest is
    recorded beside the trace and gathered to rank 0 at the stop point (Trace.ranks there)."""
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
            with recorder.installed_process_wide(), _rank_recording(recorder, session):
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
    if recorder.stop_error is not None:
        raise recorder.stop_error
    trace = _finish(recorder, caught)
    if session is not None and session.digests:
        trace.ranks = list(session.digests)
    # The script feeds itself: its micro-batches are the forwards of its model under grad mode.
    trace.batches_fed = sum(1 for e in trace.events if e.kind == "forward" and e.data.get("grad", True))
    run = ScriptRun(trace, recorder, name, seconds, ended, steps, error, session=session)
    _refuse_unaudited(run)
    if recorder.rebound:
        run.notes.append(recorder.rebound)
    return run


def _rank_recording(recorder: ScriptRecorder, session):
    """On every rank of a distributed run: what the rank checks compare (recording/ranks.py), handed
    to rank 0 at the stop point; the script's destroy_process_group() waits until tfdoctor is done."""
    import contextlib

    if session is None:
        return contextlib.nullcontext()
    from tfdoctor.recording.ranks import RankRecorder

    stack = contextlib.ExitStack()
    ranks = stack.enter_context(RankRecorder(session.world.rank, session.world.size))
    stack.enter_context(session.teardown_deferred())
    recorder.on_stop = lambda: session.gather(ranks.digest(recorder.events, recorder.bound))

    def ended_before_the_stop() -> None:  # the script ran out of steps first: the ranks meet at its end
        if recorder.window > 0:
            recorder.meet()

    stack.callback(ended_before_the_stop)
    return stack


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
