"""tfdoctor: behavioural checks for Transformer training code.

    from tfdoctor import Subject, run_checks, assert_healthy
    report = run_checks(build_model())          # a Report; report["future-leak"].status
    assert_healthy(Subject(model, pad_id=0))    # raises AssertionError listing the failures

Importing this package does not import torch; running checks does.
"""

import warnings

# torch warns "Failed to initialize NumPy" at import when numpy is absent; tfdoctor never needs numpy,
# so on a machine without it that line is noise above every report. Only that one warning is hidden.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from tfdoctor.result import ExitCode, Report, Result, Status  # noqa: E402
from tfdoctor.runner import assert_healthy, run_checks  # noqa: E402
from tfdoctor.subject import Subject  # noqa: E402

from tfdoctor.versions import __version__  # noqa: E402
__all__ = ["Subject", "run_checks", "assert_healthy", "Report", "Result", "Status", "ExitCode",
           "__version__"]
