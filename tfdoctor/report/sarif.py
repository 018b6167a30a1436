"""SARIF 2.1.0 (the format code-scanning UIs read), so that each finding annotates the very line it
is about: a loop finding the user's call it judges (details["location"]), a model finding the model's
class when the user wrote it (`tfdoctor run`'s discovered "model_defined_in"), else the user's line
that calls the model ("model_called_at": a Hugging Face model's class lives in site-packages, which
no code-scanning UI can map, so that path goes in the message), else the target's file. Problems only
(fail and error as "error", warn as "warning"); passes and skips are not results. The versions the
report was made with are the driver's version and the run's properties."""

from __future__ import annotations

import json
import os
from typing import TextIO
from urllib.parse import quote

from tfdoctor.result import Report, Status

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
LEVELS = {Status.FAIL: "error", Status.ERROR: "error", Status.WARN: "warning"}


def _split(where: str) -> tuple[str, int]:
    path, _, line = where.rpartition(":")
    return (path, int(line)) if path and line.isdigit() else (where, 1)


def _in_project(where: str) -> bool:
    """A path a code-scanning UI can map to the repository: relative, inside the current folder
    (tfdoctor shows paths outside it, site-packages among them, absolute)."""
    path = _split(where)[0]
    return not os.path.isabs(path) and not path.startswith("..")


def _model_site(report: Report) -> tuple[tuple[str, int] | None, str]:
    """Where a model finding lands, and a note for the message when the model's class is elsewhere."""
    found = report.discovered or {}
    defined, called = found.get("model_defined_in"), found.get("model_called_at")
    if defined and (_in_project(defined) or not called):
        return _split(defined), ""
    if called:
        note = f" (model class {found.get('model', '')} defined in {defined})" if defined else ""
        return _split(called), note
    target = report.target.removeprefix("run ")
    path = target.split(":", 1)[0] if target.endswith(".py") or ".py:" in target else None
    return ((path, 1) if path else None), ""


def _location(where: tuple[str, int]) -> dict:
    # artifactLocation.uri is a URI reference: a file name with spaces, `<`, `&`, `#` or non-ASCII
    # letters is percent-encoded (UTF-8), as code-scanning UIs decode it.
    return {"physicalLocation": {"artifactLocation": {"uri": quote(where[0], safe="/")},
                                 "region": {"startLine": max(1, where[1])}}}


def render(report: Report, out: TextIO, width: int | None = None) -> None:
    from tfdoctor import __version__

    problems = [r for r in report.results if r.status in LEVELS]
    rules, results = {}, []
    model_site, note = _model_site(report)
    for result in problems:
        rules.setdefault(result.id, {"id": result.id, "name": result.id,
                                     "shortDescription": {"text": result.title or result.id}})
        location = result.details.get("location")
        if location and not _in_project(location):  # a model's line outside the project: not mappable
            location = None
        where = _split(location) if location else model_site
        text = (result.message.rstrip(".") + ("" if location else note)
                + (f". Fix: {result.hint}" if result.hint else ""))
        entry = {"ruleId": result.id, "level": LEVELS[result.status], "message": {"text": text}}
        if where is not None:
            entry["locations"] = [_location(where)]
        results.append(entry)
    log = {"$schema": SCHEMA, "version": "2.1.0",
           "runs": [{"tool": {"driver": {"name": "tfdoctor", "version": __version__,
                                         "rules": list(rules.values())}},
                     "results": results, "properties": {"versions": report.versions}}]}
    json.dump(log, out, indent=2, allow_nan=False)
    out.write("\n")
