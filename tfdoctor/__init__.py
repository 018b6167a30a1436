"""tfdoctor: behavioural checks for Transformer training code.

    from tfdoctor import Subject, run_checks, assert_healthy
    report = run_checks(build_model())          # a Report; report["future-leak"].status
    assert_healthy(Subject(model, pad_id=0))    # raises AssertionError listing the failures

Importing this package does not import torch; running checks does. Nor does it touch the warning
filters: the `tfdoctor` command's worker hides torch's one warning about an absent NumPy in its own
process (tfdoctor/process/worker.py).
"""

from tfdoctor.result import ExitCode, Report, Result, Status
from tfdoctor.runner import assert_healthy, run_checks
from tfdoctor.subject import Subject
from tfdoctor.versions import __version__

__all__ = ["Subject", "run_checks", "assert_healthy", "Report", "Result", "Status", "ExitCode",
           "__version__"]
