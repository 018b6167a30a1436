"""`judge` on the log of a watched run agrees with `watch` on that same run, where the log holds the same
series: one run of fixtures/watch/jsonl_log_diverges.py (a warm-up left uncapped: the loss spikes, climbs
and becomes NaN), watched to its end while it writes its own JSON-lines log, then that log judged.

The script logs `iter` counting from 1 after each step; watch counts optimizer steps from 0: the log's
step k is the watched step k - 1.
"""

import math

import pytest

from helpers import E2E, ROOT, tfdoctor

pytestmark = E2E

SCRIPT = ROOT / "fixtures" / "watch" / "jsonl_log_diverges.py"
STEPS = 260  # the loss is NaN from about step 225 on this seed
SAME_SERIES_JUDGES = ("loss-spike", "loss-divergence", "grad-norm-trend")  # the log holds loss and grad_norm


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    log = tmp_path_factory.mktemp("agree") / "train_log.jsonl"
    watched = tfdoctor("watch", str(SCRIPT), "--format", "json", "--", str(log), "--steps", str(STEPS),
                       env={"OMP_NUM_THREADS": "1"}, timeout=900)
    judged = tfdoctor("judge", str(log), "--format", "json", timeout=300)
    return watched, judged


def _by_id(done):
    return {r["id"]: r for r in done.json["checks"]}


def test_the_logged_losses_are_the_watched_losses(both):
    watched, judged = both
    seen = dict(zip(watched.json["series"]["steps"]["step"], watched.json["series"]["steps"]["loss"]))
    logged = dict(zip(judged.json["series"]["steps"]["step"], judged.json["series"]["steps"]["loss"]))
    assert len(logged) == STEPS and len(seen) == STEPS
    for step, loss in logged.items():
        other = seen[step - 1]
        if isinstance(loss, str) or isinstance(other, str):  # NaN travels as a string in JSON
            assert str(loss).lower() == str(other).lower(), step
        else:
            assert math.isclose(loss, other, rel_tol=1e-6), (step, loss, other)


def test_both_fail_the_divergence_at_the_same_step(both):
    watched, judged = _by_id(both[0]), _by_id(both[1])
    assert watched["loss-divergence"]["status"] == judged["loss-divergence"]["status"] == "fail"
    assert judged["loss-divergence"]["details"]["step"] == watched["loss-divergence"]["details"]["step"] + 1


def test_the_judges_with_the_same_series_give_the_same_status(both):
    watched, judged = _by_id(both[0]), _by_id(both[1])
    assert {j: judged[j]["status"] for j in SAME_SERIES_JUDGES} == {j: watched[j]["status"] for j in SAME_SERIES_JUDGES}
    assert both[0].code == both[1].code == 1
