"""The suite's pytest fixtures (helpers live in tests/helpers.py, importable through pyproject's
`pythonpath`; no test imports this file)."""

import fcntl
import hashlib
import os
import pickle
from pathlib import Path

# Under pytest-xdist the workers share the cores: one intra-op thread per process (each worker and
# every tfdoctor process it starts inherits this) keeps OpenMP threads from spinning against each
# other; set before torch is first imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from helpers import audit_loop, checks_on, run_ranks, tfdoctor


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)


def _session_folder(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this session shares (the workers' temporary folders sit in
    it); this session's own one without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once_per_session(path: Path, make):
    """make()'s value (plain, picklable data), made by the first worker to ask and read back from `path`
    by the others, which wait on a lock meanwhile: a run the tests of two workers share is made once."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = path.with_suffix(".pickle")
        if made.exists():
            return pickle.loads(made.read_bytes())
        value = make()
        made.write_bytes(pickle.dumps(value))
        return value


@pytest.fixture(scope="session")
def shared_tfdoctor(tmp_path_factory):
    """helpers.tfdoctor, run once per distinct command (arguments, folder and environment) in the whole
    session, whichever worker asks: the README's examples, the CLI tests and the `run` tests that give
    the same command share its one process and assert on the same Done. For commands that write nowhere
    the test reads back."""
    folder, done = _session_folder(tmp_path_factory), {}

    def run(*args, **options):
        key = (args, repr(sorted(options.items())))
        if key not in done:
            digest = hashlib.sha1(repr(key).encode()).hexdigest()[:16]
            done[key] = _once_per_session(folder / f"command-{digest}", lambda: tfdoctor(*args, **options))
        return done[key]

    return run


@pytest.fixture(scope="session")
def loop_audit():
    """audit(loop): the train checks' Report on a loop of fixtures/loops/, run once per loop in the session
    and shared by test_trainloop's matrix, its tests of evidence and the catalogue."""
    reports = {}

    def audit(loop: str):
        if loop not in reports:
            reports[loop] = audit_loop(loop)
        return reports[loop]

    return audit


@pytest.fixture(scope="session")
def rank_digests(tmp_path_factory):
    """digests(name): both ranks' digests of fixtures/scripts/ddp_NAME.py, run once on 2 ranks in the
    session, whichever worker asks (tests/test_ranks.py, the catalogue)."""
    folder, cache = _session_folder(tmp_path_factory), {}

    def get(name: str) -> list:
        if name not in cache:
            cache[name] = _once_per_session(
                folder / f"ranks-{name}",
                lambda: run_ranks(f"fixtures/scripts/ddp_{name}.py", tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def watch_audit(tmp_path_factory):
    """audit(name, *args): the Report of a watched run of fixtures/watch/NAME.py with ARGS (the command,
    --format json), made once per session whichever worker asks first.
    `RunSeries.from_dict(report.series)` is the run's series, `report.script_output` what it printed."""
    folder, cache = _session_folder(tmp_path_factory), {}

    def audit(name: str, *args: str):
        key = (name, *args)
        if key not in cache:
            cache[key] = _once_per_session(folder / ("watch-" + "-".join(key).replace("/", "_")),
                                           lambda: watched(name, *args))
        return cache[key]

    return audit


MEMORY_RUNS = {"slow_leak", "leaky_total_loss", "healthy_stairs"}  # judged on their process's memory curve


def watched(name: str, *args: str):
    """`tfdoctor watch fixtures/watch/NAME.py -- ARGS --format json` as a Report: a process of its own,
    as a user runs it (a run's memory curve is its own process's, not a test worker's reused heap)."""
    import json

    from tfdoctor.result import Report, Result

    # The memory fixtures in a fresh interpreter, as a user starts them: forked from the preloaded one, the
    # run's RSS once jumped 26 MiB in one window and read as no steady rise (slow_leak.py, under load).
    done = tfdoctor("watch", f"fixtures/watch/{name}.py", "--format", "json", *(("--", *args) if args else ()),
                    fresh=name in MEMORY_RUNS)
    assert done.code in (0, 1), done.stderr[-3000:]
    data = json.loads(done.stdout)
    report = Report(data["target"], [Result.from_dict(check) for check in data["checks"]],
                    discovered=data.get("discovered", {}), series=data["series"])
    report.script_output = done.stderr  # what the script printed (watch passes it to stderr)
    return report


@pytest.fixture(scope="session")
def checks_report():
    """report(fixture, only, train=None, **fields): run_checks on build_fixture(fixture) with these check
    ids (`train` names a loop of fixtures/loops/), run once per distinct call in the session and shared
    by the family's table (tests/test_masking.py, ...) and the catalogue (tests/test_catalogue.py)."""
    reports = {}

    def report(fixture: str, only, train=None, **fields):
        key = (fixture, tuple(only), train, repr(sorted(fields.items())))
        if key not in reports:
            reports[key] = checks_on(fixture, only, train, **fields)
        return reports[key]

    return report
