"""The lint configuration of pyproject.toml ([tool.ruff]) holds for the whole tree, and its list of
files written before the lint (ruff-baseline.toml) names only files that still need their exemption."""

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT


def _ruff() -> list[str]:
    if importlib.util.find_spec("ruff") is not None:  # the `test` extra installs it beside this Python
        return [sys.executable, "-m", "ruff"]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")


def _check(*args: str) -> subprocess.CompletedProcess:
    # --no-cache: the check writes nothing into the repository
    return subprocess.run([*_ruff(), "check", "--no-cache", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_tree_passes_the_lint():
    done = _check(".")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_every_exempt_file_still_breaks_the_rule_it_is_exempt_from():
    """The exemptions only shrink: a file that now passes a rule it is listed for must leave the list."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    exempt = tomllib.loads((ROOT / "ruff-baseline.toml").read_text(encoding="utf-8"))["lint"]["per-file-ignores"]
    assert all(set(listed) <= {"E501", "I001"} for listed in exempt.values()), "only these two are exempted"
    rules = sorted({rule for listed in exempt.values() for rule in listed})
    done = _check("--config", "lint.per-file-ignores = {}", "--select", ",".join(rules), "--output-format", "json",
                  *exempt)
    found = {(str((ROOT / e["filename"]).resolve().relative_to(ROOT)), e["code"]) for e in json.loads(done.stdout)}
    stale = [f"{path}: {rule}" for path, listed in exempt.items() for rule in listed if (path, rule) not in found]
    assert not stale, "these files pass now: drop their entries from ruff-baseline.toml\n" + "\n".join(stale)
