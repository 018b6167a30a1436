"""The watch monitor: what a whole training run really does, one StepRow per optimizer step, light
enough to leave on for days.

`check` and `run` record the first steps with a TorchFunctionMode that sees every torch call; that
costs far more than the 3% of step time a monitor may take, so the monitor sees only calls made once
or a few times per step (watching/hooks.py installs them):
- optimizer steps: the global step pre/post hooks (the rates used, the gradient norm, the step's end);
- the loss: `F.cross_entropy` / `F.nll_loss` calls (an nn loss calls them too; a Hugging Face model's
  loss as well), the unscaled value whatever the loop backpropagates; `Tensor.backward` delimits the
  micro-batches and stands in for a loss that is not a cross-entropy;
- `clip_grad_norm_`: its return value is the pre-clip global norm (no second pass over the gradients);
- GradScaler's scale / unscale_ / step / update: the scale, and steps it skipped;
- the DataLoader iterator's `__next__`: the time spent waiting for a batch;
- the trained model's forward (a pre-hook on the one model, bound at the first step): its tokens, and
  fingerprints of its rows, so an evaluation on rows the loop trained on is seen;
- an evaluation loss (no graph) is kept per call with its call site, the DataLoader its batch came
  from, its rows and target tokens: watching/sources.py tells the evaluation's sources apart (nanoGPT's
  train split from its val split) and averages each as the loop does (`weighting`).

Values stay tensors until the step after theirs ends (`_finalise` runs one step late), so a GPU run
is not made to wait for its own queue at every step.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import torch

from tfdoctor.usercode.torch_compat import chained_schedulers, scaler_enabled
from tfdoctor.watching.fingerprints import TrainedRows, fingerprints
from tfdoctor.watching.promise import Promise
from tfdoctor.watching.readings import (
    count_params,
    cuda_memory,
    deep_size,
    device_of,
    driven,
    eval_call_site,
    has_dropout,
    loader_facts,
    norm_of,
    number,
    scale_of,
    token_ids,
)
from tfdoctor.watching.rss import close_reader, heap_reader, rss_reader
from tfdoctor.watching.series import RunSeries, StepRow
from tfdoctor.watching.sources import WEIGHTINGS, EvalCall, eval_points

# Trained ids held before they are fingerprinted together: one hash per this many forwards, not one
# each (three tensor ops a forward cost a tiny model's step about 1%).
HASH_EVERY = 16
# With a clip (which measures the global norm) and several param groups, their own norms (a pass over
# the gradients, ~1% of a 3 ms step, for the HTML figure alone) are measured every this many steps.
GROUP_NORMS_EVERY = 10
# malloc's bytes in use (~40 us a read) every this many steps: 54 readings over a 270-step run.
HEAP_EVERY = 5
SHAPES_KEPT = 4096  # input shapes remembered (past this many, none is new)
# The model's latest train()/eval() calls kept for the facts (Lightning makes two per validation).
MODE_CALLS_KEPT = 64
# What one evaluation call's record holds (an EvalCall, its float and counts, its list slot): measured,
# 152 bytes a call over 200,000 calls' RSS. Counted in own_bytes with the rows' prints (8 bytes a row):
# Karpathy's train.py keeps 400 calls an evaluation, a long run hundreds of evaluations.
EVAL_CALL_BYTES = 152


class StopWatching(BaseException):
    """Raised out of the optimizer step once --max-steps / --max-time is reached (a BaseException, so
    the script's own `except Exception` lets it through as it lets Ctrl-C through)."""


class Monitor:
    """The state the hooks record into; `series` is the run so far. `on_row(row)` hears each step as it
    is finalised (the live view, a callback's findings); `max_steps` / `max_time` stop the run."""

    def __init__(self, on_row: Optional[Callable[[StepRow], None]] = None, max_steps: Optional[int] = None,
                 max_time: Optional[float] = None, stop: bool = True, planned_from: Optional[str] = None,
                 weighting: str = "calls") -> None:
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting={weighting!r}: one of {WEIGHTINGS}")
        # How an evaluation's losses are averaged, as the loop that runs it averages them: the Trainer
        # and Lightning weigh each batch by its rows ("rows": integrations pass it); a plain script by
        # default as nanoGPT's estimate_loss and `sum(losses) / len(loader)` do, one batch one vote
        # ("calls"). Equal batches make the three agree; each point keeps the rows- and token-weighted
        # means beside it.
        self.weighting = weighting
        self.series = RunSeries()
        self.on_row = on_row
        self.max_steps, self.max_time, self.stop = max_steps, max_time, stop
        # where max_steps comes from: --max-steps (watch stops the run there), or the framework's plan
        self.planned_from = planned_from or ("--max-steps" if max_steps is not None else None)
        self.rss = rss_reader()
        self.heap = heap_reader()
        self.started = self.last_close = time.perf_counter()
        self.stopped: Optional[str] = None  # "max-steps" | "max-time" once the stop was raised
        self.main: Optional[torch.optim.Optimizer] = None  # the optimizer whose steps are the rows
        self.model: Optional[torch.nn.Module] = None  # the trained model, bound at the first step
        self.candidates: list[torch.nn.Module] = []  # modules called under grad before the first step
        self.forward_in_eval = False  # the last forward under grad ran with the model in eval mode
        self.shapes: set = set()  # input shapes the model was called on (a new one: _reset_step's new_shape)
        self.mode_calls: list[tuple[int, bool, str]] = []  # (steps done, mode, where) of the model's train()/eval()
        self._reset_step()
        self.pending: Optional[dict] = None  # the last closed step, finalised when the next one closes
        # the evaluation under way: per loss call (value, target tokens, call site, loader, its rows' prints)
        self.eval_calls: list[tuple] = []
        self.eval_at = 0
        self.eval_prints: list[torch.Tensor] = []  # prints of the rows fed to the model since the last call
        self.eval_draws = 0  # batches drawn when the last evaluation call (or step) was seen
        # evaluations done: (steps done, [EvalCall], [its rows' prints or None]) (resolved into EvalPoints)
        self.evaluations: list[tuple[int, list[EvalCall], list[Optional[torch.Tensor]]]] = []
        self.draws = 0  # DataLoader batches drawn so far
        self.eval_bytes = 0  # what the evaluations' records hold (calls, their float, their rows' prints)
        self.trained = TrainedRows()
        self.train_ids: list[tuple[torch.Tensor, int]] = []  # trained ids not fingerprinted yet
        self.refilled = 0  # trained rows whose buffer changed before they were fingerprinted
        self.scaled: dict[int, float] = {}  # id of a tensor scaler.scale() returned -> the scale then
        self.scaler_seen = False
        self.last_scale: Any = None  # the GradScaler's scale at its last scale() call (a tensor: no sync)
        self.unscaled = False  # scaler.unscale_ ran since the last step
        self.loaders: dict[int, dict] = {}  # DataLoader id -> {facts, batches, wait, trains}
        self.training_loaders: set[int] = set()  # the loaders whose batches the model trained on
        self.last_loader: Optional[int] = None
        self.schedulers: list[dict] = []  # each scheduler's name and settings, as the facts carry them
        self.scheduled: dict[int, dict] = {}  # id -> {scheduler, record, promise, calls, explicit}
        self.scheduler_depth = 0  # inside a scheduler's step(): a SequentialLR's child steps are its own
        self.position: Optional[int] = None  # step() calls of the scheduler driving the watched optimizer
        self.vocab: Optional[int] = None
        self._weights: dict = {}  # (row length, device) -> the fingerprint's random weights
        self.busy = False  # our own tensor work is not the loop's
        self.row_bytes: Optional[int] = None  # what one StepRow holds, measured on the first

    def _reset_step(self) -> None:
        self.micro: list[Any] = []  # each micro-batch's loss (tensor or float)
        self.ce_train: list[torch.Tensor] = []  # training cross-entropies since the last backward
        self.clip_norm: Any = None
        self.tokens = 0
        self.wait: dict[int, float] = {}  # loader id -> seconds waited in this step
        self.eval_mode_micro = 0  # micro-batches whose forward ran in eval mode before their backward
        self.new_shape = False  # the model met an input shape not seen before, since the last step

    # ------------------------------------------------------------------ what the hooks call

    def loss_called(self, value: torch.Tensor, logits: torch.Tensor, target: Any, reduction: str,
                    ignore_index: int) -> None:
        """A cross-entropy (or NLL) was computed: a training loss when it carries a graph, else an
        evaluation loss. Reduced to a per-token mean whatever `reduction` the caller asked for."""
        if self.busy or not isinstance(value, torch.Tensor):
            return
        self.busy = True
        try:
            mean = value.detach()  # the usual mean: one cheap op now, read (as a float) a step later
            if reduction != "mean" or mean.dim() > 0:
                with torch.no_grad():
                    if reduction != "mean" and isinstance(target, torch.Tensor) and not target.is_floating_point():
                        mean = mean.float().sum() / (target != ignore_index).sum().clamp(min=1)
                    else:
                        mean = mean.float().mean()
            if logits.dim() >= 2 and self.vocab is None:
                self.vocab = int(logits.shape[1])
            if value.requires_grad:
                self.ce_train.append(mean)
            else:
                self._eval_called(mean, target, ignore_index)
        finally:
            self.busy = False

    def _eval_called(self, mean: torch.Tensor, target: Any, ignore_index: int) -> None:
        """An evaluation loss: kept with what tells its source (call site, DataLoader, rows) and its
        weights (rows, target tokens). Only evaluation calls pay for the call-site walk: measured 2.5 us
        with the loss at the stack's top, 6 us under 20 more frames, 14 us under 60 (a Trainer's eval
        runs ~40 deep), against the eval forward of even a tiny model (~1 ms for TinyLM's batch of 32)."""
        if not self.eval_calls:  # the steps done when this evaluation began
            self.eval_at = len(self.series) + (self.pending is not None)
        tokens = None
        if isinstance(target, torch.Tensor) and not target.is_floating_point():
            with torch.no_grad():
                tokens = (target != ignore_index).sum()
        if self.draws > self.eval_draws:  # this call's batch came from a DataLoader
            loader = self.last_loader
        else:  # another loss on the same batch, or rows the script sliced itself
            loader = self.eval_calls[-1][3] if self.eval_calls else None
        self.eval_draws = self.draws
        prints = (self.eval_prints[0] if len(self.eval_prints) == 1 else torch.cat(self.eval_prints)) \
            if self.eval_prints else None
        self.eval_prints = []
        self.eval_calls.append((mean, tokens, eval_call_site(), loader, prints))

    def backward_called(self, loss: torch.Tensor) -> None:
        """One micro-batch ends: its loss is the cross-entropy computed for it, else the tensor
        backpropagated (divided by the GradScaler's scale when scaler.scale() made it)."""
        if self.busy:
            return
        if self.ce_train:
            value = self.ce_train[0] if len(self.ce_train) == 1 else torch.stack(self.ce_train).mean()
        elif loss.numel() == 1:
            value = loss.detach().float().reshape(())
            scale = self.scaled.get(id(loss))
            if scale is not None:
                value = value / scale
        else:
            value = None
        if value is not None:
            self.micro.append(value)
        self.ce_train = []
        if self.forward_in_eval:  # the forward this backward ends ran with the model in eval mode
            self.eval_mode_micro += 1
            self.forward_in_eval = False

    def forward_called(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.busy:
            return
        ids = token_ids(args, kwargs)
        if self.model is None:  # before the first step: which module is the model (the outermost)
            if torch.is_grad_enabled():
                if module not in self.candidates:
                    self.candidates.append(module)
            elif ids is not None and not self.eval_prints:
                # an evaluation before the first step (nanoGPT's at iteration 0): the first module called
                # with token ids since the last evaluation loss is the model (pre-hooks fire outermost
                # first); its submodules see the same ids again
                self._eval_forward(ids)
            return
        if ids is None:
            return
        if len(self.shapes) < SHAPES_KEPT and ids.shape not in self.shapes:
            self.shapes.add(ids.shape)
            self.new_shape = True
        # under grad in eval mode: training in eval mode if a backward follows (see backward_called), an
        # evaluation left under grad if none does
        grad = torch.is_grad_enabled()
        self.forward_in_eval = grad and not module.training
        if grad and module.training:
            self.tokens += ids.numel()
            # fingerprinted in batches (_hash_trained): a reference now, and its version, which tells
            # a buffer the loop refilled in place before it was hashed
            self.train_ids.append((ids, ids._version))
            if self.last_loader in self.loaders and self.last_loader not in self.training_loaders:
                self.loaders[self.last_loader]["trains"] = True
                self.training_loaders.add(self.last_loader)
        else:
            self._eval_forward(ids)

    def _eval_forward(self, ids: torch.Tensor) -> None:
        self.busy = True
        try:
            self.eval_prints.append(self._fingerprints(ids))
        finally:
            self.busy = False

    def mode_set(self, module: torch.nn.Module, mode: bool, where: str) -> None:
        """`module.train(mode)` (an `eval()` is one) on the watched model or a module holding it."""
        if self.model is None or not (module is self.model or any(m is self.model for m in module.modules())):
            return
        if self.mode_calls and self.mode_calls[-1][1] == bool(mode):  # the Trainer calls train() every step
            return
        self.mode_calls.append((len(self.series) + (self.pending is not None), bool(mode), where))
        del self.mode_calls[:-MODE_CALLS_KEPT]

    def batch_waited(self, loader: Any, seconds: float) -> None:
        key = id(loader)
        held = self.loaders.get(key)
        if held is None:
            self.loaders[key] = held = {"batches": 0, "wait": 0.0, "trains": False, "facts": loader_facts(loader)}
        held["batches"] += 1
        held["wait"] += seconds
        self.draws += 1
        self.last_loader = key
        self.wait[key] = self.wait.get(key, 0.0) + seconds

    def clip_returned(self, norm: Any) -> None:
        if self.clip_norm is None and isinstance(norm, torch.Tensor):
            norm = norm.detach().float()
            if self.scaler_seen and not self.unscaled and self.last_scale is not None:
                norm = norm / self.last_scale  # clipped before unscale_: the norm of scaled gradients
            self.clip_norm = norm

    def scale_called(self, scaler: Any, out: Any) -> None:
        if not self.scaler_seen and scaler_enabled(scaler):  # its settings, for scaler-overflow
            self.series.facts["amp"] = {"scaler": {"growth_interval": scaler.get_growth_interval(),
                                                   "growth_factor": scaler.get_growth_factor(),
                                                   "backoff_factor": scaler.get_backoff_factor()}}
        self.scaler_seen = self.scaler_seen or scaler_enabled(scaler)
        if isinstance(out, torch.Tensor) and scaler_enabled(scaler):
            self.last_scale = scale_of(scaler)
            self.scaled = {id(out): self.last_scale}

    def step_begins(self, optimizer: torch.optim.Optimizer) -> bool:
        """Before `optimizer.step`: whether it is the watched optimizer (then the rates and gradient
        norms of this step are read now, before the update)."""
        if self.main is None or (optimizer is not self.main and len(self.series) + bool(self.pending) < 3
                                 and count_params(optimizer) > count_params(self.main)):
            self.main = optimizer
        if self.model is None and optimizer is self.main:  # also when a GradScaler skip set main first
            self._bind(optimizer)
        if optimizer is not self.main:
            return False
        self.lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.position = self._position_on(optimizer)
        self.group_norms = self._group_norms(optimizer)
        return True

    def step_ended(self, skipped: bool = False) -> None:
        """The watched optimizer's step ended (or the GradScaler skipped it): close the row."""
        now = time.perf_counter()
        if skipped:
            self.lrs = [float(group["lr"]) for group in self.main.param_groups] if self.main else []
            self.position = self._position_on(self.main)
            self.group_norms = []
        trains = self.training_loaders  # before any is known (the first step), the latest loader's wait
        wait = (sum(s for key, s in self.wait.items() if key in trains) if trains
                else self.wait.get(self.last_loader, 0.0))
        closed = {"micro": self.micro, "clip": self.clip_norm, "groups": self.group_norms, "lrs": self.lrs,
                  "skipped": skipped, "wall": now - self.last_close, "tokens": self.tokens, "wait": wait,
                  "batches": sum(self.loaders[key]["batches"] for key in trains),
                  "rss": self.rss(), "cuda": cuda_memory(),
                  "heap": self.heap() if self.heap is not None and not len(self.series) % HEAP_EVERY else None,
                  "new_shape": self.new_shape,
                  "scale": None, "index": len(self.series) + (self.pending is not None), "position": self.position,
                  "eval_mode": bool(self.micro) and self.eval_mode_micro >= len(self.micro)}
        self.last_close = now
        self.eval_draws = self.draws  # batches drawn for training are no evaluation's
        self._reset_step()
        self.unscaled = False
        if self.pending is not None:
            self._finalise(self.pending)
        self.pending = closed
        self._check_stop(now)

    def scale_updated(self, scaler: Any) -> None:
        if self.pending is not None and scaler_enabled(scaler):
            self.pending["scale"] = scale_of(scaler)

    def scheduler_made(self, scheduler: Any) -> None:
        """A rate scheduler was made (or handed over by a callback): its settings, and a copy to project
        its promise from. A SequentialLR / ChainedScheduler takes its children's place: they step
        inside its step(), and its promise is theirs together."""
        if id(scheduler) in self.scheduled:
            return
        self.busy = True
        try:
            for child in chained_schedulers(scheduler):
                held = self.scheduled.pop(id(child), None)
                if held is not None:
                    self.schedulers.remove(held["record"])
            settings = {k: v for k, v in vars(scheduler).items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("_")}
            record = {"name": type(scheduler).__name__, **settings}
            self.schedulers.append(record)
            self.scheduled[id(scheduler)] = {"scheduler": scheduler, "record": record, "promise": Promise(scheduler),
                                             "calls": 0, "explicit": False}
        finally:
            self.busy = False

    def scheduler_stepped(self, scheduler: Any, explicit: bool) -> None:
        """The loop called scheduler.step() (not from inside another scheduler's step, nor a scheduler's
        own first step in its __init__); `explicit`: with an epoch argument, which sets the position."""
        if self.busy:  # our own projection's copies
            return
        held = self.scheduled.get(id(scheduler))
        if held is None:  # made before the hooks, and not handed over
            self.scheduler_made(scheduler)
            held = self.scheduled[id(scheduler)]
        held["calls"] += 1
        held["explicit"] = held["explicit"] or explicit

    def _position_on(self, optimizer) -> Optional[int]:
        """The step() calls so far of the scheduler that drives `optimizer` (the newest one made on it)."""
        driving = None
        for held in self.scheduled.values():
            if driven(held["scheduler"]) is optimizer:
                driving = held
        return None if driving is None else driving["calls"]

    # ------------------------------------------------------------------ the series

    def finish(self, ended: str) -> RunSeries:
        """The run ended (`ended`: finished | max-steps | max-time | exit | raised): finalise the last
        step, resolve which evaluated rows were trained on, and fill in the facts."""
        self._close_eval()
        series = self.so_far(ended)
        close_reader(self.rss)
        return series

    def so_far(self, ended: str = "running") -> RunSeries:
        """The series up to the last step that ended, its facts filled in: a callback judges the run
        while it goes on (facts["ended"] == "running": judges that need the run's end wait for it)."""
        if self.pending is not None:
            self._finalise(self.pending)
            self.pending = None
        self._resolve_eval_rows()
        return self.view(ended)

    def view(self, ended: str = "running") -> RunSeries:
        """The series of the steps finalised so far, facts filled in, without finalising the last one
        (safe inside `on_row`)."""
        facts = self.series.facts
        facts.update(ended=ended, seconds=time.perf_counter() - self.started, max_steps=self.max_steps,
                     vocab=self.vocab, schedulers=self.schedulers, scaler=self.scaler_seen,
                     device=device_of(self.main), dropout=has_dropout(self.model),
                     mode_calls=[list(call) for call in self.mode_calls[-MODE_CALLS_KEPT:]],
                     planned_steps=self.max_steps, planned_from=self.planned_from if self.max_steps else None)
        self._promises()
        if self.refilled or self.trained.full:  # the eval-gap evidence is partial: say so
            facts["fingerprints"] = {"refilled_rows": self.refilled, "trained_rows_kept": self.trained.count,
                                     "full": self.trained.full}
        if self.main is not None:  # what tells the groups' rates apart in the report (nanoGPT: decay / no decay)
            facts["param_groups"] = [{"parameters": sum(p.numel() for p in group["params"]),
                                      "weight_decay": group.get("weight_decay")} for group in self.main.param_groups]
        trains = [held for held in self.loaders.values() if held["trains"]]
        if trains:
            facts["loader"] = max(trains, key=lambda held: held["batches"])["facts"]
        return self.series

    def _promises(self) -> None:
        """Each scheduler's record says how often the loop stepped it and whether it drives the watched
        optimizer; the one that does carries its promise, projected as far as the judge needs: past
        every position the run used, and to twice the planned length (lr-trajectory looks there for
        where the schedule ends)."""
        positions = [row.scheduler_steps for row in self.series.steps if row.scheduler_steps is not None]
        planned = self.max_steps or len(self.series)
        horizon = max(max(positions, default=0) + 2, 2 * planned)
        self.busy = True
        try:
            for held in self.scheduled.values():
                record = held["record"]
                record.update(steps_called=held["calls"], epoch_given=held["explicit"],
                              watched=self.main is not None and driven(held["scheduler"]) is self.main)
                rates = held["promise"].extend(horizon) if record["watched"] else []
                if rates:
                    record["promise"] = list(rates)
                if record["watched"] and held["promise"].ended:
                    record["promise_ended"] = held["promise"].ended
        finally:
            self.busy = False

    def _finalise(self, closed: dict) -> None:
        self._close_eval()
        micro = [number(m) for m in closed["micro"]]
        finite = [m for m in micro if m is not None]
        clip = number(closed["clip"])
        groups = [clip if g is closed["clip"] else number(g) for g in closed["groups"]]
        norm = clip if clip is not None else (
            math.sqrt(sum(g * g for g in groups)) if groups and all(math.isfinite(g) for g in groups)
            else (math.inf if groups else None))
        if closed["clip"] is not None and groups and all(math.isfinite(g) for g in groups):
            after = math.sqrt(sum(g * g for g in groups))  # the groups were measured after the clip
            groups = ([g * norm / after for g in groups] if after > 0 and norm is not None and math.isfinite(norm)
                      else groups)
        if closed["skipped"] and norm is None:
            norm = math.inf
        allocated, reserved = closed["cuda"]
        row = StepRow(step=closed["index"], loss=sum(finite) / len(finite) if finite else None,
                      micro_losses=finite, grad_norm=norm, group_norms=groups, lrs=closed["lrs"],
                      scale=number(closed["scale"]), skipped=closed["skipped"],
                      wall=closed["wall"], data_wait=closed["wait"],
                      tokens=closed["tokens"] or None, rss=closed["rss"], cuda_allocated=allocated,
                      cuda_reserved=reserved, batches=closed["batches"], scheduler_steps=closed["position"],
                      eval_mode=closed["eval_mode"], heap=closed["heap"], new_shape=closed["new_shape"])
        if self.row_bytes is None:
            self.row_bytes = deep_size(row)
        row.own_bytes = (len(self.series.steps) + 1) * self.row_bytes + 8 * self.trained.count + self.eval_bytes
        self.series.steps.append(row)
        if len(self.train_ids) >= HASH_EVERY:
            self._hash_trained()
        if self.on_row is not None:
            self.on_row(row)

    def _close_eval(self) -> None:
        """The evaluation losses met since the last step become EvalPoints at the steps done then, one
        per source (watching/sources.py), labelled against the rows trained so far (the run's end
        labels them again against all of them)."""
        if not self.eval_calls:
            self.eval_prints = []
            return
        calls, prints = [], []
        for value, tokens, site, loader, rows in self.eval_calls:
            loss = number(value)
            calls.append(EvalCall(loss=loss if loss is not None and math.isfinite(loss) else math.nan, site=site,
                                  loader=loader, rows=rows.numel() if rows is not None else 0,
                                  tokens=int(tokens) if tokens is not None else 0))
            prints.append(rows.cpu() if rows is not None else None)  # accelerator memory is the run's
        self.evaluations.append((self.eval_at, calls, prints))
        self.eval_bytes += EVAL_CALL_BYTES * len(calls) + sum(8 * p.numel() for p in prints if p is not None)
        self.eval_calls, self.eval_prints = [], []
        self._hash_trained()
        self._count_trained(calls, prints)
        self._sources()

    def _resolve_eval_rows(self) -> None:
        """Every evaluation's sources again, against all the rows trained so far: a row is trained on
        whenever the run trained on it, before or after the evaluation."""
        self._hash_trained()
        for _, calls, prints in self.evaluations:
            self._count_trained(calls, prints)
        self._sources()

    def _count_trained(self, calls: list[EvalCall], prints: list) -> None:
        seen = [p for p in prints if p is not None]
        if seen:
            trained = self.trained.members(torch.cat(seen))
            for call, rows in zip([c for c, p in zip(calls, prints) if p is not None],
                                  torch.split(trained, [p.numel() for p in seen])):
                call.trained = int(rows.sum())

    def _sources(self) -> None:
        self.series.evals[:] = eval_points([(step, calls) for step, calls, _ in self.evaluations],
                                           self.training_loaders, self.weighting)

    # ------------------------------------------------------------------ helpers

    def _bind(self, optimizer: torch.optim.Optimizer) -> None:
        """The trained model: the first module called under grad (pre-hooks fire outermost first) that
        holds most of the optimizer's parameters. watching/hooks.py then hooks it alone."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in self.candidates:
            own = {id(p) for p in module.parameters()}
            if params and len(own & params) * 2 >= len(params):
                self.model = module
                break
        self.candidates = []

    def _group_norms(self, optimizer: torch.optim.Optimizer) -> list:
        """Each parameter group's gradient norm now (after any clip: _finalise rescales them). With one
        group and a clip that has measured the norm already, that norm is the group's: no second pass."""
        if self.clip_norm is not None and len(optimizer.param_groups) == 1:
            return [self.clip_norm]
        if self.clip_norm is not None and (len(self.series) + (self.pending is not None)) % GROUP_NORMS_EVERY:
            return []  # the clip measured the global norm; the groups' are for the figure, drawn every few steps
        self.busy = True
        try:
            norms = []
            with torch.no_grad():
                for group in optimizer.param_groups:
                    grads = [p.grad for p in group["params"] if p.grad is not None and not p.grad.is_sparse]
                    norms.append(norm_of(grads) if grads else 0.0)
            return norms
        finally:
            self.busy = False

    def _hash_trained(self) -> None:
        """Fingerprint the trained ids held so far, all rows of one length and device at once."""
        groups: dict = {}
        for ids, version in self.train_ids:
            if ids._version != version:
                self.refilled += ids.shape[0] if ids.dim() > 1 else 1
                continue
            rows = ids.reshape(-1, ids.shape[-1]) if ids.dim() > 1 else ids.reshape(1, -1)
            groups.setdefault((rows.shape[1], rows.device), []).append(rows)
        self.train_ids = []
        self.busy = True
        try:
            for rows in groups.values():
                self.trained.add(self._fingerprints(torch.cat(rows) if len(rows) > 1 else rows[0]))
        finally:
            self.busy = False

    def _fingerprints(self, ids: torch.Tensor) -> torch.Tensor:
        key = (ids.shape[-1] if ids.dim() > 1 else ids.numel(), ids.device)
        weights = self._weights.get(key)
        if weights is None:  # fixed per length: the same row has the same print all run
            g = torch.Generator().manual_seed(20261202 + key[0])
            self._weights[key] = weights = torch.randint(1, 2 ** 31, (key[0],), generator=g).to(ids.device)
        return fingerprints(ids, weights)

    def _check_stop(self, now: float) -> None:
        if not self.stop or self.stopped:
            return
        done = len(self.series) + (self.pending is not None)
        if self.max_steps is not None and done >= self.max_steps:
            self.stopped = "max-steps"
        elif self.max_time is not None and now - self.started >= self.max_time:
            self.stopped = "max-time"
        if self.stopped:
            raise StopWatching(self.stopped)
