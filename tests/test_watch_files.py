"""`tfdoctor watch` is the user's real run: a watched run leaves the files the bare run leaves, byte for
byte (fixtures/watch/writes_run_files.py: checkpoints, a JSONL log, a CSV); a run that --max-steps may
cut short is protected, the user told before and after, and --keep-writes keeps a copy; Ctrl-C reaches
the script's own handlers, which write for real; every run ends with the verdict line on stderr, and a
report written to a file leaves the live view on the terminal."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import E2E, ROOT, command_env, command_line, final_screen, run_in_terminal, tfdoctor

pytestmark = E2E

SCRIPT = str(ROOT / "fixtures/watch/writes_run_files.py")
RUN_ARGS = ("--out", "out", "--steps", "40", "--save-every", "20")


def files_under(folder: Path) -> dict:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def bare_and_watched(tmp_path_factory):
    bare, watched = tmp_path_factory.mktemp("bare"), tmp_path_factory.mktemp("watched")
    ran = subprocess.run([sys.executable, SCRIPT, *RUN_ARGS], cwd=bare, env=command_env(), capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    done = tfdoctor("watch", SCRIPT, "--format", "json", "--", *RUN_ARGS, cwd=watched)
    return bare, watched, ran, done


def test_a_watched_run_leaves_what_the_bare_run_leaves_byte_for_byte(bare_and_watched):
    bare, watched, _, done = bare_and_watched
    assert done.code == 0, done.stderr[-2000:]
    made = files_under(watched / "out")
    assert sorted(made) == sorted(files_under(bare / "out")) == sorted(
        ["ckpt.pt", "ckpt-0020.pt", "ckpt-0040.pt", "done.txt", "log.jsonl", "metrics.csv"])
    for name, content in files_under(bare / "out").items():
        assert made[name] == content, f"{name} differs from the bare run's"


def test_the_report_s_losses_are_the_script_s_own(bare_and_watched):
    _, watched, _, done = bare_and_watched
    logged = [json.loads(line)["loss"] for line in (watched / "out" / "log.jsonl").read_text().splitlines()]
    assert done.json["series"]["steps"]["loss"] == pytest.approx(logged, rel=1e-6)


def test_the_run_ends_with_the_verdict_line_naming_where_the_report_is(bare_and_watched):
    *_, done = bare_and_watched
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tfdoctor: PASS") and "report is on stdout" in last, last
    assert "protected" not in done.stderr  # a run tfdoctor does not cut short writes for real


def test_a_run_max_steps_may_cut_short_is_protected_and_the_user_told(tmp_path):
    done = tfdoctor("watch", SCRIPT, "--max-steps", "25", "--format", "json", "--output", "report.json",
                    "--", *RUN_ARGS, cwd=tmp_path)
    assert done.code == 0, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # out/ never reached the user's folder
    lines = done.error_lines
    assert "--max-steps may cut this run short, so your files are protected" in lines[0]
    assert "--keep-writes DIR keeps a copy" in lines[0]
    after = next(line for line in lines if "protected your files" in line)
    assert "out/ckpt.pt" in after and "thrown away" in after
    assert lines[-1].startswith("tfdoctor: PASS") and lines[-1].endswith("report in report.json")
    assert json.loads((tmp_path / "report.json").read_text())["discovered"]["ended"] == "max-steps"


def test_keep_writes_keeps_a_copy_of_what_the_protected_run_wrote(tmp_path):
    done = tfdoctor("watch", SCRIPT, "--max-steps", "25", "--keep-writes", "kept", "--format", "json",
                    "--", *RUN_ARGS, cwd=tmp_path)
    assert done.code == 0, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    (copy,) = (tmp_path / "kept").iterdir()
    kept = {path.name for path in copy.rglob("*") if path.is_file()}
    assert {"ckpt.pt", "ckpt-0020.pt", "log.jsonl", "done.txt"} <= kept
    assert f"a copy is kept in {copy}" in done.stderr


def test_keep_writes_without_a_cut_short_run_is_a_usage_error(tmp_path):
    done = tfdoctor("watch", SCRIPT, "--keep-writes", "kept", cwd=tmp_path)
    assert done.code == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "writes its files for real" in done.stderr


def test_ctrl_c_reaches_the_script_whose_own_handlers_write_for_real(tmp_path):
    proc = subprocess.Popen(command_line("watch", SCRIPT, "--format", "json", "--output", "report.json", "--",
                             "--out", "out", "--steps", "100000", "--save-every", "5", "--sleep", "0.02"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=command_env())
    seen = []
    for line in proc.stderr:  # the script's own line at its first checkpoint
        seen.append(line)
        if line.startswith("step 10 loss"):
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen)[-2000:] + err[-2000:]
    assert "interrupted at step" in err  # the script's `except KeyboardInterrupt` ran
    assert {"interrupted.pt", "done.txt", "ckpt.pt", "log.jsonl"} <= set(os.listdir(tmp_path / "out"))
    lines = err.strip().splitlines()
    assert lines[-2].startswith("tfdoctor: interrupted (Ctrl-C) after ")
    assert lines[-1].startswith("tfdoctor: ") and lines[-1].endswith("report in report.json"), lines[-1]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["discovered"]["ended"] == "interrupted"


def test_a_report_written_to_a_file_leaves_the_live_view_on_the_terminal(tmp_path):
    output = tmp_path / "report.html"
    code, raw, _ = run_in_terminal("watch", "fixtures/watch/healthy.py", "--max-steps", "60", "--format", "html",
                                   "--output", str(output))
    screen = final_screen(raw)
    assert "grad norm" in raw  # the live view was drawn
    assert code == 0, screen[-2000:]
    assert output.read_text().lstrip().lower().startswith("<!doctype html")
    assert f"report in {output}" in screen
