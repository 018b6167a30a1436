"""A learning-rate scheduler seen stepping, kept as a copy bound to a stand-in optimizer
(`snapshot_scheduler`) and projected forward from its start (`project_groups`): the rates of each
param group at each step, far enough to see the peak, for the lr-schedule check. The projection runs
once, when the recording ends (`schedule_record`), so the Trace holds floats and no live scheduler.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Optional

import torch

from tfdoctor.recording.trace import ScheduleRecord

# Schedule projection: at least this many steps, then until twice the step of the peak so far,
# never beyond the cap (a LambdaLR step costs ~7 us here, so the cap costs ~0.3 s).
PROJECT_MIN_STEPS = 200
PROJECT_MAX_STEPS = 40_000


class _ScheduleOptimizer(torch.optim.SGD):
    """Stands in for the user's optimizer when a scheduler is projected forward: same param-group
    hyperparameters, one dummy parameter each, never stepped."""

    def __init__(self, groups: list[dict]):
        dummy = [dict(g, params=[torch.zeros(1, requires_grad=True)]) for g in groups]
        super().__init__(dummy, lr=float(groups[0].get("lr", 1e-3)))


def snapshot_scheduler(scheduler):
    """A copy of the scheduler bound to a stand-in optimizer, or None when it cannot be copied."""
    try:
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                  for g in scheduler.optimizer.param_groups]
        stand_in = _ScheduleOptimizer(groups)
        return copy.deepcopy(scheduler, memo={id(scheduler.optimizer): stand_in})
    except Exception:  # an exotic scheduler: the lr-schedule check falls back on the recorded rates
        return None


def schedule_record(name: str, steps: int, optimizer: int, snapshot) -> ScheduleRecord:
    """The scheduler as the Trace keeps it: its rates projected from `snapshot` (snapshot_scheduler's
    copy, or None) into plain floats."""
    return ScheduleRecord(name, steps, optimizer, project_groups(snapshot))


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
