"""The user's code runs in a supervised worker: hangs, exits and prints end in one clear line and
exit 2 (or a clean report), never a hang and never a silent exit 0."""

import json
import os
import signal
import subprocess
import time
import xml.etree.ElementTree as ET

import pytest

from helpers import E2E, ROOT, command_line, tfdoctor

pytestmark = E2E
HOSTILE = "tests/targets/hostile.py"
QUICK = ["--only", "init-loss,future-leak"]


def run(*args, timeout=120):
    return tfdoctor(*args, timeout=timeout)


def one_line(done) -> str:
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("tfdoctor:")]
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


@pytest.mark.parametrize("target, expected", [
    ("sleeps", "loading the target (import, factory, training loop) ran past its 2 s budget "
               "(--timeout-per-check); it was at tests/targets/hostile.py:"),
    ("blocks_in_forward", "check future-leak ran past its 2 s budget (--timeout-per-check); it was at "
                          "tests/targets/hostile.py:"),
])
def test_a_hang_ends_in_one_line_naming_the_users_frame(target, expected):
    done = run("check", f"{HOSTILE}:{target}", "--timeout-per-check", "2", *QUICK)
    assert done.returncode == 2
    assert expected in one_line(done)
    assert done.seconds < 30


def test_the_run_budget_covers_the_whole_battery():
    done = run("check", f"{HOSTILE}:blocks_in_forward", "--timeout", "3", *QUICK)
    assert done.returncode == 2
    assert "the run ran past its 3 s budget (--timeout), during check future-leak" in one_line(done)


def test_a_loop_that_never_returns_keeps_the_finished_checks():
    done = run("check", "fixtures/gpt_correct.py:build", "--train", f"{HOSTILE}:train_forever",
               "--timeout-per-check", "2", "--only", "init-loss,future-leak,overfit-batch", "--format", "json")
    assert done.returncode == 2
    report = json.loads(done.stdout)
    statuses = {c["id"]: c["status"] for c in report["checks"]}
    assert statuses == {"future-leak": "pass", "init-loss": "pass", "overfit-batch": "error"}
    assert "train_forever" in report["stopped"] and "train_forever" in one_line(done)


def test_threads_left_running_do_not_keep_tfdoctor_alive():
    done = run("check", f"{HOSTILE}:starts_a_thread", *QUICK, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("args, expected", [
    (["check", f"{HOSTILE}:exits_0"], "your code called sys.exit(0) at tests/targets/hostile.py:"),
    (["check", "tests/targets/exits_at_import.py:build"],
     "your code called sys.exit(3) at tests/targets/exits_at_import.py:5 in <module> during loading the target"),
    (["check", f"{HOSTILE}:exits_hard"], "the process running your code exited with code 0 (os._exit"),
    (["check", "fixtures/gpt_correct.py:build", "--train", f"{HOSTILE}:train_exits", "--only", "overfit-batch"],
     "your code called sys.exit(0) at tests/targets/hostile.py:"),
])
def test_an_exit_in_user_code_is_never_a_silent_green(args, expected):
    done = run(*args)
    assert done.returncode == 2
    assert expected in one_line(done)


def test_the_users_prints_go_to_stderr_and_json_stays_parseable():
    done = run("check", f"{HOSTILE}:chatty", *QUICK, "--format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["pass"] == 2
    assert "number of parameters" in done.stderr and "raw write to fd 1" in done.stderr


def test_junit_on_stdout_stays_parseable_with_a_chatty_loop():
    done = run("check", "fixtures/gpt_correct.py:build", "--train", f"{HOSTILE}:chatty_train",
               "--only", "zero-grad,init-loss", "--format", "junit")
    assert done.returncode == 0, done.stderr
    ET.fromstring(done.stdout)
    assert "step 0 loss" in done.stderr


def test_ctrl_c_exits_130_with_one_line():
    proc = subprocess.Popen(command_line("check", f"{HOSTILE}:sleeps"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(6)  # well inside the factory's sleep, however slowly a fresh environment starts
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == ("tfdoctor: interrupted (Ctrl-C) during loading the target (import, "
                                            "factory, training loop)")


@pytest.mark.parametrize("target, expected", [
    ("complex_logits", "the model returns complex64 logits, and cross-entropy needs real ones"),
    ("integer_logits", "the model returns int64 logits (ids or a decision"),
    ("bool_logits", "the model returns bool logits"),
    ("vocab_1", "a vocabulary of 1 token leaves nothing to predict"),
    ("on_meta", "the model is on the meta device"),
])
def test_logits_no_check_could_judge_get_one_named_diagnosis(target, expected):
    done = run("check", f"{HOSTILE}:{target}", *QUICK)
    assert done.returncode == 2
    assert expected in one_line(done)


def test_meta_device_flag_is_one_line():
    done = run("check", "fixtures/gpt_correct.py:build", "--device", "meta", *QUICK)
    assert done.returncode == 2 and "the model is on the meta device" in one_line(done)


def test_a_float64_default_dtype_does_not_break_the_loop_audits():
    done = run("check", f"{HOSTILE}:float64_default", "--train", "fixtures/loops/correct.py:train",
               "--only", "zero-grad,accumulation-scaling,grad-health", "--format", "json")
    report = json.loads(done.stdout)
    assert report["summary"]["error"] == 0, report


def test_memory_names_the_users_line_when_fake_tensors_cannot_follow_it():
    done = run("memory", f"{HOSTILE}:reads_a_value", "--batch", "2", "--seq", "16")
    assert done.returncode == 2
    line = one_line(done)
    assert "the forward at tests/targets/hostile.py:" in line and "reads a tensor's value (.item()" in line
    assert "internal error" not in line


def test_memory_traces_a_model_built_on_the_meta_device():
    done = run("memory", f"{HOSTILE}:on_meta", "--batch", "2", "--seq", "16", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fits"] is True


@pytest.mark.parametrize("target, status, expected", [
    ("grad_off", "fail", "the forward turns autograd off"),
    ("detached_logits", "fail", "detaches the logits"),
    ("vocab_2", "skip", "a vocabulary of 2 tokens"),
])
def test_overfit_batch_names_what_it_cannot_train(target, status, expected):
    done = run("check", f"{HOSTILE}:{target}", "--only", "overfit-batch", "--format", "json")
    (check,) = json.loads(done.stdout)["checks"]
    assert (check["status"], expected in check["message"]) == (status, True), check


def test_the_worker_dies_with_its_supervisor():
    proc = subprocess.Popen(command_line("check", f"{HOSTILE}:sleeps"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        worker = None
        while worker is None and time.monotonic() < deadline:
            children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            worker = int(children[0]) if children else None
            time.sleep(0.2)
        assert worker is not None
        proc.kill()  # SIGKILL: the supervisor gets no chance to clean up
        proc.wait(timeout=10)
        for _ in range(50):
            if subprocess.run(["ps", "-p", str(worker)], capture_output=True).returncode != 0:
                break
            time.sleep(0.1)
        assert subprocess.run(["ps", "-p", str(worker)], capture_output=True).returncode != 0
    finally:
        proc.kill()


def test_memory_target_runs_supervised_too():
    done = run("memory", f"{HOSTILE}:exits_0", "--batch", "2", "--seq", "16")
    assert done.returncode == 2
    assert "your code called sys.exit(0)" in one_line(done) and "tracing one training step" in one_line(done)
    chatty = run("memory", f"{HOSTILE}:chatty", "--batch", "2", "--seq", "16", "--format", "json")
    assert chatty.returncode == 0 and json.loads(chatty.stdout)["fits"] is True
    assert "number of parameters" in chatty.stderr


def test_a_child_process_holding_the_pipe_does_not_delay_the_report():
    done = run("check", f"{HOSTILE}:forks_a_lingering_child", *QUICK, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.seconds < 40


def test_a_library_frame_in_site_packages_is_never_named_as_the_users_line():
    """The stack dump names the user's innermost frame with the recorder's own test (sites.is_library):
    a budget that runs out inside transformers or Lightning, with no user frame on the stack, names
    nothing rather than the library's line; with one, names the user's."""
    from tfdoctor.process.supervisor import user_frame

    library = "/venv/lib/python3.11/site-packages/transformers/trainer.py"
    dump = (f'Current thread 0x00000000000000ab (most recent call first):\n'
            f'  File "{library}", line 2300 in train\n'
            f'  File "/venv/lib/python3.11/dist-packages/lightning/fit.py", line 9 in fit\n\n')
    assert user_frame(dump, 0xab) == ""
    user = os.path.join(os.getcwd(), "train_user_script.py")
    with_user = dump.replace("\n\n", f'\n  File "{user}", line 12 in main\n\n')
    assert user_frame(with_user, 0xab) == "train_user_script.py:12 in main"


def test_script_arguments_past_the_environments_128_kib_reach_the_script_whole():
    # The worker's request carries the script's arguments; in one environment string it met Linux's
    # 128 KiB cap and the worker never started. A fresh interpreter: only an exec'd worker meets the cap.
    shards = [f"/datasets/openwebtext-2024/tokenized/gpt2-bpe/train-0/shard-{i:06d}-of-003000.bin"
              for i in range(3000)]
    assert len(shards[0]) == 80 and sum(map(len, shards)) > 200 * 1024
    done = tfdoctor("watch", "fixtures/watch/many_shards.py", "--format", "json", "--", *shards, "--steps", "4",
                    fresh=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"3000 shards, {sum(map(len, shards))} characters of paths" in done.stderr
    assert done.json["discovered"]["steps"] == 4
