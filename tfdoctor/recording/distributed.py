"""The distributed driver of `tfdoctor run`: the same script recording on every rank of a torchrun
job, and tfdoctor's own few messages between the ranks.

Each rank records its own run (script.py) and, when it reaches its stop point, hands the digest of
what it did (ranks.py) to rank 0 over a gloo side group made right there, while the job's own
process group is still up (the script's `finally: destroy_process_group()` has not run yet; it is
deferred until tfdoctor is done with the group). Rank 0 judges the gathered digests with the rank
checks and its own trace with every other check, then sends every rank the exit code it will exit
with, so a CI job gets one answer. Every collective runs under a timeout: a rank that never arrives
or dies ends the others with a clear line, never a hang.

A gloo side group serves a job on NCCL as well as one on gloo, and keeps tfdoctor's collectives off
the job's own communicator.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Optional

from tfdoctor.errors import LoadError, first_line
from tfdoctor.usercode.patches import Patches
from tfdoctor.usercode.world import World


class RankError(LoadError):
    """A distributed run that cannot be audited: no process group, a rank that did not arrive.
    `said_by_rank_0`: every rank finds the same, and rank 0's line is enough."""

    said_by_rank_0 = False


class RankSession:
    """tfdoctor's side of the job's process group: the gather at the stop point, then the exit code.

    Every collective is bounded: the gather waits `arrival_timeout` for the slowest rank to reach its
    stop point, the other ranks wait `exit_code_timeout` for rank 0 to judge and send its exit code."""

    def __init__(self, me: World, arrival_timeout: float, exit_code_timeout: float):
        self.world = me
        self.arrival_timeout = arrival_timeout
        self.exit_code_timeout = exit_code_timeout
        self.group: Any = None  # the gather's
        self.exit_code_group: Any = None
        self.digests: Optional[list] = None  # rank 0: every rank's digest, rank 0 first
        self.deferred: list[tuple[tuple, dict]] = []  # the script's destroy_process_group calls
        self.own_default = False  # the script made no process group: tfdoctor made one to meet over

    # ------------------------------------------------------------------ at the stop point

    def gather(self, digest: dict) -> None:
        """Called on every rank at its stop point, before the script unwinds."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            # The ranks still meet (over a group of tfdoctor's own, from torchrun's environment), so
            # that rank 0 alone says it and the job ends with one code.
            with contextlib.suppress(Exception):
                dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=self.arrival_timeout))
                self.own_default = True
                self._meet(digest)
            raise _on_every_rank(RankError(
                f"the script runs as rank {self.world.rank} of {self.world.size} (WORLD_SIZE={self.world.size}) "
                "but never called torch.distributed.init_process_group before its first optimizer steps, so "
                "every rank trained alone",
                "call torch.distributed.init_process_group() (torchrun sets its environment) before building "
                "the model, or run it without --nproc / torchrun"))
        if dist.get_world_size() != self.world.size:
            raise RankError(f"the job's process group has {dist.get_world_size()} ranks but WORLD_SIZE is "
                            f"{self.world.size}")
        self._meet(digest)

    def _meet(self, digest: dict) -> None:
        import torch.distributed as dist

        try:
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.arrival_timeout))
            self.exit_code_group = dist.new_group(backend="gloo",
                                                   timeout=datetime.timedelta(seconds=self.exit_code_timeout))
            received = [None] * self.world.size if self.world.rank == 0 else None
            dist.gather_object(digest, received, dst=0, group=self.group)
        except Exception as exc:  # gloo: a peer closed its connection, or did not come in time
            raise RankError(f"rank {self.world.rank} of {self.world.size} reached its stop point but the other "
                            f"ranks did not meet it within {self.arrival_timeout:g} s ({first_line(exc)})",
                            "every rank must take the same optimizer steps; see the other ranks' lines") from exc
        self.digests = received

    @contextlib.contextmanager
    def teardown_deferred(self):
        """While the script runs, and unwinds from its stop point, its destroy_process_group() is put
        off until tfdoctor has sent the exit code over the group (see close)."""
        import torch.distributed as dist

        session = self

        def destroy_process_group(*args, **kwargs):
            session.deferred.append((args, kwargs))

        with Patches() as patches:
            patches.setattr(dist, "destroy_process_group", destroy_process_group)
            yield

    # ------------------------------------------------------------------ after the checks

    def send_code(self, code: int) -> None:
        """Rank 0: every rank exits with this code."""
        self._broadcast(code)

    def receive_code(self) -> int:
        """The other ranks: the code rank 0 will exit with. RankError when rank 0 ended without one."""
        try:
            return int(self._broadcast(None))
        except RankError:
            raise
        except Exception as exc:  # gloo: the peer closed its connection, or the timeout passed
            raise RankError(f"rank 0 ended without sending its verdict ({first_line(exc)}); its own "
                            "line says why") from exc

    def _broadcast(self, value):
        import torch.distributed as dist

        if self.exit_code_group is None:
            raise RankError("the ranks never met at their stop point")
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.exit_code_group)
        return box[0]

    def close(self) -> None:
        """Carry out what the script asked for and tfdoctor put off: its process group goes."""
        import torch.distributed as dist

        for group in (self.group, self.exit_code_group):
            with contextlib.suppress(Exception):
                if group is not None and dist.is_initialized():
                    dist.destroy_process_group(group)
        for args, kwargs in self.deferred + ([((), {})] if self.own_default else []):
            with contextlib.suppress(Exception):
                dist.destroy_process_group(*args, **kwargs)
        self.deferred = []


def _on_every_rank(error: RankError) -> RankError:
    error.said_by_rank_0 = True
    return error
