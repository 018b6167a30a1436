"""The CLI under a pseudo-terminal, as a user runs it at a prompt: progress bars and colour exist
only there, and CI (pipes) never sees them."""

import json
import os
import pty
import re
import select
import shutil
import subprocess
import time

import pytest

from conftest import ROOT

TFDOCTOR = shutil.which("tfdoctor")
pytestmark = [pytest.mark.skipif(TFDOCTOR is None, reason="tfdoctor is not installed (pip install -e .)"),
              pytest.mark.skipif(not hasattr(pty, "openpty"), reason="no pseudo-terminals on this platform")]

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
# A bar line: "overfit-batch ━━━━━━╸━━━ 12/300 0:00:01" (description, bar, MofN, elapsed).
BAR_LINE = re.compile(r"\d+/\d+ \d+:\d\d:\d\d")


def run_in_terminal(*args, stdout_is_terminal=True, timeout=300):
    """Run `tfdoctor ARGS` with stderr (and stdout unless told otherwise) on a pseudo-terminal.

    Returns (exit code, what the terminal received, what a stdout pipe received or None)."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "200", "LINES": "50", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    out = follower if stdout_is_terminal else subprocess.PIPE
    proc = subprocess.Popen([TFDOCTOR, *args], cwd=ROOT, stdin=follower, stdout=out, stderr=follower, env=env)
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


def assert_clean_report(text: str):
    assert "ERROR" not in text and "IndexError" not in text, text[-3000:]
    assert not BAR_LINE.search(text), text[-3000:]
    assert text.lstrip().startswith("tfdoctor "), text[:500]


def test_check_at_a_prompt_shows_colour_and_a_clean_report():
    code, raw, _ = run_in_terminal("check", "fixtures/gpt_triu_mask.py:build")
    assert code == 1
    assert "\x1b[" in raw  # colour only on a terminal
    report = final_screen(raw)
    assert_clean_report(report)
    assert "torch.triu where torch.tril was meant" in report
    assert re.search(r"\d+ pass, 2 fail", report)


def test_check_with_train_at_a_prompt_runs_every_loop_check():
    code, raw, _ = run_in_terminal("check", "fixtures/gpt_correct.py:build",
                                   "--train", "fixtures/loops/no_loss_division.py:train")
    report = final_screen(raw)
    assert_clean_report(report)
    assert "accumulation-scaling" in report
    summary = report.strip().splitlines()[-1]
    assert "error" not in summary and "1 fail" in summary, summary
    assert code == 1


def test_json_stays_parseable_when_stderr_is_a_terminal():
    code, raw, piped = run_in_terminal("check", "fixtures/gpt_correct.py:build",
                                       "--train", "fixtures/loops/correct.py:train", "--format", "json",
                                       stdout_is_terminal=False)
    report = json.loads(piped)
    assert report["summary"]["error"] == 0, [c for c in report["checks"] if c["status"] == "error"]
    assert not BAR_LINE.search(raw)  # JSON mode: no bar even on a terminal
    assert code == 0


def test_traced_memory_at_a_prompt():
    code, raw, _ = run_in_terminal("memory", "fixtures/gpt_correct.py:build", "--batch", "2", "--seq", "32",
                                   "--budget", "1MiB")
    report = final_screen(raw)
    assert not BAR_LINE.search(report), report[-2000:]
    assert "OUT OF MEMORY" in report and "internal error" not in raw
    assert code == 1
