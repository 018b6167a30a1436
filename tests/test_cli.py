"""End to end through the `tfdoctor` command, as a user or CI runs it (forked from the preloaded process,
helpers.tfdoctor: the command's own start is tested fresh in test_signals, test_terminal, test_distributed
and test_preloaded)."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from helpers import E2E, ROOT, tfdoctor as run

pytestmark = E2E
FAST = ["--only", "future-leak,mask-direction,init-loss"]


# The README runs these two commands as written, at 100 columns: its process is theirs (shared_tfdoctor).
AS_THE_README_RUNS_IT = {"env": {"COLUMNS": "100"}, "timeout": 600}


def test_correct_fixture_exits_0(shared_tfdoctor):
    done = shared_tfdoctor("check", "fixtures/gpt_correct.py:build", **AS_THE_README_RUNS_IT)
    assert done.returncode == 0, done.stderr
    assert "future-leak" in done.stdout and "healthy" in done.stdout


def test_triu_fixture_exits_1_and_names_the_bug(shared_tfdoctor):
    done = shared_tfdoctor("check", "fixtures/gpt_triu_mask.py:build", **AS_THE_README_RUNS_IT)
    assert done.returncode == 1
    assert "torch.triu where torch.tril was meant" in done.stdout
    assert "fix:" in done.stdout


def test_json_format_is_one_object_with_the_schema():
    done = run("check", "fixtures/gpt_off_by_one.py:build", "--format", "json", *FAST)
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert set(report) == {"target", "checks", "summary", "versions"}  # the versions it was made with
    assert report["target"] == "fixtures/gpt_off_by_one.py:build"
    assert [c["id"] for c in report["checks"]] == ["future-leak", "mask-direction", "init-loss"]
    for entry in report["checks"]:
        assert set(entry) == {"id", "status", "message", "hint", "details"}
        assert entry["status"] in {"pass", "warn", "fail", "skip", "error"}
    assert report["checks"][1]["details"]["pattern"] == "off-by-one"
    assert report["summary"] == {"pass": 1, "warn": 0, "fail": 2, "skip": 0, "error": 0}


def test_junit_parses_with_one_testcase_per_check(tmp_path):
    out = tmp_path / "report.xml"
    done = run("check", "fixtures/gpt_no_mask.py:build", "--format", "junit", "--output", str(out), *FAST)
    assert done.returncode == 1 and done.stdout == ""
    suite = ET.parse(out).getroot().find("testsuite")
    cases = {case.get("name"): case for case in suite.findall("testcase")}
    assert list(cases) == ["future-leak", "mask-direction", "init-loss"]
    assert cases["future-leak"].find("failure") is not None
    assert cases["init-loss"].find("failure") is None
    assert suite.get("failures") == "2"


def test_module_target_with_cwd_on_path():
    done = run("check", "gpt_correct:build", "--only", "mask-direction", cwd=ROOT / "fixtures")
    assert done.returncode == 0, done.stderr


def test_skip_and_seed_flags():
    done = run("check", "fixtures/gpt_triu_mask.py:build", "--only", "init-loss,overfit-batch",
               "--skip", "overfit-batch", "--seed", "3", "--batch", "2", "--seq-len", "16", "--format", "json")
    assert done.returncode == 0
    assert [c["id"] for c in json.loads(done.stdout)["checks"]] == ["init-loss"]


def test_strict_turns_warnings_into_failures(tmp_path):
    target = tmp_path / "warm_init.py"
    target.write_text(
        "import sys\nsys.path.insert(0, %r)\n" % str(ROOT / "fixtures")
        + "import torch.nn as nn\nfrom gpt_correct import build as base\n"
        "def build():\n    m = base()\n    nn.init.normal_(m.head.weight, std=0.33)\n    return m\n"
    )
    relaxed = run("check", f"{target}:build", "--only", "init-loss", "--format", "json")
    assert json.loads(relaxed.stdout)["checks"][0]["status"] == "warn"
    assert relaxed.returncode == 0
    done = run("check", f"{target}:build", "--only", "init-loss", "--strict")
    assert done.returncode == 1
    # the summary line agrees with the exit code
    assert done.stdout.strip().splitlines()[-1].startswith("1 warn — 1 problem(s) found")


@pytest.mark.parametrize("args, expected", [
    (["check", "no_such_module:build"], "module not found: no_such_module"),
    (["check", "fixtures/nope.py:build"], "file not found"),
    (["check", "fixtures/gpt_correct.py:missing"], "has no attribute 'missing'"),
    (["check", "fixtures/gpt_correct.py"], "is not MODULE:ATTR"),
    (["check", "tests/targets/bad_targets.py:raises"],
     "factory tests/targets/bad_targets.py:raises raised ValueError: config file missing"),
    (["check", "tests/targets/bad_targets.py:returns_string"], "returned str, not an nn.Module"),
    (["check", "tests/targets/bad_targets.py:NOT_CALLABLE"], "is a int, not a model"),
    (["check", "tests/targets/bad_targets.py:wrong_shape"], "expected but got [2, 10]"),
    (["check", "fixtures/gpt_correct.py:build", "--pad-id", "500"], "outside the vocabulary"),
    (["check", "fixtures/gpt_correct.py:build", "--device", "bogus"], "cannot use device 'bogus'"),
    (["check", "fixtures/gpt_correct.py:build", "--train", "fixtures/gpt_correct.py:nope"], "has no attribute 'nope'"),
])
def test_bad_input_is_one_line_and_exit_2(args, expected):
    done = run(*args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert expected in lines[0]
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_checks_lists_the_catalogue_without_torch():
    code = ("import sys; from tfdoctor.cli import main; sys.argv=['tfdoctor','checks'];\n"
            "try: main()\nexcept SystemExit: pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "future-leak" in done.stdout and "overfit-batch" in done.stdout
    assert done.stdout.strip().endswith("NO-TORCH")


def test_help_does_not_import_torch():
    code = ("import sys; from tfdoctor.cli import main; sys.argv=['tfdoctor','--help'];\n"
            "try: main()\nexcept SystemExit: pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "check" in done.stdout
    assert done.stdout.strip().endswith("NO-TORCH")
    assert run("--help").returncode == 0


def test_checks_with_an_unknown_id_exits_2():
    # (the documentation `checks ID` prints: test_usage.py)
    assert run("checks", "no-such-check").returncode == 2


def test_no_numpy_warning_on_a_machine_without_numpy(tmp_path):
    # Hide numpy the way a fresh `pip install -e .` leaves it: importing it fails.
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    # (this tree's tfdoctor after it: the worker, not `import tfdoctor`, hides the warning)
    done = run("check", "fixtures/gpt_correct.py:build", *FAST, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert done.returncode == 0, done.stderr
    assert "NumPy" not in done.stderr


def test_packing_flag_reaches_the_check():
    done = run("check", "fixtures/gpt_correct.py:build", "--only", "packing-isolation", "--packing", "position_ids",
               "--format", "json")
    (check,) = json.loads(done.stdout)["checks"]
    assert "packing='position_ids' calls model(input_ids=..., position_ids=...)" in check["message"]
    # and an unknown --packing is refused: test_usage.py
