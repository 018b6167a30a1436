"""The supervisor: starts a worker process (tfdoctor/process/worker.py) for the user's code and watches it,
the way pytest-timeout or xdist watch theirs. The two speak tfdoctor/process/protocol.py; the supervisor
keeps what it hears as an Outcome.

It enforces the time budgets (one per check, one for the whole run), names the user's frame that
was running when a budget ran out (from a faulthandler dump), and tells a worker that delivered its
report from one that ended without it (sys.exit, os._exit, a crash, a signal). It never imports
torch and never runs user code, so it always exits.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from tfdoctor.process.protocol import (
    CHANNEL_LOST_EXIT,
    Ended,
    Event,
    Phase,
    decode_result,
    decode_verdict,
    phase_name,
    read_event,
    send_request,
)
from tfdoctor.process.reaper import Descendants
from tfdoctor.process.sandbox import Host
from tfdoctor.process.signals import signals_stop, stopped_by
from tfdoctor.process.tempdirs import private_folder, temp_environment
from tfdoctor.result import ExitCode, Result
from tfdoctor.usercode.call_sites import display_path, is_library
from tfdoctor.usercode.environment import LAUNCHED

FIRST_FAILURE = "tfdoctor-first-failure"
# After SIGUSR1, how long the worker gets to write its stack dump before it is killed.
DUMP_GRACE_SECONDS = 2.0
POLL_SECONDS = 0.1


@dataclass
class Outcome:
    """What the worker did: its results so far, and how it ended."""

    results: list[Result] = field(default_factory=list)
    ended: Ended = Ended.DONE
    message: str = ""  # for everything but done: the one line to print
    phase: str = ""  # what was running when it ended (a protocol.Phase or a check id)
    debug: str = ""  # internal-error: the worker's traceback
    discovered: dict = field(default_factory=dict)  # `tfdoctor run`: what the script showed
    verdict: Any = None  # `tfdoctor memory TARGET`: the traced Verdict
    code: int = 0  # rank-exit: the exit code rank 0 sent; interrupted: 128 + the signal's number
    quiet: bool = False  # usage-error: rank 0 says the same line, this rank says nothing
    sandbox: dict = field(default_factory=dict)  # what the user's code tried to write (tfdoctor/process/sandbox)


def supervise(request: dict, *, timeout: float, timeout_per_check: float,
              progress: Optional[Callable] = None, hold: Optional[Callable[[Outcome], Any]] = None) -> Outcome:
    """Run `request` (see worker.run_check_request) in a worker and return its Outcome.

    `progress` is a Progress (tfdoctor.context) that draws the worker's long tasks, or None.
    `hold(outcome)` (with request["release"]: rank 0 of a distributed run) is called once the worker
    has said its last word but still waits; the exit code it ends with (returned, or the code of the
    SystemExit it raises) is then written to the worker, which sends it to the other ranks."""
    with signals_stop(), Descendants():
        # A private temporary folder (the stack dump; TMPDIR of the worker and all it starts, whose
        # files a kill leaves behind, multiprocessing's pymp-* folders among them): it goes with the run.
        with private_folder() as private:
            return _supervised(request, timeout, timeout_per_check, progress, hold, private)


def _supervised(request: dict, timeout: float, timeout_per_check: float, progress, hold, private: str) -> Outcome:
    dump = os.path.join(private, "stack.txt")
    Path(dump).touch()
    release_read = release_write = None
    if hold is not None:
        release_read, release_write = os.pipe()
    # A rank of `--nproc` already has the launcher's private folder as its TMPDIR: not one more level,
    # since a Unix socket's path (multiprocessing makes them there) is limited to 107 bytes.
    temp = os.environ["TMPDIR"] if LAUNCHED.on() and os.environ.get("TMPDIR") else private
    # The user's files are sacred: the worker writes into this scratch folder. A watched run that
    # tfdoctor does not cut short is the user's real run: it writes for real, in the user's TMPDIR.
    protected = request.get("protect", True)
    sandbox = Host(request, own=(private, temp), keep_in=request.get("keep_writes")) if protected else None
    # `watch`'s live view: the user's output comes through a pipe and is printed above the view.
    output_read, output_write = os.pipe() if getattr(progress, "output", None) is not None else (None, None)
    request = {**request, "stack_dump": dump, "progress": progress is not None, "release_fd": release_read,
               "sandbox": sandbox.spec if sandbox is not None else None, "output_fd": output_write}
    read_end, write_end = os.pipe()
    request_read, request_write = os.pipe()
    env = {**os.environ, **(temp_environment(temp) if protected else {})}
    outcome = Outcome()
    proc = None
    try:
        try:
            proc = start_worker(write_end, request_read, tuple(fd for fd in (release_read, output_write)
                                                               if fd is not None), env)
        except BaseException:
            os.close(request_write)
            raise
        finally:
            for fd in (write_end, request_read, release_read, output_write):
                if fd is not None:
                    os.close(fd)
        # From a thread: a request larger than the pipe's buffer (64 KiB) is written while the worker
        # reads it, and the budgets below already hold a worker that never starts reading.
        threading.Thread(target=send_request, args=(request_write, request), name="tfdoctor-request",
                         daemon=True).start()
        outcome = _read_events(outcome, proc, read_end, dump, timeout, timeout_per_check, progress, output_read,
                               forward_ctrl_c=request.get("command") == "watch")
        outcome.sandbox = sandbox.report() if sandbox is not None else {}
        _first_failure(outcome)
        if hold is not None and proc.poll() is None and outcome.ended in (Ended.DONE, Ended.USAGE_ERROR,
                                                                         Ended.INTERNAL_ERROR):
            _clear(progress)  # the report is printed on a clean line, the bar gone
            _held(hold, outcome, proc, release_write)
        return outcome
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM or SIGHUP (the worker has its own session)
        stop = stopped_by(interrupt)
        if LAUNCHED.on():  # one rank of `--nproc`: the launcher says it once
            outcome.ended, outcome.code = Ended.RANK_EXIT, stop.code
        else:
            outcome.ended, outcome.code = Ended.INTERRUPTED, stop.code
            outcome.message = f"{stop.said} during {phase_name(outcome.phase)}"
        return outcome
    finally:
        _clear(progress)
        if proc is not None:
            _kill(proc)
        for fd in (read_end, release_write, output_read):
            if fd is not None:
                os.close(fd)
        if sandbox is not None:
            sandbox.close()


def _first_failure(outcome: Outcome) -> None:
    """One rank of `--nproc`: the first rank to fail says why. A rank that fails after it (the failed
    rank's end broke the job's collectives under it) ends quietly. The claim, a file in the job's
    private temporary folder (TMPDIR, process/launch.py), is made before this rank's worker is
    killed, which is what breaks the others'. A worker killed by a signal is never a consequence: it
    says so whatever the claim."""
    if not LAUNCHED.on() or outcome.quiet or outcome.ended in (Ended.DONE, Ended.RANK_EXIT):
        return
    try:
        os.close(os.open(os.path.join(tempfile.gettempdir(), FIRST_FAILURE), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        if outcome.ended != Ended.VANISHED:
            outcome.ended, outcome.code = Ended.RANK_EXIT, int(ExitCode.USAGE_ERROR)
    except OSError:
        pass


def _clear(progress) -> None:
    """Take the progress bar off the terminal (tfdoctor.report.progress), if one is drawn."""
    clear = getattr(progress, "clear", None)
    if clear is not None:
        clear()


# After its release, how long the worker gets to send the other ranks their exit code and end.
RELEASE_GRACE_SECONDS = 30.0


def _held(hold: Callable[[Outcome], Any], outcome: Outcome, proc, release_write: int) -> None:
    """Conclude (hold) while the worker waits, then release it with the exit code concluded on."""
    code = 2
    try:
        code = hold(outcome)
    except SystemExit as exit_:
        code = exit_.code
        raise
    except BaseException as exc:  # click's Exit carries exit_code
        code = getattr(exc, "exit_code", 2)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.write(release_write, f"{int(code) if isinstance(code, int) else 2}\n".encode())
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=RELEASE_GRACE_SECONDS)


def spawn_worker(channel_fd: int, request_fd: int, kept: tuple, env: dict) -> subprocess.Popen:
    """The worker process, a fresh interpreter: `python -m tfdoctor.process.worker CHANNEL_FD REQUEST_FD`
    (the events go out on the first descriptor, the request comes in on the second); `kept`: the other
    descriptors it inherits. Its stdin is /dev/null, its stdout this process's stderr."""
    return subprocess.Popen(
        [sys.executable, "-m", "tfdoctor.process.worker", str(channel_fd), str(request_fd)],
        pass_fds=(channel_fd, request_fd) + kept, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
        start_new_session=True,  # its own process group: DataLoader workers and all go with it
        preexec_fn=die_with_parent,
    )


# How the supervisor starts its worker: a seam, the one the test suite uses (tests/zygote.py sets it to
# tests/forked_worker.py's `start`, which forks a process that has imported torch already, with
# spawn_worker's arguments and the same start state). Anything with Popen's poll, wait, kill and pid.
start_worker: Callable[[int, int, tuple, dict], Any] = spawn_worker


def die_with_parent() -> None:
    """In the worker, before exec (Linux): the kernel kills it if the supervisor dies first, however
    that happens, so a worker stuck in the user's code never outlives tfdoctor and holds its pipes."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the supervisor's own kill in `finally` remains
        pass


class _Budgets:
    """The run's budget and the current phase's, from the moment the worker starts."""

    def __init__(self, timeout: float, per_check: float) -> None:
        self.timeout, self.per_check = timeout, per_check
        self.started = self.phase_started = time.monotonic()

    def left(self, phase: str) -> tuple[float, float]:
        now = time.monotonic()
        # Waiting for rank 0 is not a check of its own: the whole run's budget bounds it.
        phase_left = (_hard_limit(self.per_check) - (now - self.phase_started) if phase != Phase.RANKS
                      else self.timeout)
        return phase_left, self.timeout - (now - self.started)

    def overrun(self, phase: str) -> str:
        """The line's start when a budget has run out, else ""."""
        phase_left, run_left = self.left(phase)
        if phase_left <= 0:
            return f"{phase_name(phase)} ran past its {self.per_check:g} s budget (--timeout-per-check)"
        if run_left <= 0:
            return f"the run ran past its {self.timeout:g} s budget (--timeout), during {phase_name(phase)}"
        return ""


def _read_events(outcome: Outcome, proc, read_end: int, dump_path: str, timeout: float, per_check: float,
                 progress, output_read: Optional[int] = None, forward_ctrl_c: bool = False) -> Outcome:
    budgets = _Budgets(timeout, per_check)
    state = {"main_thread": None, "finished": False}
    tasks: dict[int, Callable] = {}
    buffer = b""
    watched = [read_end] + ([output_read] if output_read is not None else [])
    while True:
        which = budgets.overrun(outcome.phase)
        if which:
            return _timed_out(outcome, which, proc, dump_path, state["main_thread"])
        try:
            ready, _, _ = select.select(watched, [], [], min(POLL_SECONDS, *budgets.left(outcome.phase)))
        except KeyboardInterrupt as interrupt:
            # `watch`: the first Ctrl-C ends the script, not tfdoctor: the worker (its own session, which
            # the terminal's signal misses) gets it and judges the steps recorded; a second one stops all
            if not forward_ctrl_c or stopped_by(interrupt).signum != signal.SIGINT or proc.poll() is not None:
                raise
            forward_ctrl_c, state["forwarded"] = False, True
            # to the worker's process group, as a terminal's Ctrl-C reaches the bare script's (its
            # DataLoader workers, its subprocesses); the run keeps its budgets: the script's own
            # KeyboardInterrupt handler may save a checkpoint of any size, and a second Ctrl-C stops all
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except (ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGINT)
            continue
        if output_read is not None and output_read in ready:
            _relay_output(output_read, progress, watched)
        if read_end not in ready:
            continue
        chunk = os.read(read_end, 1 << 16)
        if not chunk:  # the worker closed the pipe: it has ended, or its code closed the descriptor
            if output_read is not None and output_read in watched:
                _drain_output(output_read, progress)
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if _take(outcome, read_event(line), state, tasks, progress, budgets):
                state["finished"] = True
        if state["finished"] or outcome.ended != Ended.DONE:
            if output_read is not None and output_read in watched:  # what it printed before its last word
                _drain_output(output_read, progress)
            # The worker said its last word. Processes it started (DataLoader workers) may still hold
            # the pipe open, so waiting for its end could wait for them: they go with the group.
            return outcome
    # The pipe is at its end: wait for the worker to end too, within the budgets still (a script that
    # closed every descriptor above 2 and hangs ends no other way).
    while True:
        which = budgets.overrun(outcome.phase)
        if which:
            return _timed_out(outcome, which, proc, dump_path, state["main_thread"])
        try:
            code = proc.wait(timeout=min(POLL_SECONDS, *budgets.left(outcome.phase)))
            break
        except subprocess.TimeoutExpired:
            continue
    if state.get("forwarded") and code in (130, -signal.SIGINT):  # Ctrl-C before the run had a step
        outcome.ended, outcome.code = Ended.INTERRUPTED, 130
        outcome.message = f"interrupted (Ctrl-C) during {phase_name(outcome.phase)}"
        return outcome
    outcome.ended = Ended.VANISHED
    if code == CHANNEL_LOST_EXIT:
        outcome.message = (f"your code closed tfdoctor's report pipe (a file descriptor above 2, closed below "
                           f"Python's os.close) during {phase_name(outcome.phase)}, so the report could not be "
                           "delivered; leave descriptors you did not open alone")
        return outcome
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        why = f"was killed by {name}" + (" (out of memory? the kernel's OOM killer sends it)" if name == "SIGKILL"
                                         else "")
    else:
        why = f"exited with code {code} (os._exit, or a crash in native code)"
    outcome.message = (f"the process running your code {why} during {phase_name(outcome.phase)}, before the "
                       "report was delivered")
    return outcome


def _relay_output(output_read: int, progress, watched: list) -> None:
    """The user's output, printed above the live view (progress.output); at its end the pipe is no
    longer watched."""
    chunk = os.read(output_read, 1 << 16)
    if chunk:
        progress.output(chunk)
    else:
        watched.remove(output_read)


def _drain_output(output_read: int, progress) -> None:
    while select.select([output_read], [], [], 0)[0]:
        chunk = os.read(output_read, 1 << 16)
        if not chunk:
            return
        progress.output(chunk)


def _timed_out(outcome: Outcome, which: str, proc, dump_path: str, main_thread: Optional[int]) -> Outcome:
    where = _stack_of(proc, dump_path, main_thread)
    outcome.ended = Ended.TIMEOUT
    outcome.message = which + (f"; it was at {where}" if where else "")
    return outcome


def _take(outcome: Outcome, event: dict, state: dict, tasks: dict, progress, budgets: _Budgets) -> bool:
    """Apply one event of the worker's to the outcome; True when it is the worker's "done"."""
    kind = event["event"]
    if kind == Event.HELLO:
        state["main_thread"] = event.get("main_thread")
    elif kind == Event.PHASE:
        outcome.phase, budgets.phase_started = event["name"], time.monotonic()
    elif kind == Event.RESULT:
        outcome.results.append(decode_result(event["result"]))
    elif kind == Event.PROGRESS and progress is not None:
        tasks[event["task"]] = progress(event["description"], event["total"])
    elif kind == Event.ADVANCE and event["task"] in tasks:
        tasks[event["task"]](event["n"])
    elif kind == Event.DISCOVERED:
        outcome.discovered = event["facts"]
    elif kind == Event.ROWS and hasattr(progress, "rows"):  # `watch`: the live view
        progress.rows(event["rows"], event.get("eval"))
    elif kind == Event.FINDINGS and hasattr(progress, "findings"):
        progress.findings(event["findings"])
    elif kind == Event.VERDICT:  # `memory TARGET`: the traced Verdict
        outcome.verdict = decode_verdict(event["verdict"])
    elif kind == Event.DONE:
        return True
    elif kind == Event.USAGE_ERROR:
        outcome.ended, outcome.message = Ended.USAGE_ERROR, event["message"]
        outcome.quiet = bool(event.get("quiet"))
    elif kind == Event.RANK_EXIT:  # a rank other than 0: rank 0 reports, this one exits as it does
        outcome.ended, outcome.code = Ended.RANK_EXIT, int(event["code"])
    elif kind == Event.EXIT:
        where = f" at {event['where']}" if event.get("where") else ""
        outcome.ended = Ended.EXIT
        outcome.message = (f"your code called sys.exit({event['code']!r}){where} during "
                           f"{phase_name(outcome.phase)}, so tfdoctor could not finish")
    elif kind == Event.INTERNAL_ERROR:
        outcome.ended, outcome.message = Ended.INTERNAL_ERROR, event["message"]
        outcome.debug = event.get("traceback", "")
    return False


def _hard_limit(budget: float) -> float:
    """The worker is stopped a little after a check's budget, not at it: a check that watches its own
    budget (overfit-batch) then gets to stop and report what it measured first."""
    return budget * 1.1 + min(5.0, budget / 2)


def _stack_of(proc, dump_path: str, main_thread: Optional[int]) -> str:
    """Ask the worker for its stacks (SIGUSR1 -> faulthandler) and name the user's innermost frame."""
    if proc.poll() is not None or not hasattr(signal, "SIGUSR1"):
        return ""
    try:
        os.kill(proc.pid, signal.SIGUSR1)
    except ProcessLookupError:
        return ""
    deadline = time.monotonic() + DUMP_GRACE_SECONDS
    text = ""
    while time.monotonic() < deadline:
        time.sleep(0.05)
        text = Path(dump_path).read_text(encoding="utf-8", errors="replace")
        if "File " in text and text.endswith("\n"):
            time.sleep(0.05)  # let the other threads' stacks land too
            text = Path(dump_path).read_text(encoding="utf-8", errors="replace")
            break
    return user_frame(text, main_thread)


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.M)


def user_frame(dump: str, main_thread: Optional[int]) -> str:
    """file:line in function of the innermost frame that is the user's (not tfdoctor's, torch's, the
    standard library's or an installed package's: sites.is_library), preferring the main thread,
    where the checks run."""
    blocks = []
    for match in _THREAD.finditer(dump):
        end = dump.find("\n\n", match.end())
        blocks.append((int(match.group(1), 16), dump[match.end(): end if end >= 0 else len(dump)]))
    blocks.sort(key=lambda block: block[0] != main_thread)
    for _, block in blocks:
        for path, line, function in _FRAME.findall(block):
            if not is_library(path):
                return f"{display_path(path)}:{line} in {function}"
    return ""


def _kill(proc) -> None:
    """The worker and everything it started (its own process group) go, whatever they are doing."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def report_from_outcome(outcome, target: str, strict: bool):
    """The Report from what the worker delivered; None when a run cut short finished no check."""
    from tfdoctor.result import Report, Result, Status

    if outcome.ended != Ended.DONE and not outcome.results:
        return None
    report = Report(target, list(outcome.results), strict=strict, sandbox=outcome.sandbox)
    if outcome.ended != Ended.DONE:
        report.stopped = outcome.message
        if outcome.phase not in ("", Phase.LOADING):  # the check that was cut short is reported as such
            cut = Result(Status.ERROR, outcome.message, "see the line on stderr; fix it or raise the budget",
                         id=outcome.phase)
            report.results.append(cut)
    return report
