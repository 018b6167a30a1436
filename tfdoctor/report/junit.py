"""JUnit XML: one testcase per check; fail and error are failures, skip is skipped."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from typing import TextIO

from tfdoctor.result import Report, Status


def render(report: Report, out: TextIO, width: int | None = None) -> None:
    summary = report.summary()
    suite = ET.Element("testsuite", {
        "name": f"tfdoctor {report.target}",
        "tests": str(len(report.results)),
        "failures": str(summary["fail"] + summary["error"]),
        "errors": "0",
        "skipped": str(summary["skip"]),
        "time": f"{sum(r.seconds for r in report.results):.3f}",
    })
    for result in report.results:
        case = ET.SubElement(suite, "testcase", {
            "classname": f"tfdoctor.{report.target}", "name": result.id, "time": f"{result.seconds:.3f}",
        })
        body = "\n".join(filter(None, [result.message, f"fix: {result.hint}" if result.hint else "",
                                       json.dumps(result.details, indent=1)[:4000]]))
        if result.status in (Status.FAIL, Status.ERROR):
            tag = ET.SubElement(case, "failure", {"message": f"[{result.status.value}] {result.message}",
                                                  "type": result.status.value})
            tag.text = body
        elif result.status is Status.SKIP:
            ET.SubElement(case, "skipped", {"message": result.message})
        else:
            ET.SubElement(case, "system-out").text = f"[{result.status.value}] {result.message}"
    suites = ET.Element("testsuites")
    suites.append(suite)
    ET.indent(suites)
    out.write('<?xml version="1.0" encoding="utf-8"?>\n')
    out.write(ET.tostring(suites, encoding="unicode"))
    out.write("\n")
