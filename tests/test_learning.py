import math

import pytest

from conftest import build_fixture
from real_models import CAUSAL_MODELS
from tfdoctor import run_checks
from tfdoctor.checks.learning import HIGH_FAIL_NATS, sparkline

CORRECT = ["gpt_correct", "gpt_blocked_triu", "gpt_sdpa"]


@pytest.mark.parametrize("name", CORRECT + ["gpt_triu_mask", "gpt_no_mask", "gpt_off_by_one"])
def test_init_loss_passes_at_chance(name):
    result = run_checks(build_fixture(name), only="init-loss")["init-loss"]
    assert result.status.value == "pass"
    assert result.details["ln_vocab"] == pytest.approx(math.log(96))
    assert abs(result.details["excess_nats"]) < 0.3


def test_init_loss_fails_oversized_init():
    result = run_checks(build_fixture("gpt_big_init"), only="init-loss")["init-loss"]
    assert result.status.value == "fail"
    assert result.details["excess_nats"] > HIGH_FAIL_NATS
    assert "std=0.02" in result.hint


@pytest.mark.parametrize("name", CORRECT + ["gpt_big_init"])
def test_overfit_batch_passes_on_wired_models(name):
    result = run_checks(build_fixture(name), only="overfit-batch")["overfit-batch"]
    assert result.status.value == "pass", result.message
    assert result.details["final_loss"] < result.details["target_loss"]
    assert result.details["steps"] < result.details["max_steps"]


def test_overfit_batch_fails_when_forward_ignores_tokens():
    result = run_checks(build_fixture("gpt_ignores_tokens"), only="overfit-batch")["overfit-batch"]
    assert result.status.value == "fail"
    assert result.details["steps"] == result.details["max_steps"]
    # Position embeddings alone cannot tell the 4 rows apart: the floor is about ln(4).
    assert result.details["best_loss"] > 1.0
    assert len(result.details["loss_curve"]) == result.details["steps"]
    assert result.details["sparkline"]


@pytest.mark.parametrize("name", sorted(CAUSAL_MODELS))
def test_real_models_pass_learning_checks(name):
    report = run_checks(CAUSAL_MODELS[name](), only=["init-loss", "overfit-batch"])
    assert [r.status.value for r in report.results] == ["pass", "pass"], [r.message for r in report.results]


def test_sparkline_draws_a_falling_curve():
    line = sparkline([5.0, 4.0, 3.0, 2.0, 1.0])
    assert line[0] == "█" and line[-1] == "▁"
    assert len(sparkline(list(range(300)), points=60)) == 60
