"""Invariance checks: padding-equivalence, packing-isolation, cache-consistency (model side) on the
fixtures and on tiny real Hugging Face models built locally."""

import pytest
import torch

from conftest import build_fixture
from real_models import MORE_MODELS, hf_gpt2, hf_llama, with_pad
from tfdoctor import Subject, run_checks
from tfdoctor.errors import UsageError

INVARIANCE = ["padding-equivalence", "packing-isolation", "cache-consistency"]


def one(subject, check_id, **fields):
    return run_checks(subject, only=check_id, **fields)[check_id]


# ------------------------------------------------------------------------------------- padding


def test_left_padding_with_arange_positions_fails_and_names_the_shift():
    result = one(build_fixture("gpt_left_pad_positions"), "padding-equivalence")
    assert result.status.value == "fail"
    assert (result.details["pad_side"], result.details["cause"]) == ("left", "positions")
    # the full row agrees (no pads before it), every shorter row differs at every real position
    rows = result.details["row_differences"]
    assert rows[0] <= result.details["tolerance"] and all(d > 0.1 * result.details["output_scale"] for d in rows[1:])
    assert result.details["differing_count"] == sum(result.details["real_lengths"][1:])
    assert result.details["largest_change_from_pad_content"] <= result.details["tolerance"]  # pads unread
    assert "shift by the pad count" in result.message and "as declared" in result.message
    assert "cumsum" in result.hint


def test_positions_from_the_mask_pass_left_padded():
    result = one(build_fixture("gpt_left_pad_mask_positions"), "padding-equivalence")
    assert result.status.value == "pass", result.message
    assert list(result.details["sides"]) == ["left"]
    assert result.details["sides"]["left"]["largest_difference"] <= result.details["sides"]["left"]["tolerance"]


def test_attended_pads_are_named_as_the_cause():
    result = one(build_fixture("gpt_left_padded"), "padding-equivalence")  # causal-only SDPA, left pads
    assert result.status.value == "fail" and result.details["cause"] == "pads"
    assert "attend to the pads" in result.message and "attention_mask" in result.hint


def test_unknown_side_left_only_difference_warns():
    result = one(build_fixture("gpt_pad_unmasked"), "padding-equivalence")
    assert result.status.value == "warn"
    assert result.details["declared_side"] is None and result.details["pad_side"] == "left"
    right = result.details["sides"]["right"]
    assert right["largest_difference"] <= right["tolerance"]
    assert "--padding-side right" in result.hint


def test_right_padded_causal_model_without_key_mask_passes():
    assert one(build_fixture("gpt_right_padded"), "padding-equivalence").status.value == "pass"


def test_batch_dependent_operation_is_named():
    """A model that centres its logits on the batch mean: each row depends on the others."""
    inner = build_fixture("gpt_pad_masked").model

    class BatchCentred(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = inner
            self.pad_id = inner.pad_id

        def forward(self, ids):
            logits = self.gpt(ids)
            return logits - logits.mean(dim=0, keepdim=True)  # BUG: a statistic over the batch

    result = one(Subject(BatchCentred(), pad_id=0, padding_side="right"), "padding-equivalence")
    assert result.status.value == "fail" and result.details["cause"] == "batch"
    assert result.details["row_alone_vs_in_batch"] > result.details["tolerance"]


def test_padding_equivalence_skips_without_pad_id_and_for_seq2seq():
    assert one(build_fixture("gpt_correct"), "padding-equivalence").status.value == "skip"
    result = one(build_fixture("seq2seq_correct"), "padding-equivalence")
    assert result.status.value == "skip" and "seq2seq" in result.message


@pytest.mark.parametrize("factory", [hf_gpt2, hf_llama, MORE_MODELS["hf-qwen2"]], ids=["gpt2", "llama", "qwen2"])
def test_hugging_face_causal_lms_are_padding_equivalent_with_positions_from_the_mask(factory):
    result = one(Subject(factory(), pad_id=0), "padding-equivalence")
    assert result.status.value == "pass", result.message
    assert set(result.details["sides"]) == {"right", "left"}
    assert result.details["attn_implementations"] == ["eager", "sdpa"]


def test_hugging_face_gpt2_left_padded_without_position_ids_fails():
    """GPT-2 builds arange positions when none are passed: a user forward that forgets them shifts."""
    model = hf_gpt2()
    subject = Subject(model, pad_id=0, padding_side="left",
                      forward=lambda m, ids: m(input_ids=ids, attention_mask=(ids != 0).long()).logits)
    result = one(subject, "padding-equivalence")
    assert result.status.value == "fail" and result.details["cause"] == "positions"


# ------------------------------------------------------------------------------------- packing


def test_packed_documents_without_a_document_mask_fail_with_the_map():
    result = one(build_fixture("gpt_packed_no_doc_mask"), "packing-isolation")
    assert result.status.value == "fail" and result.details["cause"] == "attention"
    for row, lengths in zip(result.details["document_map"].values(), result.details["document_lengths"]):
        # causal, no document mask: every document reads every earlier one, none a later one
        assert row == ["".join("X" if j < i else "#" if j == i else "." for j in range(len(lengths)))
                       for i in range(len(lengths))]
    first_documents = len(result.details["documents_per_row"])
    assert result.details["differing_count"] == sum(result.details["documents_per_row"]) - first_documents
    assert "doc_ids[:, :, None] == doc_ids[:, None, :]" in result.hint


def test_packed_documents_with_a_document_mask_pass():
    result = one(build_fixture("gpt_packed"), "packing-isolation")
    assert result.status.value == "pass", result.message
    assert result.details["largest_difference"] <= result.details["tolerance"]


def test_positions_not_restarting_are_named():
    """The fixed model, but the loop forgets to pass the collator's position ids."""
    from packedgpt import PackedGPT

    from gpt_packed import DocumentAttention

    subject = Subject(PackedGPT(DocumentAttention), packing=lambda m, ids, doc, pos: m(ids, doc_ids=doc))
    result = one(subject, "packing-isolation")
    assert result.status.value == "fail" and result.details["cause"] == "positions"
    assert result.details["cross_document_pairs"] == 0 and "restart" in result.message


def test_packing_isolation_skips_unless_the_subject_packs():
    result = one(build_fixture("gpt_correct"), "packing-isolation")
    assert result.status.value == "skip" and "packing=" in result.message
    with pytest.raises(UsageError, match="unknown packing"):
        run_checks(Subject(build_fixture("gpt_correct"), packing="cu_seqlens"), only="packing-isolation")


@pytest.mark.parametrize("factory", [hf_gpt2, hf_llama, MORE_MODELS["hf-qwen2"]], ids=["gpt2", "llama", "qwen2"])
def test_hugging_face_position_id_packing_isolates_documents(factory):
    result = one(Subject(factory(), packing="position_ids"), "packing-isolation")
    assert result.status.value == "pass", result.message
    assert result.details["documents_per_row"] == [4]  # one flattened row, as DataCollatorWithFlattening builds
    # transformers 5 reads packing off the position ids only without a cache: said in the message
    if "difference_with_config_use_cache" in result.details:
        assert "use_cache=False" in result.message


# ------------------------------------------------------------------------------------- cache


def test_cache_path_without_the_causal_mask_diverges_in_the_prefill():
    result = one(build_fixture("gpt_kv_cache_no_mask"), "cache-consistency")
    assert result.status.value == "fail"
    assert result.details["first_divergence"] == 0 and result.details["first_divergence"] < result.details["prefill"]
    assert "drops the causal mask" in result.message


def test_cache_positions_restarting_diverge_at_the_first_decoded_token():
    result = one(build_fixture("gpt_kv_cache_positions"), "cache-consistency")
    assert result.status.value == "fail"
    assert result.details["first_divergence"] == result.details["prefill"] == 16
    by_position = result.details["arms"]["unpadded"]["difference_by_position"]
    assert max(by_position[:16]) <= result.details["arms"]["unpadded"]["tolerance"]
    assert "arange(past, past + t)" in result.hint


def test_correct_cache_passes():
    result = one(build_fixture("gpt_kv_cache"), "cache-consistency")
    assert result.status.value == "pass", result.message
    assert result.details["path"] == "incremental"


def test_cache_consistency_skips_without_a_cache_path():
    result = one(build_fixture("gpt_correct"), "cache-consistency")
    assert result.status.value == "skip" and "incremental=" in result.message


@pytest.mark.parametrize("factory", [hf_gpt2, hf_llama, MORE_MODELS["hf-qwen2"]], ids=["gpt2", "llama", "qwen2"])
def test_hugging_face_cache_matches_the_full_forward_also_left_padded(factory):
    model = factory()
    result = one(model, "cache-consistency")
    assert result.status.value == "pass", result.message
    assert set(result.details["arms"]) == {"unpadded", "left-padded prompts"}
    assert result.details["attn_implementations"] == ["eager", "sdpa"]
    assert model.config._attn_implementation == "sdpa"  # restored


def test_a_hugging_face_cache_that_offsets_positions_fails():
    """A subclass that feeds decoded tokens at position 0, as a hand-written generate loop might."""
    from transformers import GPT2LMHeadModel

    class RestartingPositions(GPT2LMHeadModel):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            if input_ids is not None and input_ids.shape[1] == 1:
                position_ids = torch.zeros_like(input_ids)  # BUG: not the cache length
            return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)

    result = one(RestartingPositions(hf_gpt2().config), "cache-consistency")
    assert result.status.value == "fail" and result.details["first_divergence"] == result.details["prefill"]


# ------------------------------------------------------------------------------------- shared


@pytest.mark.parametrize("name", ["gpt_left_pad_positions", "gpt_packed_no_doc_mask", "gpt_kv_cache_no_mask"])
def test_invariance_checks_leave_the_model_as_found(name):
    built = build_fixture(name)
    model = built.model
    model.train()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    run_checks(built, only=INVARIANCE)
    assert all(m.training for m in model.modules())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert hooks == sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_catalogue_entries_end_with_the_fix():
    from tfdoctor.registry import all_checks

    docs = {spec.id: spec.doc for spec in all_checks()}
    for check_id in INVARIANCE + ["token-weighting"]:
        assert docs[check_id].split("\n\n")[-1].startswith("Fix:"), check_id


def test_real_models_in_the_battery_use_with_pad():
    """The padded real models of test_kinds go through padding-equivalence on both sides."""
    result = one(with_pad(hf_gpt2)(), "padding-equivalence")
    assert result.status.value == "pass" and set(result.details["sides"]) == {"right", "left"}


# ------------------------------------------------------------------------------------- token weighting


def train_fn(name):
    import importlib
    import sys

    from conftest import FIXTURES

    loops = str(FIXTURES / "loops")
    if loops not in sys.path:
        sys.path.insert(0, loops)
    return importlib.import_module(name).train


TOKEN_WEIGHTED = ["token_sum_total", "num_items_in_batch", "rescale_grads_total", "masked_token_sum_scaler"]


def audit(loop, only=("token-weighting", "accumulation-scaling"), **fields):
    return run_checks(build_fixture("gpt_pad_masked"), only=list(only), train=train_fn(loop), **fields)


def test_per_micro_batch_means_warn_with_the_weight_ratio():
    report = audit("per_micro_batch_mean")
    result = report["token-weighting"]
    assert result.status.value == "warn"
    tokens, means = result.details["tokens_per_micro_batch"], result.details["mean_weight_per_micro_batch"]
    # each micro-batch's mean / k: a token weighs 1 / (k * its micro-batch's tokens)
    for n, w in zip(tokens, means):
        assert w == pytest.approx(1 / (4 * n), rel=1e-3)
    assert result.details["weight_ratio"] == pytest.approx(max(tokens) / min(tokens), rel=1e-3)
    assert result.details["weight_ratio"] > 1.5  # the fed batches alternate long and short
    assert f"{result.details['weight_ratio']:.1f}x" in result.message and "num_items_in_batch" in result.hint
    assert report["accumulation-scaling"].status.value == "pass"  # the step's total weight is right
    strict = run_checks(build_fixture("gpt_pad_masked"), only="token-weighting", train=train_fn("per_micro_batch_mean"))
    strict.strict = True
    assert strict.exit_code().value == 1


@pytest.mark.parametrize("loop", TOKEN_WEIGHTED)
def test_token_weighted_loops_pass_token_weighting_and_accumulation_scaling(loop):
    report = audit(loop)
    assert report["token-weighting"].status.value == "pass", report["token-weighting"].message
    assert report["token-weighting"].details["weight_ratio"] == pytest.approx(1.0, abs=1e-3)
    scaling = report["accumulation-scaling"]
    assert scaling.status.value == "pass", scaling.message
    assert scaling.details["gradient_factor"] == pytest.approx(1.0, rel=1e-3)


def test_gradients_rescaled_after_backward_are_judged_at_the_step():
    scaling = audit("rescale_grads_total")["accumulation-scaling"]
    tokens = audit("rescale_grads_total", only=["token-weighting"])["token-weighting"].details
    # the backward sends each token weight 1 (summed loss); .grad is then multiplied by 1 / tokens
    step = tokens["window"]
    assert scaling.details["grad_rescale"][step] == pytest.approx(1 / sum(tokens["tokens_per_micro_batch"]), rel=1e-3)
    assert "rescales the accumulated gradients" in scaling.message


def test_rescaling_by_k_squared_still_fails():
    """Divided twice (the loss by k, then .grad by k): the step is k times too small."""
    import torch.nn.functional as F

    def train(model, batches):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step, ids in enumerate(batches):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), ignore_index=0)
            (loss / 4).backward()
            if (step + 1) % 4 == 0:
                for p in model.parameters():
                    p.grad.div_(4)  # BUG: divided a second time
                optimizer.step()
                optimizer.zero_grad()

    result = run_checks(build_fixture("gpt_pad_masked"), only="accumulation-scaling", train=train)["accumulation-scaling"]
    assert result.status.value == "fail"
    assert result.details["gradient_factor"] == pytest.approx(0.25, rel=1e-3)


@pytest.mark.parametrize("loop", ["token_sum_total", "rescale_grads_total"])
def test_overfit_batch_passes_token_weighted_loops(loop):
    result = audit(loop, only=["overfit-batch"])["overfit-batch"]
    assert result.status.value == "pass", result.message


def test_token_weighting_skips_without_accumulation_or_pad_id():
    one_backward = audit("no_zero_grad", only=["token-weighting"])["token-weighting"]  # no accumulation
    assert one_backward.status.value == "skip" and "one backward" in one_backward.message
    no_pad = run_checks(build_fixture("gpt_correct"), only="token-weighting", train=train_fn("per_micro_batch_mean"))
    assert no_pad["token-weighting"].status.value == "skip" and "pad_id" in no_pad["token-weighting"].message


def test_fed_batches_alternate_long_and_short():
    from tfdoctor.probes.batches import train_batches
    from tfdoctor.subject import resolve

    subject = resolve(build_fixture("gpt_pad_masked"))
    batches = train_batches(subject, 8, torch.Generator().manual_seed(5))
    real = [int((b != 0).sum()) for b in batches]
    assert all(long > short for long, short in zip(real[0::2], real[1::2]))
    assert all(int((b[0] != 0).sum()) == subject.seq_len for b in batches)  # one full row each
