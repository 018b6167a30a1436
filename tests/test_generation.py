"""generation: greedy decoding from each row's first token writes the batch overfit-batch memorised
again, without and with the cache; a model that trains well and decodes something else has a
train/inference mismatch (seed 004's triu mask: "<sos> <sos> <sos>"), named at its first position."""

import json

import pytest

from catalogue import GENERATION
from helpers import build_fixture, train_fn
from real_models import hf_gpt2, hf_llama
from tfdoctor import run_checks


def test_triu_mask_trains_well_and_decodes_something_else(report_of):
    report = report_of("gpt_triu_mask", GENERATION)
    assert report["overfit-batch"].status.value == "pass"  # it memorised: the future token is in view
    result = report["generation"]
    assert result.status.value == "fail", result.message
    d = result.details
    assert "train/inference mismatch" in result.message and f"position {d['position']}" in result.message
    assert d["decoded_token"] != d["expected_token"] and d["mismatched_rows"] == d["rows"]
    assert "tril" in result.hint
    json.dumps(d)


def test_positions_counted_from_the_end_pass_the_mask_checks_and_fail_here(report_of):
    result = report_of("gpt_positions_from_end", GENERATION)["generation"]
    assert result.status.value == "fail", result.message
    assert result.details["position"] >= 1 and result.details["cache"].startswith("no cached decoding")
    leak = run_checks(build_fixture("gpt_positions_from_end"), only=["future-leak", "mask-direction"])
    assert [r.status.value for r in leak.results] == ["pass", "pass"]


def test_a_cache_that_restarts_positions_fails_on_the_cache_path_only(report_of):
    result = report_of("gpt_kv_cache_positions", GENERATION)["generation"]
    assert result.status.value == "fail", result.message
    assert "cache path differs" in result.message and result.details["cache"] == "incremental"
    assert result.details["reproduced_rows"] == result.details["rows"]  # without the cache it reproduces


@pytest.mark.parametrize("fixture, cache", [("gpt_correct", "no cached decoding"), ("gpt_kv_cache", "incremental")])
def test_correct_models_reproduce_the_batch(fixture, cache, report_of):
    result = report_of(fixture, GENERATION)["generation"]
    assert result.status.value == "pass", result.message
    assert result.details["reproduced_rows"] == result.details["rows"] and result.details["cache"].startswith(cache)


def test_the_memorised_copy_is_shared_with_overfit_batch(monkeypatch):
    """One memorisation serves both checks: generation never trains a second time."""
    import tfdoctor.probes.memorise as memorise

    calls = []
    original = memorise.memorise
    monkeypatch.setattr(memorise, "memorise", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = build_fixture("gpt_correct")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = run_checks(model, only=list(GENERATION))
    assert [r.status.value for r in report.results] == ["pass", "pass"] and len(calls) == 1
    alone = run_checks(build_fixture("gpt_correct"), only=["generation"])  # memorises on its own when alone
    assert alone.results[0].status.value == "pass" and len(calls) == 2
    assert all((before[k] == v).all() for k, v in model.state_dict().items())  # the user's model untouched


def test_skips_when_the_model_did_not_memorise(report_of):
    result = run_checks(build_fixture("gpt_ignores_tokens"), only=list(GENERATION))["generation"]
    assert result.status.value == "skip" and "did not memorise" in result.message


def test_skips_under_train_and_for_encoders():
    result = run_checks(build_fixture("gpt_correct"), only=["generation"], pad_id=0, train=train_fn("correct"))
    assert result["generation"].status.value == "skip" and "--train" in result["generation"].message
    encoder = run_checks(build_fixture("encoder_correct"), only=["generation"])["generation"]
    assert encoder.status.value == "skip"


# --- real library models: memorised, then decoded by their own generate() (the cache) and without it ------

@pytest.mark.parametrize("build", [hf_gpt2, hf_llama])
def test_hugging_face_models_memorise_and_decode_their_batch(build):
    report = run_checks(build(), only=list(GENERATION))
    result = report["generation"]
    assert report["overfit-batch"].status.value == "pass"
    assert result.status.value == "pass", result.message
    assert result.details["cache"] == "generate"
