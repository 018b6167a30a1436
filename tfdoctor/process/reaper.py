"""Every process a run starts ends with the run: the worker, its DataLoader workers, torchrun's ranks,
and what the user's code detached from them (`subprocess.Popen(..., start_new_session=True)`, a
double fork). A detached process leaves the worker's process group, so killing the group misses it,
and once its parent is gone it is adopted by init and would outlive tfdoctor.

On Linux the supervising process is made a child subreaper (prctl PR_SET_CHILD_SUBREAPER) while the
run lasts: an orphan among its descendants is re-parented to it rather than to init, so it is still
found among its children at the end, and killed there. Elsewhere the descendants still attached to
their parents are killed; a detached orphan is not found.
"""

from __future__ import annotations

import contextlib
from typing import Optional

# linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
# Killing what was found can race with a process that forks meanwhile: look again, a few times.
ROUNDS = 3
REAP_SECONDS = 5.0


class Descendants:
    """A context manager around a run: on exit every process started inside it (by this process, and
    by those) is killed with SIGKILL and reaped. Processes that were this process's children before
    it was entered are not the run's and are left alone (a caller running tfdoctor in-process)."""

    def __enter__(self) -> "Descendants":
        import psutil

        self._before = {child.pid for child in psutil.Process().children()}
        self._was_subreaper = _subreaper(True)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.end_all()
        finally:
            if self._was_subreaper is not None:
                _subreaper(self._was_subreaper)

    def end_all(self) -> None:
        import psutil

        for _ in range(ROUNDS):
            doomed = []
            for child in psutil.Process().children():
                if child.pid in self._before:
                    continue
                doomed.append(child)
                with contextlib.suppress(psutil.Error):
                    doomed.extend(child.children(recursive=True))
            if not doomed:
                return
            for process in doomed:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            psutil.wait_procs(doomed, timeout=REAP_SECONDS)


def _subreaper(on: bool) -> Optional[bool]:
    """Set this process's child-subreaper flag; returns what it was (None where prctl is not there)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        was = ctypes.c_int(0)
        if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0) != 0:
            return None
        if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
            return None
        return bool(was.value)
    except (OSError, AttributeError):  # not Linux
        return None
