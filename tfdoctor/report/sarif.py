"""SARIF 2.1.0 (the format code-scanning UIs read), so that each finding annotates the very line it
is about: a loop finding the user's call it judges (details["location"]), a model finding the model's
class (`tfdoctor run`'s discovered "model_defined_in") or else the target's file. Problems only
(fail and error as "error", warn as "warning"); passes and skips are not results."""

from __future__ import annotations

import json
from typing import TextIO

from tfdoctor.result import Report, Status

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
LEVELS = {Status.FAIL: "error", Status.ERROR: "error", Status.WARN: "warning"}


def _split(where: str) -> tuple[str, int]:
    path, _, line = where.rpartition(":")
    return (path, int(line)) if path and line.isdigit() else (where, 1)


def _fallback(report: Report) -> tuple[str, int] | None:
    found = report.discovered or {}
    if found.get("model_defined_in"):
        return _split(found["model_defined_in"])
    target = report.target.removeprefix("run ")
    path = target.split(":", 1)[0] if target.endswith(".py") or ".py:" in target else None
    return (path, 1) if path else None


def render(report: Report, out: TextIO, width: int | None = None) -> None:
    from tfdoctor import __version__

    problems = [r for r in report.results if r.status in LEVELS]
    rules, results = {}, []
    fallback = _fallback(report)
    for result in problems:
        rules.setdefault(result.id, {"id": result.id, "name": result.id,
                                     "shortDescription": {"text": result.title or result.id}})
        where = _split(result.details["location"]) if result.details.get("location") else fallback
        text = result.message.rstrip(".") + (f". Fix: {result.hint}" if result.hint else "")
        entry = {"ruleId": result.id, "level": LEVELS[result.status], "message": {"text": text}}
        if where is not None:
            entry["locations"] = [{"physicalLocation": {"artifactLocation": {"uri": where[0]},
                                                        "region": {"startLine": max(1, where[1])}}}]
        results.append(entry)
    log = {"$schema": SCHEMA, "version": "2.1.0",
           "runs": [{"tool": {"driver": {"name": "tfdoctor", "version": __version__,
                                         "rules": list(rules.values())}},
                     "results": results}]}
    json.dump(log, out, indent=2, allow_nan=False)
    out.write("\n")
