"""Encoders and encoder-decoders: kind recognition, the kind-specific checks, and the whole battery
on every correct real model and fixture (no fail, no error)."""

import pytest

from conftest import build_fixture
from real_models import ALL_MODELS, MORE_MODELS, hf_bart, hf_bert, hf_gpt2, hf_t5
from tfdoctor import Subject, run_checks
from tfdoctor.subject import resolve

CORRECT_FIXTURES = ["gpt_correct", "gpt_blocked_triu", "gpt_sdpa", "gpt_pad_masked", "encoder_correct",
                    "seq2seq_correct"]


@pytest.mark.parametrize("factory, kind, pad_id", [
    (hf_gpt2, "causal", None), (hf_bert, "encoder", 0), (hf_t5, "seq2seq", 0), (hf_bart, "seq2seq", 1),
])
def test_hugging_face_kinds_and_pad_ids_are_recognised(factory, kind, pad_id):
    subject = resolve(Subject(factory()))
    assert (subject.kind, subject.pad_id) == (kind, pad_id)


def test_explicit_forward_keeps_the_declared_kind():
    subject = resolve(Subject(hf_bert(), forward=lambda m, ids: m(input_ids=ids).logits))
    assert subject.kind == "causal"


@pytest.mark.parametrize("name, expected", [
    ("encoder_correct", "pass"), ("encoder_causal", "fail"),
])
def test_bidirectional_encoder(name, expected):
    result = run_checks(build_fixture(name), only="bidirectional-encoder")["bidirectional-encoder"]
    assert result.status.value == expected
    assert result.details["pattern"] == ("none" if expected == "pass" else "causal")


@pytest.mark.parametrize("name, expected", [
    ("seq2seq_correct", "pass"), ("seq2seq_causal_cross", "fail"),
])
def test_cross_attention_mask(name, expected):
    result = run_checks(build_fixture(name), only="cross-attention-mask")["cross-attention-mask"]
    assert result.status.value == expected
    if expected == "fail":
        assert result.details["unread_pairs"] == 32 * 31 // 2
        assert "memory_mask=None" in result.hint


def test_kind_specific_checks_skip_with_reasons():
    report = run_checks(build_fixture("gpt_correct"), only=["bidirectional-encoder", "cross-attention-mask"])
    assert [r.status.value for r in report.results] == ["skip", "skip"]
    encoder = run_checks(build_fixture("encoder_correct"), only=["future-leak", "cross-attention-mask"])
    assert [r.status.value for r in encoder.results] == ["skip", "skip"]


def test_seq2seq_future_leak_is_over_the_decoder():
    report = run_checks(build_fixture("seq2seq_correct"), only=["future-leak", "mask-direction"])
    assert report["mask-direction"].details["pattern"] == "causal"


def test_hugging_face_masking_checks_name_both_attention_implementations():
    result = run_checks(hf_bert(), only="padding-mask")["padding-mask"]
    assert result.details["attn_implementations"] == ["eager", "sdpa"]


def test_implementation_is_restored():
    model = hf_gpt2()
    before = model.config._attn_implementation
    run_checks(model, only=["future-leak"])
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("name", sorted(ALL_MODELS) + sorted(MORE_MODELS))
def test_battery_is_quiet_on_correct_real_models(name):
    report = run_checks({**ALL_MODELS, **MORE_MODELS}[name]())
    loud = [(r.id, r.status.value, r.message) for r in report.results if r.status.value in ("fail", "error", "warn")]
    assert not loud
    ran = {r.id for r in report.results if r.status.value == "pass"}
    assert {"init-loss", "overfit-batch"} <= ran


@pytest.mark.parametrize("name", CORRECT_FIXTURES)
def test_battery_is_quiet_on_correct_fixtures(name):
    report = run_checks(build_fixture(name))
    loud = [(r.id, r.status.value, r.message) for r in report.results if r.status.value in ("fail", "error", "warn")]
    assert not loud


def test_a_leak_under_one_attention_implementation_is_named():
    """As with the released model that leaked the future under SDPA only, eager being correct."""
    import torch
    from transformers import GPT2LMHeadModel

    class LeaksUnderSdpa(GPT2LMHeadModel):
        def forward(self, input_ids=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            if self.config._attn_implementation == "sdpa":  # a kernel-specific bug: sees the next token
                out.logits = out.logits + 0.1 * self.transformer.wte(input_ids.roll(-1, dims=1)) @ self.lm_head.weight.T
            return out

    model = LeaksUnderSdpa(hf_gpt2().config)
    result = run_checks(model, only="future-leak")["future-leak"]
    assert result.status.value == "fail"
    assert result.message.startswith("with attn_implementation='sdpa':")
    assert result.details["failing_implementations"] == ["sdpa"]
    assert model.config._attn_implementation == "sdpa"  # restored after the eager run
