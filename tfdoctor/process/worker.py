"""The worker process: loads the user's target and runs the battery, streaming what happens to its
supervisor (tfdoctor/process/supervisor.py) over a pipe as JSON lines.

The user's code runs here, never in the process that prints the report, so that:
- whatever it prints goes to stderr (file descriptor 1 points at stderr), and stdout carries only
  the report the supervisor renders;
- a hang, a `sys.exit`, an `os._exit` or a crash is seen from outside and named, instead of ending
  a CI job silently green or running until the job's own limit;
- threads the user leaves running cannot keep tfdoctor alive (the worker ends with os._exit).

Its arguments are two descriptors: the channel the events go out on, one JSON object per line
(protocol.Channel), and the pipe the request comes in on (protocol.receive_request).
tfdoctor/process/protocol.py lists every event and what it carries: hello, phase, progress/advance,
discovered, result, verdict, then one last word: done, usage-error, exit, rank-exit or internal-error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import traceback
import warnings
from typing import Any, Callable

from tfdoctor.errors import InternalError, OutputShapeError, TfdoctorError, UsageError, folded
from tfdoctor.process.fds import keep_open
from tfdoctor.process.protocol import Channel, Event, Phase, encode_result, encode_verdict, receive_request
from tfdoctor.process.sandbox import enter as enter_sandbox
from tfdoctor.usercode.call_sites import raised_at
from tfdoctor.usercode.environment import DEBUG
from tfdoctor.usercode.world import world


class _LineEnds:
    """The worker's sys.stdout and sys.stderr (both stderr): remembers whether what was written last
    left a line open (an `input()` prompt, `print(..., end="")`), so that tfdoctor's one line starts
    a line of its own and is the last line on stderr."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.open = False

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        if text:
            self.open = not text.endswith("\n")
        return written

    def end_line(self) -> None:
        if self.open:
            self.write("\n")
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def progress_over(channel: Channel) -> Callable:
    """A Progress (tfdoctor.context) whose tasks the supervisor draws."""
    ids = itertools.count()

    def start(description: str, total: int):
        task = next(ids)
        channel.send(Event.PROGRESS, task=task, description=description, total=int(total))

        def advance(n: int = 1) -> None:
            if n > 0:
                channel.send(Event.ADVANCE, task=task, n=int(n))

        return advance

    return start


def run_check_request(request: dict, listener=None, progress=None):
    """`tfdoctor check` itself: load the target (and loop), then run the selected checks."""
    import torch

    from tfdoctor.loader import load_function, load_subject
    from tfdoctor.memory.seq_limit import refuse_unfit_seq
    from tfdoctor.runner import as_subject, run_checks

    # Seeded before the factory builds the model: the same command gives the same initial weights,
    # the same evidence and the same verdict in every process.
    torch.manual_seed(request.get("seed", 0))
    subject = load_subject(request["target"])
    train = request.get("train")
    train_fn = load_function(train) if train else None
    if request.get("device"):
        subject = _move(subject, request["device"])
    fields = dict(request.get("fields", {}), train=train_fn)
    if request.get("options", {}).get("train_seq"):  # a length the model cannot take is a usage error
        refuse_unfit_seq(as_subject(subject, **fields), request["options"]["train_seq"], "--train-seq")
    return run_checks(subject, request.get("only"), request.get("skip"), seed=request.get("seed", 0),
                      target=request["target"], progress=progress, options=request.get("options", {}),
                      listener=listener, **fields)


def run_script_request(request: dict, listener=None, progress=None, inform=None, session=None) -> bool:
    """`tfdoctor run`: run the script until it has taken its steps (tfdoctor/recording/script.py),
    then judge the recorded loop with the loop checks and a copy of its model, as it was at its first
    forward, with the model checks: one run_checks call, the trace handed in. `inform(facts)` hears
    what was discovered, before any check.

    In a distributed run (`session`, a RankSession) every rank records and rank 0 alone judges:
    returns False on the other ranks, which then only wait for rank 0's exit code."""
    import torch

    from tfdoctor.recording.collectives import communicating_reason
    from tfdoctor.recording.discovery import discover, subject_of
    from tfdoctor.recording.script import record_script
    from tfdoctor.recording.snapshot import TraceOnly
    from tfdoctor.recording.wrappers import unwrap
    from tfdoctor.runner import run_checks

    torch.manual_seed(request.get("seed", 0))  # a script that seeds nothing still gives one report
    run = record_script(request.get("script"), request.get("module"), tuple(request.get("args", ())),
                        steps=request["steps"], model=request.get("model"), session=session)
    if session is not None and session.world.rank != 0:
        return False
    absent = {}  # inputs the checks cannot have: the runner skips the checks that read them
    uncopied = run.recorder.uncopied
    if uncopied is not None:  # the loop and rank checks still judge the trace; no model check runs
        run.recorder.snapshot = TraceOnly(run.recorder.vocab, unwrap(run.recorder.bound))
        run.notes.append(uncopied)
        absent["model"] = uncopied
    facts = discover(run)
    if session is not None:
        facts["world_size"] = session.world.size
    subject = subject_of(run, facts, request.get("fields", {}))
    # a forward that communicates is never called here: probing it alone would wait for the other ranks
    unreadable = None if uncopied is not None else (
        communicating_reason(run.recorder.forward_collectives) if run.recorder.forward_collectives
        else _unreadable_output(subject))
    if unreadable is not None:  # only the model checks need the logits; the loop checks judge the trace
        stand_in = TraceOnly(subject.vocab_size or run.recorder.vocab, unwrap(run.recorder.bound))
        subject = dataclasses.replace(subject, model=stand_in, forward=None, packing=None)
        absent["model"] = unreadable
        facts.setdefault("notes", []).append(unreadable)
    if inform is not None:
        inform(facts)
    if facts.get("checkpoint"):  # the init init-loss judges is not the script's
        absent["initial_weights"] = (f"the script loaded trained weights before its first forward "
                                     f"({facts['checkpoint']}): the initial loss judges an untrained model")
    # overfit-batch tries the script's own optimizer first (probes/memorise.py)
    options = dict(request.get("options", {}), recorded_optimizers=run.trace.optimizers)
    run_checks(subject, request.get("only"), request.get("skip"), seed=request.get("seed", 0), target=run.name,
               progress=progress, options=options, listener=listener, trace=run.trace, absent=absent)
    return True


def _serve_memory_or_watch(request: dict, channel: Channel, listener, progress) -> None:
    """`memory TARGET` and `watch`, which need no rank session: run it and send what it found."""
    if request["command"] == "memory":
        channel.send(Event.PHASE, name=Phase.MEMORY)
        channel.send(Event.VERDICT, verdict=encode_verdict(run_memory_request(request, progress=progress)))
        return
    channel.send(Event.PHASE, name=Phase.WATCH)
    report = run_watch_request(request, listener=listener, send=channel.send if request.get("progress") else None)
    channel.send(Event.DISCOVERED, facts={**report.discovered, "series": report.series})


def run_watch_request(request: dict, listener=None, send=None):
    """`tfdoctor watch`: run the script watched to its end (or --max-steps / --max-time), then judge the
    whole run. With `send(event, **data)` (a terminal shows the live view) the finalised steps go out
    a few times a second, with the findings of the run so far."""
    from tfdoctor.process.live import LiveFeed
    from tfdoctor.watching.driver import watch_script
    from tfdoctor.watching.judging import judge_run, watched_report

    if request.get("seed") is not None:
        import torch

        torch.manual_seed(request["seed"])
    feed = LiveFeed(send, judge=lambda series: judge_run(series, request.get("only"), request.get("skip"))) \
        if send is not None else None
    run = watch_script(request.get("script"), request.get("module"), tuple(request.get("args", ())),
                       max_steps=request.get("max_steps"), max_time=request.get("max_time"),
                       on_row=feed.row if feed is not None else None, on_monitor=feed.bind if feed else None)
    if feed is not None:
        feed.flush()
    return watched_report(run, request.get("only"), request.get("skip"), listener=listener)


def _unreadable_output(subject):
    """Why the model checks cannot judge the audited model (its output is not logits [B, T, V]: a model
    that returns its loss, rows tfdoctor could not place; or calling it as the probes do raised: a
    part kept in bfloat16 that the script only calls under autocast), or None when they can, or when
    there is no vocabulary to stand in for (then the run stops on that, as before). A model the probes
    cannot call never takes the loop's verdicts down with it."""
    from tfdoctor.errors import SubjectError
    from tfdoctor.subject import NonFiniteLogits, resolve, vocab_size_of

    if not (subject.vocab_size or vocab_size_of(subject.model)):
        return None
    name = type(subject.model).__name__
    try:
        resolve(subject)
    except OutputShapeError as error:
        return (f"model checks skipped: {name}'s output is not logits over the vocabulary "
                f"for every position, and no module inside it returns them ({error.message}); the loop checks "
                "judge the recorded trace")
    except NonFiniteLogits:
        return None  # finite-logits judges that, and says why the other model checks skip
    except SubjectError as error:
        return (f"model checks skipped: tfdoctor's probes could not call {name} outside the script "
                f"({error.message}); the loop checks judge the recorded trace")
    return None


def run_memory_request(request: dict, progress=None):
    """`tfdoctor memory TARGET`: load the target and trace one training step (the Verdict)."""
    import torch

    from tfdoctor.loader import load_subject
    from tfdoctor.memory.seq_limit import refuse_unfit_seq
    from tfdoctor.memory.traced_judge import judge_traced
    from tfdoctor.runner import as_subject

    torch.manual_seed(0)  # as `check` does: the factory's weights are the same in every run
    subject = as_subject(load_subject(request["target"]), vocab_size=request.get("vocab"))
    refuse_unfit_seq(subject, request["seq"], "--seq")
    return judge_traced(subject, request["target"], request["batch"], request["seq"], request["budget_bytes"],
                        request["budget_source"], dtype=request["dtype"], optimizer=request["optimizer"],
                        gpus=request["gpus"], shard=request["shard"], progress=progress, device=request.get("device"))


def _rank_session(request: dict):
    """One rank of a torchrun job (RANK / WORLD_SIZE set): its RankSession; None in one process. The
    ranks wait for each other at the stop point within the script's budget, and for rank 0's exit code
    within the whole run's."""
    from tfdoctor.recording.distributed import RankSession

    me = world()
    if not me.distributed:
        return None
    options = request.get("options", {})
    return RankSession(me, arrival_timeout=float(options.get("timeout_per_check", 300)),
                       exit_code_timeout=float(request.get("timeout", 600)))


def _close_session(session, release_fd) -> None:
    """Rank 0 waits for its supervisor to have printed the report (the exit code comes back on
    `release_fd`), then sends every rank that code; then the group goes."""
    if session is None:
        return
    if session.world.rank == 0 and session.exit_code_group is not None:
        code = 2
        if release_fd is not None:
            with os.fdopen(release_fd, "r") as release:
                line = release.readline().strip()  # empty: the supervisor is gone
            code = int(line) if line.lstrip("-").isdigit() else 2
        with contextlib.suppress(Exception):  # a rank that died already: the others still get theirs
            session.send_code(code)
    session.close()


def _move(subject, device: str):
    import torch

    from tfdoctor.runner import as_subject

    try:
        torch_device = torch.device(device)
        subject = as_subject(subject)
        subject.model.to(torch_device)
    except (RuntimeError, AssertionError) as exc:
        raise UsageError(f"cannot use device {device!r}: {exc}") from exc
    return subject


def _prepare(request: dict, channel_fd: int) -> _LineEnds:
    """This process made ready for the user's code: its output on stderr (returned: the stream tfdoctor
    ends its lines on), the user's sys.argv, the stack dump armed, tfdoctor's descriptors kept open."""
    # torch warns "Failed to initialize NumPy" at import when numpy is absent; tfdoctor never needs numpy,
    # so on a machine without it that line is noise above every report. Only that one warning is hidden,
    # in this process only (never on `import tfdoctor`: a library user's filters are theirs).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    # The user's prints, Python's and C's alike, go to stderr: stdout is the report's alone. Under
    # `watch`'s live view stderr is a pipe to the supervisor, which prints them above the view.
    if request.get("output_fd") is not None:
        os.dup2(request["output_fd"], 2)
        os.close(request["output_fd"])
    os.dup2(2, 1)
    sys.stdout = sys.stderr = output = _LineEnds(sys.stderr)
    sys.argv = [request.get("target", "tfdoctor")]  # the user's module sees no tfdoctor arguments
    dump_path = request.get("stack_dump")
    kept = [channel_fd] + ([request["release_fd"]] if request.get("release_fd") is not None else [])
    if dump_path and hasattr(__import__("signal"), "SIGUSR1"):
        import faulthandler
        import signal

        # The supervisor sends SIGUSR1 when a budget runs out: every thread's stack goes to the file,
        # so the one line it prints can name the user's frame that was running.
        dump_file = open(dump_path, "w")
        faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
        kept.append(dump_file.fileno())
    keep_open(kept)  # the user's os.closerange(3, ...) leaves tfdoctor's pipes and dump file alone
    return output


def main(argv: list[str]) -> None:
    """`python -m tfdoctor.process.worker CHANNEL_FD REQUEST_FD` (supervisor.spawn_worker)."""
    channel = Channel(int(argv[1]))
    request = receive_request(int(argv[2]))
    output = _prepare(request, int(argv[1]))
    # Before any thread starts (a user namespace needs one) and before the user's code runs.
    sandbox = enter_sandbox(request.get("sandbox"))
    channel.send(Event.HELLO, pid=os.getpid(), main_thread=threading.main_thread().ident)

    def listener(event: str, payload) -> None:
        if event == "start":
            channel.send(Event.PHASE, name=payload)
        elif event == "result":
            channel.send(Event.RESULT, result=encode_result(payload))

    code = 0
    session = None
    try:
        channel.send(Event.PHASE, name=Phase.LOADING)
        progress = progress_over(channel) if request.get("progress") else None
        if request.get("command") in ("memory", "watch"):
            _serve_memory_or_watch(request, channel, listener, progress)
        elif request.get("command") == "run":
            channel.send(Event.PHASE, name=Phase.SCRIPT)
            session = _rank_session(request)
            judged = run_script_request(request, listener=listener, progress=progress, session=session,
                                        inform=lambda facts: channel.send(Event.DISCOVERED, facts=facts))
            if session is not None and not judged:
                channel.send(Event.PHASE, name=Phase.RANKS)
                code_sent = session.receive_code()  # the code this rank's tfdoctor exits with, not the worker
                channel.send(Event.RANK_EXIT, code=code_sent, rank=session.world.rank)
        else:
            run_check_request(request, listener=listener, progress=progress)
        output.end_line()
        channel.send(Event.DONE)
    except TfdoctorError as error:
        if DEBUG.on() and error.__cause__ is not None:  # the user's code raised: its traceback, as the hint says
            output.end_line()
            traceback.print_exception(error.__cause__, file=sys.stderr)
        if session is not None and session.world.rank != 0 and session.exit_code_group is not None:
            # rank 0 prints the job's line: this rank ends only once it has (torchrun ends the rest then)
            with contextlib.suppress(Exception):
                session.receive_code()
        output.end_line()
        channel.send(Event.USAGE_ERROR, message=error.one_line(),
                     quiet=bool(getattr(error, "said_by_rank_0", False)) and world().rank != 0)
    except SystemExit as error:  # the user's code: a CI gate must not take its code for ours
        output.end_line()
        channel.send(Event.EXIT, code=error.code if isinstance(error.code, int) or error.code is None
                     else str(error.code), where=raised_at(error))
    except KeyboardInterrupt:
        code = 130
    except BaseException as error:  # noqa: BLE001 - everything else is reported, never a traceback
        said = str(error) if isinstance(error, InternalError) else f"{type(error).__name__}: {error}"
        output.end_line()
        channel.send(Event.INTERNAL_ERROR, message=folded(said),
                     traceback="".join(traceback.format_exception(type(error), error, error.__traceback__)))
    finally:
        if sandbox is not None:
            sandbox.leave()
        _close_session(session, request.get("release_fd"))
        sys.stderr.flush()
    # os._exit: the user's non-daemon threads must not keep the worker (and CI) waiting.
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv)
