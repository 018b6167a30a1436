"""`tfdoctor judge PATH` end to end: the report, its JSON shape for one run and for several, the exit codes,
the one-line usage errors, TensorBoard as an optional extra, no torch imported, and `--follow` naming a
finding while the run that writes the log is still going.

The logs are written by fixtures/watch/jsonl_log_healthy.py (correct) and jsonl_log_diverges.py (planted:
a warm-up without its cap, the loss diverges to NaN), real tiny training loops that keep a JSON-lines log.
"""

import json
import os
import select
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from helpers import E2E, ROOT, start, tfdoctor

pytestmark = E2E

FIXTURES = ROOT / "fixtures" / "watch"
LOOP_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PLANNED_STEPS = 1500


def _writer(script: str, log, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(FIXTURES / script), str(log), *map(str, args)], cwd=FIXTURES,
                            env=LOOP_ENV)


@pytest.fixture(scope="module")
def followed(tmp_path_factory):
    """`judge --follow` on the diverging loop's log while the loop writes it (a step every 20 ms at least,
    up to 1500 steps; it stops once the test says so). Returns what was seen when the finding appeared."""
    folder = tmp_path_factory.mktemp("follow")
    log, stop = folder / "train_log.jsonl", folder / "stop"
    writer = _writer("jsonl_log_diverges.py", log, "--steps", PLANNED_STEPS, "--sleep", 0.02, "--until", stop)
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and log.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.2)
        follow = start("judge", str(log), "--follow", "--every", "0.3", "--idle", "3", "--format", "json",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        lines, seen = [], None
        buffer = b""
        while seen is None and time.monotonic() < deadline and follow.poll() is None:
            ready, _, _ = select.select([follow.stderr], [], [], 1.0)
            if not ready:
                continue
            chunk = os.read(follow.stderr.fileno(), 65536)
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for line in complete:
                lines.append(line.decode())
                if "loss-divergence" in line.decode() and seen is None:
                    seen = {"line": line.decode(), "writer_running": writer.poll() is None,
                            "steps_written": sum(1 for _ in open(log))}
        stop.touch()
        writer.wait(timeout=300)
        stdout, stderr = follow.communicate(timeout=300)
        lines += (buffer + stderr).decode().splitlines()
        return {"seen": seen, "code": follow.returncode, "report": json.loads(stdout), "stderr": lines,
                "log": log, "steps_at_end": sum(1 for _ in open(log))}
    finally:
        stop.touch()
        if writer.poll() is None:
            writer.kill()


@pytest.fixture(scope="module")
def healthy_log(tmp_path_factory):
    log = tmp_path_factory.mktemp("healthy") / "train_log.jsonl"
    subprocess.run([sys.executable, str(FIXTURES / "jsonl_log_healthy.py"), str(log), "--steps", "100"],
                   check=True, cwd=FIXTURES, env=LOOP_ENV, timeout=600)
    return log


def test_follow_names_the_divergence_while_the_run_still_writes(followed):
    seen = followed["seen"]
    assert seen is not None, followed["stderr"][-5:]
    # the writer was still running, far from the 1500 steps it planned (it stops once told, so it may
    # write no line after the finding: the count at the end proves nothing more)
    assert seen["writer_running"] and seen["steps_written"] < PLANNED_STEPS
    assert seen["line"].startswith("tfdoctor: FAIL loss-divergence at step ")
    assert followed["code"] == 1
    checks = {c["id"]: c for c in followed["report"]["checks"]}
    assert checks["loss-divergence"]["status"] == "fail"
    assert any("did not grow for 3 s" in line for line in followed["stderr"])
    assert followed["stderr"][-1].startswith("tfdoctor: FAIL (") and "loss-divergence" in followed["stderr"][-1]


def test_judge_json_carries_the_series_and_where_each_came_from(followed):
    done = tfdoctor("judge", str(followed["log"]), "--format", "json")
    assert done.code == 1 and done.statuses["loss-divergence"] == "fail"
    (run,) = done.json["discovered"]["runs"]
    assert run["format"] == "jsonl" and run["sources"]["loss"] == "loss"
    assert run["sources"]["eval:val_loss"] == "val_loss"
    steps = done.json["series"]["steps"]
    logged = [json.loads(line) for line in followed["log"].read_text().splitlines() if '"loss"' in line]
    assert steps["step"] == [line["iter"] for line in logged] and steps["loss"] == [line["loss"] for line in logged]
    assert done.json["series"]["facts"]["logged"]["step_from"] == "the step column 'iter'"
    assert done.error_lines[-1].startswith("tfdoctor: FAIL")


def test_several_runs_one_object_worst_exit(followed, healthy_log, tmp_path):
    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "good" / "log.jsonl").write_text(healthy_log.read_text())
    (tmp_path / "bad" / "log.jsonl").write_text(followed["log"].read_text())
    done = tfdoctor("judge", str(tmp_path), "--format", "json")
    assert done.code == 1
    runs = done.json["discovered"]["runs"]
    assert sorted(run["name"] for run in runs) == ["bad/log.jsonl", "good/log.jsonl"]
    assert all(run["series"]["steps"]["step"] for run in runs) and "series" not in done.json
    failing = [c for c in done.json["checks"] if c["status"] == "fail"]
    assert failing and all(c["details"]["run"] == "bad/log.jsonl" and c["message"].startswith("bad/log.jsonl: ")
                           for c in failing)
    good = [c for c in done.json["checks"] if c["details"].get("run") == "good/log.jsonl"]
    assert {c["status"] for c in good} <= {"pass", "skip"}
    junit = tfdoctor("judge", str(tmp_path), "--format", "junit")
    cases = ET.fromstring(junit.stdout).findall(".//testcase")
    assert junit.code == 1 and len(cases) == len(done.json["checks"])
    rich = tfdoctor("judge", str(tmp_path))
    headers = [line for line in rich.stdout.splitlines() if line.startswith("judged ")]
    assert rich.code == 1 and len(headers) == 2  # each run's own report, one after the other


def test_healthy_log_passes(healthy_log):
    done = tfdoctor("judge", str(healthy_log))
    assert done.code == 0, done.stdout
    assert "judged" in done.stdout and "loss <- loss" in done.stdout
    assert done.error_lines[-1].startswith("tfdoctor: PASS")


def test_tag_maps_unfamiliar_names(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("n,objective\n" + "".join(f"{i},{3 - i / 50}\n" for i in range(1, 40)))
    unknown = tfdoctor("judge", str(log))
    assert unknown.code == 2 and len(unknown.error_lines) == 1 and "objective" in unknown.error_lines[0]
    mapped = tfdoctor("judge", str(log), "--tag", "loss=objective", "--tag", "step=n", "--format", "json")
    assert mapped.code == 0 and mapped.json["discovered"]["runs"][0]["sources"] == {"loss": "objective"}
    wrong = tfdoctor("judge", str(log), "--tag", "loss=objectiv")
    assert wrong.code == 2 and "did you mean 'objective'" in wrong.error_lines[0]


@pytest.mark.parametrize("args, said", [
    (["fixtures/watch/jsonl_log_healty.py"], "did you mean"),
    (["fixtures/watch"], "no training log found"),
    (["fixtures/watch/healthy.py"], "not a training log"),
    (["fixtures", "--tag", "loss"], "is not SERIES=NAME"),
    (["fixtures", "--tag", "los=x"], "did you mean loss"),
])
def test_bad_input_is_one_line_and_exit_2(args, said):
    done = tfdoctor("judge", *args)
    assert done.code == 2 and "Traceback" not in done.stderr
    assert len(done.error_lines) == 1 and said in done.error_lines[0], done.stderr


def test_tensorboard_missing_is_one_line(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "run")) as writer:
        for step in range(10):
            writer.add_scalar("train/loss", 3.0 - step / 10, step)
    blocker = tmp_path / "blocker" / "tensorboard"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError(\"No module named 'tensorboard'\", name='tensorboard')\n")
    done = tfdoctor("judge", str(tmp_path / "run"), env={"PYTHONPATH": f"{blocker.parent}{os.pathsep}{ROOT}"})
    assert done.code == 2 and "Traceback" not in done.stderr
    assert len(done.error_lines) == 1 and "install tfdoctor[logs]" in done.error_lines[0]


def test_judge_imports_no_torch(healthy_log):
    program = ("import sys\nfrom tfdoctor.cli import main\nsys.argv = ['tfdoctor', 'judge', sys.argv[1], '--format', "
               "'json']\ntry:\n    main()\nexcept SystemExit:\n    pass\nsys.stderr.write('torch imported: %s' % "
               "('torch' in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", program, str(healthy_log)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert json.loads(done.stdout)["discovered"]["runs"][0]["format"] == "jsonl"
    assert done.stderr.endswith("torch imported: False")
