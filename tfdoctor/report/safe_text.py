"""Any string a user's code can produce, made safe for every report format.

An exception message, a traceback, a module name or a target's file name is the user's text: it can
carry ANSI colour codes, NUL and other control characters, lone surrogates (invalid bytes decoded
with surrogateescape) or Unicode bidi overrides. Each is harmless in a Python string and harmful in a
report: XML 1.0 forbids most control characters (a JUnit file with one is not well-formed), lone
surrogates cannot be encoded as UTF-8 (the write fails or a JSON parser refuses them), and on a
terminal an escape sequence recolours, moves the cursor or rewrites the title. So every reporter
reads the Report through `clean_report`: colour codes are dropped (they were presentation, not
content), every other control character is shown as a visible escape (`\\x00`, `\\x1b`), and an
invalid byte as its `\\xNN`. Newline and tab are kept.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from tfdoctor.result import Report, Result

# Terminal escape sequences as a whole: CSI (colours, cursor moves), OSC (titles, links; ended by BEL
# or ST) and the two-character ones, so that no half of one is left behind.
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b\n]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
# C0 controls but tab and newline, DEL and the C1 controls, every surrogate, the two non-characters
# XML 1.0 excludes, and the bidi controls that make a line read differently from what it holds.
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match) -> str:
    char = match.group()
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, kept by surrogateescape: show the byte
        return f"\\x{code - 0xDC00:02x}"
    if 0xD800 <= code <= 0xDFFF:  # any other lone surrogate has no byte to show
        return "\ufffd"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def clean(text: str) -> str:
    """The text with colour codes dropped and every unsafe character shown as an escape."""
    return UNSAFE.sub(_visible, ANSI.sub("", text))


def clean_value(value: Any) -> Any:
    """Strings cleaned all the way down a details tree (keys too); numbers and None as they are."""
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, dict):
        return {clean(str(k)): clean_value(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(clean_value(v) for v in value)
    if isinstance(value, list):
        return [clean_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return clean(str(value))


def clean_result(result: Result) -> Result:
    return dataclasses.replace(result, message=clean(result.message), hint=clean(result.hint),
                               details=clean_value(result.details), id=clean(result.id), title=clean(result.title))


def clean_report(report: Report) -> Report:
    """A copy of the report safe to render in any format; the Report itself keeps the raw text."""
    return dataclasses.replace(report, target=clean(report.target), results=[clean_result(r) for r in report.results],
                               stopped=clean(report.stopped), discovered=clean_value(report.discovered),
                               versions=clean_value(report.versions), sandbox=clean_value(report.sandbox))
