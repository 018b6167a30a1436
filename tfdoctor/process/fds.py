"""The worker's own file descriptors stay open while the user's code runs, whatever it closes.

A script that starts by closing every descriptor above 2 (`os.closerange(3, N)`, as daemons and some
launchers do) would cut tfdoctor's report pipe, or worse, have the number reused for a file of its
own that the report is then written into. In the worker process, os.close and os.closerange skip
the descriptors kept here (a forked child, a DataLoader worker, closes what it likes).

Limit: a close made below Python (ctypes, a C extension) is not seen. Then the report pipe is gone:
the worker exits with CHANNEL_LOST_EXIT (tfdoctor/process/protocol.py) at its next word and the supervisor,
which keeps applying the budgets after the pipe's end, names the cause in one line.
"""

from __future__ import annotations

import os
from typing import Iterable

from tfdoctor.usercode.patches import Patches


def keep_open(fds: Iterable[int]) -> Patches:
    """From now on, in this process, os.close and os.closerange leave `fds` open (the worker never
    undoes it: its process ends with the run; the Patches returned can)."""
    owner = os.getpid()
    kept = frozenset(int(fd) for fd in fds)

    def guarding_close(close):
        def guarded_close(fd: int) -> None:
            if fd in kept and os.getpid() == owner:
                return
            close(fd)

        return guarded_close

    def guarding_closerange(closerange):
        def guarded_closerange(low: int, high: int) -> None:
            if os.getpid() != owner:
                closerange(low, high)
                return
            start = low
            for fd in sorted(fd for fd in kept if low <= fd < high):
                closerange(start, fd)
                start = fd + 1
            closerange(start, high)

        return guarded_closerange

    patches = Patches()
    patches.wrap(os, "close", guarding_close)
    patches.wrap(os, "closerange", guarding_closerange)
    return patches
