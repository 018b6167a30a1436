"""Reporters: one module per format, each with `render(report, out, width=None)`. They only read the
Report; none imports torch.
"""

from __future__ import annotations

import importlib
from typing import TextIO

from tfdoctor.result import Report

FORMATS = ("rich", "json", "junit", "sarif")
_MODULES = {"rich": "tfdoctor.report.console", "json": "tfdoctor.report.json_format",
            "junit": "tfdoctor.report.junit", "sarif": "tfdoctor.report.sarif"}


def render(report: Report, fmt: str, out: TextIO, width: int | None = None) -> None:
    importlib.import_module(_MODULES[fmt]).render(report, out, width=width)
