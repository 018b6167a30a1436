"""`tfdoctor run --nproc N`: torchrun itself (torch.distributed.run, on this machine) starting N
copies of `python -m tfdoctor run ...`, one per rank, each of which records its rank and meets the
others at the stop point (distributed.py). Rank 0 prints the report; every rank exits with the code
rank 0 sent, so the job's code is rank 0's.

torchrun's own chatter (rendezvous info, the per-rank failure table and its traceback) is kept off
the terminal: each rank already says in one line what went wrong.

What the job exposes and leaves behind:
- everything it listens on is bound to the loopback interface: the rendezvous endpoint and the
  ranks' MASTER_ADDR are 127.0.0.1, the TCP stores torchrun serves them from listen on 127.0.0.1
  only (torch binds a store to every interface, so the launcher hands it a socket bound here), and
  gloo is told to use the loopback device (GLOO_SOCKET_IFNAME, unless set);
- Ctrl-C, SIGTERM and SIGHUP end every rank (torchrun forwards the signal, and whatever is left is
  killed, detached descendants too: tfdoctor/process/reaper.py) and the command exits 130/143/129 with
  one line; the ranks stopped that way say nothing;
- torchelastic's folders and every rank's temporary files go to a private temporary folder (TMPDIR
  for the ranks), removed when the job ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import uuid
from typing import Iterator

from tfdoctor.process.reaper import Descendants
from tfdoctor.process.signals import Stopped, is_stop_code, signals_stop
from tfdoctor.process.tempdirs import private_folder, temp_environment
from tfdoctor.recording.distributed import RankError
from tfdoctor.usercode.environment import LAUNCHED
from tfdoctor.usercode.patches import Patches

# torchrun starts every rank with one thread per process unless told otherwise (and warns that it
# did): set it the same way, without the warning.
DEFAULT_OMP_THREADS = "1"
LOOPBACK = "127.0.0.1"
LOOPBACK_DEVICE = "lo"  # Linux's; where it does not exist gloo picks its device as before
LISTEN_BACKLOG = 128


def launch(nproc: int, run_args: list[str], command: str = "run") -> int:
    """Run `tfdoctor COMMAND RUN_ARGS` (`run` or `watch`, less any --nproc) as an nproc-rank torchrun
    job; returns the job's exit code (rank 0's). RankError when a rank ended on its own (killed,
    crashed) and took the job down; Stopped (a KeyboardInterrupt) when a signal stopped the job, every
    rank ended."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run as torchrun

    args = parse_args([f"--nproc-per-node={nproc}", "--nnodes=1", "--max-restarts=0", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint={LOOPBACK}:0", f"--rdzv-id={uuid.uuid4()}", f"--local-addr={LOOPBACK}",
                       "--module", "tfdoctor", command, *without_nproc(run_args)])
    with signals_stop(), Descendants(), _private_temp() as folder, _environment(folder), _quiet(), \
            _loopback_stores():
        try:
            torchrun(args)
        except SignalException as signalled:  # torchrun's own handler: it has sent the ranks the signal
            raise Stopped(int(signalled.sigval)) from None
        except ChildFailedError as failed:
            return _job_code(failed.failures, nproc)
    return 0


def without_nproc(args: list[str]) -> list[str]:
    """The command line again, less --nproc (before `--`: after it the arguments are the script's)."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + args[i:]
        if arg == "--nproc":
            i += 2
            continue
        if not arg.startswith("--nproc="):
            out.append(arg)
        i += 1
    return out


@contextlib.contextmanager
def _private_temp() -> Iterator[str]:
    """A folder of the job's own for torchelastic's logs and error files (it makes them with
    tempfile.mkdtemp in this process) and the ranks' temporary files; removed at the end."""
    with private_folder() as folder, Patches() as patches:
        patches.setattr(tempfile, "tempdir", folder)
        yield folder


@contextlib.contextmanager
def _environment(folder: str) -> Iterator[None]:
    """What the ranks inherit from this process's environment (torchrun copies it), put back after."""
    wanted = {**temp_environment(folder), LAUNCHED.name: "1",
              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", DEFAULT_OMP_THREADS)}
    if "GLOO_SOCKET_IFNAME" not in os.environ and _has_device(LOOPBACK_DEVICE):
        wanted["GLOO_SOCKET_IFNAME"] = LOOPBACK_DEVICE
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _has_device(name: str) -> bool:
    try:
        return any(device == name for _, device in socket.if_nameindex())
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # torchelastic gives its module loggers levels of their own (the agent's "Received 15 death
    # signal" warning among them): each one is quieted, not only the parents.
    prefixes = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
    names = [name for name in list(logging.root.manager.loggerDict) if name.startswith(prefixes)]
    quiet = [logging.getLogger(name) for name in {*prefixes, *names}]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _loopback_stores() -> Iterator[None]:
    """While torchrun runs here, a TCP store it serves (the rendezvous's, the one the ranks share)
    listens on a socket bound to the loopback address rather than on every interface."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    original = dist.TCPStore

    class LoopbackTCPStore(original):  # type: ignore[misc, valid-type]
        def __init__(self, host_name, port, *args, **kwargs):
            if kwargs.get("is_master") and not args and kwargs.get("master_listen_fd") is None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    listener.bind((LOOPBACK, int(port)))
                    listener.listen(LISTEN_BACKLOG)
                except OSError as exc:  # torchrun takes a RuntimeError for a store it cannot serve
                    listener.close()
                    raise RuntimeError(f"cannot listen on {LOOPBACK}:{port}: {exc}") from exc
                kwargs["master_listen_fd"] = listener.detach()  # the store owns the socket from here
            super().__init__(host_name, port, *args, **kwargs)

    with Patches() as patches:
        for owner in (dist, c10d_rendezvous_backend):
            patches.setattr(owner, "TCPStore", LoopbackTCPStore)
        yield


def _job_code(failures: dict, nproc: int) -> int:
    """Every rank exits with rank 0's verdict (1: problems found, 2: the run could not be judged), so
    the job's code is the lowest failed rank's own code (rank 0's when it has one). A rank torchrun
    stopped once another had exited (SIGTERM, or tfdoctor's 143 for it) is not the cause; a rank killed
    by any other signal is named instead."""
    import signal

    killed = sorted(rank for rank, f in failures.items()
                    if f.exitcode is not None and f.exitcode < 0 and not is_stop_code(f.exitcode))
    if killed:
        failure = failures[killed[0]]
        raise RankError(f"rank {killed[0]} of {nproc} was killed by {failure.signal_name()}, which ended the job"
                        + (" (out of memory? the kernel's OOM killer sends SIGKILL)"
                           if -failure.exitcode == signal.SIGKILL else ""), "see that rank's lines above")
    exited = sorted(rank for rank, f in failures.items()
                    if f.exitcode is not None and f.exitcode > 0 and not is_stop_code(f.exitcode))
    if not exited:
        raise RankError(f"the {nproc} ranks were terminated (SIGTERM) before any of them finished")
    return int(failures[exited[0]].exitcode)
