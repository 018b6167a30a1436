"""The suite's shortcut (tests/zygote.py and tests/forked_worker.py: the command forked from a process
that has imported torch, its worker forked in turn) must give what the installed command gives: the same
exit code, the same report and the same stderr, on a run and on a check."""

import pytest

from helpers import E2E, SCRIPTS, fresh_tfdoctor, tfdoctor

pytestmark = E2E

# Wall-clock measures, the only fields two runs of one command may disagree on.
TIMINGS = {"seconds", "seconds_to_stop", "duration"}


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


@pytest.mark.parametrize("args", [
    ("run", f"{SCRIPTS}/plain_loop_no_accum_division.py", "--format", "json"),
    ("check", "fixtures/gpt_triu_mask.py:build", "--format", "json", "--only", "future-leak,init-loss"),
], ids=["run", "check"])
def test_the_forked_command_reports_what_the_installed_one_does(args):
    forked, fresh = tfdoctor(*args), fresh_tfdoctor(*args)
    assert forked.code == fresh.code != 0  # a bug found, so that a report with findings is compared
    assert _without_timings(forked.json) == _without_timings(fresh.json)
    assert forked.stderr == fresh.stderr
