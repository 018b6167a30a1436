"""The worker <-> supervisor protocol, defined once: how the request reaches the worker (a JSON object
on a pipe of its own, read to its end: send_request / receive_request), the events it sends back (one
JSON object per line on a pipe, "event" naming which), how a worker ended, and the
encoding of what crosses the pipe (Results and the memory Verdict, as JSON).

The worker (tfdoctor/process/worker.py) writes events with Channel; the supervisor (tfdoctor/process/supervisor.py)
reads them with read_event and keeps its Outcome, whose `ended` is an Ended. Both import this module
and not each other. No torch here.

Events, in the order a worker sends them:
- hello (pid, main_thread): the worker runs; the main thread's id names its frame on a timeout.
- phase (name): what runs now, a Phase ("loading", "memory", "script", "watch", "ranks") or a check id.
- progress (task, description, total) / advance (task, n): a long task, drawn by the supervisor.
- discovered (facts): what `tfdoctor run` read off the script, sent before any check; for `tfdoctor
  watch`, how the run ended and its series (facts["series"]), after the judges' results.
- rows (rows, eval) / findings (findings): `watch` on a terminal, while the run goes on: the steps
  finalised since the last rows and the latest evaluation; the judges' warn/fail findings so far.
- result (result): one Result record (encode_result).
- verdict (verdict): `tfdoctor memory TARGET`'s traced Verdict (encode_verdict).
- the last word, one of: done; usage-error (message, quiet); exit (code, where: the user's code raised
  SystemExit); rank-exit (code, rank: a rank other than 0 of a distributed run ends with rank 0's exit
  code); internal-error (message, traceback).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading
from typing import Any

from tfdoctor.memory.analytic import Config, Estimate, Remedy, Verdict
from tfdoctor.result import Result

# The worker's exit code when its report pipe was closed under it (below os.close, which keeps it:
# tfdoctor/process/fds.py): nothing more can be said, and the supervisor names the cause.
CHANNEL_LOST_EXIT = 86


class _Word(str, enum.Enum):
    """A protocol word: compares equal to its string and is written as it in JSON and f-strings."""

    def __str__(self) -> str:
        return self.value


class Event(_Word):
    """What one line from the worker says (its "event" key)."""

    HELLO = "hello"
    PHASE = "phase"
    PROGRESS = "progress"
    ADVANCE = "advance"
    DISCOVERED = "discovered"
    RESULT = "result"
    VERDICT = "verdict"
    ROWS = "rows"  # `watch` on a terminal: the steps finalised since the last ROWS (the live view)
    FINDINGS = "findings"  # `watch` on a terminal: the run judges' warn/fail findings so far
    DONE = "done"
    USAGE_ERROR = "usage-error"
    EXIT = "exit"
    RANK_EXIT = "rank-exit"
    INTERNAL_ERROR = "internal-error"


class Phase(_Word):
    """The phases that are not a check (a check's phase is its id)."""

    LOADING = "loading"
    MEMORY = "memory"
    SCRIPT = "script"
    RANKS = "ranks"
    WATCH = "watch"


class Ended(_Word):
    """How a supervised worker ended (Outcome.ended)."""

    DONE = "done"  # it said done: the results are all there
    USAGE_ERROR = "usage-error"
    TIMEOUT = "timeout"  # a budget ran out and the supervisor stopped it
    EXIT = "exit"  # the user's code called sys.exit
    VANISHED = "vanished"  # it ended without its last word (os._exit, a crash, a signal)
    INTERNAL_ERROR = "internal-error"
    INTERRUPTED = "interrupted"  # Ctrl-C, SIGTERM or SIGHUP
    RANK_EXIT = "rank-exit"  # a rank other than 0 of a distributed run: it exits with the code it was sent


def phase_name(phase: str) -> str:
    """A phase as the one-line messages name it."""
    if phase == Phase.MEMORY:
        return "loading the target and tracing one training step"
    if phase == Phase.LOADING:
        return "loading the target (import, factory, training loop)"
    if phase == Phase.SCRIPT:
        return "running the script up to its last recorded step"
    if phase == Phase.WATCH:
        return "the watched run of the script"
    if phase == Phase.RANKS:
        return "waiting for rank 0 to judge the run"
    return f"check {phase}" if phase else "starting"


def encode_result(result: Result) -> dict[str, Any]:
    return result.to_record()


def decode_result(record: dict[str, Any]) -> Result:
    return Result.from_dict(record)


def encode_verdict(verdict: Verdict) -> dict[str, Any]:
    """The memory Verdict as plain data (dataclasses, dicts, numbers: all of it JSON)."""
    return dataclasses.asdict(verdict)


def decode_verdict(data: dict[str, Any]) -> Verdict:
    """The inverse of encode_verdict."""
    estimate = data.get("estimate")
    if estimate is not None:
        estimate = Estimate(**{**estimate, "config": Config(**estimate["config"])})
    return Verdict(**{**data, "estimate": estimate, "remedies": [Remedy(**r) for r in data.get("remedies", [])]})


def send_request(fd: int, request: dict) -> None:
    """Write the request on `fd` (the write end of the worker's request pipe) and close it; the
    worker's end, not the environment, carries it: Linux caps one environment string at 128 KiB and
    the user's script arguments travel in the request. A worker that died first is not an error
    here: the supervisor sees it end."""
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(json.dumps(request).encode("utf-8"))
    except BrokenPipeError:
        pass


def receive_request(fd: int) -> dict:
    """In the worker: the request, read from `fd` to its end (the supervisor closes it), which is then closed."""
    with os.fdopen(fd, "rb") as pipe:
        return json.loads(pipe.read())


class Channel:
    """The write end of the pipe to the supervisor; each event is one flushed line."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "w", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def send(self, event: Event, **payload: Any) -> None:
        line = json.dumps({"event": event, **payload}, default=str)
        with self._lock:
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except (OSError, ValueError):  # the user's code closed the descriptor (in C): the report is lost
                os._exit(CHANNEL_LOST_EXIT)


def read_event(line: bytes) -> dict[str, Any]:
    """One line from the worker: the event as a dict ("event" and its payload)."""
    return json.loads(line)
