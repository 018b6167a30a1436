"""The suite's way to start the worker: by forking the supervisor's process rather than a fresh interpreter.

The supervisor starts `python -m tfdoctor.process.worker` (supervisor.spawn_worker), which spends 2-3 s
importing torch (and torch._dynamo, which torch.optim's first step imports) before it runs a line of
the user's code. The `tfdoctor` command itself never imports torch, so a user gains nothing from
forking it. The test suite does: it runs the command in a process that has imported torch already
(tests/zygote.py), which puts `start` in the supervisor's seam (supervisor.start_worker), so that each
of its runs starts its worker in milliseconds. From the fork on, the worker runs the same
`tfdoctor.process.worker.main` as the exec'd one, in the state a fresh worker has: its own session,
stdin from /dev/null, stdout on the supervisor's stderr, only the channel's and the request's
descriptors open, Python's own signal handlers, the supervisor's environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable, Optional

from tfdoctor.process import supervisor

_WAIT_STEP_SECONDS = 0.005


def start(channel_fd: int, request_fd: int, kept: tuple, env: dict) -> "ForkedWorker":
    """supervisor.spawn_worker's stand-in, with its arguments."""
    return ForkedWorker.start(channel_fd, request_fd, kept, env, sys.stderr.fileno(), supervisor.die_with_parent)


class ForkedWorker:
    """A forked worker, with the part of subprocess.Popen's interface the supervisor uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    @classmethod
    def start(cls, channel_fd: int, request_fd: int, pass_fds: Iterable[int], env: dict, stdout_fd: int,
              before: Callable[[], None]) -> "ForkedWorker":
        """Fork; the child becomes the worker and never returns here. `before` runs in the child
        first, as Popen's preexec_fn does."""
        for stream in (sys.stdout, sys.stderr):  # what is buffered now is the supervisor's to write
            stream.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _become_worker(channel_fd, request_fd, set(pass_fds), env, stdout_fd, before)
            finally:
                os._exit(1)  # the worker ends with os._exit; anything else is a crash of the start
        return cls(pid)

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(_WAIT_STEP_SECONDS)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _become_worker(channel_fd: int, request_fd: int, pass_fds: set, env: dict, stdout_fd: int,
                   before: Callable[[], None]) -> None:
    os.setsid()  # start_new_session=True: its own process group, which the supervisor kills whole
    before()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(stdout_fd, 1)
    _close_all_but({0, 1, 2, channel_fd, request_fd, *pass_fds})
    _fresh_signal_handlers()
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read TMPDIR again: the request's private folder, not the supervisor's
    sys.path[0] = os.getcwd()  # `python -m` puts the working folder first, where `-m MODULE` is found
    from tfdoctor.process import worker

    worker.main(["tfdoctor.process.worker", str(channel_fd), str(request_fd)])


def _close_all_but(keep: set) -> None:
    """Popen's close_fds: a descriptor the fork inherited (the supervisor's end of a pipe, above all)
    must not stay open in the worker."""
    try:
        open_fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        open_fds = range(3, os.sysconf("SC_OPEN_MAX"))
    for fd in open_fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _fresh_signal_handlers() -> None:
    """Handlers installed in Python do not survive exec: the supervisor's (Ctrl-C and SIGTERM stop
    the run) must not answer in the worker. SIGINT gets Python's own, as a new interpreter has."""
    for number in signal.valid_signals():
        try:
            if callable(signal.getsignal(number)):
                signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
