"""What `tfdoctor watch` records over a whole run, as data: one `StepRow` per optimizer step, one
`EvalPoint` per evaluation the script ran, and the run's `facts`. The judges (checks/run_*.py) read a
`RunSeries` and nothing else; the HTML report draws it; JSON carries it column by column.

No torch here: the series travels from the worker to the supervisor (the live dashboard) as JSON and
is judged wherever it lands (a callback inside the user's own process, the worker of `watch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional


@dataclass
class StepRow:
    """One optimizer step (a step the GradScaler skipped included), as the loop really took it."""

    step: int  # 0-based, counting skipped steps
    loss: Optional[float]  # the mean of this step's micro-batch losses (the unscaled loss, see monitor.py)
    micro_losses: list[float] = field(default_factory=list)
    grad_norm: Optional[float] = None  # global L2 norm of the gradients before any clip, unscaled
    group_norms: list[float] = field(default_factory=list)  # the same per parameter group
    lrs: list[float] = field(default_factory=list)  # per parameter group, the rate the optimizer used
    scale: Optional[float] = None  # the GradScaler's scale after this step's update()
    skipped: bool = False  # the GradScaler skipped the optimizer step (inf/NaN gradients)
    wall: float = 0.0  # seconds from the end of the previous step to the end of this one
    data_wait: float = 0.0  # of which seconds spent waiting for the next batch of a DataLoader
    tokens: Optional[int] = None  # input tokens of this step's training forwards
    rss: Optional[int] = None  # the process's resident memory (bytes) at the step's end
    cuda_allocated: Optional[int] = None  # bytes, where the run uses a GPU
    cuda_reserved: Optional[int] = None
    batches: int = 0  # DataLoader batches drawn so far (the batch this step ended on)
    own_bytes: Optional[int] = None  # what the monitor's own records held then (part of rss)
    heap: Optional[int] = None  # bytes malloc held in use (glibc), read every few steps (watching/rss.py)
    # the model was called on an input shape not seen before (since the last step): the C libraries
    # behind torch cache kernels per shape (oneDNN's primitive cache), which grows the heap until full
    new_shape: bool = False
    # scheduler.step() calls made so far on the scheduler driving the optimizer: the position in its
    # promise (facts["schedulers"][i]["promise"]) that this step's rate should come from
    scheduler_steps: Optional[int] = None
    # the step's micro-batches were trained with the model in eval mode (its dropout off): the forward
    # before each backward ran under grad with module.training False
    eval_mode: bool = False


# EvalPoint.split: what the source's rows are, as the monitor could tell (watching/sources.py)
HELD_OUT, TRAINING_SPLIT, UNKNOWN = "held-out", "training-split", "unknown"


@dataclass
class EvalPoint:
    """One evaluation source's losses between two optimizer steps (computed under no_grad or eval()).
    A source is one evaluation pass: its call site and the rows it read (watching/sources.py), so that
    nanoGPT's estimate_loss gives two points per evaluation, its train split and its val split."""

    step: int  # optimizer steps completed when it ran
    loss: float  # the mean of the source's losses, weighted as `weighting` says
    rows: int = 0  # evaluation rows whose tokens were fingerprinted
    trained_rows: int = 0  # of those, rows the loop also trained on (at any step of the run)
    calls: int = 0  # loss computations averaged
    source: str = ""  # the evaluation pass: "train.py:52#1" (the call site, then its pass there)
    split: str = UNKNOWN  # held-out | training-split | unknown (rows not fingerprinted)
    weighting: str = "calls"  # how `loss` weighs its calls: calls (a plain mean) | rows | tokens
    tokens: int = 0  # target tokens counted (ignore_index left out) over the calls
    row_weighted: float = math.nan  # the same losses weighted by each call's rows ...
    token_weighted: float = math.nan  # ... and by its target tokens (NaN where not counted)


@dataclass
class RunSeries:
    steps: list[StepRow] = field(default_factory=list)
    evals: list[EvalPoint] = field(default_factory=list)
    # What the judges need besides the series: "vocab" (int), "ended" (finished | max-steps | max-time |
    # exit | raised), "loader" ({num_workers, pin_memory, batch_size} of the training DataLoader),
    # "device" ("cpu", "cuda:0"), "schedulers" ([{name, ...settings}]), "amp" ({dtype, scaler}),
    # "dropout" (whether the trained model holds active dropout), "max_steps", "seconds", "param_groups"
    # ([{parameters, weight_decay}] of the watched optimizer's groups, in the order of the rows' lrs),
    # "planned_steps" (the run's planned optimizer steps, where known) and "planned_from" (where that
    # number came from: --max-steps, the Trainer's max_steps, Lightning's estimated_stepping_batches).
    # A scheduler's entry also says "steps_called", "watched" (it drives the watched optimizer) and,
    # where watched, "promise": the rate it gives after k of its step() calls, k = 0, 1, ...
    facts: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ reading

    def column(self, name: str) -> list:
        """One StepRow field over the steps, e.g. series.column("loss")."""
        return [getattr(row, name) for row in self.steps]

    def finite_losses(self) -> list[tuple[int, float]]:
        return [(row.step, row.loss) for row in self.steps if row.loss is not None and math.isfinite(row.loss)]

    def __len__(self) -> int:
        return len(self.steps)

    def sources(self) -> dict[str, list[EvalPoint]]:
        """The evaluation points by source, in the order the sources first ran."""
        out: dict[str, list[EvalPoint]] = {}
        for point in self.evals:
            out.setdefault(point.source, []).append(point)
        return out

    def evaluation(self) -> list[EvalPoint]:
        """The script's evaluation: the points of its held-out source (the one evaluated most often, the
        first on a tie), else of a source whose rows could not be told; [] when every source is a
        training-split estimate (or nothing was evaluated)."""
        for split in (HELD_OUT, UNKNOWN):
            best: list[EvalPoint] = []
            for points in self.sources().values():
                chosen = [p for p in points if p.split == split]
                if len(chosen) > len(best):
                    best = chosen
            if best:
                return best
        return []

    def training_split(self) -> list[EvalPoint]:
        """The training-split estimates (nanoGPT's estimate_loss on 'train'): the most evaluated source."""
        return max(([p for p in points if p.split == TRAINING_SPLIT] for points in self.sources().values()),
                   key=len, default=[])

    # ------------------------------------------------------------------ as data (JSON, the channel)

    def to_dict(self) -> dict[str, Any]:
        """Column by column (a few hundred thousand steps stay a compact JSON): {"steps": {field: [..]},
        "evals": {field: [..]}, "facts": {...}}. NaN and infinities are strings (result.json_safe)."""
        from tfdoctor.result import json_safe

        return {"steps": {f.name: json_safe(self.column(f.name)) for f in fields(StepRow)},
                "evals": {f.name: json_safe([getattr(e, f.name) for e in self.evals]) for f in fields(EvalPoint)},
                "facts": json_safe(self.facts)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSeries":
        steps = _rows(StepRow, data.get("steps", {}))
        evals = _rows(EvalPoint, data.get("evals", {}))
        return cls(steps, evals, dict(data.get("facts", {})))


def row_dict(row: StepRow) -> dict[str, Any]:
    """One step as JSON data (asdict's deep copy would cost a tiny model's step a few percent)."""
    from tfdoctor.result import json_safe

    return json_safe(dict(row.__dict__))


def row_of(data: dict[str, Any]) -> StepRow:
    return StepRow(**{f.name: _number(data[f.name]) for f in fields(StepRow) if f.name in data})


def _rows(kind, columns: dict[str, list]) -> list:
    names = [f.name for f in fields(kind) if f.name in columns]
    count = len(columns[names[0]]) if names else 0
    return [kind(**{name: _number(columns[name][i]) for name in names}) for i in range(count)]


def _number(value):
    """Back from json_safe: "nan" / "inf" / "-inf" are floats again (lists element by element)."""
    if isinstance(value, list):
        return [_number(v) for v in value]
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return value


def is_finite(value) -> bool:
    """A recorded number that is there and finite (a row's loss, norm or scale may be None, NaN or inf)."""
    return value is not None and math.isfinite(value)


def trailing(flags: list) -> int:
    """How many of the last `flags` in a row are true (a run that ends on skipped steps, on a rate at 0)."""
    count = 0
    for flag in reversed(flags):
        if not flag:
            break
        count += 1
    return count
