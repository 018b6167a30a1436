"""What the tests share that is not a pytest fixture (those are in conftest.py): the repository's paths, a
fixture model by name, the one way to run the `tfdoctor` command and read what it said (a child process:
tfdoctor() -> Done, start, run_in_terminal; this process, for what it refuses before it starts anything:
refused), and the runs conftest's session fixtures share (a model's checks, a loop of the matrix, a 2-rank
run of a DDP script)."""

import importlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
SCRIPTS = "fixtures/scripts"  # relative to ROOT, as the command is given it and names it back


def _installed_command() -> list:
    """The `tfdoctor` command of the interpreter running the tests: the script pip installed beside it (a
    virtual environment's bin/, which is on PATH only when the environment is activated: an IDE or a CI
    step runs `.venv/bin/python -m pytest` without activating it), else `python -m tfdoctor`."""
    beside = os.path.join(os.path.dirname(sys.executable), "tfdoctor")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return [beside]
    return [sys.executable, "-m", "tfdoctor"]


COMMAND = _installed_command()
# A test that starts a tfdoctor process is marked `e2e`, so that `python -m pytest -m "not e2e"` is the fast
# inner loop.
E2E = [pytest.mark.e2e]  # a spawning module's pytestmark


def build_fixture(name: str):
    """The model a fixture's build() returns, as `tfdoctor check fixtures/NAME.py:build` would load it."""
    return importlib.import_module(name).build()


@dataclass
class Done:
    """One finished `tfdoctor` process: its exit code, both streams and how long it took."""

    code: int
    stdout: str
    stderr: str
    seconds: float = 0.0
    _json: object = field(default=None, repr=False)

    @property
    def returncode(self) -> int:  # subprocess's name, so a Done reads like a CompletedProcess
        return self.code

    @property
    def json(self):
        """stdout parsed as one JSON document (the report under --format json)."""
        if self._json is None:
            self._json = json.loads(self.stdout)
        return self._json

    @property
    def checks(self) -> dict:
        """check id -> the report's entry for it."""
        return {c["id"]: c for c in self.json["checks"]}

    def by_id(self, check_id: str) -> dict:
        return self.checks[check_id]

    @property
    def statuses(self) -> dict:
        return {c["id"]: c["status"] for c in self.json["checks"]}

    @property
    def problems(self) -> list:
        """(id, status, message) of every check that did not pass or skip."""
        return [(c["id"], c["status"], c["message"]) for c in self.json["checks"]
                if c["status"] in ("fail", "error", "warn")]

    @property
    def error_lines(self) -> list:
        """stderr's lines that tfdoctor itself wrote (`tfdoctor: ...`)."""
        return [line for line in self.stderr.splitlines() if line.startswith("tfdoctor:")]


def command_env(env=None) -> dict:
    """This process's environment for a tfdoctor process, with a wide "terminal" so that phrases
    asserted on are not wrapped across table lines; `env` entries are added (None removes one)."""
    merged = {**os.environ, "COLUMNS": "200"}
    for name, value in (env or {}).items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = str(value)
    return merged


def command_line(*args, module=False, launcher=None) -> list:
    """The installed command (COMMAND; `python -m tfdoctor` with module=True; `[*launcher, "-m", "tfdoctor"]`
    under a launcher such as torchrun) and its arguments."""
    if launcher is not None:
        return [*launcher, "-m", "tfdoctor", *args]
    return [sys.executable, "-m", "tfdoctor", *args] if module else [*COMMAND, *args]


def tfdoctor(*args, cwd=ROOT, timeout=300, env=None, module=False, launcher=None, input=None, text=True,
             fresh=False) -> Done:
    """Run tfdoctor ARGS to its end (see command_env and command_line); text=False keeps both streams
    as bytes, for a test of how they are encoded.

    The installed command in a fresh interpreter where `fresh` (the tests of the command itself: its
    start, its modules, its processes and signals), under a launcher, as `python -m tfdoctor`, or with an
    environment that an interpreter reads as it starts. Otherwise the same command forked from the
    preloaded process (tests/zygote.py), whose worker is forked in turn: the same code from main() on,
    without 2-3 s of imports twice per run."""
    started = time.monotonic()
    if fresh or module or launcher is not None or not _preloadable(args, env):
        done = subprocess.run(command_line(*args, module=module, launcher=launcher), cwd=cwd,
                              capture_output=True, text=text, timeout=timeout, env=command_env(env), input=input)
        return Done(done.returncode, done.stdout, done.stderr, time.monotonic() - started)
    # sys.argv as the command sees it: the script's path, or (as `python -m tfdoctor`) no folder of its own
    argv = [COMMAND[0] if len(COMMAND) == 1 else "tfdoctor", *args]
    code, stdout, stderr = preloaded().run(argv, cwd, command_env(env), input, timeout)
    if text:
        stdout, stderr = (stream.decode("utf-8", "replace") for stream in (stdout, stderr))
    return Done(code, stdout, stderr, time.monotonic() - started)


def fresh_tfdoctor(*args, **options) -> Done:
    """tfdoctor(ARGS) in a fresh interpreter, as a user starts it."""
    return tfdoctor(*args, fresh=True, **options)


# What an interpreter (or torch, as it is imported) reads from the environment when it starts: a command
# given one of these is run fresh.
STARTUP_ENV = ("PYTHON", "TORCH", "OMP_", "MKL_", "LD_", "CUDA", "KMP_")


def _preloadable(args, env) -> bool:
    """Not `--nproc`: its ranks are fresh interpreters started by torchrun, which misjudges a job
    launched from a forked process (a rank exits 2 and says nothing)."""
    return (hasattr(os, "fork") and not any(name.startswith(STARTUP_ENV) for name in env or {})
            and not any(str(arg).startswith("--nproc") for arg in args))


class Preloaded:
    """The client of one tests/zygote.py process (one per pytest process, started on first use)."""

    def __init__(self) -> None:
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="tfdoctor-zygote-")
        reply_read, reply_write = os.pipe()
        self.log = open(os.path.join(self.folder, "zygote.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py"), str(reply_write)],
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=self.log,
                                     pass_fds=(reply_write,), cwd=ROOT, env=command_env())
        os.close(reply_write)
        self.replies = os.fdopen(reply_read, "r", buffering=1)
        self.count = 0

    def run(self, argv: list, cwd, env: dict, input, timeout: float):
        self.count += 1
        paths = {name: os.path.join(self.folder, f"{self.count}.{name}") for name in ("stdin", "stdout", "stderr")}
        with open(paths["stdin"], "wb") as stdin:
            stdin.write(input.encode() if isinstance(input, str) else input or b"")
        for name in ("stdout", "stderr"):
            open(paths[name], "wb").close()
        request = {"argv": argv, "cwd": str(cwd), "env": env, **paths}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._reply(60)["pid"]
        try:
            code = self._reply(timeout)["code"]
        except subprocess.TimeoutExpired:
            os.kill(pid, 9)  # as subprocess.run does on its timeout
            self._reply(60)
            raise subprocess.TimeoutExpired(argv, timeout) from None
        streams = []
        for name in ("stdout", "stderr"):
            with open(paths[name], "rb") as stream:
                streams.append(stream.read())
        for path in paths.values():
            os.unlink(path)
        return code, *streams

    def _reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.replies], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired("zygote", timeout)
        line = self.replies.readline()
        if not line:
            self.log.flush()
            with open(self.log.name) as said:
                raise RuntimeError(f"tests/zygote.py ended: {said.read()[-2000:]}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.folder, ignore_errors=True)


_preloaded: list = []


def preloaded() -> Preloaded:
    if not _preloaded:
        import atexit

        _preloaded.append(Preloaded())
        atexit.register(_preloaded[0].close)
    return _preloaded[0]


def start(*args, cwd=ROOT, env=None, **popen) -> subprocess.Popen:
    """Start tfdoctor ARGS and return at once, for a test that signals it or watches its processes."""
    return subprocess.Popen(command_line(*args), cwd=cwd, env=command_env(env), **popen)


# --- under a pseudo-terminal, as a user runs it at a prompt --------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
# A bar line: "overfit-batch ━━━━━━╸━━━ 12/300 0:00:01" (description, bar, MofN, elapsed).
BAR_LINE = re.compile(r"\d+/\d+ \d+:\d\d:\d\d")


def run_in_terminal(*args, stdout_is_terminal=True, timeout=300):
    """Run `tfdoctor ARGS` with stderr (and stdout unless told otherwise) on a pseudo-terminal.

    Returns (exit code, what the terminal received, what a stdout pipe received or None)."""
    import pty

    leader, follower = pty.openpty()
    env = command_env({"LINES": "50", "TERM": "xterm-256color", "NO_COLOR": None})
    out = follower if stdout_is_terminal else subprocess.PIPE
    proc = subprocess.Popen(command_line(*args), cwd=ROOT, stdin=follower, stdout=out, stderr=follower, env=env)
    os.close(follower)
    screen = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the follower side closed: the process is gone
                break
            if not chunk:
                break
            screen += chunk
        elif proc.poll() is not None:
            break
    piped = proc.stdout.read().decode() if proc.stdout else None
    code = proc.wait(timeout=30)
    os.close(leader)
    return code, screen.decode("utf-8", "replace"), piped


def final_screen(raw: str) -> str:
    """What is left to read once the transient bar has erased itself: the text after the last
    erase-line sequence the bar sent, without colour codes."""
    cut = raw.rfind("\x1b[2K")
    tail = raw[cut:] if cut >= 0 else raw
    return ANSI.sub("", tail)


# --- the loop matrix: the train checks on one loop of fixtures/loops/ (tests/test_trainloop.py) ---------

TRAIN_IDS = ["objective", "ignore-index", "unscale-before-clip", "accumulation-scaling", "scheduler-placement",
             "zero-grad", "clip-global-norm", "lr-schedule", "amp-loss-scaling", "grad-health", "optimizer-coverage",
             "trained-in-eval"]
PAD_ID = 0  # the pad id every loop fixture was written for
# The model each family of loops trains (by file-name prefix; the fixture GPT otherwise), and the
# pad id a loop was written for when it is not PAD_ID.
MODEL_OF = {"fused_head": "fused_head_gpt", "hf_": "hf_gpt2", "annotated_": "annotated_model", "xt_": "xt_decoder",
            "time_major": "time_major_lm", "loss_only": "gpt_returns_loss"}
PAD_OF = {"hf_eos_as_pad": 1, "hf_eos_as_pad_twice": 1, "hf_eos_masked_as_pad": 1}  # hf_gpt2's eos id


def model_for(loop: str):
    return build_fixture(next((m for prefix, m in MODEL_OF.items() if loop.startswith(prefix)), "gpt_correct"))


def train_fn(loop: str):
    from tfdoctor.loader import load_function

    return load_function(str(FIXTURES / "loops" / f"{loop}.py") + ":train")


def audit_loop(loop: str):
    """The train checks' Report on one loop fixture (conftest's loop_audit runs it once per session)."""
    import torch

    from tfdoctor import run_checks

    torch.manual_seed(0)
    return run_checks(model_for(loop), only=TRAIN_IDS, pad_id=PAD_OF.get(loop, PAD_ID), train=train_fn(loop))


# --- the rank checks on real 2-process gloo runs of fixtures/scripts/ddp_*.py (tests/test_ranks.py) ------

RANK_STEPS = 4  # two epochs of the fixtures' 2 steps each
WORLD = 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, out: Path) -> list:
    """Both ranks' digests of `script`, rank 0 first: each rank a process with torchrun's environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) under tests/rank_worker.py."""
    import pickle

    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "rank_worker.py"), script, str(out),
                                       str(RANK_STEPS)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    gathered = [pickle.loads((out / f"rank{rank}.pkl").read_bytes()) for rank in range(WORLD)]
    assert [g["ended"] for g in gathered] == ["stopped"] * WORLD
    return [g["digest"] for g in gathered]


def rank_checks() -> dict:
    """check id -> the rank check's function."""
    from tfdoctor.checks.ranks import ddp_accumulation, rank_data, rank_equivalence, rank_sync, rank_uniform

    return {"rank-data": rank_data, "rank-sync": rank_sync, "ddp-accumulation": ddp_accumulation,
            "rank-uniform": rank_uniform, "rank-equivalence": rank_equivalence}


def trace_of(ranks: list):
    """A Trace holding only these ranks' digests, as rank 0 hands them to the judges."""
    from tfdoctor.recording.trace import Trace

    return Trace([], 0, [], [], [], 0, ranks=ranks)


def rank_subject():
    """The subject the rank judges are handed beside the trace: they read only the trace."""
    import torch

    from tfdoctor.subject import Subject

    return Subject(torch.nn.Linear(2, 2), vocab_size=50)


def judge_ranks(ranks: list) -> dict:
    """check id -> Result of every rank check on these digests: a judge is a function of (subject,
    trace), called on a hand-built Trace with no loop and no recorder."""
    subject, trace = rank_subject(), trace_of(ranks)
    return {check_id: func(subject, trace) for check_id, func in rank_checks().items()}


def checks_on(fixture: str, only, train=None, **fields):
    """run_checks(build_fixture(fixture), only=list(only), train=the loop named `train`, **fields), from
    the seed every test starts with (conftest's checks_report runs it once per session)."""
    import torch

    from tfdoctor import run_checks

    torch.manual_seed(0)
    loop = train_fn(train) if train else None
    return run_checks(build_fixture(fixture), only=list(only), **({"train": loop} if loop else {}), **fields)


# --- the command in this process, for what it refuses before it starts anything -------------------------

class Spawned(AssertionError):
    """The command tried to start a process: the case is not one refused before anything runs."""


def refused(*args, columns: int = 200, env=None) -> Done:
    """`tfdoctor ARGS` run by the CLI's own entry point in this process, for a usage error the command
    refuses before it starts its worker (no interpreter start-up, no torch import: milliseconds). Both
    streams and the exit code as from the installed command; raises Spawned if the command would start
    a process, so a case that needs the worker cannot pass here by accident."""
    import contextlib
    import io
    from unittest import mock

    from tfdoctor import cli

    def no_process(*_, **__):
        raise Spawned(f"tfdoctor {' '.join(args)} started a process")

    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    with mock.patch.object(sys, "argv", ["tfdoctor", *args]), \
            mock.patch.dict(os.environ, {"COLUMNS": str(columns), **(env or {})}), \
            mock.patch.object(subprocess, "Popen", no_process), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    if "UnsupportedOperation: fileno" in err.getvalue():  # the supervisor handing its stderr to a worker
        raise Spawned(f"tfdoctor {' '.join(args)} started its worker: {err.getvalue().strip()}")
    return Done(code, out.getvalue(), err.getvalue(), time.monotonic() - started)
