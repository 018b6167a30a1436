"""The user's files are sacred: while tfdoctor runs the user's code (the worker of `run`, `check` and
`memory`, every rank under --nproc), nothing the user had may change or disappear.

Writes, truncations, renames and deletions under the protected folders (roots.py) go to a scratch
folder that is thrown away (or kept, TFDOCTOR_KEEP_WRITES=DIR); reads still see the user's files, and
the code's own writes. Two mechanisms, chosen in the worker: an overlay in a private user and mount
namespace (overlay.py: everything, Python or not, is covered) where the machine allows it, else
interposition on Python's file APIs (interpose.py). TFDOCTOR_SANDBOX=interpose forces the second.

The supervisor side (Host) makes the scratch folder outside every protected folder, reads back what
was written (ledger.py) for the report, and removes it; the worker side (enter) never reports.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

from tfdoctor.process.sandbox.ledger import summary, write_state
from tfdoctor.process.sandbox.roots import exempt_folders, inside, protected_roots
from tfdoctor.usercode.environment import KEEP_WRITES, SANDBOX

OVERLAY_LIMITS = ("renaming a folder the code did not create fails with EXDEV (shutil.move copies); under --nproc "
                  "each rank has its own view of the protected folders")
INTERPOSE_LIMITS = ("Python file APIs only: non-Python subprocesses and C/Rust code that opens paths itself "
                    "write for real")


class Host:
    """The supervisor's half: a scratch folder for one worker, and what the worker wrote into it."""

    def __init__(self, request: dict, own: tuple[str, ...] = (), keep_in: Optional[str] = None) -> None:
        """`own`: tfdoctor's folders for this run (the run's private TMPDIR): left uncovered when a
        protected folder holds them (a run started in /tmp), since the ranks of `--nproc` meet there.
        `keep_in`: a folder where a copy of what the code wrote is kept (`watch --keep-writes`), else
        TFDOCTOR_KEEP_WRITES."""
        roots = protected_roots(request)
        self.keep_in = keep_in or KEEP_WRITES.get() or None
        self.scratch = tempfile.mkdtemp(prefix="tfdoctor-writes-", dir=_scratch_parent(roots))
        self.spec = {"scratch": self.scratch, "roots": roots, "exempt": exempt_folders(roots, own)}

    def report(self) -> dict:
        """The report's `sandbox` record (empty when the worker never entered the sandbox)."""
        try:
            return summary(self.scratch, self.keep_in)
        except OSError as error:  # the report still comes; it says the listing failed
            return {"error": f"could not read what the code wrote: {error}"}

    def close(self) -> None:
        for folder, dirs, _ in os.walk(self.scratch):
            for name in dirs:  # an overlay's work folder is left mode 000 by the kernel
                os.chmod(os.path.join(folder, name), 0o700)
        shutil.rmtree(self.scratch, ignore_errors=True)


def _scratch_parent(roots: list[str]) -> Optional[str]:
    """The first temporary folder no protected folder holds (the overlay cannot nest its layers)."""
    for candidate in (tempfile.gettempdir(), "/var/tmp", "/dev/shm"):
        real = os.path.realpath(candidate)
        if os.path.isdir(real) and os.access(real, os.W_OK) and not any(inside(real, r) for r in roots):
            return real
    return None


class Sandbox:
    """The worker's half, once entered; `leave` undoes every patch (the overlay ends with the process)."""

    def __init__(self, mechanism: str, installed=None) -> None:
        self.mechanism, self._installed = mechanism, installed

    def leave(self) -> None:
        """Undo the patches, unless a thread of the user's code still runs: it could still write (an
        async checkpoint), and the worker ends with os._exit next, patches and all."""
        import threading

        if self._installed is not None and threading.active_count() == 1:
            self._installed.uninstall()
            self._installed = None


def enter(spec: Optional[dict]) -> Optional[Sandbox]:
    """In the worker, before any thread starts and before the user's code: protect the user's files."""
    if not spec:
        return None
    scratch, roots, exempt = spec["scratch"], spec["roots"], spec.get("exempt", [])
    if SANDBOX.get() == "interpose":
        fallback = f"{SANDBOX.name}=interpose"
    else:
        from tfdoctor.process.sandbox import overlay

        try:
            layers = overlay.enter(roots, scratch, exempt)
        except (OSError, AttributeError) as error:  # AttributeError: no unshare/O_PATH (not Linux)
            fallback = f"no overlay here ({error})"
        else:
            write_state(scratch, {"mechanism": "overlay", "layers": layers, "protected": roots, "exempt": exempt,
                                  "limits": OVERLAY_LIMITS})
            return Sandbox("overlay")
    from tfdoctor.process.sandbox import interpose

    write_state(scratch, {"mechanism": "interpose", "protected": roots, "exempt": exempt, "limits": INTERPOSE_LIMITS,
                          "layers": [{"root": "/", "upper": os.path.join(scratch, "mirror")}],
                          "fallback": fallback})
    return Sandbox("interpose", interpose.install(roots, scratch, exempt))
