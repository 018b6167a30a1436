"""`TfdoctorCallback` for Lightning: the whole run watched and judged from inside `trainer.fit()`, as
`tfdoctor watch` does for a script.

    from tfdoctor.integrations.lightning import TfdoctorCallback
    trainer = L.Trainer(max_steps=10_000, callbacks=[TfdoctorCallback(stop_on="fail", report="run.html")])
    trainer.fit(module, train_loader, val_loader)

One row per optimizer step, whatever accumulate_grad_batches is. Only global rank 0 records, judges
and writes; with stop_on, every rank stops at the same step. Uses `lightning.pytorch`, or
`pytorch_lightning` where only that is installed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Optional

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package of Lightning 1.x/2.x
    from pytorch_lightning import Callback

from tfdoctor.integrations.common import DEFAULT_JUDGE_EVERY, LiveWatch
from tfdoctor.result import Report


class TfdoctorCallback(Callback):
    """Watch a Lightning run: the monitor's hooks go on at on_train_start and come off at on_train_end
    or on_exception; every `judge_every` optimizer steps the run so far is judged and each new warn or
    fail is logged (logger "tfdoctor"); `stop_on="fail"` (or "warn") stops the run on one
    (trainer.should_stop); at the end the whole run is judged, kept as `callback.report` and written to
    `report=PATH` (.json, .xml JUnit, .sarif, .html; any other suffix: rich text) and named in the
    verdict line logged last. `only` / `skip` choose judges by id, as `tfdoctor watch --only/--skip`
    do. Under `tfdoctor run`, `check --train` or `watch` it stands aside (integrations/common.py)."""

    def __init__(self, stop_on: Optional[str] = None, judge_every: int = DEFAULT_JUDGE_EVERY,
                 only: Optional[Iterable[str] | str] = None, skip: Optional[Iterable[str] | str] = None,
                 report: Optional[str | Path] = None) -> None:
        super().__init__()
        self.live = LiveWatch(stop_on, judge_every, only, skip, report)
        self.stopping = False

    @property
    def report(self) -> Optional[Report]:
        """The last run's Report (its `.series` the recorded run); None before a run has ended."""
        return self.live.report

    def close(self) -> None:
        """Take the hooks off now, if a run left them on (fit() ending or raising does it already)."""
        self.live.close()

    # ------------------------------------------------------------------ Lightning's events

    def on_train_start(self, trainer, pl_module) -> None:
        self.stopping = False
        schedulers = [config.scheduler for config in getattr(trainer, "lr_scheduler_configs", [])]
        # the planned length: max_steps, else what max_epochs of the loader make (inf without either)
        given = trainer.max_steps is not None and trainer.max_steps > 0
        planned = trainer.max_steps if given else trainer.estimated_stepping_batches
        max_steps = int(planned) if math.isfinite(planned) else None
        self.live.start(f"Lightning {type(pl_module).__name__}", main=trainer.global_rank == 0,
                        max_steps=max_steps, schedulers=schedulers, step=trainer.global_step,
                        planned_from="the Trainer's max_steps" if given else "Lightning's estimated_stepping_batches",
                        # self.log(..., on_epoch=True) averages a validation epoch weighted by each batch's
                        # size (its mean metric sums value * batch_size over cumulated_batch_size)
                        weighting="rows")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # called per batch, so per micro-batch under accumulate_grad_batches: LiveWatch judges once per
        # `judge_every` optimizer steps whatever the number of calls
        if self.live.step_ended(trainer.global_step):
            self.stopping = trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self.live.finish("stopped" if self.stopping else "finished")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.live.finish("raised", exception)  # the hooks off; Lightning then raises the run's own error
