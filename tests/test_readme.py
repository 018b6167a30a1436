"""The documentation's examples, run as written (the way doctests run a docstring's examples): those of
README.md, CONTRIBUTING.md and every page of docs/ (the README keeps one example per command; the rest
moved to docs/ with their tests).

- Every `tfdoctor ...` command in a code block runs from the repository root and exits with the code
  the page gives it (`# exit N` after it; none given means 0).
- A fenced block that starts with `$ tfdoctor ...` shows output: every line of it that is not
  abridged (no "...") appears in the real output, in order, compared by shape: times dropped, every
  number masked (a CPU that rounds a loss or a bfloat16 difference otherwise prints 0.0035 where the
  README shows 0.0034) and the table borders and line breaks ignored (a number one character wider
  moves where Rich wraps a cell, so a shown line is looked for in the output's text as one stream).
- Every ```python block runs with `fixtures/` on the path (in this process, in a namespace of its own),
  and the `test_*` functions it defines run too; `print(...)  # "value"` must print that value.
"""

import contextlib
import io
import re
import shlex

import pytest

from helpers import ROOT, fresh_tfdoctor as tfdoctor

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXTS = {page.relative_to(ROOT).as_posix(): page.read_text(encoding="utf-8") for page in PAGES}
README = TEXTS["README.md"]
TIME = re.compile(r"\b\d+\.\d\ds(?=│|\s*$)")  # the per-check time column
# Measured numbers (a loss, a bfloat16 difference) round differently on other CPUs: shown text is
# compared with every number masked, and without the table's borders and the layout's whitespace.
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")
BORDERS = re.compile("[\u2500-\u257f]")  # Unicode box drawing: table and panel borders
EXIT = re.compile(r"#.*?\bexits? (\d)\b")


def code_blocks(text: str):
    """(info string, body) for each fenced block, and ("indented", body) for each indented one."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            info, body = line[3:].strip(), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((info, "\n".join(body)))
        elif line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            blocks.append(("indented", "\n".join(body).strip("\n")))
            continue
        i += 1
    return blocks


def commands(text: str):
    """Each tfdoctor command of a page: (command line, expected exit code, shown output or None)."""
    found = []
    for info, body in code_blocks(text):
        if info == "python":
            continue
        body_lines = body.splitlines()
        if body_lines and body_lines[0].startswith("$ tfdoctor "):
            command, rest = body_lines[0][2:], body_lines[1:]
            found.append((command, _exit_code(command, rest), rest))
            continue
        for line in body_lines:
            part = line.split("&& ", 1)[-1] if "&& tfdoctor " in line else line
            if part.startswith("tfdoctor "):
                found.append((part, _exit_code(part, None), None))
    return found


def _shape(lines) -> str:
    """Report text by shape: times dropped, numbers masked, borders and all whitespace removed, so that
    where Rich breaks a line or how wide it pads a cell does not matter, the words and their order do."""
    return "".join("".join(BORDERS.sub(" ", NUMBER.sub("#", TIME.sub("", line))).split()) for line in lines)


def _missing(shown, output: str):
    """The first shown line (abridged ones aside) not found by shape in the output after the lines
    before it, or None when every one is there in order."""
    actual, at = _shape(output.splitlines()), 0
    for line in shown:
        want = _shape([line])
        if "..." in line or not want:
            continue
        found = actual.find(want, at)
        if found < 0:
            return line
        at = found + len(want)
    return None


def _exit_code(command: str, output) -> int:
    match = EXIT.search(command)
    if match:
        return int(match.group(1))
    if output is not None:  # a shown report: its summary says whether anything failed
        summary = next((line for line in reversed(output) if re.match(r"\d+ pass", line)), "")
        if "OUT OF MEMORY" in "\n".join(output) or "problem(s) found" in summary:
            return 1
    return 0


COMMANDS = [(name, *command) for name, text in TEXTS.items() for command in commands(text)]


def test_shown_text_is_compared_by_shape_not_by_the_cpus_rounding():
    """Another CPU's numbers, and a wrap moved by a wider number, still match; other words do not."""
    readme = ["│PASS   │ half-precision-mask │ largest difference from float32: float16 0.00051, bfloat16  │ 0.01s│",
              "│       │                     │ 0.0034                                                      │      │"]
    other_cpu = ["│PASS   │ half-precision-mask │ largest difference from float32: float16 0.000512,  │ 0.02s│",
                 "│       │                     │ bfloat16 0.0035                                     │      │"]
    assert _shape(readme) == _shape(other_cpu)
    assert _shape(readme) != _shape([other_cpu[0].replace("float32", "float64")] + other_cpu[1:])
    output = "\n".join(other_cpu + ["│FAIL   │ zero-grad           │ 2 of 2 steps                     │ 0.00s│"])
    assert _missing(readme + ["...", "│FAIL   │ zero-grad │ 3 of 3 steps │"], output) is None
    assert _missing(["│FAIL   │ zero-grad │ 3 of 3 steps │"] + readme, output) == readme[0]  # out of order


def test_the_readme_has_an_example_per_command_and_the_docs_the_rest():
    shown = [command.split()[1] for command, _, output in commands(README) if output]
    assert shown == ["check", "run", "watch", "memory", "judge"]  # one report shown per command, in that order
    assert sum(1 for info, _ in code_blocks(README) if info == "python") >= 1
    assert len(COMMANDS) >= 30 and len(PYTHON_BLOCKS) >= 3  # the README held 26 commands and 2 blocks before the move
    assert len(README.splitlines()) < 250


@pytest.mark.e2e
@pytest.mark.parametrize("page, command, expected, shown", COMMANDS,
                         ids=[f"{c[0]}: {c[1].split('#')[0].strip()}" for c in COMMANDS])
def test_readme_command(page, command, expected, shown, shared_tfdoctor):
    line = command.split("#", 1)[0].strip()
    words = shlex.split(line)
    assert words[0] == "tfdoctor" and not set("|&;<>$`") & set(line), line  # one plain command, as typed
    # The README writes reports into the reader's own folder (never a shared /tmp path): the test
    # removes what the command wrote there. A command that writes nothing is the same process as the
    # tests' own run of it, if they give it (test_cli, test_run): one run, shared.
    written = [ROOT / path for path in re.findall(r"--output[= ](\S+)", line) if not (ROOT / path).exists()]
    assert not [path for path in re.findall(r"--output[= ](\S+)", line) if path.startswith("/tmp")], line
    try:
        run = tfdoctor if "--output" in words else shared_tfdoctor
        done = run(*words[1:], env={"COLUMNS": "100"}, timeout=600)
    finally:
        for path in written:
            path.unlink(missing_ok=True)
    assert done.returncode == expected, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr
    if shown:
        missing = _missing(shown, done.stdout)
        assert missing is None, f"{page} line not in the output of {line} (or out of order):\n{missing}\n\n" \
                                + done.stdout


PYTHON_BLOCKS = [(name, body) for name, text in TEXTS.items() for info, body in code_blocks(text) if info == "python"]


@pytest.mark.parametrize("page, body", PYTHON_BLOCKS,
                         ids=[f"{name}: python-{i}" for i, (name, _) in enumerate(PYTHON_BLOCKS)])
def test_readme_python_block(page, body):
    """Run in this process, in a namespace of its own, as a fresh `python -c` would run it (fixtures/ is
    on the path here too); an exception fails the test as a non-zero exit would."""
    expected = [m.group(1) for m in re.finditer(r"print\(.*\)\s*#\s*(.+)$", body, re.M)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        namespace = {"__name__": "readme_example"}
        exec(compile(body, page, "exec"), namespace)
        for name, value in list(namespace.items()):
            if name.startswith("test_") and callable(value):
                value()
        if callable(namespace.get("build")):
            namespace["build"]()
    printed = out.getvalue().splitlines()
    assert [p.strip() for p in printed] == [e.strip().strip('"') for e in expected], out.getvalue()
