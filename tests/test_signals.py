"""The run's processes and files under signals and hostile scripts: SIGTERM and SIGHUP end a run as
Ctrl-C does (one line, every process of the run gone, exit 143 / 129), `--nproc` included (Ctrl-C is
130 there too, and nothing it opens listens beyond the loopback interface); a detached child of the
script never outlives tfdoctor; nothing is left in the temporary folder; a script that closes every
descriptor above 2 is audited (os.closerange) or ends in one line (a close below Python).

Each test waits for the script's own marker file (written once its processes are started) before it
signals, never for a fixed time."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import psutil
import pytest

from helpers import start as start_command

HANGS = "fixtures/scripts/hangs_in_loop.py"
CLOSES = "fixtures/scripts/closes_fds.py"
LIMIT = 180  # a hang fails the test here rather than stalling the suite
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


@pytest.fixture(autouse=True)
def short_tmp(tmp_path):
    """A temporary folder with a short path, as /tmp is: pytest's own are long, and multiprocessing's
    Unix sockets under the run's folders must stay within 107 bytes."""
    folder = tempfile.mkdtemp(prefix="tfs-")
    (tmp_path / "tmp").symlink_to(folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def start(tmp_path, *args, marker=None):
    """`tfdoctor ARGS` with a temporary folder of its own (TMPDIR), to see what it leaves there. The
    script writes `marker` (named in the environment: a folder its arguments named would be protected
    by tfdoctor's sandbox, and what the script writes there thrown away)."""
    temp = os.path.realpath(tmp_path / "tmp")
    env = {"TMPDIR": temp, "WORLD_SIZE": None, **({"MARKER": marker} if marker else {})}
    return start_command(*args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc, *paths):
    deadline = time.monotonic() + LIMIT
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the script never reached its marker"
        time.sleep(0.05)
    return [json.loads(p.read_text()) for p in paths]


def pids_of(markers) -> list[int]:
    return [pid for m in markers for pid in (m["script"], m["detached"], *m["workers"])]


def gone(pids) -> bool:
    """Every process ended: none left, or only zombies about to be reaped."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and _status(pid) != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _status(pid):
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return psutil.STATUS_ZOMBIE


def left_behind(tmp_path) -> list[str]:
    """What the run left in its temporary folder (torch's own caches, meant to be kept, aside)."""
    return [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")]


def tfdoctor_lines(err: str) -> list[str]:
    lines = [line for line in err.splitlines() if line.startswith("tfdoctor:")]
    assert "Traceback" not in err, err
    return lines


@pytest.mark.e2e
@pytest.mark.parametrize("signum, code, said", [
    (signal.SIGTERM, 143, "tfdoctor: terminated (SIGTERM) during running the script up to its last recorded step"),
    (signal.SIGHUP, 129, "tfdoctor: hung up (SIGHUP) during running the script up to its last recorded step"),
])
def test_sigterm_and_sighup_end_every_process_of_the_run_with_one_line(tmp_path, signum, code, said):
    marker = tmp_path / "started"
    proc = start(tmp_path, "run", HANGS, "--", marker=marker)
    pids = pids_of(wait_for(proc, marker))
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=LIMIT)
    assert proc.returncode == code, err
    assert tfdoctor_lines(err) == [said] and out == ""
    assert gone(pids)  # the worker, its 2 DataLoader workers and the child it detached
    assert not left_behind(tmp_path)  # the stack dump file went too


@pytest.mark.e2e
def test_a_detached_child_does_not_outlive_a_finished_run(tmp_path):
    marker = tmp_path / "started"
    proc = start(tmp_path, "run", HANGS, "--only", "zero-grad", "--format", "json", "--",
                 "--then", "train", "--workers", "0", marker=marker)
    out, err = proc.communicate(timeout=LIMIT)
    assert proc.returncode == 0, err
    assert json.loads(out)["checks"][0]["id"] == "zero-grad"
    (started,) = wait_for(proc, marker)
    assert gone([started["detached"]])
    assert not left_behind(tmp_path)


@pytest.mark.e2e
def test_ctrl_c_under_nproc_ends_every_rank_with_one_line_and_listens_on_loopback_only(tmp_path):
    marker = tmp_path / "started"
    proc = start(tmp_path, "run", "--nproc", "2", HANGS, "--", marker=marker)
    markers = wait_for(proc, tmp_path / "started.0", tmp_path / "started.1")
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    listening = []
    for member in family:
        try:
            listening += [c.laddr for c in member.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    assert listening  # torchrun's stores, gloo's pairs
    assert all(address.ip in LOOPBACK for address in listening), listening
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=LIMIT)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["tfdoctor: interrupted (Ctrl-C) while the 2 ranks ran"], err
    assert out == ""
    assert gone(pids_of(markers))
    assert not left_behind(tmp_path)  # torchelastic's folders and the ranks' files


@pytest.mark.e2e
def test_closing_descriptors_with_os_closerange_leaves_tfdoctors_pipe_alone(tmp_path):
    proc = start(tmp_path, "run", CLOSES, "--only", "zero-grad", "--format", "json", "--", "--how", "os",
                 "--then", "train")
    out, err = proc.communicate(timeout=LIMIT)
    assert proc.returncode == 0, err
    assert [c["status"] for c in json.loads(out)["checks"]] == ["pass"]


@pytest.mark.e2e
def test_closing_descriptors_below_python_then_training_is_one_line(tmp_path):
    proc = start(tmp_path, "run", CLOSES, "--only", "zero-grad", "--", "--how", "libc", "--then", "train")
    out, err = proc.communicate(timeout=LIMIT)
    assert proc.returncode == 2
    (line,) = tfdoctor_lines(err)
    assert "your code closed tfdoctor's report pipe" in line and out == ""


@pytest.mark.e2e
def test_closing_descriptors_below_python_then_hanging_is_stopped_by_the_budget(tmp_path):
    marker = tmp_path / "closed"
    proc = start(tmp_path, "run", CLOSES, "--timeout-per-check", "10", "--", "--how", "libc", "--then", "hang",
                 marker=marker)
    out, err = proc.communicate(timeout=LIMIT)
    assert proc.returncode == 2
    (line,) = tfdoctor_lines(err)
    assert "running the script up to its last recorded step ran past its 10 s budget" in line
    assert marker.exists()  # the descriptors were closed before the budget ran out


def test_a_stopping_signal_gives_its_shell_exit_code_and_its_line():
    from tfdoctor.process.signals import Stopped, is_stop_code

    assert (Stopped(signal.SIGTERM).code, Stopped(signal.SIGHUP).code, Stopped(signal.SIGINT).code) == (143, 129, 130)
    assert str(Stopped(signal.SIGHUP)) == "hung up (SIGHUP)" and isinstance(Stopped(signal.SIGTERM), KeyboardInterrupt)
    assert is_stop_code(143) and is_stop_code(-signal.SIGTERM) and is_stop_code(130)
    assert not is_stop_code(1) and not is_stop_code(2) and not is_stop_code(-signal.SIGKILL)


class _Failure:  # torchrun's ProcessFailure, as much of it as the job's code reads
    def __init__(self, exitcode):
        self.exitcode = exitcode

    def signal_name(self):
        return signal.Signals(-self.exitcode).name


def test_a_rank_torchrun_stopped_after_another_failed_is_not_the_jobs_code():
    from tfdoctor.process.launch import _job_code

    # rank 1 failed (2); torchrun then stopped rank 0, whose tfdoctor exits 143 on SIGTERM
    assert _job_code({0: _Failure(143), 1: _Failure(2)}, 2) == 2
    assert _job_code({0: _Failure(1), 1: _Failure(-signal.SIGTERM)}, 2) == 1
