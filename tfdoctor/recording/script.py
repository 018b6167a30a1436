"""The script driver of the recorder: run an unmodified training script as __main__ (`tfdoctor run`),
record its first optimizer steps with the same recorder `check --train` uses, and stop it there.

`record_script(...)` runs the script like `python train.py ARGS` (its own sys.argv, sys.path[0] its
folder, the current directory unchanged) or `python -m pkg.mod ARGS`, with the recording installed
process-wide. Which model is trained is not known in advance, so the recorder binds late (the
ScriptRecorder of script_recorder.py: the first model called under grad, settled at the first optimizer
step). After K optimizer steps (all optimizers of the step stepped) a private BaseException is
raised out of optimizer.step (for a loop that updates the weights by hand: out of the next
backward), so the script's finally blocks run and nothing it would do after the stop point (a
checkpoint, a log) is reached.

What the script did also tells how it calls its model (the recorded forward), what its batches look
like (shape, pad id from the -100 / ignore_index masking, the attention mask or runs of one id at
the rows' ends, padding side) and whether it loaded a checkpoint first: `discover` turns that into
the facts the report shows under "discovered" and the Subject the model checks run on.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from tfdoctor.errors import LoadError
from tfdoctor.recording.ranks import RankRecorder
from tfdoctor.recording.recorder import finish
from tfdoctor.recording.script_recorder import ScriptRecorder
from tfdoctor.recording.stopping import StopScript
from tfdoctor.recording.trace import Trace
from tfdoctor.usercode.as_main import ScriptOutcome, exit_code, refuse_no_step, run_script, script_name
from tfdoctor.usercode.patches import Patches


class ScriptError(LoadError):
    """The script could not be audited: it raised, exited or ended before its first optimizer step."""


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


@contextlib.contextmanager
def _shown_and_kept() -> Iterator[list]:
    """The script's warnings reach its stderr as under `python SCRIPT` (the user's filters decide which),
    and are kept for the Trace too, in the list yielded."""
    kept: list = []

    def keeping(show: Callable) -> Callable:
        def shown(message, category, filename, lineno, file=None, line=None):
            kept.append(warnings.WarningMessage(message, category, filename, lineno, file, line))
            show(message, category, filename, lineno, file, line)

        return shown

    with Patches() as patches:
        patches.wrap(warnings, "showwarning", keeping)
        yield kept


def record_script(path: Optional[str] = None, module: Optional[str] = None, args: tuple = (),
                  steps: int = 2, model: Optional[str] = None, session=None) -> ScriptRun:
    """Run the script (a file `path` or a module `module`) as __main__ with `args` until `steps`
    optimizer steps of its model (`model`: the class or variable name of the one to audit when it
    trains several) are recorded. Raises ScriptError when it ends, exits or raises before its first
    step; a KeyboardInterrupt propagates.

    `session` (a RankSession) makes it one rank of a distributed run: the rank's own digest is
    recorded beside the trace and gathered to rank 0 at the stop point (Trace.ranks there)."""
    name = script_name(path, module, ScriptError)
    recorder = ScriptRecorder(steps, model)
    with warnings.catch_warnings(), _shown_and_kept() as caught:
        try:  # `run` stops the script early: any sys.exit before the stop point is noted, Ctrl-C propagates
            outcome = run_script(path, module, args, "tfdoctor run", _recording(recorder, session), StopScript,
                                 clean_exit_finishes=False, interrupt_ends=False)
        finally:
            recorder.stopper.disarm()
    ended, error, seconds = outcome.ended, outcome.error, outcome.seconds
    if recorder.stopper.raised and ended != "stopped":  # caught by the script, which ran on or raised after
        ended, error = "stopped", None
    if recorder.stop_error is not None:
        raise recorder.stop_error
    trace = finish(recorder, caught)
    if session is not None and session.digests:
        trace.ranks = list(session.digests)
    trace.forward_collectives = dict(recorder.forward_collectives)  # tensor parallelism: read by the rank checks
    # The script feeds itself: its micro-batches are the forwards of its model under grad mode.
    trace.batches_fed = sum(1 for e in trace.events if e.kind == "forward" and e.data.get("grad", True))
    run = ScriptRun(trace, recorder, name, seconds, ended, steps, error, session=session)
    _refuse_unaudited(run)
    if recorder.rebound:
        run.notes.append(recorder.rebound)
    swallowed = recorder.stopper.note(steps)
    if swallowed:
        run.notes.append(swallowed)
    return run


@contextlib.contextmanager
def _recording(recorder: ScriptRecorder, session) -> Iterator[None]:
    """The recorder installed process-wide (and a rank's recording) around the script. A stop raised
    out of the script's step ends the block here, so that what is installed unwinds as after a clean
    end (the ranks meet); record_script reads the stop off the recorder's stopper."""
    with recorder.installed_process_wide(), _rank_recording(recorder, session):
        try:
            yield
            recorder._manual_update()  # a hand-written update after the last backward
        except StopScript:
            pass


def _rank_recording(recorder: ScriptRecorder, session):
    """On every rank of a distributed run: what the rank checks compare (recording/ranks.py), handed
    to rank 0 at the stop point; the script's destroy_process_group() waits until tfdoctor is done."""
    if session is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    ranks = stack.enter_context(RankRecorder(session.world.rank, session.world.size))
    stack.enter_context(session.teardown_deferred())
    def stopped() -> None:
        recorder.read_unread()  # the scored rows of the last backwards, which the rank checks weigh too
        session.gather(ranks.digest(recorder.events, recorder.bound, recorder.scores))

    recorder.on_stop = stopped

    def ended_before_the_stop(kind, error, tb) -> None:  # the script ran out of steps first: the ranks meet
        # at its end; not when it raised: the other ranks wait for this one in the job's own collectives
        if recorder.window > 0 and not isinstance(error, Exception):
            recorder.meet()

    stack.push(ended_before_the_stop)
    return stack


def _refuse_unaudited(run: ScriptRun) -> None:
    trace, recorder, name = run.trace, run.recorder, run.name
    outcome = ScriptOutcome(run.ended, run.seconds, run.error)
    if recorder.unmatched:
        raise ScriptError(recorder.unmatched, "give --model one of those class or variable names")
    if trace.steps:
        if recorder.bound is None:
            raise ScriptError(f"{name} stepped an optimizer but never called an nn.Module with trainable "
                              "parameters, so there is no model to audit")
        where = f" at {outcome.where}" if outcome.where else ""
        if run.ended == "raised" and run.session is not None:  # the other ranks wait on it: the job ends
            raise ScriptError(f"{name} raised {type(run.error).__name__}: {run.error}{where} after "
                              f"{trace.steps} optimizer step(s)",
                              "fix the script so that it runs under torchrun (TFDOCTOR_DEBUG=1 shows the "
                              "traceback)") from run.error
        if run.ended != "stopped":
            how = {"finished": "ended", "exit": f"called sys.exit({exit_code(run.error)!r})",
                   "raised": f"raised {type(run.error).__name__}: {run.error}"}[run.ended]
            run.notes.append(f"the script {how}{where} after {trace.steps} of the {run.steps_asked} "
                             "optimizer steps asked for; judged on those")
        return
    refuse_no_step(name, outcome, ScriptError)
    forwards = sum(1 for e in trace.events if e.kind == "forward")
    backwards = sum(1 for e in trace.events if e.kind == "backward")
    raise ScriptError(f"{name} ended without an optimizer step: {forwards} forward(s) of a model and "
                      f"{backwards} backward() call(s) seen",
                      "give it arguments that make it train (after --), e.g. more iterations")
