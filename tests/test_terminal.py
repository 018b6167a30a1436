"""The CLI under a pseudo-terminal, as a user runs it at a prompt: progress bars and colour exist
only there, and CI (pipes) never sees them."""

import json
import pty
import re

import pytest

from helpers import BAR_LINE, E2E, final_screen, run_in_terminal

pytestmark = [*E2E, pytest.mark.skipif(not hasattr(pty, "openpty"), reason="no pseudo-terminals on this platform")]


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
    # future-leak, mask-direction, and generation: memorised through the leak, it cannot decode the batch
    assert re.search(r"\d+ pass, 3 fail", report)


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
