"""Reporters on a hand-built Report (no torch): golden Rich output, JSON and JUnit shapes."""

import io
import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

from tfdoctor.report import render
from tfdoctor.result import ExitCode, Report, Result, Status

GOLDEN = Path(__file__).parent / "golden" / "report.txt"


def sample_report() -> Report:
    leak = Result.failed("output position 0 changes when token 1 (a later one) changes",
                         "use torch.tril(torch.ones(T, T, dtype=torch.bool)) as the allowed mask",
                         {"dependency_map": [[1, 2, 2, 2], [0, 1, 2, 2], [0, 0, 1, 2], [0, 0, 0, 1]],
                          "map_cell_positions": 1, "first_leak": {"output_position": 0, "input_position": 1},
                          "tolerance": 1.5e-06})
    direction = Result.failed("upper-triangular", "use torch.tril", {"dependency_map": leak.details["dependency_map"],
                                                                    "pattern": "upper"})
    overfit = Result.warned("slow to fit", "check the loss", {"sparkline": "█▆▄▂▁", "final_loss": 0.5})
    crash = Result.errored("RuntimeError: boom", "see traceback", {"traceback": "Traceback...\nRuntimeError: boom"})
    results = [leak, direction, Result.passed("initial loss 4.57 vs ln(V) = 4.56", {"loss": 4.57}), overfit,
               Result.skipped("needs pad_id (pass --pad-id N or Subject(pad_id=N))"), crash]
    for result, check_id in zip(results, ["future-leak", "mask-direction", "init-loss", "overfit-batch",
                                          "padding-mask", "crashy"]):
        result.id, result.title, result.seconds = check_id, f"title of {check_id}", 0.25
    return Report("fixtures/gpt_triu_mask.py:build", results)


def rendered(fmt: str) -> str:
    out = io.StringIO()
    render(sample_report(), fmt, out, width=100)
    return out.getvalue()


def test_rich_report_matches_golden():
    text = rendered("rich")
    if os.environ.get("TFDOCTOR_REGEN_GOLDEN"):
        GOLDEN.write_text(text, encoding="utf-8")
    assert text == GOLDEN.read_text(encoding="utf-8")


def test_rich_report_draws_the_map_once_and_the_fix():
    text = rendered("rich")
    assert text.count("0 ░░██████") == 1  # first row of the map, drawn once
    assert "as drawn above" in text
    assert "fix: use torch.tril" in text
    assert "█▆▄▂▁" in text


def test_json_is_one_object():
    data = json.loads(rendered("json"))
    assert data["summary"] == {"pass": 1, "warn": 1, "fail": 2, "skip": 1, "error": 1}
    assert data["checks"][0]["details"]["first_leak"] == {"output_position": 0, "input_position": 1}


def test_junit_marks_fail_and_error_as_failures_and_skip_as_skipped():
    suite = ET.fromstring(rendered("junit")).find("testsuite")
    kinds = {case.get("name"): [child.tag for child in case] for case in suite.findall("testcase")}
    assert kinds["future-leak"] == ["failure", "system-out"] and kinds["crashy"] == ["failure", "system-out"]
    assert kinds["padding-mask"] == ["skipped", "system-out"] and kinds["init-loss"] == ["system-out"]
    assert suite.get("failures") == "3" and suite.get("skipped") == "1"


def test_junit_keeps_the_evidence_out_of_the_failure_message():
    suite = ET.fromstring(rendered("junit")).find("testsuite")
    leak = next(case for case in suite.findall("testcase") if case.get("name") == "future-leak")
    failure = leak.find("failure").text
    assert failure.splitlines() == ["output position 0 changes when token 1 (a later one) changes",
                                    "fix: use torch.tril(torch.ones(T, T, dtype=torch.bool)) as the allowed mask"]
    out = leak.find("system-out").text.splitlines()
    assert json.loads(out[1])["first_leak"] == {"output_position": 0, "input_position": 1}
    assert len(rendered("junit").splitlines()) < 50  # one compact line of evidence per check


def test_strict_summary_agrees_with_the_exit_code():
    calm = Report("x", [Result(Status.PASS, "ok"), Result(Status.WARN, "hm", "fix")])
    calm.results[1].id = "init-loss"
    out = io.StringIO()
    render(calm, "rich", out, width=100)
    assert out.getvalue().strip().splitlines()[-1] == "1 pass, 1 warn — healthy"
    calm.strict = True
    out = io.StringIO()
    render(calm, "rich", out, width=100)
    assert out.getvalue().strip().splitlines()[-1] == ("1 pass, 1 warn — 1 problem(s) found "
                                                       "(warnings fail under --strict)")
    assert calm.exit_code() == ExitCode.CHECKS_FAILED
    out = io.StringIO()
    render(calm, "junit", out)
    assert ET.fromstring(out.getvalue()).find("testsuite").get("failures") == "1"


def test_a_failure_panel_states_what_was_expected_and_the_legend_names_every_glyph():
    text = rendered("rich")
    assert "FAIL future-leak ─" in text  # the title alone on the border: it cannot be cut mid-claim
    assert "expected: title of future-leak" in text
    assert "·· does not depend" in text and "░░ depends on itself or the past" in text


def test_exit_codes():
    report = sample_report()
    assert report.exit_code() == ExitCode.CHECKS_FAILED
    calm = Report("x", [Result(Status.PASS, "ok"), Result(Status.WARN, "hm", "fix")])
    assert calm.exit_code() == ExitCode.OK and calm.exit_code(strict=True) == ExitCode.CHECKS_FAILED


def test_json_stays_strict_when_the_evidence_is_nan():
    report = Report("x", [Result(Status.FAIL, "loss went NaN", "fix", {"loss": float("nan"), "curve": (1.0, float("inf"))})])
    out = io.StringIO()
    render(report, "json", out)
    details = json.loads(out.getvalue())["checks"][0]["details"]
    assert details == {"loss": "nan", "curve": [1.0, "inf"]}
