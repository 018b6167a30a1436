"""What a learning-rate scheduler promises: the rate it would set after each of its `step()` calls,
projected on a copy made when it was made, so lr-trajectory can compare the rate the optimizer used
with the rate the scheduler was built to give at that point of its schedule.

The copy (recording/schedule.snapshot_scheduler) is bound to a stand-in optimizer holding copies of
the param groups' hyperparameters, so projecting it touches neither the user's optimizer nor the
scheduler. It holds plain numbers out: `rates[k]` is the highest param group's rate after k calls
(the judges compare it with max(row.lrs), the rate of the same group).

ReduceLROnPlateau has no promise (it follows the loss). A closed-form scheduler (LambdaLR, StepLR,
CosineAnnealingLR, OneCycleLR, SequentialLR, the Hugging Face get_*_schedule_with_warmup LambdaLRs,
...) is stepped as the loop would step it; OneCycleLR raises past its total_steps, where the
projection ends, as the run itself would.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from tfdoctor.recording.schedule import snapshot_scheduler

# The most positions projected. A LambdaLR step() costs ~5 us on this CPU (20k steps of
# healthy.py's schedule in 0.1 s), so the cap costs ~0.7 s once at the end of a run of 65k steps or
# more; a longer run is compared over its first 131,072 scheduler steps.
PROMISE_MAX_STEPS = 2 ** 17


class Promise:
    """A scheduler's rates, projected on demand (`extend`) from its copy."""

    def __init__(self, scheduler: Any) -> None:
        self.rates: list[float] = []
        self.ended: Optional[str] = None  # why the projection stopped before it was asked to
        self.runner = None
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.ended = "ReduceLROnPlateau follows the loss: it has no schedule to project"
            return
        self.runner = snapshot_scheduler(scheduler)
        if self.runner is None:
            self.ended = f"{type(scheduler).__name__} could not be copied"

    def extend(self, positions: int) -> list[float]:
        """The rates after 0 .. positions-1 step() calls (fewer when the scheduler stopped earlier)."""
        positions = min(positions, PROMISE_MAX_STEPS)
        if self.runner is None or len(self.rates) >= positions:
            return self.rates
        with warnings.catch_warnings():  # the stand-in's step() is not wrapped: torch's order warning
            warnings.simplefilter("ignore")
            while len(self.rates) < positions:
                if self.rates:
                    try:
                        self.runner.step()
                    except Exception as error:  # noqa: BLE001 - OneCycleLR past total_steps, a lambda that raises
                        self.ended = f"{type(error).__name__} at step {len(self.rates)}: {error}"[:200]
                        self.runner = None
                        break
                self.rates.append(max(float(group["lr"]) for group in self.runner.optimizer.param_groups))
        return self.rates
