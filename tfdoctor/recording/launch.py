"""`tfdoctor run --nproc N`: torchrun itself (torch.distributed.run, standalone, on this machine)
starting N copies of `python -m tfdoctor run ...`, one per rank, each of which records its rank and
meets the others at the stop point (distributed.py). Rank 0 prints the report; every rank exits with
the code rank 0 sent, so the job's code is rank 0's.

torchrun's own chatter (rendezvous info, the per-rank failure table and its traceback) is kept off
the terminal: each rank already says in one line what went wrong.
"""

from __future__ import annotations

import logging
import os
from tfdoctor.recording.distributed import RankError

# torchrun starts every rank with one thread per process unless told otherwise (and warns that it
# did): set it the same way, without the warning.
DEFAULT_OMP_THREADS = "1"


def launch(nproc: int, run_args: list[str]) -> int:
    """Run `tfdoctor run RUN_ARGS` as an nproc-rank torchrun job; returns the job's exit code (rank
    0's). RankError when a rank ended on its own (killed, crashed) and took the job down."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", DEFAULT_OMP_THREADS)
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.run",
                                                  "torch.distributed.launcher")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        torchrun(parse_args(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", "--module",
                             "tfdoctor", "run", *run_args]))
    except ChildFailedError as failed:
        return _job_code(failed.failures, nproc)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return 0


def _job_code(failures: dict, nproc: int) -> int:
    """Every rank exits with rank 0's verdict (1: problems found, 2: the run could not be judged), so
    the job's code is the lowest failed rank's own code (rank 0's when it has one: torchrun ends the
    others with SIGTERM once one has exited). A rank killed by any other signal is named instead."""
    import signal

    killed = sorted(rank for rank, f in failures.items()
                    if f.exitcode is not None and f.exitcode < 0 and -f.exitcode != signal.SIGTERM)
    if killed:
        failure = failures[killed[0]]
        raise RankError(f"rank {killed[0]} of {nproc} was killed by {failure.signal_name()}, which ended the job"
                        + (" (out of memory? the kernel's OOM killer sends SIGKILL)"
                           if -failure.exitcode == signal.SIGKILL else ""), "see that rank's lines above")
    exited = sorted(rank for rank, f in failures.items() if f.exitcode is not None and f.exitcode > 0)
    if not exited:
        raise RankError(f"the {nproc} ranks were terminated (SIGTERM) before any of them finished")
    return int(failures[exited[0]].exitcode)
