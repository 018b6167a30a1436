"""What a training loop did, as plain data: the ordered `Event`s the recorder saw (forward, loss,
backward, GradScaler calls, clip, optimizer step, zero_grad, scheduler step, autocast region), each
stamped with the optimizer-step window it fell in, and the `Trace` that holds them with what the
recorder read at the end (optimizers, schedules, warnings, scores, coverage).

The recorder (recording/recorder.py) fills it, whichever driver runs the loop (recording/loop.py for
`check --train`, recording/script.py for `tfdoctor run`); the loop checks only read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Optional, TypeVar, overload

from tfdoctor.recording import events as payloads

# Events that carry the user's file:line of the call (`where`), which the loop checks name in their findings.
LOCATED_EVENTS = payloads.LOCATED_EVENTS

# The payload an Event carries: the TypedDict of its kind (recording/events.py, PAYLOADS).
P = TypeVar("P")


@dataclass
class Event(Generic[P]):
    kind: str  # batch forward loss backward scale unscale scaler_step scaler_update clip opt_step zero_grad
    #            sched_step autocast mode (Module.train / eval)
    window: int  # optimizer steps taken before this event
    # What the call carried: a plain dict holding the keys its kind's TypedDict declares (events.py).
    data: P = field(default_factory=dict)  # type: ignore[assignment]


@dataclass(frozen=True)
class OptimizerRecord:
    """An optimizer the loop stepped, as plain data read when the recording ended."""

    class_name: str  # AdamW, SGD, Muon, ...; "manual update" for a loop that updates the weights itself
    id: Optional[int]  # id() of the optimizer, as opt_step events and ScheduleRecord name it; None: manual
    groups: list[dict]  # each param group's hyperparameters as plain values (lr, initial_lr, betas, eps, ...)
    # What each param group holds: "embedding", "matrix", "vector" (elements), "tensors", "names" (a few).
    composition: list[dict]


MANUAL_UPDATE = OptimizerRecord("manual update", None, [{}], [{}])


@dataclass(frozen=True)
class ScheduleRecord:
    """A learning-rate scheduler the loop stepped, as plain numbers: projected when the recording ends
    (recording/schedule.project_groups, on the copy taken at its first step), so that a judge reads
    floats and runs no scheduler."""

    name: str  # its class: LambdaLR, OneCycleLR, ...
    steps: int  # the loop's own step() calls while recorded
    optimizer: int  # id() of the optimizer it schedules (OptimizerRecord.id)
    # Each param group's rate after 0, 1, 2, ... step() calls from the scheduler's start, far enough to see
    # the peak. None: it cannot be projected (ReduceLROnPlateau follows the loss; a scheduler deepcopy
    # cannot copy); the judges then read the rates the loop's optimizer steps used.
    projected: Optional[list[list[float]]]


@dataclass
class Trace:
    events: list[Event[Any]]  # in the order they happened; Event.kind says which payload each carries
    batches_fed: int
    optimizers: list[OptimizerRecord]  # per optimizer stepped, in the order of their first step
    schedules: list[ScheduleRecord]  # per scheduler stepped by the loop
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
    # torch.distributed collectives the model's own forward called (tensor parallelism), name -> the
    # user's line: the model runs only with every rank taking part (recording/collectives.py).
    forward_collectives: dict = field(default_factory=dict)
    # The first optimizer steps' effect on the low-precision weights they hold (recording/updates.py
    # UpdateProbe): per step, per tensor with a gradient, its elements graded and left unchanged.
    updates: list = field(default_factory=list)

    # One kind's events come back typed with that kind's payload: `trace.of("opt_step")[0].data["lr"]`
    # is a type error (OptStepData has "lrs"), not a KeyError at run time.
    @overload
    def of(self, kind: Literal["batch"], /) -> list[Event[payloads.BatchData]]: ...
    @overload
    def of(self, kind: Literal["forward"], /) -> list[Event[payloads.ForwardData]]: ...
    @overload
    def of(self, kind: Literal["loss"], /) -> list[Event[payloads.LossData]]: ...
    @overload
    def of(self, kind: Literal["backward"], /) -> list[Event[payloads.BackwardData]]: ...
    @overload
    def of(self, kind: Literal["scale"], /) -> list[Event[payloads.ScaleData]]: ...
    @overload
    def of(self, kind: Literal["unscale"], /) -> list[Event[payloads.UnscaleData]]: ...
    @overload
    def of(self, kind: Literal["scaler_step"], /) -> list[Event[payloads.ScalerStepData]]: ...
    @overload
    def of(self, kind: Literal["scaler_update"], /) -> list[Event[payloads.ScalerUpdateData]]: ...
    @overload
    def of(self, kind: Literal["clip"], /) -> list[Event[payloads.ClipData]]: ...
    @overload
    def of(self, kind: Literal["opt_step"], /) -> list[Event[payloads.OptStepData]]: ...
    @overload
    def of(self, kind: Literal["zero_grad"], /) -> list[Event[payloads.ZeroGradData]]: ...
    @overload
    def of(self, kind: Literal["sched_step"], /) -> list[Event[payloads.SchedStepData]]: ...
    @overload
    def of(self, kind: Literal["autocast"], /) -> list[Event[payloads.AutocastData]]: ...
    @overload
    def of(self, kind: Literal["mode"], /) -> list[Event[payloads.ModeData]]: ...
    @overload
    def of(self, *kinds: str) -> list[Event[Any]]: ...

    def of(self, *kinds: str) -> list[Event[Any]]:
        return [e for e in self.events if e.kind in kinds]

    @property
    def steps(self) -> int:
        """Optimizer steps of the loop (several optimizers stepped together count once)."""
        return len({e.window for e in self.of("opt_step")})

    def training_losses(self) -> list[Event[payloads.LossData]]:
        """Loss calls whose value reached a backward (their gradient hook fired)."""
        return [e for e in self.of("loss") if e.data.get("grad") is not None]

    @property
    def manual(self) -> bool:
        """Whether the loop updates the parameters itself, with no optimizer object."""
        return any(e.data.get("manual") for e in self.of("opt_step"))
