"""Every TFDOCTOR_* environment variable, declared once with its meaning, and read through here.

A leaf: no tfdoctor import, so the sandbox's boot code (process/sandbox/boot/sitecustomize.py) can load
this file by its path in a child process where tfdoctor is not importable. docs/environment.md is
the same table for a reader (tests/test_environment.py holds the two together).

`set_by` says whose the variable is: USER (you set it to change what tfdoctor does), TFDOCTOR
(tfdoctor sets it for processes it starts; never set it yourself), TESTS (read by the test suite
only, as CI sets it).
"""

import os

USER, TFDOCTOR, TESTS = "you", "tfdoctor", "the test suite"


class Variable:
    """One environment variable: its name, who sets it and what it means."""

    def __init__(self, name: str, set_by: str, meaning: str) -> None:
        self.name, self.set_by, self.meaning = name, set_by, meaning

    def get(self, default=None):
        """Its value in this process's environment, or `default` where it is unset."""
        return os.environ.get(self.name, default)

    def on(self) -> bool:
        """Set to anything but the empty string."""
        return bool(os.environ.get(self.name))

    def __repr__(self) -> str:
        return f"Variable({self.name!r})"


DEBUG = Variable(
    "TFDOCTOR_DEBUG", USER,
    "Set (to anything): tfdoctor's own internal error prints its traceback, and so does an error of your "
    "code that ended the run before tfdoctor could judge it (a script that raised before its first step, "
    "a target whose import or factory raised), above the one line that names it.")
SANDBOX = Variable(
    "TFDOCTOR_SANDBOX", USER,
    "`interpose`: protect your files by interposing on Python's file calls, not with an overlay in a "
    "mount namespace (CI without user namespaces behaves so); anything else: the overlay where the "
    "machine allows it.")
KEEP_WRITES = Variable(
    "TFDOCTOR_KEEP_WRITES", USER,
    "A folder: a copy of what your code wrote under the protected folders (and a list of what it "
    "deleted) is kept in a new folder inside it, for inspection.")
LAUNCHED = Variable(
    "TFDOCTOR_LAUNCHED", TFDOCTOR,
    "Set by `run --nproc N` for each rank's tfdoctor: a rank stopped by torchrun (Ctrl-C, SIGTERM, another "
    "rank's failure) ends quietly, since the launcher or the first rank to fail says why, and the ranks "
    "share the launcher's private temporary folder.")
SANDBOX_VIEW = Variable(
    "TFDOCTOR_SANDBOX_VIEW", TFDOCTOR,
    "Set by the interposing sandbox for the Python processes your code starts: the protected folders "
    "and the scratch folder (JSON), which boot/sitecustomize.py installs the same sandbox from.")
REGEN_GOLDEN = Variable(
    "TFDOCTOR_REGEN_GOLDEN", TESTS,
    "Set: tests/test_report.py rewrites the golden report files in tests/golden/ instead of comparing.")
REQUIRE_BROWSER = Variable(
    "TFDOCTOR_REQUIRE_BROWSER", TESTS,
    "`1`: tests/test_html.py fails, rather than skips, where no headless Chromium is installed (.ci/run "
    "sets it).")
SCREENSHOT_DIR = Variable(
    "TFDOCTOR_SCREENSHOT_DIR", TESTS,
    "A folder: tests/test_html.py copies its screenshots of the HTML report there (.ci/run sets it).")

DECLARED = (DEBUG, SANDBOX, KEEP_WRITES, LAUNCHED, SANDBOX_VIEW, REGEN_GOLDEN, REQUIRE_BROWSER, SCREENSHOT_DIR)
