"""A script that carries TfdoctorCallback, as the README shows it, under the commands that audit it
themselves (fixtures/scripts/hf_trainer_callback.py, correct code). `tfdoctor run` must see through
the callback: the verdicts it gives without it, stopped at its steps (with the callback's monitor
hooks on, it once recorded one optimizer step of 40, never stopped the script and failed
scheduler-placement). The callback stands aside there, and under `watch`, and says so in one line;
run by plain `python`, it ends on the verdict line, on the terminal although the script configured
no logging.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import E2E, ROOT, SCRIPTS, tfdoctor

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = E2E

SCRIPT = f"{SCRIPTS}/hf_trainer_callback.py"
ASIDE = "tfdoctor: TfdoctorCallback stands aside: `tfdoctor {}` is auditing this run"


@pytest.fixture(scope="module")
def with_callback():
    return tfdoctor("run", SCRIPT, "--format", "json")


@pytest.fixture(scope="module")
def without_callback():
    return tfdoctor("run", SCRIPT, "--format", "json", "--", "--without-callback")


def test_run_gives_the_same_verdicts_with_the_callback(with_callback, without_callback):
    assert without_callback.returncode == 0, without_callback.stderr
    assert with_callback.returncode == without_callback.returncode, with_callback.stderr
    assert with_callback.statuses == without_callback.statuses
    assert not with_callback.problems
    for done in (with_callback, without_callback):
        found = done.json["discovered"]
        assert (found["steps"], found["ended"], found["model"]) == (2, "stopped", "GPT2LMHeadModel")
        assert "training done" not in done.stderr  # stopped at its steps, train() never returned
    # the two micro-batches of each step and the one schedule step per optimizer step are seen again
    for check in ("accumulation-scaling", "scheduler-placement"):
        assert with_callback.checks[check]["details"] == without_callback.checks[check]["details"], check
    assert with_callback.checks["accumulation-scaling"]["details"]["micro_batches_per_step"] == 2


def test_the_callback_says_once_that_it_stands_aside(with_callback, without_callback):
    lines = [line for line in with_callback.stderr.splitlines() if line.startswith("tfdoctor: TfdoctorCallback")]
    assert len(lines) == 1 and lines[0].startswith(ASIDE.format("run")), with_callback.stderr
    assert "TfdoctorCallback" not in without_callback.stderr


def test_watch_hooks_the_run_once(tmp_path):
    report = tmp_path / "callback.json"
    done = tfdoctor("watch", SCRIPT, "--format", "json", "--", "--report", str(report))
    assert done.returncode == 0, done.stderr
    assert ASIDE.format("watch") in done.stderr
    assert len(done.json["series"]["steps"]["loss"]) == 40 and "training done 40" in done.stderr
    assert not report.exists()  # the command's report is the one


def test_plain_python_ends_on_the_verdict_line(tmp_path):
    """No logging configured by the script: the callback's lines still reach stderr, the verdict last."""
    report = tmp_path / "run.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, SCRIPT, "--steps", "10", "--report", str(report)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("tfdoctor:")]
    summary = json.loads(report.read_text())["summary"]
    quiet = ", ".join(f"{summary[status]} {status}" for status in ("pass", "skip") if summary[status])
    assert said == [f"tfdoctor: PASS (curves healthy: {quiet}); report in {report}"]
