"""The TFDOCTOR_* environment variables are declared once (tfdoctor/usercode/environment.py), read through
that module, and documented in docs/environment.md with the same text; `import tfdoctor` leaves the
importing process's warning filters as they were."""

import ast
import os
import re
import subprocess
import sys

from helpers import ROOT
from tfdoctor.usercode.environment import DECLARED

DECLARATIONS = ROOT / "tfdoctor" / "usercode" / "environment.py"
NAME = re.compile(r"\bTFDOCTOR_[A-Z][A-Z_]*[A-Z]\b")


def _sources():
    """Every Python file of the package, the tests, the fixtures and the benchmarks, and the CI script."""
    for folder in ("tfdoctor", "tests", "fixtures", "bench"):
        yield from sorted((ROOT / folder).rglob("*.py"))
    yield ROOT / ".ci" / "run"


def _documented_rows() -> list:
    """(name, set by, meaning) of each row of docs/environment.md's table."""
    rows = []
    for line in (ROOT / "docs" / "environment.md").read_text(encoding="utf-8").splitlines():
        row = re.fullmatch(r"\| `(TFDOCTOR_\w+)` \| ([^|]+) \| (.+) \|", line)
        if row:
            rows.append((row[1], row[2].strip(), row[3].strip()))
    return rows


def test_the_document_lists_exactly_the_declared_variables_with_their_meaning():
    declared = [(v.name, v.set_by, v.meaning) for v in DECLARED]
    assert _documented_rows() == declared, "docs/environment.md's table, as declared:\n" + "\n".join(
        f"| `{name}` | {set_by} | {meaning} |" for name, set_by, meaning in declared)


def test_every_variable_named_anywhere_is_declared():
    declared = {v.name for v in DECLARED}
    named = {}
    for path in [*_sources(), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            named.setdefault(name, str(path.relative_to(ROOT)))
    assert {name: where for name, where in named.items() if name not in declared} == {}


def test_no_variable_is_read_by_its_literal_name_outside_the_declarations():
    """A read (os.environ.get("TFDOCTOR_X"), env["TFDOCTOR_X"]) goes through the declared Variable; the
    name inside a longer message (a hint saying `TFDOCTOR_DEBUG=1`) is not a read, nor is a row of the
    patched targets' table (usercode/patches.py's `Target(...)`: it names what the sandbox sets, and is
    loaded by path where tfdoctor cannot be imported)."""
    literal = {}
    for path in _sources():
        if path == DECLARATIONS or path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        table_rows = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.Call)
                      and isinstance(node.func, ast.Name) and node.func.id == "Target" for inner in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in table_rows:
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                literal.setdefault(str(path.relative_to(ROOT)), []).append(node.value)
    assert literal == {}


def test_the_declarations_import_nothing_of_tfdoctor():
    """The sandbox's boot code loads the file by its path where tfdoctor is not importable."""
    imported = [node for node in ast.walk(ast.parse(DECLARATIONS.read_text(encoding="utf-8")))
                if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [alias.name for node in imported for alias in node.names] == ["os"]


def test_importing_tfdoctor_leaves_the_warning_filters_as_they_were():
    # A fresh interpreter: this one's filters are pytest's, and tfdoctor is imported here already.
    code = ("import warnings; before = list(warnings.filters); import tfdoctor, tfdoctor.cli; "
            "print(repr([f for f in warnings.filters if f not in before]), len(warnings.filters) - len(before))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "0"]
