"""`tfdoctor watch` as a user runs it: the whole run recorded and judged, JSON carrying every series,
--max-steps / --max-time, bad input (one line, exit 2), a script that dies mid-run, and the live view
on a terminal with the script's own output above it."""

import json

import pytest

from helpers import E2E, final_screen, run_in_terminal, tfdoctor

pytestmark = E2E

HEALTHY = "fixtures/watch/healthy.py"


@pytest.fixture(scope="module")
def healthy_json():
    done = tfdoctor("watch", HEALTHY, "--max-steps", "120", "--format", "json")
    return done, json.loads(done.stdout)


def test_json_carries_every_series_and_every_judge(healthy_json):
    from tfdoctor.registry import select

    done, report = healthy_json
    assert [c["id"] for c in report["checks"]] == [spec.id for spec in select(run_judges=True)]
    steps = report["series"]["steps"]
    assert len(steps["step"]) == 120 and steps["step"] == list(range(120))
    for column in ("loss", "micro_losses", "grad_norm", "group_norms", "lrs", "scale", "skipped", "wall",
                   "data_wait", "tokens", "rss", "batches"):
        assert len(steps[column]) == 120, column
    assert steps["loss"][0] > steps["loss"][-1]  # it learns
    assert report["series"]["evals"]["step"] == [50, 100]  # healthy.py evaluates every 50 steps
    assert report["series"]["facts"]["loader"]["batch_size"] == 16
    assert report["discovered"]["ended"] == "max-steps"
    assert "step 50 train" in done.stderr and "step 50" not in done.stdout  # the script's prints: stderr


def test_the_healthy_run_is_quiet_under_every_judge(healthy_json):
    done, report = healthy_json
    assert report["summary"]["fail"] == report["summary"]["warn"] == report["summary"]["error"] == 0, \
        [c for c in report["checks"] if c["status"] != "pass" and c["status"] != "skip"]
    assert done.code == 0


def test_max_time_stops_the_run():
    done = tfdoctor("watch", HEALTHY, "--max-time", "1", "--format", "json")
    report = json.loads(done.stdout)
    assert report["discovered"]["ended"] == "max-time"
    assert 0 < len(report["series"]["steps"]["step"]) < 300


@pytest.mark.parametrize("args, said", [
    (("fixtures/watch/missing.py",), "script not found"),
    ((HEALTHY, "--max-steps", "0"), "--max-steps must be at least 1"),
    ((HEALTHY, "--only", "future-leak"), "'future-leak' is not judged here"),
    ((HEALTHY, "--only", "no-such-judge"), "unknown check id"),
    ((), "give the script to watch"),
])
def test_bad_input_is_one_line_and_exit_2(args, said):
    done = tfdoctor("watch", *args)
    assert done.code == 2 and done.stdout == ""
    assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("command", ["watch", "run"])
def test_debug_shows_the_traceback_the_hint_promises_above_the_one_line(command):
    # "fix the script so that `python` runs it (TFDOCTOR_DEBUG=1 shows the traceback)"
    from tfdoctor.usercode.environment import DEBUG

    script = "fixtures/scripts/bad/raises_early.py"
    plain, debug = tfdoctor(command, script), tfdoctor(command, script, env={DEBUG.name: "1"})
    assert plain.code == debug.code == 2
    assert "TFDOCTOR_DEBUG=1 shows the traceback" in plain.stderr and "Traceback" not in plain.stderr
    *traceback, line = debug.stderr.strip().splitlines()
    assert traceback[0] == "Traceback (most recent call last):" and f'{script}", line 7, in load_corpus' in debug.stderr
    assert traceback[-1] == "FileNotFoundError: no such corpus: data/train.bin"
    assert line.startswith("tfdoctor: error: ") and line == plain.stderr.strip(), debug.stderr


def test_a_script_that_dies_midway_is_reported_with_the_steps_it_took():
    done = tfdoctor("watch", "fixtures/watch/raises_midway.py", "--format", "json")
    report = json.loads(done.stdout)
    assert len(report["series"]["steps"]["step"]) == 30
    assert report["discovered"]["ended"] == "raised"
    assert "KeyError" in report["discovered"]["error"] and "raises_midway.py:20" in report["discovered"]["error"]
    assert done.code == 2 and "the watched script raised KeyError" in done.stderr


def test_the_live_view_on_a_terminal_keeps_the_script_s_output_above_it():
    code, raw, piped = run_in_terminal("watch", HEALTHY, "--max-steps", "120", stdout_is_terminal=False)
    assert "tfdoctor watch fixtures/watch/healthy.py" in raw and "grad norm" in raw  # the view, on stderr
    assert "step 100 train" in raw  # the script's own line, printed through
    screen = final_screen(raw)
    assert "Traceback" not in raw and "internal error" not in raw
    assert piped.startswith("tfdoctor watch") and "120 optimizer step(s)" in piped  # stdout: the report only
    assert "grad norm" not in piped and "step 100 train" not in piped
    assert code == 0, screen[-2000:]


def test_ctrl_c_ends_the_run_and_the_steps_it_took_are_judged():
    import signal
    import subprocess

    from helpers import ROOT, command_line

    proc = subprocess.Popen(command_line("watch", HEALTHY, "--format", "json", "--", "--steps", "100000"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # the script's own progress: it has trained 100 steps by then
        seen.append(line)
        if line.startswith("step 100 train"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    report = json.loads(out)
    steps = len(report["series"]["steps"]["step"])
    assert report["discovered"]["ended"] == "interrupted" and 100 <= steps < 100000
    lines = err.strip().splitlines()
    assert lines[-2] == f"tfdoctor: interrupted (Ctrl-C) after {steps} optimizer step(s)"
    assert lines[-1].startswith("tfdoctor: ") and lines[-1].endswith("the json report is on stdout"), lines[-1]
    assert proc.returncode == 130, "".join(seen)[-2000:]


@pytest.mark.parametrize("command, ours", [("watch", ("--max-steps", "5")), ("run", ("--steps", "2"))])
def test_the_script_s_own_option_before_the_double_dash_is_one_line_with_the_command_that_works(command, ours):
    done = tfdoctor(command, HEALTHY, *ours, "--device=cpu")
    assert done.code == 2 and done.stdout == ""
    assert done.stderr.strip() == (f"tfdoctor: error: No such option: --device; the script's own options go after "
                                   f"--: tfdoctor {command} {HEALTHY} {' '.join(ours)} -- --device=cpu")


def test_a_nanogpt_style_run_reads_data_wait_not_measured_its_groups_and_curves_healthy(watch_audit):
    """fixtures/watch/healthy_get_batch.py: get_batch() slices a tensor (no DataLoader), two parameter
    groups on one schedule, every judge that applies passes."""
    import io

    from tfdoctor.report.console import render

    report = watch_audit("healthy_get_batch")
    facts = report.series["facts"]
    assert "loader" not in facts
    assert [g["weight_decay"] for g in facts["param_groups"]] == [0.1, 0.0]
    assert all(g["parameters"] > 0 for g in facts["param_groups"])
    assert not [r.id for r in report.results if r.status.value in ("warn", "fail", "error")]
    out = io.StringIO()
    render(report, out, width=100)
    text = " ".join(out.getvalue().split())
    assert "data wait not measured (no DataLoader)" in text and "data wait 0" not in text
    assert "in every group (2)" in text
    assert "— curves healthy" in text
    assert "`tfdoctor run fixtures/watch/healthy_get_batch.py` audits the model and the loop" in text
