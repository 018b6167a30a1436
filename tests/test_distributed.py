"""`tfdoctor run` on a torchrun job: every rank records, rank 0 alone reports, every rank exits with
rank 0's code; and the ways a distributed run cannot be audited, each one line and exit 2, no hang.

Two gloo processes on the CPU, through the installed command (`--nproc 2`, which starts torchrun) and
through torchrun itself (`python -m torch.distributed.run ... -m tfdoctor run`)."""

import json
import os
import re
import shutil
import sys
import tempfile

import pytest

from helpers import BAR_LINE, E2E, SCRIPTS, final_screen, fresh_tfdoctor as tfdoctor, run_in_terminal

pytestmark = E2E
# The model checks are `check`'s own, tested there: here the run's plumbing and the loop and rank
# checks are what is judged.
ONLY_LOOP = ["--only", "rank-data,rank-sync,ddp-accumulation,rank-uniform,zero-grad,accumulation-scaling"]
LIMIT = 120  # a hang would fail the test here rather than stall the suite


def run(*args, launcher=None, temp=None):
    env = {"WORLD_SIZE": None, **({"TMPDIR": temp} if temp else {})}
    return tfdoctor("run", *args, launcher=launcher, env=env, timeout=LIMIT)


def error_lines(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("tfdoctor:")]


def test_nproc_runs_every_rank_and_rank_0_alone_reports_a_quiet_battery():
    done = run("--nproc", "2", f"{SCRIPTS}/ddp_correct.py", "--steps", "4", "--format", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # one JSON document: the other rank printed nothing to stdout
    facts = report["discovered"]
    assert facts["world_size"] == 2
    assert facts["wrapper"] == "DistributedDataParallel" and facts["model"] == "TinyLM"
    assert facts["steps"] == 4 and facts["ended"] == "stopped"
    assert not error_lines(done)
    statuses = {c["id"]: c["status"] for c in report["checks"]}
    # the whole battery, the rank checks judged on both ranks' digests: nothing to say on a correct job
    assert {statuses[i] for i in ("rank-data", "rank-sync", "ddp-accumulation", "rank-uniform")} == {"pass"}
    assert not [i for i, status in statuses.items() if status in ("warn", "fail", "error")], statuses


def test_every_rank_exits_with_rank_0s_code_when_it_finds_a_bug():
    done = run("--nproc", "2", f"{SCRIPTS}/ddp_rank0_clip.py", "--steps", "4", "--format", "json", *ONLY_LOOP)
    assert done.returncode == 1, done.stderr
    checks = {c["id"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["rank-uniform"]["status"] == "fail" and checks["rank-sync"]["status"] == "fail"
    assert checks["rank-uniform"]["details"]["location"].startswith("fixtures/scripts/ddp_rank0_clip.py:")
    assert not error_lines(done)


def test_under_torchrun_itself_one_report_and_the_same_exit_code():
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = run(f"{SCRIPTS}/ddp_correct.py", "--steps", "4", "--format", "json", *ONLY_LOOP, launcher=launcher)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["discovered"]["world_size"] == 2


def test_a_script_that_never_initialises_the_process_group_is_one_line():
    done = run("--nproc", "2", "tests/targets/ddp_bad_inputs.py", "--", "--case", "no-init")
    assert done.returncode == 2
    lines = error_lines(done)
    assert len(lines) == 1, done.stderr  # rank 1 finds the same and leaves the saying to rank 0
    assert "never called torch.distributed.init_process_group" in lines[0]
    assert done.stdout == ""


@pytest.mark.parametrize("case, said", [
    ("rank-killed", "rank 1 of 2: the process running your code was killed by SIGKILL"),
    ("rank-raises", "rank 1 of 2: tests/targets/ddp_bad_inputs.py raised FileNotFoundError: shard-1.bin at "
                    "tests/targets/ddp_bad_inputs.py:"),
])
def test_a_rank_that_dies_ends_the_job_with_its_line(case, said):
    done = run("--nproc", "2", "tests/targets/ddp_bad_inputs.py", "--format", "json", "--", "--case", case)
    assert done.returncode == 2
    assert any(said in line for line in error_lines(done)), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_a_rank_that_raises_after_a_step_names_the_error_and_ends_the_job_at_once():
    # rank 0 waits for rank 1 in DDP's all-reduce: it must learn of the error now, not after its
    # 300 s budget (the subprocess limit, 120 s, fails the test long before that)
    temp = tempfile.mkdtemp(prefix="tfd-")  # short: Unix socket paths are made under it
    try:
        done = run("--nproc", "2", f"{SCRIPTS}/ddp_rank1_raises_after_step.py", "--format", "json", temp=temp)
        # torchelastic's folders and the ranks' temporary files went with the job
        assert [p for p in os.listdir(temp) if not p.startswith("torchinductor_")] == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 2
    lines = error_lines(done)
    assert len(lines) == 1, done.stderr  # rank 0's broken all-reduce is a consequence: rank 1 says it
    script = f"{SCRIPTS}/ddp_rank1_raises_after_step.py"
    assert lines[0].startswith(f"tfdoctor: error: rank 1 of 2: {script} raised ValueError: corrupt shard 1 at "
                               f"row 8 at {script}:")
    assert "after 1 optimizer step(s)" in lines[0]
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_at_a_terminal_rank_0_clears_its_bar_before_the_report_and_erases_no_line_of_the_script():
    code, raw, _ = run_in_terminal("run", "--nproc", "2", f"{SCRIPTS}/ddp_correct.py", "--steps", "4",
                                   "--only", "overfit-batch,zero-grad", timeout=LIMIT)
    assert code == 0, raw[-3000:]
    assert BAR_LINE.search(raw)  # overfit-batch drew its bar
    # the bar redraws its own line only: it never moves the cursor up over lines others printed
    assert not re.search(r"\x1b\[\d*A", raw), raw[-3000:]
    for step in range(1, 4):  # rank 0 prints after each step but the 4th (stopped there): none erased
        assert re.search(rf"(^|\n)epoch \d step {step} loss \d", raw.replace("\x1b[2K", "").replace("\r", "")), raw
    report = final_screen(raw)  # after the bar's last erase: the report alone, on a clean line
    assert report.lstrip().startswith("tfdoctor ") and not BAR_LINE.search(report), report[:500]


def test_an_fsdp2_job_is_judged_on_its_trace_and_on_a_whole_copy_of_its_model():
    done = run("--nproc", "2", f"{SCRIPTS}/fsdp_correct.py", "--steps", "4", "--format", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    checks = {c["id"]: c for c in report["checks"]}
    # the rank checks compare the ranks (sharded weights are never compared), the loop checks judge
    # the trace, the model checks a copy gathered whole from the ranks' shards
    assert {checks[i]["status"] for i in ("rank-data", "rank-uniform", "zero-grad")} == {"pass"}
    assert checks["rank-sync"]["status"] == "skip" and "sharded" in checks["rank-sync"]["message"]
    assert {checks[i]["status"] for i in ("future-leak", "mask-direction", "init-loss", "overfit-batch")} == {"pass"}
    assert not [i for i, c in checks.items() if c["status"] in ("warn", "fail", "error")]
    facts = report["discovered"]
    assert facts["model"] == "TinyLM" and facts["wrapper"] == "fully_shard (FSDP2)"


def test_a_leak_in_an_fsdp2_model_is_found_on_its_gathered_copy():
    done = run("--nproc", "2", f"{SCRIPTS}/fsdp_future_leak.py", "--steps", "2", "--format", "json",
               "--only", "future-leak,mask-direction,zero-grad")
    assert done.returncode == 1, done.stderr
    checks = {c["id"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["future-leak"]["status"] == "fail" and checks["mask-direction"]["status"] == "fail"
    assert checks["zero-grad"]["status"] == "pass"


def test_one_epoch_seen_leaves_the_epoch_order_unjudged_and_says_so():
    # ddp_no_set_epoch replays its order from the second epoch on: two steps see only the first
    done = run("--nproc", "2", f"{SCRIPTS}/ddp_no_set_epoch.py", "--steps", "2", "--format", "json",
               "--only", "rank-data")
    assert done.returncode == 0, done.stderr
    (check,) = json.loads(done.stdout)["checks"]
    assert check["status"] == "pass" and "epoch order was not judged: one epoch seen" in check["message"]


def test_a_forward_that_communicates_skips_the_model_checks_and_judges_the_ranks():
    # issue 29: tensor parallelism written by hand (all_reduce inside the forward); probing the model on
    # rank 0 alone waited for the other rank until the budget ran out
    done = run("--nproc", "2", f"{SCRIPTS}/tp_correct.py", "--timeout", "240", "--format", "json")
    assert done.code == 0, done.stderr[-2000:]
    checks = done.checks
    assert checks["future-leak"]["status"] == "skip"
    assert "forward issues collectives (dist.all_reduce" in checks["future-leak"]["message"]
    assert "tp_correct.py:" in checks["future-leak"]["message"]
    assert checks["rank-data"]["status"] == "pass" and "tensor-parallel" in checks["rank-data"]["message"]
    assert checks["rank-sync"]["status"] == "pass" and checks["rank-sync"]["details"]["tensors_compared"] >= 2
    assert checks["objective"]["status"] == "pass"  # the loop checks still judge the recorded trace
