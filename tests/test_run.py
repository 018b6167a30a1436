"""`tfdoctor run SCRIPT`: an unmodified training script, run as __main__ and stopped after its first
optimizer steps, audited end to end through the installed command (fixtures/scripts/)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

TFDOCTOR = shutil.which("tfdoctor")
pytestmark = pytest.mark.skipif(TFDOCTOR is None, reason="tfdoctor is not installed (pip install -e .)")
SCRIPTS = "fixtures/scripts"
# The loop checks read the recorded trace (instant); of the model checks only a cheap pair runs where
# the test is about the loop.
LOOP_ONLY = ["--skip", "future-leak,mask-direction,softmax-mask-order,half-precision-mask,padding-mask,"
                       "masked-row-nan,padding-equivalence,overfit-batch,bidirectional-encoder,"
                       "cross-attention-mask,packing-isolation,cache-consistency,memory"]


def tfdoctor(*args, cwd=ROOT, timeout=300):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([TFDOCTOR, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def as_json(done):
    return json.loads(done.stdout)


def by_id(report):
    return {c["id"]: c for c in report["checks"]}


def test_correct_plain_loop_is_quiet_and_discovered():
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop.py", "--format", "json", "--", "--accum", "2")
    assert done.returncode == 0, done.stderr
    report = as_json(done)
    bad = [(c["id"], c["status"], c["message"]) for c in report["checks"] if c["status"] in ("fail", "error", "warn")]
    assert not bad
    found = report["discovered"]
    assert found["model"] == "TinyLM" and found["model_defined_in"] == f"{SCRIPTS}/tinylm.py:8"
    assert found["called_as"] == "model(ids)"
    assert found["batch_shape"] == [4, 16] and found["vocab_size"] == 50
    assert (found["pad_id"], found["pad_id_source"], found["padding_side"]) == (0, "targets set to ignore_index",
                                                                                "right")
    assert found["steps"] == 2 and found["ended"] == "stopped" and found["optimizers"] == ["AdamW"]
    checks = by_id(report)
    # every model check ran on the discovered model, every loop check on the real trace
    assert checks["padding-mask"]["status"] == "pass" and checks["init-loss"]["status"] == "pass"
    assert checks["ignore-index"]["status"] == "pass" and checks["accumulation-scaling"]["status"] == "pass"
    # the script's own prints went to stderr, never into the JSON on stdout
    assert "epoch 0 step 1" in done.stderr and "epoch 0 step" not in done.stdout


def test_missing_accumulation_division_fails_at_the_backward_line():
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop_no_accum_division.py", "--format", "json", *LOOP_ONLY)
    assert done.returncode == 1, done.stderr
    checks = by_id(as_json(done))
    accumulation = checks["accumulation-scaling"]
    assert accumulation["status"] == "fail"
    assert accumulation["details"]["micro_batches_per_step"] == 2
    assert accumulation["details"]["gradient_factor"] == pytest.approx(2.0, rel=0.05)
    line = open(ROOT / SCRIPTS / "plain_loop_no_accum_division.py").read().splitlines().index(
        "        loss.backward()") + 1
    assert accumulation["details"]["location"] == f"{SCRIPTS}/plain_loop_no_accum_division.py:{line}"
    assert accumulation["details"]["call"] == "backward()"
    assert as_json(done)["discovered"]["pad_id"] is None  # fixed-length blocks: no padding to find


def test_stops_after_the_steps_asked_and_reaches_nothing_after(tmp_path):
    out = tmp_path / "model.pt"
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop.py", "--steps", "3", "--format", "json", *LOOP_ONLY,
                    "--", "--accum", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    found = as_json(done)["discovered"]
    assert found["steps"] == 3 and found["stopped_at"].startswith(f"{SCRIPTS}/plain_loop.py:")
    assert "epoch 0 step 2 " in done.stderr and "epoch 0 step 3 " not in done.stderr  # stopped inside step 3
    assert not out.exists()  # the checkpoint written after the loop was never reached


def test_rich_report_shows_discovered_header_and_locations():
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop_no_accum_division.py", *LOOP_ONLY)
    assert done.returncode == 1
    assert "discovered model TinyLM" in done.stdout and "called as model(ids)" in done.stdout
    assert "2 optimizer step(s) recorded" in done.stdout
    assert f"at {SCRIPTS}/plain_loop_no_accum_division.py:" in done.stdout and "(backward())" in done.stdout


def test_module_form_and_python_dash_m(tmp_path):
    # `-m pkg.mod` runs like `python -m`: from the current directory, every argument the script's
    done = tfdoctor("run", "-m", "plain_loop", "--format", "json", "--only", "accumulation-scaling", "--",
                    "--accum", "2", cwd=ROOT / SCRIPTS)
    assert done.returncode == 0, done.stderr
    assert as_json(done)["discovered"]["script"] == "-m plain_loop"
    done = subprocess.run([sys.executable, "-m", "tfdoctor", "run", f"{SCRIPTS}/plain_loop.py", "--format", "json",
                           "--only", "zero-grad"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert by_id(as_json(done))["zero-grad"]["status"] == "pass"


@pytest.mark.parametrize("script, args, expected", [
    ("missing.py", [], "script not found: fixtures/scripts/missing.py"),
    ("bad/raises_early.py", [], "raised FileNotFoundError: no such corpus: data/train.bin at "
                                "fixtures/scripts/bad/raises_early.py:7 in load_corpus before its first optimizer step"),
    ("bad/exits_early.py", [], "called sys.exit(3) at fixtures/scripts/bad/exits_early.py:10 in <module> before its "
                               "first optimizer step"),
    ("bad/never_steps.py", [], "ended without an optimizer step: 3 forward(s) of a model and 3 backward() call(s) seen"),
    ("bad/hangs.py", ["--timeout-per-check", "3"], "running the script up to its last recorded step ran past its 3 s "
                                                   "budget (--timeout-per-check); it was at "
                                                   "fixtures/scripts/bad/hangs.py:10 in <module>"),
])
def test_bad_scripts_are_one_line_and_exit_2(script, args, expected):
    done = tfdoctor("run", f"{SCRIPTS}/{script}", "--format", "json", *args)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("tfdoctor:")]
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert done.stdout == ""


def test_usage_errors():
    done = tfdoctor("run")
    assert done.returncode == 2 and "give the script to run" in done.stderr
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop.py", "--steps", "1")
    assert done.returncode == 2 and "--steps must be at least 2" in done.stderr
