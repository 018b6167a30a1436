"""Reporters: one module per format, each with `render(report, out, width=None)`, and the memory
command's verdict in report/memory.py, one function per format. They only read what they render;
none imports torch.

`render` is the one way in, for a Report and a memory verdict alike: it picks the reporter by what is
rendered and the format, hands a reporter a copy of the Report whose strings are safe in any format
(report/safe_text.py; the memory reporter cleans the user's names it shows), and writes the machine
formats as UTF-8 whatever the locale's encoding (a JUnit or SARIF file declares UTF-8 and its parsers
read it as such).

One module per format:
- `console.py`: the human report (Rich), a summary table then one panel per problem;
- `json_format.py`: exactly one JSON object;
- `junit.py`: JUnit XML, one testcase per check;
- `sarif.py`: SARIF 2.1.0, each finding on the line it is about;
- `html.py`: one self-contained HTML file, pictures first, then the findings;
- `memory.py`: the memory command's Verdict as Rich text, JSON or HTML.

Shared by the formats:
- `safe_text.py`: the user's strings made safe for every format (clean_report);
- `theme.py`: the one Rich theme, every colour a named style;
- `figures.py`: the HTML report's pictures (matplotlib, inline SVG);
- `run_figures.py`: a watched run's series drawn over its optimizer steps;
- `run_summary.py`: a watched run's headline numbers, computed once for every view;
- `watch_header.py`: `tfdoctor watch`'s header in the console report;
- `logged.py`: `tfdoctor judge`'s header lines for a run read from a log.

On the terminal while a command runs:
- `progress.py`: a progress bar on stderr, shown only on a terminal;
- `dashboard.py`: `tfdoctor watch`'s live view;
- `shortened.py`: a finding's message cut to one line of the live view;
- `verdict.py`: the one line a watched run ends with.

The check catalogue:
- `catalogue.py`: `tfdoctor checks`, the catalogue as a table or one check's documentation;
- `catalogue_markdown.py`: docs/checks.md written from the registry.
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
