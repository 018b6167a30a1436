"""Invariance checks: padding-equivalence, packing-isolation, cache-consistency (model side) on the
fixtures and on tiny real Hugging Face models built locally."""

import pytest
import torch

from helpers import build_fixture
from real_models import MORE_MODELS, hf_gpt2, hf_llama, with_pad
from tfdoctor import Subject, run_checks
from tfdoctor.errors import UsageError

INVARIANCE = ["padding-equivalence", "packing-isolation", "cache-consistency"]


def one(subject, check_id, **fields):
    return run_checks(subject, only=check_id, **fields)[check_id]


# ------------------------------------------------------------------------------------- padding


def test_left_padding_with_arange_positions_fails_and_names_the_shift(checks_report):
    result = checks_report("gpt_left_pad_positions", ["padding-equivalence"])["padding-equivalence"]
    assert result.status.value == "fail"
    assert (result.details["pad_side"], result.details["cause"]) == ("left", "positions")
    # the full row agrees (no pads before it), every shorter row differs at every real position
    rows = result.details["row_differences"]
    assert rows[0] <= result.details["tolerance"] and all(d > 0.1 * result.details["output_scale"] for d in rows[1:])
    assert result.details["differing_count"] == sum(result.details["real_lengths"][1:])
    assert result.details["largest_change_from_pad_content"] <= result.details["tolerance"]  # pads unread
    assert "shift by the pad count" in result.message and "as declared" in result.message
    assert "cumsum" in result.hint


def test_positions_from_the_mask_pass_left_padded(checks_report):
    result = checks_report("gpt_left_pad_mask_positions", ["padding-equivalence"])["padding-equivalence"]
    assert result.status.value == "pass", result.message
    assert list(result.details["sides"]) == ["left"]
    assert result.details["sides"]["left"]["largest_difference"] <= result.details["sides"]["left"]["tolerance"]


def test_attended_pads_are_named_as_the_cause():
    result = one(build_fixture("gpt_left_padded"), "padding-equivalence")  # causal-only SDPA, left pads
    assert result.status.value == "fail" and result.details["cause"] == "pads"
    # a fused kernel keeps its weights: the message says how the pads may be read, not a guess
    assert "read the pads (by attention" in result.message and "attention_mask" in result.hint


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


def test_left_padding_is_probed_as_the_librarys_own_generate_calls_the_model(checks_report):
    """WhisperForCausalLM takes position_ids only through **kwargs, so its generate() hands it none and
    the decoder counts a left-padded prompt from the row's start. The probe must call it the same
    way (handing it position ids from the mask hid the defect: 'largest difference 0')."""
    from hf_whisper_causal import PAD_ID, model
    from tfdoctor.probes.invariance import generate_arguments
    from tfdoctor.subject import resolve

    result = checks_report("hf_whisper_causal", ["padding-equivalence"])["padding-equivalence"]
    assert result.status.value == "fail", result.message
    assert (result.details["pad_side"], result.details["cause"]) == ("left", "positions")
    assert result.details["largest_difference"] > 0.1 * result.details["output_scale"]
    assert result.details["declared_side"] is None and "generate()" in result.details["left_padding_evidence"]
    assert "generate() passes no position_ids" in result.message and "names" in result.hint
    # what the library's own generate() does: a left-padded prompt's next-token logits against alone
    whisper = model().eval()
    prompt = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([torch.full((1, 4), PAD_ID), prompt], 1)

    def next_logits(ids):
        out = whisper.generate(ids, attention_mask=(ids != PAD_ID).long(), max_new_tokens=1, do_sample=False,
                               output_logits=True, return_dict_in_generate=True, pad_token_id=PAD_ID)
        return out.logits[0]

    alone = next_logits(prompt)
    assert float((next_logits(padded) - alone).abs().max()) > 0.1 * float(alone.abs().max())
    assert "position_ids" not in generate_arguments(resolve(Subject(whisper, pad_id=PAD_ID)))


def test_left_padding_without_evidence_warns_naming_the_padding_side(checks_report):
    """A correct GPT with a key mask and learned positions from the row's start, side undeclared:
    nothing says it is padded on the left (no tokenizer, loop or library generate()), so the shift
    left padding would cause warns; declared right it passes, declared left it fails."""
    checks = ["padding-equivalence"]
    default = checks_report("gpt_right_pad_positions", checks)["padding-equivalence"]
    assert default.status.value == "warn", default.message
    assert default.details["cause"] == "positions" and default.details["left_padding_evidence"] is None
    assert "--padding-side right" in default.hint and "no side is declared" in default.message
    right = checks_report("gpt_right_pad_positions", checks, padding_side="right")["padding-equivalence"]
    assert right.status.value == "pass" and list(right.details["sides"]) == ["right"], right.message
    left = checks_report("gpt_right_pad_positions", checks, padding_side="left")["padding-equivalence"]
    assert left.status.value == "fail" and left.details["cause"] == "positions", left.message


# ------------------------------------------------------------------------------------- packing


def test_packed_documents_without_a_document_mask_fail_with_the_map(checks_report):
    result = checks_report("gpt_packed_no_doc_mask", ["packing-isolation"])["packing-isolation"]
    assert result.status.value == "fail" and result.details["cause"] == "attention"
    for row, lengths in zip(result.details["document_map"].values(), result.details["document_lengths"]):
        # causal, no document mask: every document reads every earlier one, none a later one
        assert row == ["".join("X" if j < i else "#" if j == i else "." for j in range(len(lengths)))
                       for i in range(len(lengths))]
    first_documents = len(result.details["documents_per_row"])
    assert result.details["differing_count"] == sum(result.details["documents_per_row"]) - first_documents
    assert "doc_ids[:, :, None] == doc_ids[:, None, :]" in result.hint


def test_packed_documents_with_a_document_mask_pass(checks_report):
    result = checks_report("gpt_packed", ["packing-isolation"])["packing-isolation"]
    assert result.status.value == "pass", result.message
    assert result.details["largest_difference"] <= result.details["tolerance"]


def test_documents_numbered_otherwise_than_alone_fail_naming_the_start(checks_report):
    """RoBERTa packed by DataCollatorWithFlattening: the documents are isolated, but numbered from 0
    where RoBERTa numbers a sequence alone from padding_idx + 1 = 2. Every document differs, the
    first of its row too; the reference is the document as the model numbers it by itself."""
    result = checks_report("hf_roberta_packed", ["packing-isolation"])["packing-isolation"]
    assert result.status.value == "fail", result.message
    assert result.details["cause"] == "numbering" and result.details["own_numbering_start"] == 2
    assert result.details["cross_document_pairs"] == 0
    assert result.details["differing_count"] == sum(result.details["documents_per_row"])
    assert result.details["numbering_difference"] > 0.1 * result.details["output_scale"]
    assert "documents are isolated" in result.message and "from 2 (padding_idx + 1" in result.message
    assert "add 2 to the collator's position_ids" in result.hint


def test_documents_numbered_as_the_model_numbers_them_alone_pass():
    """The same RoBERTa, its packed position ids shifted to the model's own numbering: quiet."""
    from hf_roberta_packed import model

    def shifted(m, input_ids, doc_ids, position_ids):
        return m(input_ids=input_ids, position_ids=position_ids + 2, use_cache=False).logits

    result = one(Subject(model(), packing=shifted, seq_len=16), "packing-isolation")
    assert result.status.value == "pass", result.message


def test_positions_not_restarting_are_named():
    """The fixed model, but the loop forgets to pass the collator's position ids."""
    from gpt_packed import DocumentAttention
    from packedgpt import PackedGPT

    subject = Subject(PackedGPT(DocumentAttention), packing=lambda m, ids, doc, pos: m(ids, doc_ids=doc))
    result = one(subject, "packing-isolation")
    assert result.status.value == "fail" and result.details["cause"] == "positions"
    assert result.details["cross_document_pairs"] == 0 and "restart" in result.message
    assert result.details["change_with_running_positions"] == 0  # measured: the ids never reach the model
    assert "do not reach the model" in result.message


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


def test_cache_path_without_the_causal_mask_diverges_in_the_prefill(checks_report):
    result = checks_report("gpt_kv_cache_no_mask", ["cache-consistency"])["cache-consistency"]
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


def test_correct_cache_passes(checks_report):
    result = checks_report("gpt_kv_cache", ["cache-consistency"])["cache-consistency"]
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

    return importlib.import_module(name).train  # fixtures/loops is on the path (pyproject's pythonpath)


TOKEN_WEIGHTED = ["token_sum_total", "num_items_in_batch", "rescale_grads_total", "masked_token_sum_scaler"]


TOKEN_CHECKS = ("token-weighting", "accumulation-scaling")


def audit(loop, only=TOKEN_CHECKS, **fields):
    return run_checks(build_fixture("gpt_pad_masked"), only=list(only), train=train_fn(loop), **fields)


def test_per_micro_batch_means_warn_with_the_weight_ratio(checks_report):
    report = checks_report("gpt_pad_masked", TOKEN_CHECKS, train="per_micro_batch_mean")  # as audit() runs it
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
def test_token_weighted_loops_pass_token_weighting_and_accumulation_scaling(loop, checks_report):
    report = checks_report("gpt_pad_masked", TOKEN_CHECKS, train=loop)  # as audit() runs it
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

    result = run_checks(build_fixture("gpt_pad_masked"), only="accumulation-scaling",
                        train=train)["accumulation-scaling"]
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
    from tfdoctor.recording.loop import train_batches
    from tfdoctor.subject import resolve

    subject = resolve(build_fixture("gpt_pad_masked"))
    batches = train_batches(subject, 8, torch.Generator().manual_seed(5))
    real = [int((b != 0).sum()) for b in batches]
    assert all(long > short for long, short in zip(real[0::2], real[1::2]))
    assert all(int((b[0] != 0).sum()) == subject.seq_len for b in batches)  # one full row each


# ------------------------------------------------------------------------------------- cache as generate() runs it

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)


def tiny_hf(name):
    """Tiny library models whose decoding conventions differ (state objects, no cache, buckets)."""
    import transformers as T

    V = 128
    builders = {
        "mamba": lambda: T.MambaForCausalLM(T.MambaConfig(
            vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4)),
        "falcon_mamba": lambda: T.FalconMambaForCausalLM(T.FalconMambaConfig(
            vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=4)),
        "recurrent_gemma": lambda: T.RecurrentGemmaForCausalLM(T.RecurrentGemmaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, lru_width=32, attention_window_size=16,
            block_types=["recurrent", "attention"])),
        "openai_gpt": lambda: T.OpenAIGPTLMHeadModel(T.OpenAIGPTConfig(vocab_size=V, n_positions=32, n_embd=32,
                                                                       n_layer=1, n_head=2)),
        "xlm": lambda: T.XLMWithLMHeadModel(T.XLMConfig(vocab_size=V, emb_dim=32, n_layers=1, n_heads=2,
                                                        max_position_embeddings=32, causal=True)),
        "cpmant": lambda: T.CpmAntForCausalLM(T.CpmAntConfig(
            vocab_size=V, hidden_size=32, num_attention_heads=2, dim_head=16, dim_ff=64, num_hidden_layers=1,
            prompt_length=2, position_bias_num_buckets=16, position_bias_max_distance=32)),
        "reformer": lambda: T.ReformerModelWithLMHead(T.ReformerConfig(
            vocab_size=V, hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=64,
            attn_layers=["local", "lsh"], axial_pos_embds=False, max_position_embeddings=64, local_attn_chunk_length=4,
            lsh_attn_chunk_length=4, num_buckets=4, is_decoder=True, pad_token_id=0, eos_token_id=2)),
        "rwkv": lambda: T.RwkvForCausalLM(T.RwkvConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                       attention_hidden_size=32, intermediate_size=64,
                                                       context_length=64)),
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**TINY)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=1, n_head=2)),
        "granitemoe": lambda: T.GraniteMoeForCausalLM(T.GraniteMoeConfig(**TINY, num_local_experts=2,
                                                                         num_experts_per_tok=1)),
    }
    return builders[name]()


def decode(model, **fields):
    return one(Subject(model, seq_len=12, batch_size=2, pad_id=1, **fields), "cache-consistency")


@pytest.mark.parametrize("name", ["mamba", "falcon_mamba", "recurrent_gemma", "llama", "gpt2"])
def test_cache_is_driven_by_the_models_own_generate(name):
    """State objects (Mamba's cache_params, RecurrentGemma's cache), a mask given on the first call only:
    each as its generate() runs it, and every position agrees with the full forward."""
    model = tiny_hf(name).train()
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    result = decode(model)
    assert result.status.value == "pass", result.message
    assert result.details["path"] == "generate"
    assert all(m.training for m in model.modules()) and hooks == sum(len(m._forward_hooks) for m in model.modules())
    left = result.details["arms"]["left-padded prompts"]
    assert left["positions_compared"] == 12 and left["decoding_calls"][1]["input_ids"] == [2, 1]
    if name in ("mamba", "falcon_mamba"):  # generate gives the mask to the prompt only
        assert "attention_mask" in left["decoding_calls"][0]["arguments"]
        assert "attention_mask" not in left["decoding_calls"][1]["arguments"]


@pytest.mark.parametrize("name", ["openai_gpt", "xlm", "cpmant"])
def test_a_generate_that_refeeds_the_sequence_skips_saying_so(name):
    result = decode(tiny_hf(name))
    assert result.status.value == "skip" and "feeds the whole sequence again" in result.message


def test_reformer_buckets_are_followed_and_never_an_error():
    """LSH hashing is random at inference (no hash_seed): the full forward cannot be a reference."""
    result = decode(tiny_hf("reformer"))
    assert result.status.value == "skip" and "random at inference" in result.message


def test_batched_decoding_shape_bug_is_the_models_own():
    """RWKV's one-token decoding returns [B, B, V] (a defect of the release); the fixture plants the same."""
    for model in (tiny_hf("rwkv"), build_fixture("hf_decode_shape")):
        result = decode(model)
        assert result.status.value == "fail", result.message
        defect = result.details["shape_defect"]
        assert defect["logits"] == [2, 2, 128] and defect["input_ids"] == [2, 1] and defect["expected"] == [2, 1, 128]
        assert "the model's cached forward, called by its own generate()" in result.message
        assert "[2, 2, 128]" in result.message and "incremental" not in result.message


def one_ulp_apart(dtype, rounded=lambda ids: ids.shape[1] == 1):
    """A Llama whose calls picked by `rounded` (one-token decoding steps by default) land one unit in
    the last place of its low precision away from the others (as another kernel's accumulation order
    does); exact in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class OtherKernelRounding(LlamaForCausalLM):
        def forward(self, input_ids=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            if input_ids is not None and rounded(input_ids) and self.dtype != torch.float32:
                out.logits = out.logits * (1 + torch.finfo(self.dtype).eps)  # rounding, not a bug
            return out

    torch.manual_seed(0)
    return OtherKernelRounding(LlamaConfig(**TINY)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_cache_rounding_is_not_a_failure(dtype):
    model = one_ulp_apart(dtype)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    result = decode(model)
    assert result.status.value == "pass", result.message
    assert result.details["compute_dtype"] == str(dtype).replace("torch.", "")
    assert result.details["relative_difference_in_compute_dtype"] > 1e-5  # over float32's tolerance: a close call
    assert "measured again in float32" in result.message
    assert all(v.dtype == dtype and torch.equal(weights[k], v) for k, v in model.state_dict().items())  # as found


def test_a_cache_bug_in_bfloat16_still_fails():
    """Decoded tokens placed at position 0: in bfloat16 a close call, measured again in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class RestartingPositions(LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            if input_ids is not None and input_ids.shape[1] == 1:
                position_ids = torch.zeros_like(input_ids)  # BUG: not the cache length
            return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)

    torch.manual_seed(0)
    result = decode(RestartingPositions(LlamaConfig(**TINY)).to(torch.bfloat16))
    assert result.status.value == "fail", result.message
    assert result.details["first_divergence"] == result.details["prefill"] == 6
    assert result.details["compute_dtype"] == "bfloat16" and "measured again in float32" in result.message


# ------------------------------------------------------------------------------------- packing, as the model runs

def packed(model, **fields):
    return one(Subject(model, packing="position_ids", seq_len=16, **fields), "packing-isolation")


def test_granitemoe_gets_use_cache_false_through_kwargs():
    """GraniteMoe takes use_cache through **kwargs: without it a cache turns off packed detection."""
    result = packed(tiny_hf("granitemoe"))
    assert result.status.value == "pass", result.message


def test_packing_is_judged_under_the_implementation_the_model_runs():
    from hf_eager_packing_leak import model

    warned = one(build_fixture("hf_eager_packing_leak"), "packing-isolation")
    assert warned.status.value == "warn", warned.message
    assert "eager" in warned.message and "do not switch" in warned.hint
    eager = model()
    eager.set_attn_implementation("eager")  # configured to run the leaking one: its verdict
    assert packed(eager).status.value == "fail"


def test_roberta_masked_lm_packed_by_position_ids_is_not_a_failure():
    result = packed(MORE_MODELS["hf-roberta"]())
    assert result.status.value in ("pass", "skip"), result.message


def test_bfloat16_packing_rounding_is_not_a_failure():
    """The packed row (a batch of one) one bfloat16 ulp away from the documents alone: a close call,
    measured again in float32, not 'positions do not restart' (the sweep's llama@bf16)."""
    result = packed(one_ulp_apart(torch.bfloat16, rounded=lambda ids: ids.shape[0] == 1))
    assert result.status.value == "pass", result.message
    assert result.details["compute_dtype"] == "bfloat16" and "measured again in float32" in result.message


def test_documents_that_differ_with_positions_read_list_the_candidates():
    """The row-offset fixture reads the restarting position ids and a table indexed from the row
    start: measured, the ids reach the model, so 'positions do not restart' is not claimed alone."""
    result = one(build_fixture("gpt_packed_row_offset"), "packing-isolation")
    assert result.status.value == "fail" and result.details["cause"] == "unexplained"
    assert result.details["cross_document_pairs"] == 0
    assert result.details["change_with_running_positions"] > result.details["tolerance"]
    assert "not told apart" in result.message and "positions that do not restart" in result.message


def test_a_model_that_raises_on_padded_prompts_is_named_not_an_error():
    result = decode(build_fixture("hf_refuses_padding"))
    assert result.status.value == "warn", result.message
    assert "raises when decoding left-padded prompts" in result.message and "RuntimeError" in result.message
    assert "prefill of 6 tokens" in result.message  # the unpadded arm was judged and agrees
