"""Reporters: one module per format, each with `render(report, out, width=None)`. They only read the
Report; none imports torch.

`render` is the one way in: it hands each reporter a copy of the Report whose strings are safe in any
format (report/text.py), and writes the machine formats as UTF-8 whatever the locale's encoding (a
JUnit or SARIF file declares UTF-8 and its parsers read it as such).
"""

from __future__ import annotations

import codecs
import importlib
import io
from typing import TextIO

from tfdoctor.report.text import clean_report
from tfdoctor.result import Report

FORMATS = ("rich", "json", "junit", "sarif", "html")
_MODULES = {"rich": "tfdoctor.report.console", "json": "tfdoctor.report.json_format",
            "junit": "tfdoctor.report.junit", "sarif": "tfdoctor.report.sarif", "html": "tfdoctor.report.html"}


def render(report: Report, fmt: str, out: TextIO, width: int | None = None) -> None:
    reporter = importlib.import_module(_MODULES[fmt])
    report = clean_report(report)
    if fmt == "rich" or _is_utf8(out) or not hasattr(out, "buffer"):
        reporter.render(report, out, width=width)
        return
    text = io.StringIO()
    reporter.render(report, text, width=width)
    out.flush()
    out.buffer.write(text.getvalue().encode("utf-8"))
    out.buffer.flush()


def _is_utf8(out: TextIO) -> bool:
    encoding = getattr(out, "encoding", None)
    if not encoding:
        return True  # a StringIO: the caller encodes
    try:
        return codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        return False
