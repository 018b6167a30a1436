"""Reporters: one module per format, each with `render(report, out, width=None)`, and the memory
command's verdict in report/memory.py, one function per format. They only read what they render;
none imports torch.

`render` is the one way in, for a Report and a memory verdict alike: it picks the reporter by what is
rendered and the format, hands a reporter a copy of the Report whose strings are safe in any format
(report/safe_text.py; the memory reporter cleans the user's names it shows), and writes the machine
formats as UTF-8 whatever the locale's encoding (a JUnit or SARIF file declares UTF-8 and its parsers
read it as such).
"""

from __future__ import annotations

import codecs
import importlib
import io
from typing import TextIO

from tfdoctor.report.safe_text import clean_report
from tfdoctor.result import Report

FORMATS = ("rich", "json", "junit", "sarif", "html")
# (what is rendered, format) -> "module:function" of its reporter, imported when used.
_REPORTERS = {
    ("report", "rich"): "tfdoctor.report.console:render",
    ("report", "json"): "tfdoctor.report.json_format:render",
    ("report", "junit"): "tfdoctor.report.junit:render",
    ("report", "sarif"): "tfdoctor.report.sarif:render",
    ("report", "html"): "tfdoctor.report.html:render",
    ("memory", "rich"): "tfdoctor.report.memory:render_rich",
    ("memory", "json"): "tfdoctor.report.memory:render_json",
    ("memory", "html"): "tfdoctor.report.memory:render_html",
}


def render(shown, fmt: str, out: TextIO, width: int | None = None) -> None:
    """Write `shown` (a Report, or a memory verdict: tfdoctor.memory's Verdict) to `out` in `fmt`."""
    kind = "report" if isinstance(shown, Report) else "memory"
    module, function = _REPORTERS[kind, fmt].split(":")
    reporter = getattr(importlib.import_module(module), function)
    if kind == "report":
        shown = clean_report(shown)
    if fmt == "rich" or _is_utf8(out) or not hasattr(out, "buffer"):
        reporter(shown, out, width=width)
        return
    text = io.StringIO()
    reporter(shown, text, width=width)
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
