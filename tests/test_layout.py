"""The house's shape, asserted: what `../shared/tools/layout.py` measured by hand now guards every run.

- no import circle between tfdoctor's modules, and probes/ never imports recording/ (a probe measures a
  model; it must not know how a loop is recorded);
- a check family imports no other family (shared judging lives in checks/verdicts/);
- no file over 600 lines (memory/analytic.py, a ledger read top to bottom, excepted) and no function
  over 80 code lines;
- the root holds only the modules a check author reads;
- private torch names only in usercode/torch_compat.py;
- the docstring of recording/, watching/, probes/, memory/ and report/ maps each of its modules, one line each.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tfdoctor"
ROOT_MODULES = {"subject", "kinds", "tasks", "modes", "loader", "registry", "runner", "context", "result", "errors",
                "tolerances", "versions", "sparkline"}
LONG_LEDGER = "memory.analytic"  # the analytic estimate reads as one ledger (its `estimate` too)
PRIVATE_TORCH = re.compile(r"\btorch(\.\w+)*\._[A-Za-z]|\bfrom torch(\.\w+)*\._|\bimport torch(\.\w+)*\._")
COMPAT = "usercode.torch_compat"
# Packages whose docstring is the map a newcomer reads first: one "- `module.py`: what it holds" line per module.
MAPPED_PACKAGES = ("recording", "watching", "probes", "memory", "report", "usercode")
MAP_LINE = re.compile(r"^- `(\w+)\.py`:", re.MULTILINE)


def _modules() -> dict[str, Path]:
    """'checks.masking' -> its path; a package is named by its folder ('checks')."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imports(name: str) -> set[str]:
    """The tfdoctor modules `name` imports (absolute imports, at any depth of the file), package-relative."""
    out = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("tfdoctor"):
            target = node.module.removeprefix("tfdoctor").lstrip(".")
            for alias in node.names:  # `from tfdoctor.process import worker` imports a module
                child = f"{target}.{alias.name}".lstrip(".")
                out.add(child if child in MODULES else target)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("tfdoctor.") for a in node.names if a.name.startswith("tfdoctor."))
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _circles() -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index, low, on, stack, groups = {}, {}, set(), [], []

    def enter(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)

    def visit(start):
        work = [(start, iter(sorted(GRAPH[start])))]
        enter(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    enter(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        group.append(top)
                        if top == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    return groups


def test_no_import_circle():
    assert _circles() == []


def test_probes_never_import_recording():
    assert [(a, b) for a, targets in GRAPH.items() for b in targets
            if a.startswith("probes") and b.startswith("recording")] == []


def test_check_families_import_no_other_family():
    def family(name):
        parts = name.split(".")
        return parts[1] if len(parts) > 1 and parts[0] == "checks" else None

    crossing = [(a, b) for a, targets in GRAPH.items() for b in targets
                if family(a) and family(b) and family(a) != family(b) and family(b) != "verdicts"]
    assert crossing == []


def test_no_file_over_600_lines():
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items() if name != LONG_LEDGER}
    assert {name: n for name, n in long.items() if n > 600} == {}


def test_no_function_over_80_code_lines():
    def code_lines(fn) -> int:
        body = fn.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring is not code
        return body[-1].end_lineno - body[0].lineno + 1 if body else 0

    long = [f"{name}.{node.name}: {code_lines(node)}" for name, tree in TREES.items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and code_lines(node) > 80
            and not (name == LONG_LEDGER and node.name == "estimate")]
    assert long == []


def test_the_root_holds_only_the_check_authors_modules():
    root = {name for name, path in MODULES.items() if "." not in name and name and path.name != "__init__.py"}
    assert root - {"__main__"} <= ROOT_MODULES, f"new root module(s): {root - ROOT_MODULES - {'__main__'}}"


@pytest.mark.parametrize("name", [n for n in MODULES if n != COMPAT])
def test_private_torch_names_only_in_the_compat_module(name):
    text = MODULES[name].read_text()
    assert not PRIVATE_TORCH.search(text), f"{MODULES[name]} names a private torch name: go through {COMPAT}"


@pytest.mark.parametrize("package", MAPPED_PACKAGES)
def test_the_package_docstring_maps_every_module_once(package):
    mapped = MAP_LINE.findall(ast.get_docstring(TREES[package]) or "")
    modules = {name.split(".")[1] for name in MODULES if name.startswith(f"{package}.") and name.count(".") == 1}
    assert len(mapped) == len(set(mapped)), f"mapped twice: {sorted({m for m in mapped if mapped.count(m) > 1})}"
    assert modules - set(mapped) == set(), f"missing from {package}/__init__.py's map"
    assert set(mapped) - modules == set(), f"{package}/__init__.py maps modules that are gone"
