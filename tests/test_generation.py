"""generation: greedy decoding from each row's first token writes the batch overfit-batch memorised
again, without and with the cache; a model that trains well and decodes something else has a
train/inference mismatch (seed 004's triu mask: "<sos> <sos> <sos>"), named at its first position."""

import json

import pytest

from catalogue import GENERATION
from helpers import build_fixture, train_fn
from real_models import hf_blt, hf_gpt2, hf_llama, hf_xlstm
from tfdoctor import run_checks


def test_triu_mask_trains_well_and_decodes_something_else(checks_report):
    report = checks_report("gpt_triu_mask", GENERATION)
    assert report["overfit-batch"].status.value == "pass"  # it memorised: the future token is in view
    result = report["generation"]
    assert result.status.value == "fail", result.message
    d = result.details
    assert "train/inference mismatch" in result.message and f"position {d['position']}" in result.message
    assert d["decoded_token"] != d["expected_token"] and d["mismatched_rows"] == d["rows"]
    assert "tril" in result.hint
    json.dumps(d)


def test_positions_counted_from_the_end_pass_the_mask_checks_and_fail_here(checks_report):
    result = checks_report("gpt_positions_from_end", GENERATION)["generation"]
    assert result.status.value == "fail", result.message
    assert result.details["position"] >= 1 and result.details["cache"].startswith("no cached decoding")
    leak = run_checks(build_fixture("gpt_positions_from_end"), only=["future-leak", "mask-direction"])
    assert [r.status.value for r in leak.results] == ["pass", "pass"]


def test_a_cache_that_restarts_positions_fails_on_the_cache_path_only(checks_report):
    result = checks_report("gpt_kv_cache_positions", GENERATION)["generation"]
    assert result.status.value == "fail", result.message
    assert "cache path differs" in result.message and result.details["cache"] == "incremental"
    assert result.details["reproduced_rows"] == result.details["rows"]  # without the cache it reproduces


@pytest.mark.parametrize("fixture, cache", [("gpt_correct", "no cached decoding"), ("gpt_kv_cache", "incremental")])
def test_correct_models_reproduce_the_batch(fixture, cache, checks_report):
    result = checks_report(fixture, GENERATION)["generation"]
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


def test_skips_when_the_model_did_not_memorise(checks_report):
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


# --- the model's own generate() method (nanoGPT's generate(idx, max_new_tokens, temperature, top_k)) -----

@pytest.mark.parametrize("fixture, line", [("gpt_generate_window", "def generate"),
                                           ("gpt_generate_cache_position0", "def generate")])
def test_a_decoder_that_departs_only_through_its_own_generate_fails_naming_it(fixture, line, checks_report):
    """A window left-filled with token 0, cached tokens embedded at position 0: the forward is correct,
    tfdoctor's greedy loop writes the batch again, and only the model's own method decodes something else."""
    report = checks_report(fixture, GENERATION)
    assert report["overfit-batch"].status.value == "pass"
    result = report["generation"]
    assert result.status.value == "fail", result.message
    d = result.details
    assert d["reproduced_rows"] == d["rows"]  # tfdoctor's own loop reproduces every row
    own = d["own_decoder"]
    path, number = own["location"].rsplit(":", 1)
    assert path.endswith(f"{fixture}.py") and open(path).read().splitlines()[int(number) - 1].strip().startswith(line)
    assert own["greedy_by"] == "top_k=1" and own["arguments"]["max_new_tokens"] == d["tokens_per_row"] - 1
    assert own["first_departure_per_row"][d["row"]] == d["position"] >= 1 and d["decoded_token"] != d["expected_token"]
    assert f"position {d['position']} of row {d['row']}" in result.message and own["location"] in result.message
    assert "generate()" in result.hint and "block_size" in result.hint
    json.dumps(d)


@pytest.mark.parametrize("fixture", ["gpt_generate", "gpt_generate_cached", "mamba_generate"])
def test_a_correct_own_generate_reproduces_the_batch(fixture, checks_report):
    """With or without a cache of its own: a key/value cache, or a Mamba's recurrent state and window."""
    result = checks_report(fixture, GENERATION)["generation"]
    assert result.status.value == "pass", result.message
    own = result.details["own_decoder"]
    assert own["first_departure_per_row"] == [None] * result.details["rows"]
    assert own["tokens_compared"] == result.details["tokens_per_row"] and "through your" in result.message


def greedy_reference(model, first, length):
    """tfdoctor's own greedy loop (the whole prefix through forward at every step)."""
    from tfdoctor import Subject
    from tfdoctor.probes.greedy import _free_running

    return _free_running(Subject(model, kind="causal", vocab_size=96), first, length)


@pytest.mark.parametrize("style, how, returned", [
    ("mingpt", "do_sample=False, top_k=1", "prompt + new tokens"),
    ("nanochat", "top_k=1", "new tokens only, one Python list per sequence"),
    ("new_tokens_on_device", "temperature=0.0001", "new tokens only"),
    ("total_length", "top_k=1", "prompt + new tokens"),
    ("no_switch", "every torch.multinomial draw taken as its most likely choice", "prompt + new tokens"),
])
def test_own_generate_is_called_the_way_its_signature_asks(style, how, returned):
    """Each convention decodes the greedy path tfdoctor's loop decodes, whatever the seed."""
    import torch

    import decoders
    from tfdoctor.probes.own_decoder import decode_with_own_generate

    model = decoders.build(style).eval()
    first = torch.randint(0, 96, (3, 1), generator=torch.Generator().manual_seed(1))
    reference = greedy_reference(model, first, 13)
    decoded = decode_with_own_generate(model, first, 12, seed=0)
    assert decoded.how == how and decoded.returned == returned
    assert torch.equal(decoded.tokens, reference)
    assert torch.equal(decode_with_own_generate(model, first, 12, seed=1).tokens, reference)
    assert torch.multinomial.__module__ != "tfdoctor.probes.own_decoder"  # the draw is restored


def test_own_generate_that_cannot_be_driven_or_samples_anyway_is_noted_not_judged():
    import decoders

    text = run_checks(decoders.build("needs_tokenizer", sharp=False), only=list(GENERATION))["generation"]
    assert text.status.value == "pass" and "decodes text, not token ids" in text.message
    random = run_checks(decoders.build("gumbel", sharp=False), only=list(GENERATION))["generation"]
    assert random.status.value == "pass", random.message
    assert random.details["own_decoder"]["repeatable"] is False and "decodes at random" in random.message


def test_a_hugging_face_generate_is_not_taken_for_the_users_own():
    from tfdoctor.probes.own_decoder import own_generate

    assert own_generate(hf_gpt2()) is None and own_generate(build_fixture("gpt_correct")) is None
    assert own_generate(build_fixture("gpt_generate")) is not None


# --- library models tfdoctor cannot decode or train: the library's failure named, never an error -------

def test_a_library_whose_cached_decoding_crashes_is_named_as_the_librarys():
    """transformers 5.25's BLT: generate() reads config.num_hidden_layers, which BltConfig lacks."""
    result = run_checks(hf_blt(), only=["overfit-batch", "generation", "cache-consistency"])
    generation, cache = result["generation"], result["cache-consistency"]
    assert generation.status.value == "pass", generation.message
    assert "crashes inside transformers" in generation.message and "not your model's" in generation.message
    assert cache.status.value == "skip" and "crashes inside transformers" in cache.message
    assert cache.details["library_crash"] is True


def test_a_model_that_cannot_be_trained_skips_generation_with_the_reason():
    """transformers 5.25's xLSTM with its cache on updates its state in place: backward refuses."""
    result = run_checks(hf_xlstm(), only=["generation"])["generation"]
    assert result.status.value == "skip" and "cannot be trained" in result.message
    assert "modified in place" in result.message
