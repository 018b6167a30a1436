"""Exactly one JSON object: {"target", "checks": [{id, status, message, hint, details}], "summary",
"versions": {tfdoctor, python, torch, transformers}}."""

from __future__ import annotations

import json
from typing import TextIO

from tfdoctor.result import Report


def render(report: Report, out: TextIO, width: int | None = None) -> None:
    json.dump(report.to_dict(), out, indent=2, allow_nan=False)
    out.write("\n")
