"""Encoders and encoder-decoders: kind recognition, the kind-specific checks, and the whole battery
on every correct real model and fixture (no fail, no error)."""

import pytest
import torch

from helpers import build_fixture, tfdoctor
from real_models import ALL_MODELS, CAUSAL_MODELS, MORE_MODELS, hf_bart, hf_bert, hf_gpt2, hf_t5, x_transformers_encoder
from tfdoctor import Subject, run_checks
from tfdoctor.subject import resolve

CORRECT_FIXTURES = ["gpt_correct", "gpt_blocked_triu", "gpt_sdpa", "gpt_pad_masked", "encoder_correct",
                    "seq2seq_correct", "gpt_right_padded", "word_lm_correct", "seq2seq_seq_first"]


@pytest.mark.parametrize("factory, kind, pad_id", [
    (hf_gpt2, "causal", None), (hf_bert, "encoder", 0), (hf_t5, "seq2seq", 0), (hf_bart, "seq2seq", 1),
])
def test_hugging_face_kinds_and_pad_ids_are_recognised(factory, kind, pad_id):
    subject = resolve(Subject(factory()))
    assert (subject.kind, subject.pad_id) == (kind, pad_id)


def test_explicit_forward_keeps_the_declared_kind():
    subject = resolve(Subject(hf_bert(), forward=lambda m, ids: m(input_ids=ids).logits))
    assert subject.kind == "causal"


def test_a_declared_kind_wins_over_what_the_model_announces():
    from xt_encoder_as_lm import build, build_model

    assert resolve(Subject(build_model())).kind == "encoder"  # detected from the layers
    assert resolve(build()).kind == "causal"  # Subject(kind="causal") wins over the layers
    assert resolve(Subject(hf_bert(), kind="causal")).kind == "causal"  # and over a Hugging Face class


def test_an_encoder_trained_as_a_causal_lm_fails_future_leak_when_declared_causal():
    from xt_encoder_as_lm import build, build_model

    assert run_checks(build(), only="future-leak")["future-leak"].status.value == "fail"
    # A flag (run_checks field, as --kind passes it) wins over the Subject, which wins over detection.
    flagged = run_checks(Subject(build_model(), kind="encoder"), only="future-leak", kind="causal")
    assert flagged["future-leak"].status.value == "fail"
    assert run_checks(build_model(), only="future-leak")["future-leak"].status.value == "skip"


@pytest.mark.e2e
def test_kind_flag_on_the_command_line_wins():
    """`--kind causal` on a bare module whose layers say encoder (the detected path skips: see above)."""
    import json

    done = tfdoctor("check", "fixtures/xt_encoder_as_lm.py:build_model", "--only", "future-leak", "--format", "json",
                    "--kind", "causal", module=True)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["checks"][0]["status"] == "fail"


def test_sequence_first_models_are_detected_and_fed_time_major():
    assert resolve(Subject(build_fixture("word_lm_correct"))).batch_first is False
    assert resolve(build_fixture("seq2seq_seq_first")).batch_first is False
    assert resolve(Subject(build_fixture("gpt_correct"))).batch_first is True
    report = run_checks(build_fixture("word_lm_correct"), only=["future-leak", "mask-direction"])
    assert [r.status.value for r in report.results] == ["pass", "pass"]
    assert report["mask-direction"].details["pattern"] == "causal"


@pytest.mark.parametrize("factory", [*CAUSAL_MODELS.values(), hf_bert, hf_t5, x_transformers_encoder])
def test_real_models_stay_batch_first(factory):
    made = factory()
    assert resolve(made if isinstance(made, Subject) else Subject(made)).batch_first is True


def test_a_sequence_first_model_without_its_mask_fails_as_a_leak_not_as_randomness():
    report = run_checks(build_fixture("word_lm_no_mask"), only=["future-leak", "mask-direction"])
    assert [r.status.value for r in report.results] == ["fail", "fail"]
    assert report["mask-direction"].details["pattern"] == "none"
    assert report["future-leak"].details["leaking_pairs"] == 32 * 31 // 2


def test_a_declared_layout_is_not_second_guessed():
    """batch_first=True on a sequence-first model: fed [B, T], two identical rows are two time steps,
    so the map cannot be measured (the misdiagnosis that detection avoids)."""
    subject = Subject(build_fixture("word_lm_correct"), batch_first=True)
    assert resolve(subject).batch_first is True
    assert run_checks(subject, only="future-leak")["future-leak"].status.value == "warn"


def test_a_model_random_in_eval_is_not_taken_for_sequence_first():
    class NoisyGPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = build_fixture("gpt_correct")

        def forward(self, ids):
            return torch.nn.functional.dropout(self.gpt(ids), 0.1)  # training=True even in eval

    subject = resolve(Subject(NoisyGPT()))
    assert subject.batch_first is True
    assert run_checks(subject, only="future-leak")["future-leak"].status.value == "warn"


@pytest.mark.parametrize("name, expected", [
    ("encoder_correct", "pass"), ("encoder_causal", "fail"),
])
def test_bidirectional_encoder(name, expected, checks_report):
    result = checks_report(name, ["bidirectional-encoder"])["bidirectional-encoder"]
    assert result.status.value == expected
    assert result.details["pattern"] == ("none" if expected == "pass" else "causal")


@pytest.mark.parametrize("name, expected", [
    ("seq2seq_correct", "pass"), ("seq2seq_causal_cross", "fail"),
])
def test_cross_attention_mask(name, expected, checks_report):
    result = checks_report(name, ["cross-attention-mask"])["cross-attention-mask"]
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


def test_an_implementation_the_library_refuses_to_switch_to_is_not_judged():
    """A class can declare SDPA while a sub-model refuses it: transformers raises ValueError from
    set_attn_implementation (VibeVoice ASR on 5.24), even to switch back to the configured one. The
    checks judge what the model runs and leave its configuration exactly as found."""
    from transformers import GPT2LMHeadModel

    class RefusesToSwitch(GPT2LMHeadModel):
        def set_attn_implementation(self, attn_implementation):
            raise ValueError(f"a sub-model does not support {attn_implementation} yet")

    model = RefusesToSwitch(hf_gpt2().config)
    report = run_checks(model, only=["future-leak", "softmax-mask-order"])
    assert [r.status.value for r in report.results] == ["pass", "pass"], [r.message for r in report.results]
    assert model.config._attn_implementation == "sdpa"


def _xlm_family(family: str, causal: bool):
    import transformers

    config = getattr(transformers, f"{family}Config")(vocab_size=128, emb_dim=32, n_layers=2, n_heads=4,
                                                      causal=causal, max_position_embeddings=64)
    return getattr(transformers, f"{family}WithLMHeadModel")(config)


@pytest.mark.parametrize("family", ["XLM", "Flaubert"])
def test_config_causal_flag_decides_xlm_and_flaubert_kind(family):
    """One class serves as a masked LM (causal=False) and a causal LM (causal=True); its name says
    LMHead both ways, and XLM's class is registered for both tasks."""
    from tfdoctor.subject import inferred_kind

    masked, causal = _xlm_family(family, False), _xlm_family(family, True)
    assert (inferred_kind(masked), inferred_kind(causal)) == ("encoder", "causal")
    report = run_checks(masked, only=["future-leak", "bidirectional-encoder", "padding-equivalence"])
    assert [r.status.value for r in report.results] == ["skip", "pass", "pass"], [r.message for r in report.results]
    assert run_checks(causal, only="future-leak")["future-leak"].status.value == "pass"


def test_xlnet_attention_type_decides_its_kind():
    """XLNetLMHeadModel is registered as a causal LM, yet with attn_type="bi" (its default) and no
    perm_mask every position reads both ways; attn_type="uni" (Transformer-XL's) is one-way."""
    from transformers import XLNetConfig, XLNetLMHeadModel

    from tfdoctor.subject import inferred_kind

    def xlnet(attn_type):
        return XLNetLMHeadModel(XLNetConfig(vocab_size=128, d_model=32, n_layer=1, n_head=2, d_inner=64,
                                            attn_type=attn_type))

    both, one = xlnet("bi"), xlnet("uni")
    assert (inferred_kind(both), inferred_kind(one)) == ("encoder", "causal")
    report = run_checks(both, only=["future-leak", "bidirectional-encoder"])
    assert [r.status.value for r in report.results] == ["skip", "pass"], [r.message for r in report.results]
    # ("uni" is not run: on transformers 5.24 its forward raises at batch sizes above 1, in the library.)


def test_an_unregistered_lmhead_class_is_told_by_what_it_reads():
    """A user's own PreTrainedModel named *LMHeadModel with nothing else to go on is measured."""
    from hf_custom_lmhead import build_causal, build_encoder
    from tfdoctor.subject import inferred_kind

    assert (inferred_kind(build_encoder()), inferred_kind(build_causal())) == ("encoder", "causal")


def test_registered_task_and_config_switches_decide_before_names():
    from transformers import BertConfig, BertForMaskedLM, BertLMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    from tfdoctor.subject import inferred_kind

    small = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    assert inferred_kind(BertForMaskedLM(BertConfig(**small))) == "encoder"
    assert inferred_kind(BertLMHeadModel(BertConfig(is_decoder=True, **small))) == "causal"
    assert inferred_kind(GPTNeoXForCausalLM(GPTNeoXConfig(**small))) == "causal"  # is_decoder=False says nothing


def test_a_given_seq_len_is_not_replaced_for_a_fixed_output_model():
    from transformers import PerceiverConfig, PerceiverForMaskedLM

    from tfdoctor.errors import SubjectError

    model = PerceiverForMaskedLM(PerceiverConfig(vocab_size=128, d_model=32, d_latents=32, num_latents=8,
                                                 num_blocks=1, num_self_attends_per_block=1, qk_channels=32,
                                                 num_self_attention_heads=2, num_cross_attention_heads=2,
                                                 max_position_embeddings=64, v_channels=32))
    with pytest.raises(SubjectError, match="expected but got"):
        resolve(Subject(model, seq_len=16))


def test_a_composite_config_gives_the_text_vocabulary():
    from hf_composite_vocab import build

    assert resolve(Subject(build())).vocab_size == 64  # not the audio tower's 1500-row table
