"""tfdoctor: behavioural checks for Transformer training code.

    from tfdoctor import Subject, run_checks, assert_healthy
    report = run_checks(build_model())          # a Report; report["future-leak"].status
    assert_healthy(Subject(model, pad_id=0))    # raises AssertionError listing the failures

Importing this package does not import torch; running checks does.
"""

from tfdoctor.result import ExitCode, Report, Result, Status
from tfdoctor.runner import assert_healthy, run_checks
from tfdoctor.subject import Subject

__version__ = "0.1.0"
__all__ = ["Subject", "run_checks", "assert_healthy", "Report", "Result", "Status", "ExitCode",
           "__version__"]
