"""The user's files are sacred (tfdoctor/process/sandbox): while tfdoctor runs the user's code, a checksum of the
user's folder is the same before and after, whatever the code writes, and the report names the writes.

One spawned run per mechanism exercises every kind of write at once (fixtures/scripts/writes_everywhere.py
reads each write back, so a run that exits 0 also shows the script saw its own writes); the overlay run
is skipped where this machine forbids unprivileged user namespaces."""

import hashlib
import json
import os
import subprocess
import sys
import tempfile

import pytest

from helpers import ROOT, tfdoctor as run
from tfdoctor.usercode.environment import KEEP_WRITES, SANDBOX

SCRIPT = ROOT / "fixtures" / "scripts" / "writes_everywhere.py"
USER_FILES = {"ckpt.pt": b"the user's trained weights", "results.csv": b"step,loss\n0,9.9\n",
              "notes.txt": b"my notes\n", "old.txt": b"old\n", "rename_me.txt": b"keep my name\n",
              "out/a.txt": b"a\n", "out/sub/b.txt": b"b\n"}
WRITTEN = {"ckpt.pt", "results.csv", "arrays.npy", "notes.txt", "renamed.txt", "touched.txt", "out/fresh.txt",
           "out/worker-fork.txt", "out/worker-spawn.txt"}


def make_user_folder(folder):
    import numpy as np

    for name, content in USER_FILES.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    np.save(folder / "arrays.npy", np.arange(7))


def checksums(folder) -> dict:
    """Every file and folder under `folder`: path -> content hash (folders: 'dir')."""
    sums = {}
    for where, dirs, files in os.walk(folder):
        for name in dirs:
            sums[os.path.relpath(os.path.join(where, name), folder)] = "dir"
        for name in files:
            path = os.path.join(where, name)
            sums[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return sums


def overlay_refused() -> str:
    """Why this machine has no overlay for an unprivileged process ('' when it has one)."""
    with tempfile.TemporaryDirectory() as lower, tempfile.TemporaryDirectory() as scratch:
        probe = subprocess.run([sys.executable, "-c", "import sys; from tfdoctor.process.sandbox import overlay; "
                                "overlay.enter([sys.argv[1]], sys.argv[2])", lower, scratch],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


def tfdoctor(args, cwd, tmp, **env):
    # from the user's folder, which is not the repository: this tree's tfdoctor on the path
    return run(*args, cwd=cwd, module=True, env={"PYTHONPATH": ROOT, "TMPDIR": tmp, **env})


@pytest.fixture(scope="module", params=[pytest.param("overlay", marks=pytest.mark.e2e),
                                        pytest.param("interpose", marks=pytest.mark.e2e)])
def hostile_run(request, tmp_path_factory):
    """writes_everywhere.py run under one mechanism from a folder of the user's files."""
    if request.param == "overlay" and (why := overlay_refused()):
        pytest.skip(f"no unprivileged overlay on this machine: {why}")
    base = tmp_path_factory.mktemp(request.param)
    user, tmp, kept = base / "user", base / "tmp", base / "kept"
    user.mkdir()
    tmp.mkdir()
    make_user_folder(user)
    before = checksums(user)
    # The overlay run asks for the default mechanism even where the suite runs with the fallback forced.
    env = {SANDBOX.name: "interpose" if request.param == "interpose" else "", KEEP_WRITES.name: str(kept)}
    done = tfdoctor(["run", str(SCRIPT), "--only", "zero-grad", "--format", "json", "--output", "report.json",
                     "--", "--out-dir", "out"], user, tmp, **env)
    return request.param, user, tmp, kept, before, done


def test_nothing_of_the_users_changes_and_the_script_sees_its_own_writes(hostile_run):
    mechanism, user, tmp, _, before, done = hostile_run
    assert done.returncode == 0, done.stderr  # the script's read-backs all held
    after = checksums(user)
    report = json.loads(after.pop("report.json") and (user / "report.json").read_text())
    assert after == before  # (a)-(g): not one byte, name or folder moved
    assert not [name for name in os.listdir(tmp) if name.startswith("tfdoctor-")]  # the scratch went too
    record = report["sandbox"]
    assert record["mechanism"] == mechanism and str(user) in record["protected"]
    assert {os.path.relpath(p, user) for p in record["written"]} == WRITTEN
    assert {os.path.relpath(p, user) for p in record["deleted"]} == {"old.txt", "rename_me.txt", "out"}


def test_keep_writes_keeps_a_copy_at_the_users_paths(hostile_run):
    _, user, _, kept, _, done = hostile_run
    report = json.loads((user / "report.json").read_text())
    copy = report["sandbox"]["kept_in"]
    assert os.path.dirname(copy) == str(kept)
    assert open(os.path.join(copy, str(user).lstrip(os.sep), "results.csv")).read() == "step,loss\n"
    assert str(user / "old.txt") in open(os.path.join(copy, "DELETED.txt")).read()


@pytest.mark.e2e
def test_a_check_factory_that_writes_leaves_the_users_files_as_they_were(tmp_path):
    user, tmp = tmp_path / "user", tmp_path / "tmp"
    user.mkdir()
    tmp.mkdir()
    (user / "ckpt.pt").write_bytes(b"weights")
    (user / "train.log").write_text("a long log\n")
    before = checksums(user)
    done = tfdoctor(["check", f"{ROOT}/fixtures/writes_in_factory.py:build", "--only", "init-loss", "--format",
                     "json"], user, tmp)
    assert done.returncode == 0, done.stderr
    assert checksums(user) == before
    written = json.loads(done.stdout)["sandbox"]["written"]
    assert written == [str(user / "ckpt.pt"), str(user / "train.log")]


def test_interposer_views_and_undoes_in_process(tmp_path):
    """The fallback's view in this process (pathlib, os, shutil, glob, torch, numpy), then every patch
    undone: the process is left as it was found."""
    import builtins
    import glob
    import io
    import shutil

    import numpy as np
    import torch

    from tfdoctor.process.sandbox import interpose
    from tfdoctor.process.sandbox.ledger import summary, write_state
    from tfdoctor.report.console import sandbox_lines

    user, scratch = tmp_path / "user", tmp_path / "scratch"
    user.mkdir()
    scratch.mkdir()
    make_user_folder(user)
    before = checksums(user)
    originals = (builtins.open, io.open, os.open, os.stat, os.scandir, shutil.rmtree, torch.save, torch.load)
    env = {name: os.environ.get(name) for name in (interpose.VIEW_ENV, "PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    bytecode = sys.dont_write_bytecode
    write_state(str(scratch), {"mechanism": "interpose", "layers": [{"root": "/", "upper": str(scratch / "mirror")}]})
    assert sandbox_lines(summary(str(scratch))) == []  # wrote nothing: the report says nothing
    installed = interpose.install([str(user)], str(scratch))
    try:
        (user / "out").rename(user / "moved")
        assert not (user / "out").exists() and (user / "moved" / "sub" / "b.txt").read_text() == "b\n"
        (user / "moved" / "new").mkdir()
        (user / "moved" / "new" / "x.txt").write_text("x")
        assert sorted(p.name for p in (user / "moved").iterdir()) == ["a.txt", "new", "sub"]
        assert sorted(glob.glob(str(user / "moved" / "**" / "*.txt"), recursive=True)) == [
            str(user / "moved" / n) for n in ("a.txt", "new/x.txt", "sub/b.txt")]
        shutil.rmtree(user / "moved" / "sub")
        assert [w[0] for w in os.walk(user / "moved")] == [str(user / "moved"), str(user / "moved" / "new")]
        shutil.copy(user / "notes.txt", user / "notes2.txt")
        with open(user / "notes.txt", "a") as notes:
            notes.write("more\n")
        assert (user / "notes.txt").read_text() == "my notes\nmore\n"
        torch.save({"w": torch.ones(2)}, user / "ckpt.pt")
        assert torch.load(user / "ckpt.pt")["w"].tolist() == [1.0, 1.0]
        np.save(user / "arrays.npy", np.ones(3))
        assert np.load(user / "arrays.npy").tolist() == [1.0, 1.0, 1.0]
        (user / "old.txt").unlink()
        with pytest.raises(FileNotFoundError):
            (user / "old.txt").read_text()
        os.replace(user / "rename_me.txt", user / "results.csv")
        assert (user / "results.csv").read_bytes() == b"keep my name\n"
        (user / "moved" / "new" / "x.txt").unlink()
        (user / "moved" / "new").rmdir()
        os.makedirs(user / "deep" / "er", exist_ok=True)
        (user / "deep" / "er" / "y.bin").write_bytes(b"\0" * 8)
        os.truncate(user / "deep" / "er" / "y.bin", 2)
        shutil.copytree(user / "deep", user / "deep2")
        shutil.move(str(user / "deep2"), str(user / "moved" / "deep3"))
        assert (user / "moved" / "deep3" / "er" / "y.bin").stat().st_size == 2
        assert sorted(os.listdir(user / "moved")) == ["a.txt", "deep3"]
        assert checksums(user) != before  # the script's view
    finally:
        installed.uninstall()
    assert checksums(user) == before  # the user's folder
    assert (builtins.open, io.open, os.open, os.stat, os.scandir, shutil.rmtree, torch.save, torch.load) == originals
    assert {name: os.environ.get(name) for name in env} == env and sys.dont_write_bytecode == bytecode
    record = summary(str(scratch))
    assert str(user / "ckpt.pt") in record["written"] and str(user / "out") in record["deleted"]
    assert "thrown away" in sandbox_lines(record)[0].plain


def test_a_child_python_that_cannot_import_tfdoctor_still_writes_into_the_sandbox(tmp_path):
    """The user's code starts another environment's python (a virtual environment without tfdoctor): the
    boot folder on its PYTHONPATH installs the parent's sandbox from TFDOCTOR_SANDBOX_VIEW without
    importing tfdoctor. Were the boot code to import it, Python's `site` would report the error and run
    the child outside the sandbox, writing the user's file for real."""
    import venv

    from tfdoctor.process.sandbox import interpose

    other = tmp_path / "other-env"
    venv.create(other, symlinks=True, with_pip=False)
    user, scratch = tmp_path / "user", tmp_path / "scratch"
    user.mkdir()
    scratch.mkdir()
    (user / "ckpt.pt").write_bytes(b"the user's trained weights")
    view = {"roots": [str(user)], "scratch": str(scratch), "exempt": []}  # as install() hands it to children
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update({interpose.VIEW_ENV: json.dumps(view), "PYTHONPATH": interpose.BOOT})
    code = ("import importlib.util, sys; open(sys.argv[1], 'w').write('overwritten'); "
            "print(open(sys.argv[1]).read(), importlib.util.find_spec('tfdoctor') is None)")
    done = subprocess.run([str(other / "bin" / "python"), "-c", code, str(user / "ckpt.pt")], cwd=user, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "sitecustomize" not in done.stderr, done.stderr
    assert done.stdout.split() == ["overwritten", "True"]  # it sees its own write; tfdoctor is not importable there
    assert (user / "ckpt.pt").read_bytes() == b"the user's trained weights"
    assert open(str(scratch / "mirror") + str(user / "ckpt.pt")).read() == "overwritten"
