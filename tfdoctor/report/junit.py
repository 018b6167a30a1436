"""JUnit XML: one testcase per check; fail and error (and warn under --strict) are failures, skip is
skipped. The suite's <properties> name the versions it was made with (tfdoctor, python, torch,
transformers). Text reaches here cleaned (report/safe_text.py: nothing XML 1.0 forbids) and ElementTree
escapes the rest (`<`, `&`, `>`), so the file is well-formed whatever the user's code raised."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from typing import TextIO

from tfdoctor.result import Report, Status, json_safe


def render(report: Report, out: TextIO, width: int | None = None) -> None:
    summary = report.summary()
    failing = {Status.FAIL, Status.ERROR} | ({Status.WARN} if report.strict else set())
    suite = ET.Element("testsuite", {
        "name": f"tfdoctor {report.target}",
        "tests": str(len(report.results)),
        "failures": str(sum(1 for r in report.results if r.status in failing)),
        "errors": "0",
        "skipped": str(summary["skip"]),
        "time": f"{sum(r.seconds for r in report.results):.3f}",
    })
    properties = ET.SubElement(suite, "properties")
    for name, version in report.versions.items():
        ET.SubElement(properties, "property", {"name": f"{name}.version", "value": str(version or "not installed")})
    for result in report.results:
        case = ET.SubElement(suite, "testcase", {
            "classname": f"tfdoctor.{report.target}", "name": result.id, "time": f"{result.seconds:.3f}",
        })
        verdict = "\n".join(filter(None, [result.message, f"fix: {result.hint}" if result.hint else ""]))
        if result.status in failing:
            tag = ET.SubElement(case, "failure", {"message": f"[{result.status.value}] {result.message}",
                                                  "type": result.status.value})
            tag.text = verdict
        elif result.status is Status.SKIP:
            ET.SubElement(case, "skipped", {"message": result.message})
        # The evidence (maps, curves, tracebacks) is for whoever opens the test: one compact line of
        # JSON in system-out, so that CI's failure summary stays the message and the fix.
        out_text = f"[{result.status.value}] {result.message}"
        if result.details:
            out_text += "\n" + json.dumps(json_safe(result.details), separators=(",", ":"))
        ET.SubElement(case, "system-out").text = out_text
    suites = ET.Element("testsuites")
    suites.append(suite)
    ET.indent(suites)
    out.write('<?xml version="1.0" encoding="utf-8"?>\n')
    out.write(ET.tostring(suites, encoding="unicode"))
    out.write("\n")
