"""`TfdoctorCallback` for the Hugging Face Trainer: the whole run watched and judged from inside
`trainer.train()`, as `tfdoctor watch` does for a script.

    from tfdoctor.integrations.huggingface import TfdoctorCallback
    trainer = Trainer(model, args, train_dataset=..., callbacks=[TfdoctorCallback(stop_on="fail", report="run.html")])
    trainer.train()   # findings logged as they appear; the run stops on a failure; the report at the end

One row per optimizer step (not per micro-batch: the monitor closes a row at each optimizer step,
whatever gradient_accumulation_steps is). Only the main process (state.is_world_process_zero) records,
judges and writes; with stop_on, every rank stops at the same step.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Iterable, Optional

from transformers import Trainer, TrainerCallback

from tfdoctor.integrations.common import DEFAULT_JUDGE_EVERY, LiveWatch, logger
from tfdoctor.result import Report
from tfdoctor.usercode.patches import Patches


class TfdoctorCallback(TrainerCallback):
    """Watch a Trainer run: the monitor's hooks go on at on_train_begin and come off at on_train_end,
    or when `train()` raises; every `judge_every` optimizer steps the run so far is judged and each new
    warn or fail is logged (logger "tfdoctor"); `stop_on="fail"` (or "warn") stops the run on one
    (control.should_training_stop); at the end the whole run is judged, kept as `callback.report` and
    written to `report=PATH` (.json, .xml JUnit, .sarif, .html; any other suffix: rich text) and
    named in the verdict line logged last. `only` / `skip` choose judges by id, as `tfdoctor watch
    --only/--skip` do. Under `tfdoctor run`, `check --train` or `watch` it stands aside (integrations/
    common.py)."""

    def __init__(self, stop_on: Optional[str] = None, judge_every: int = DEFAULT_JUDGE_EVERY,
                 only: Optional[Iterable[str] | str] = None, skip: Optional[Iterable[str] | str] = None,
                 report: Optional[str | Path] = None) -> None:
        self.live = LiveWatch(stop_on, judge_every, only, skip, report)
        self.stopping = False

    @property
    def report(self) -> Optional[Report]:
        """The last run's Report (its `.series` the recorded run); None before a run has ended."""
        return self.live.report

    def close(self) -> None:
        """Take the hooks off now, if a run left them on (train() ending or raising does it already)."""
        self.live.close()

    # ------------------------------------------------------------------ the Trainer's events

    def on_init_end(self, args, state, control, **kwargs):
        _guard(_calling_trainer(), self)

    def on_train_begin(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
        if not _guard(_calling_trainer(), self) and state.is_world_process_zero:
            logger.warning("tfdoctor: TfdoctorCallback was added after Trainer(...) was made: should this train() "
                           "raise, call callback.close() to take the watch hooks off (pass the callback in "
                           "Trainer(callbacks=[...]) and train() takes them off itself)")
        self.stopping = False
        self.live.start(f"Trainer {type(model).__name__}" if model is not None else "Trainer",
                        main=state.is_world_process_zero, max_steps=state.max_steps or None,
                        schedulers=[lr_scheduler] if lr_scheduler is not None else [], step=state.global_step,
                        planned_from="the Trainer's state.max_steps",
                        # eval_loss is a mean over samples: evaluation_loop repeats each batch's loss once per
                        # row (losses.repeat(batch_size), the last batch cut to its rows by accelerate's
                        # gather_for_metrics), so a short last batch weighs its rows, not a full batch's
                        weighting="rows")

    def on_step_end(self, args, state, control, **kwargs):
        if self.live.step_ended(state.global_step):
            self.stopping = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.live.finish("stopped" if self.stopping else "finished")

    def raised(self, error: BaseException) -> None:
        """train() raised: the hooks off, and what was recorded judged and written (the run's own error
        then goes on up)."""
        self.live.finish("raised", error)


def _calling_trainer() -> Optional[Trainer]:
    """The Trainer whose callback handler called us: the `self` of the nearest Trainer method on the
    stack (the Trainer hands its callbacks no reference to itself)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame held in a local keeps the whole stack alive


def _guard(trainer: Optional[Trainer], callback: TfdoctorCallback) -> bool:
    """Wrap this trainer's `train` (on the instance) so that a run that raises still takes the hooks
    off: the Trainer has no event for an exception. Once per trainer and callback; True when it was
    wrapped already (a train() under way is guarded only then). The wrap stays for the trainer's next
    train() while the callback is one of its callbacks, and is undone when a train() ends without it."""
    if trainer is None:
        return False
    if getattr(trainer.train, "tfdoctor_callback", None) is callback:
        return True
    patches = Patches()

    def guarding(original):
        @functools.wraps(original)
        def train(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except BaseException as error:
                callback.raised(error)
                raise
            finally:
                if callback not in trainer.callback_handler.callbacks:  # trainer.remove_callback(...)
                    patches.undo()

        train.tfdoctor_callback = callback
        return train

    patches.wrap(trainer, "train", guarding)
    return False
