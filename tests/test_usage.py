"""What the command refuses before it starts anything (flags, selections, numbers, paths): one line on
stderr and exit 2, or a document on stdout and exit 0, through the CLI's own entry point in this
process (helpers.refused, which fails a case that would start the worker). The installed command's
exit-2 and exit-0 paths run end to end in test_cli.py, test_run.py, test_memory_cli.py and
test_readme.py."""

import time

import pytest

from helpers import refused, tfdoctor

HOSTILE = "tests/targets/hostile.py"  # its `sleeps` factory would hang were the target loaded
SEED = ["--batch", "8", "--seq", "5000", "--d-model", "512", "--heads", "8", "--vocab", "10000"]  # test_memory_cli's
SCRIPTS = "fixtures/scripts"


def one_line(done) -> str:
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("tfdoctor:")]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


# --- check (test_cli.py, test_supervision.py) -------------------------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["check", "fixtures/gpt_correct.py:build", "--seq-len", "0"], "--seq-len must be at least 2"),
    (["check", "fixtures/gpt_correct.py:build", "--only", "nope"], "unknown check id 'nope'"),
    (["check", "fixtures/gpt_correct.py:build", "--format", "xml"], "--format"),
    (["check", "fixtures/gpt_correct.py:build", "--no-such-flag"], "No such option"),
])
def test_bad_input_is_one_line_and_exit_2(args, expected):
    """The rest of test_cli's table: the ones the command refuses before it loads anything."""
    done = refused(*args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert expected in lines[0]
    assert "Traceback" not in done.stderr and done.stdout == ""


W = "fixtures/watch/healthy.py"


@pytest.mark.parametrize("args, works", [
    (["watch", W, "--device=cpu"], f"tfdoctor watch {W} -- --device=cpu"),
    # tfdoctor's own options stay before --, the script's (with a value given apart) go after it
    (["watch", W, "--max-steps", "5", "--device", "cpu", "--compile=False"],
     f"tfdoctor watch {W} --max-steps 5 -- --device cpu --compile=False"),
    (["watch", "--device=cpu", W, "--strict"], f"tfdoctor watch {W} --strict -- --device=cpu"),
    (["run", "--steps", "3", W, "--lr", "1e-3"], f"tfdoctor run --steps 3 {W} -- --lr 1e-3"),
    (["watch", "-m", "pkg.train", "--device=cpu"], "tfdoctor watch -m pkg.train -- --device=cpu"),
    (["watch", W, "--out", "a b.txt"], f"tfdoctor watch {W} -- --out 'a b.txt'"),
])
def test_a_script_option_before_the_double_dash_gets_the_command_that_works(args, works):
    done = refused(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert one_line(done).endswith(f"; the script's own options go after --: {works}"), done.stderr


@pytest.mark.parametrize("args", [["checks", "--device=cpu"],
                                  ["watch", W, "--max-steps", "nope"]])
def test_other_usage_errors_get_no_double_dash_hint(args):
    done = refused(*args)
    assert done.returncode == 2 and "go after --" not in done.stderr


@pytest.mark.parametrize("args, expected", [
    (["--only", ","], "the selection is empty"),
    (["--only", "init-loss", "--skip", "init-loss"], "the selection is empty"),
    (["--seed", str(2 ** 70)], "--seed must be between 0 and 2**63 - 1"),
    (["--timeout", "0"], "--timeout must be a number of seconds above 0"),
    (["--output", "/no/such/folder/report.json"], "the folder /no/such/folder does not exist"),
    (["--output", "/proc/version"], "--output /proc/version is not writable"),
])
def test_usage_errors_before_anything_runs(args, expected):
    started = time.monotonic()
    done = refused("check", f"{HOSTILE}:sleeps", *args)  # would hang if the target were loaded
    assert done.returncode == 2
    assert expected in one_line(done)
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("args, expected", [
    (["check", f"{HOSTILE}:sleeps", "--batch", str(10 ** 12)], "--batch must be at most 4,096"),
    (["check", f"{HOSTILE}:sleeps", "--budget", "1" + "0" * 400 + "GiB"], "is beyond any machine's memory"),
    (["memory", "--batch", "1", "--seq", "8", "--budget", "1" + "0" * 400 + "GiB"], "is beyond any machine's memory"),
])
def test_huge_numbers_name_their_flag(args, expected):
    done = refused(*args)
    assert done.returncode == 2 and expected in one_line(done)

# --- memory (test_memory_cli.py) ---------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["--heads", "7"],
    ["--budget", "lots"],
    ["--budget", "0GB"],
    ["--gpus", "0"],
    ["--dtype", "fp8"],
    ["--output", "/no/such/folder/memory.json"],
])
def test_usage_errors_exit_2_with_one_line(args):
    done = refused("memory", *SEED, *args)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdoctor: error:"), done.stderr
    assert "Traceback" not in done.stderr


def test_non_positive_batch_exit_2():
    done = refused("memory", "--batch", "0", "--seq", "10")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_model_shape_flags_rejected_with_a_target():
    done = refused("memory", "fixtures/gpt_correct.py:build", "--batch", "2", "--seq", "16", "--d-model", "64")
    assert done.returncode == 2 and "analytic" in done.stderr

# --- run (test_run.py) ---------------------------------------------------------------------------

def test_a_missing_script_is_one_line_and_exit_2():
    """The first row of test_run.py's bad scripts, with its assertions."""
    script, args, expected = "missing.py", [], "script not found: fixtures/scripts/missing.py"
    done = refused("run", f"{SCRIPTS}/{script}", "--format", "json", *args)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("tfdoctor:")]
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert done.stderr.splitlines()[-1] == lines[0]  # tfdoctor's line is the last one on stderr
    assert done.stdout == ""


def test_nproc_flag_out_of_range_or_under_torchrun_is_a_usage_error():
    done = refused("run", "--nproc", "0", f"{SCRIPTS}/ddp_correct.py")
    assert done.returncode == 2 and "--nproc must be at least 1" in done.stderr
    done = refused("run", "--nproc", "2", f"{SCRIPTS}/ddp_correct.py", env={"WORLD_SIZE": "2", "RANK": "0"})
    assert done.returncode == 2 and "already one rank of a job" in done.stderr


def test_usage_errors():
    done = refused("run")
    assert done.returncode == 2 and "give the script to run" in done.stderr
    done = refused("run", f"{SCRIPTS}/plain_loop.py", "--steps", "1")
    assert done.returncode == 2 and "--steps must be at least 2" in done.stderr

def test_an_unknown_packing_is_refused():
    assert refused("check", "fixtures/gpt_correct.py:build", "--packing", "bogus").returncode == 2  # test_cli.py's


# --- checks and --version (test_cli.py) -----------------------------------------------------------

def test_checks_with_an_id_prints_its_documentation():
    done = refused("checks", "mask-direction")
    assert done.returncode == 0
    assert "torch.triu(ones, diagonal=1) used as a blocked mask passes" in " ".join(done.stdout.split())
    # `checks no-such-check` exits 2: through the installed command, test_cli.py


def test_version_flag():
    from tfdoctor import __version__

    done = refused("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"tfdoctor {__version__}"


@pytest.mark.e2e
@pytest.mark.parametrize("args, said", [
    (("check", "fixtures/gpt_corect.py:build"), "did you mean fixtures/gpt_correct.py"),
    (("check", "fixtures/gpt_correct.py:bulid"), "did you mean 'build'?"),
    (("run", "fixtures/scripts/plain_lop.py"), "did you mean fixtures/scripts/plain_loop.py"),
    (("watch", "fixtures/watch/helthy.py"), "did you mean fixtures/watch/healthy.py"),
])
def test_a_mistyped_path_or_name_gets_the_nearest_one(args, said):
    done = tfdoctor(*args)
    assert done.code == 2 and done.stdout == "" and said in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_format_known_by_another_name_gets_its_name_here():
    done = refused("check", "fixtures/gpt_correct.py:build", "--format", "xml")
    assert done.code == 2 and done.stderr.strip().endswith("JUnit XML is --format junit")
    assert len(done.stderr.strip().splitlines()) == 1
