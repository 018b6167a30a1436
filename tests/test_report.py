"""Reporters: golden Rich output, JSON, JUnit and SARIF shapes on a hand-built Report (no torch), and
every format's validity for hostile strings on a Report made for real (tests/../fixtures/hostile_strings.py)."""

import io
import json
import os
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from helpers import FIXTURES, ROOT, build_fixture, tfdoctor
from hostile_strings import HOSTILE
from tfdoctor.report import render
from tfdoctor.result import ExitCode, Report, Result, Status
from tfdoctor.usercode.environment import REGEN_GOLDEN

GOLDEN = Path(__file__).parent / "golden" / "report.txt"


def sample_report() -> Report:
    leak = Result.failed("output position 0 changes when token 1 (a later one) changes",
                         "use torch.tril(torch.ones(T, T, dtype=torch.bool)) as the allowed mask",
                         {"dependency_map": [[1, 2, 2, 2], [0, 1, 2, 2], [0, 0, 1, 2], [0, 0, 0, 1]],
                          "map_cell_positions": 1, "first_leak": {"output_position": 0, "input_position": 1},
                          "tolerance": 1.5e-06})
    direction = Result.failed("upper-triangular", "use torch.tril", {"dependency_map": leak.details["dependency_map"],
                                                                    "pattern": "upper"})
    overfit = Result.warned("slow to fit", "check the loss", {"loss_curve": [5.0, 4.0, 3.0, 2.0, 1.0],
                                                                   "final_loss": 0.5})
    crash = Result.errored("RuntimeError: boom", "see traceback", {"traceback": "Traceback...\nRuntimeError: boom"})
    results = [leak, direction, Result.passed("initial loss 4.57 vs ln(V) = 4.56", {"loss": 4.57}), overfit,
               Result.skipped("needs pad_id (pass --pad-id N or Subject(pad_id=N))"), crash]
    for result, check_id in zip(results, ["future-leak", "mask-direction", "init-loss", "overfit-batch",
                                          "padding-mask", "crashy"]):
        result.id, result.title, result.seconds = check_id, f"title of {check_id}", 0.25
    return Report("fixtures/gpt_triu_mask.py:build", results, versions=VERSIONS)


# Fixed, so that the golden text does not follow the installed libraries.
VERSIONS = {"tfdoctor": "0.1.0", "python": "3.11.9", "torch": "2.4.0", "transformers": None}


def rendered(fmt: str) -> str:
    out = io.StringIO()
    render(sample_report(), fmt, out, width=100)
    return out.getvalue()


def test_rich_report_matches_golden():
    text = rendered("rich")
    if REGEN_GOLDEN.on():
        GOLDEN.write_text(text, encoding="utf-8")
    assert text == GOLDEN.read_text(encoding="utf-8")


def test_rich_report_draws_the_map_once_and_the_fix():
    text = rendered("rich")
    assert text.count("0 ░░██████") == 1  # first row of the map, drawn once
    assert "as drawn above" in text
    assert "fix: use torch.tril" in text
    assert "█▆▄▂▁" in text


def test_rich_report_labels_each_series_by_what_it_is():
    """grad-health keeps the pre-clip gradient norm, not a loss: the drawing says so (issue 19)."""
    norms = Result.failed("gradients were NaN/Inf", "find the first", {"pre_clip_norms": [1.0, 2.0, 3.0], "steps": 3})
    norms.id, norms.title = "grad-health", "title of grad-health"
    out = io.StringIO()
    render(Report("t", [norms], versions=VERSIONS), "rich", out, width=100)
    text = out.getvalue()
    assert "pre-clip gradient norm ▁▄█" in text and "loss curve" not in text


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
    report = Report("x", [Result(Status.FAIL, "loss went NaN", "fix",
                                 {"loss": float("nan"), "curve": (1.0, float("inf"))})])
    out = io.StringIO()
    render(report, "json", out)
    details = json.loads(out.getvalue())["checks"][0]["details"]
    assert details == {"loss": "nan", "curve": [1.0, "inf"]}


# --- Hostile strings: every format stays valid for any string a user's code can produce -----------

HOSTILE_NAME = "<&]]>\x1bhostile.py"  # a legal file name on Linux; the model's message is the rest


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """The hostile fixture copied to a file named with `<`, `&`, `]]>` and ESC, checked for real (the
    loader, the checks, the runner), and the folder it sits in for the CLI test."""
    from tfdoctor import run_checks
    from tfdoctor.loader import load_subject

    folder = tmp_path_factory.mktemp("hostile")
    shutil.copy(FIXTURES / "tinygpt.py", folder / "tinygpt.py")
    shutil.copy(FIXTURES / "hostile_strings.py", folder / HOSTILE_NAME)
    target = f"{folder / HOSTILE_NAME}:build"
    report = run_checks(load_subject(target), only=["half-precision-mask", "init-loss"], target=target)
    assert report["half-precision-mask"].status is Status.WARN  # the message travelled into the Report
    crash = Result.errored("RuntimeError: " + HOSTILE, "see traceback",
                           {"traceback": f'File "{HOSTILE_NAME}", line 3\nRuntimeError: {HOSTILE}', HOSTILE: [HOSTILE]})
    crash.id, crash.title = "crashy", HOSTILE
    report.results.append(crash)
    report.stopped, report.discovered = HOSTILE, {"notes": [HOSTILE], "model_defined_in": f"{HOSTILE_NAME}:3"}
    return folder, target, report


def encoded(report: Report, fmt: str) -> bytes:
    """What a reporter writes to a stream whose locale encoding is not UTF-8 (Latin-1 here)."""
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="latin-1", errors="strict", newline="\n")
    render(report, fmt, out, width=100)
    out.flush()
    return raw.getvalue()


def assert_shown_not_obeyed(text: str) -> None:
    assert "\x1b" not in text and "\x00" not in text and "\u202e" not in text and "\r" not in text
    assert "\\x00" in text and "\\u202e" in text and "\\xff" in text  # shown as escapes, where they were
    assert "red nul" in text  # the colour codes around "red" dropped, the word kept


def test_junit_is_well_formed_utf8_xml_for_any_user_string(hostile):
    _, target, report = hostile
    data = encoded(report, "junit")
    assert data.startswith(b'<?xml version="1.0" encoding="utf-8"?>')
    root = ET.fromstring(data.decode("utf-8", errors="strict").split("\n", 1)[1])
    suite = root.find("testsuite")
    assert "<&]]>" in suite.get("name") and "\\x1bhostile.py" in suite.get("name")
    text = "\n".join(e.text or "" for e in root.iter()) + "".join(v for e in root.iter() for v in e.attrib.values())
    assert_shown_not_obeyed(text)
    assert '<tag a="1"> & ]]> [bold]markup[/]' in text  # escaped in the file, exact once parsed


@pytest.mark.parametrize("fmt", ["json", "sarif"])
def test_json_and_sarif_are_strict_utf8_json_for_any_user_string(hostile, fmt):
    data = encoded(hostile[2], fmt)
    document = json.loads(data.decode("utf-8", errors="strict"))
    text = json.dumps(document, ensure_ascii=False)
    text.encode("utf-8", errors="strict")  # no lone surrogate survived
    assert_shown_not_obeyed(json.loads(json.dumps(text)))
    assert "<tag a=" in text


def test_sarif_uri_of_a_file_named_with_xml_characters_is_percent_encoded(hostile):
    log = json.loads(encoded(hostile[2], "sarif"))
    uris = {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in log["runs"][0]["results"]}
    assert uris == {"%3C%26%5D%5D%3E%5Cx1bhostile.py"}


def test_console_shows_user_strings_without_obeying_them(hostile):
    out = io.StringIO()
    render(hostile[2], "rich", out, width=100)
    text = out.getvalue()
    assert_shown_not_obeyed(text)
    assert "[bold]markup[/] [/] :x:" in text  # Rich markup and emoji codes printed as written
    assert "<&]]>\\x1bhostile.py" in text.splitlines()[0]


@pytest.mark.e2e
def test_junit_through_the_command_on_a_latin1_locale(hostile):
    folder, target, _ = hostile
    env = {"COLUMNS": None, "PYTHONIOENCODING": "latin-1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = tfdoctor("check", target, "--only", "half-precision-mask", "--format", "junit", module=True, env=env,
                    text=False)
    assert done.returncode == 0, done.stderr.decode("utf-8", "replace")
    root = ET.fromstring(done.stdout.decode("utf-8", errors="strict").split("\n", 1)[1])
    (case,) = root.find("testsuite").findall("testcase")
    assert_shown_not_obeyed(case.find("system-out").text)


# --- The Report as a collection, and the versions in every format ---------------------------------

def test_report_iterates_counts_and_answers_membership():
    report = sample_report()
    assert [r.id for r in report] == [r.id for r in report.results] and len(report) == 6
    assert "future-leak" in report and "no-such-check" not in report and report.results[0] in report
    assert report["init-loss"].status is Status.PASS


def test_every_format_names_the_versions_it_was_made_with():
    from tfdoctor import __version__
    from tfdoctor.versions import tool_versions

    found = tool_versions()
    assert found["tfdoctor"] == __version__ and found["torch"] and set(found) >= {"python", "transformers"}
    report = Report("x", [Result(Status.FAIL, "bad", "fix")])
    report.results[0].id = "init-loss"
    assert json.loads(rendered_of(report, "json"))["versions"] == found
    props = ET.fromstring(rendered_of(report, "junit").split("\n", 1)[1]).find("testsuite/properties")
    assert {p.get("name"): p.get("value") for p in props}["torch.version"] == found["torch"]
    run = json.loads(rendered_of(report, "sarif"))["runs"][0]
    assert run["tool"]["driver"]["version"] == __version__ and run["properties"]["versions"] == found
    assert f"torch {found['torch']}" in rendered_of(report, "rich").splitlines()[1]


def rendered_of(report: Report, fmt: str) -> str:
    out = io.StringIO()
    render(report, fmt, out, width=100)
    return out.getvalue()


# --- SARIF locations: the user's own line for every finding ---------------------------------------

def test_token_weighting_finding_points_at_the_users_loss_line():
    """The one loop finding that had no location (it landed on line 1 of the model's file)."""
    from per_micro_batch_mean import train
    from tfdoctor import run_checks

    report = run_checks(build_fixture("gpt_pad_masked"), only="token-weighting", train=train)
    result = report["token-weighting"]
    assert result.status is Status.WARN
    path, line = result.details["location"].rsplit(":", 1)
    assert (path.endswith("per_micro_batch_mean.py")
            and "cross_entropy" in Path(path).read_text().splitlines()[int(line) - 1])
    (entry,) = json.loads(rendered_of(report, "sarif"))["runs"][0]["results"]
    assert entry["locations"][0]["physicalLocation"]["region"]["startLine"] == int(line)


SCRIPT_WITH_LIBRARY_MODEL = '''
import sys
sys.path.insert(0, {fixtures!r})  # the model's class lives outside this folder, as a library's would
import torch
import torch.nn.functional as F
from gpt_triu_mask import build

model = build()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(4):
    ids = torch.randint(0, 96, (4, 16))
    logits = model(ids)  # the call site
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 96), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
'''


@pytest.mark.e2e
def test_sarif_puts_a_model_defined_outside_the_project_on_the_scripts_call(tmp_path):
    """`run` on a model whose class is not the user's file (site-packages for a Hugging Face model;
    here a folder outside the current one): the finding lands on the script's line that calls the
    model, a path a code-scanning UI can map, and the class's path is kept in the message. The script's
    name holds `<&]]>`: a real file, not a "<string>" pseudo-file, and percent-encoded in the URI."""
    script = tmp_path / "<&]]>train.py"
    script.write_text(SCRIPT_WITH_LIBRARY_MODEL.format(fixtures=str(FIXTURES)))
    env = {"COLUMNS": None, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = tfdoctor("run", script.name, "--only", "future-leak", "--format", "sarif", cwd=tmp_path, module=True,
                    env=env)
    assert done.returncode == 1, done.stderr
    (entry,) = json.loads(done.stdout)["runs"][0]["results"]
    where = entry["locations"][0]["physicalLocation"]
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if "# the call site" in text)
    assert (where["artifactLocation"]["uri"], where["region"]["startLine"]) == ("%3C%26%5D%5D%3Etrain.py", line)
    assert str(FIXTURES / "tinygpt.py") in entry["message"]["text"]


# --- At 80 columns (a pipe, a CI log) a fix wraps, it is never cut ----------------------------------

def _cell_text(output: str, column: int) -> str:
    """One column of a Rich table's rows, whitespace dropped (a word wrapped or folded reads the same)."""
    cells = [line.split("│")[column] for line in output.splitlines() if line.count("│") >= column + 1]
    return "".join("".join(cells).split())


@pytest.mark.e2e
def test_checks_catalogue_wraps_every_fix_at_80_columns_through_a_pipe():
    from tfdoctor.registry import all_checks

    env = {"COLUMNS": "80", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = tfdoctor("checks", module=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout and max(len(line) for line in done.stdout.splitlines()) <= 80
    assert _cell_text(done.stdout, 3) == "".join("".join(spec.fix.split()) for spec in all_checks())


def test_memory_remedies_wrap_long_code_at_80_columns():
    from tfdoctor.memory.analytic import Config, judge
    from tfdoctor.report import render as render_memory

    verdict = judge(Config(batch=64, seq=4096).validated(), 8 << 30, "--budget")
    code = "torch.autocast(device_type='cuda', dtype=torch.bfloat16) around the forward and the loss"
    verdict.remedies[0].change = code  # as a traced verdict words it: a token longer than its column
    out = io.StringIO()
    render_memory(verdict, "rich", out, width=80)
    assert "…" not in out.getvalue()
    assert "".join(code.split()) in _cell_text(out.getvalue(), 1)


@pytest.mark.e2e
def test_the_one_line_on_stderr_shows_a_factorys_hostile_message_without_obeying_it(tmp_path):
    (tmp_path / "factory.py").write_text("from hostile_strings import HOSTILE\n\n\ndef build():\n"
                                         "    raise ValueError(HOSTILE)\n")
    env = {"COLUMNS": None,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(FIXTURES), os.environ.get("PYTHONPATH", "")])}
    done = tfdoctor("check", f"{tmp_path / 'factory.py'}:build", module=True, env=env, text=False)
    err = done.stderr.decode("utf-8", errors="strict")
    assert done.returncode == 2 and "raised ValueError: red nul\\x00" in err
    assert "\x1b" not in err and "\x00" not in err


def test_progress_bar_survives_early_stops_overshoot_and_later_tasks():
    import io

    from rich.console import Console

    from tfdoctor.report.progress import terminal_progress

    with terminal_progress(Console(file=io.StringIO(), force_terminal=True)) as start:
        first = start("overfit-batch", 10)
        first(4)
        first(6)  # completes: the task is removed
        first(0)
        first(3)  # after completion: ignored, not a KeyError
        second = start("training loop", 3)  # a task started after one was removed (issue 8 item 1)
        second(1)
        second(5)
        third = start("overfit-batch (your loop)", 2)
        third(1)
    with terminal_progress(Console(file=io.StringIO(), force_terminal=False)) as start:
        assert start is None


def test_counts_and_shares_read_right_at_their_edges():
    from tfdoctor.result import counted, percent

    assert counted(1, "optimizer step") == "1 optimizer step" and counted(2, "optimizer step") == "2 optimizer steps"
    assert counted(0, "batch", "batches") == "0 batches"
    assert percent(4 / 1440) == "0.3%" and percent(1 / 5000) == "under 0.1%" and percent(0) == "0%"
    assert percent(0.88) == "88%"
