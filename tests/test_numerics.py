import math

import pytest
import torch
import torch.nn as nn

from helpers import build_fixture
from real_models import CAUSAL_MODELS
from tfdoctor import Subject, run_checks

NUMERICS_CHECKS = ["softmax-mask-order", "half-precision-mask"]

# fixture -> (softmax-mask-order, half-precision-mask). gpt_triu_mask and gpt_no_mask carry other
# mask bugs, which these two checks must not claim.
FIXTURE_EXPECTATIONS = {
    "gpt_correct": ("pass", "pass"),
    "gpt_blocked_triu": ("pass", "pass"),
    "gpt_sdpa": ("pass", "pass"),
    "gpt_triu_mask": ("pass", "pass"),
    "gpt_no_mask": ("pass", "pass"),
    "gpt_softmax_then_mask": ("fail", "pass"),
    "gpt_mask_minus_1e9": ("pass", "fail"),
}


def statuses(report):
    return tuple(report[check_id].status.value for check_id in NUMERICS_CHECKS)


@pytest.mark.parametrize("name", sorted(FIXTURE_EXPECTATIONS))
def test_numerics_checks_on_fixtures(name, checks_report):
    report = checks_report(name, NUMERICS_CHECKS)
    assert statuses(report) == FIXTURE_EXPECTATIONS[name], [r.message for r in report.results]


@pytest.mark.parametrize("name", sorted(CAUSAL_MODELS))
def test_real_causal_models_pass(name):
    report = run_checks(CAUSAL_MODELS[name](), only=NUMERICS_CHECKS)
    assert statuses(report) == ("pass", "pass"), [r.message for r in report.results]


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_hugging_face_eager_attention_weights_sum_to_one(name):
    """Under eager attention the softmax is visible; both layers' weights must be followed to V."""
    model = CAUSAL_MODELS[name]()
    model.set_attn_implementation("eager")
    result = run_checks(model, only="softmax-mask-order")["softmax-mask-order"]
    assert result.status.value == "pass", result.message
    assert result.details["weights_reaching_v"] == 2
    assert all(site["rows_off"] == 0 for site in result.details["sites"])


def test_softmax_then_mask_reports_row_sums_per_layer():
    result = run_checks(build_fixture("gpt_softmax_then_mask"), only="softmax-mask-order")["softmax-mask-order"]
    sites = result.details["sites"]
    assert [site["module"] for site in sites] == ["blocks.0.attn", "blocks.1.attn"]
    for site in sites:
        # (B=2, nh=4, T=32): every row but the last of each head loses the mass of later positions
        assert site["shape"] == [2, 4, 32, 32]
        assert site["rows"] == 2 * 4 * 32
        assert site["rows_off"] == 2 * 4 * 31
        assert site["min_row_sum"] < 0.1  # row 0 keeps ~1/T of its mass at initialisation
        assert site["max_row_sum"] == pytest.approx(1.0, abs=1e-5)
    assert "496 of 512 rows" in result.message
    assert "masked_fill(~allowed, float('-inf')).softmax" in result.hint


def test_correct_weights_sum_to_one_within_float_noise():
    result = run_checks(build_fixture("gpt_correct"), only="softmax-mask-order")["softmax-mask-order"]
    for site in result.details["sites"]:
        assert site["rows_off"] == 0
        assert abs(site["min_row_sum"] - 1) < 1e-5 and abs(site["max_row_sum"] - 1) < 1e-5


def test_sdpa_passes_with_a_note_and_counts_the_calls():
    result = run_checks(build_fixture("gpt_sdpa"), only="softmax-mask-order")["softmax-mask-order"]
    assert result.details["fused_attention_calls"] == {"scaled_dot_product_attention": 2}
    assert result.details["weights_reaching_v"] == 0
    assert "2 call(s) to scaled_dot_product_attention" in result.message


def test_minus_1e9_names_constant_module_and_dtype():
    result = run_checks(build_fixture("gpt_mask_minus_1e9"), only="half-precision-mask")["half-precision-mask"]
    fp16, bf16 = result.details["runs"]["float16"], result.details["runs"]["bfloat16"]
    assert fp16["outcome"] == "overflow error" and "without overflow" in fp16["error"]
    assert fp16["constants"][0] == {"value": -1e9, "dtype": "float16", "op": "masked_fill",
                                    "module": "blocks.0.attn", "raised": True}
    assert bf16["outcome"] == "finite" and bf16["constants"] == []  # bfloat16 reaches 3.4e38
    assert "-1e+09" in result.message and "float16" in result.message and "blocks.0.attn" in result.message
    assert "torch.finfo(scores.dtype).min" in result.hint


# ----------------------------------------------------------------------------------------------
# Small hand-written attention LMs for the spellings the fixtures do not cover


class OneHeadLM(nn.Module):
    """Embedding -> one attention written by `attend(q, k, v)` -> head."""

    def __init__(self, attend, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, vocab)
        self.attend = attend

    def forward(self, ids):
        q, k, v = self.qkv(self.emb(ids)).chunk(3, dim=-1)  # (B, T, d)
        return self.head(self.attend(q, k, v))


def _scores(q, k):
    return q @ k.mT / math.sqrt(q.shape[-1])  # (B, T, T)


def _tril(T):
    return torch.tril(torch.ones(T, T, dtype=torch.bool))


def zeroed_then_transposed(q, k, v):
    att = torch.softmax(_scores(q, k), dim=-1) * _tril(q.shape[1])  # masked after the softmax
    return (v.transpose(-2, -1) @ att.transpose(-2, -1)).transpose(-2, -1)  # att reaches V as the right operand


def zeroed_then_einsum(q, k, v):
    att = nn.functional.softmax(_scores(q, k), dim=-1).masked_fill(~_tril(q.shape[1]), 0.0)
    return torch.einsum("...ij,...jd->...id", att, v)


def zeroed_then_reshaped_bmm(q, k, v):
    B, T, d = q.shape
    att = _scores(q, k).softmax(-1)
    att[..., ~_tril(T)] = 0.0  # in place, after the softmax
    return torch.bmm(att.unsqueeze(1).reshape(B, T, T), v)


def zeroed_then_renormalised(q, k, v):
    att = _scores(q, k).softmax(-1) * _tril(q.shape[1])
    return (att / att.sum(-1, keepdim=True)) @ v  # equivalent to masking before: rows sum to one


def normalised_over_queries(q, k, v):
    att = _scores(q, k).softmax(dim=-2)  # slot-attention style: not a distribution over the keys
    return att @ v


def no_attention(q, k, v):
    return v


def signed_cog(q, k, v):
    """Cog attention (x-transformers' attn_cog_signed): softmax of |scores|, masked before it, then
    the scores' signs put back. Rows sum to 1 in magnitude: correct."""
    scores = _scores(q, k)
    sign = scores.sign()
    att = scores.abs().masked_fill(~_tril(q.shape[1]), float("-inf")).softmax(-1)
    return (att * sign) @ v


def signed_cog_zeroed_after(q, k, v):
    scores = _scores(q, k)
    att = scores.abs().softmax(-1) * scores.sign() * _tril(q.shape[1])  # masked after the softmax
    return att @ v


@pytest.mark.parametrize("attend, status", [
    (zeroed_then_transposed, "fail"),
    (zeroed_then_einsum, "fail"),
    (zeroed_then_reshaped_bmm, "fail"),
    (zeroed_then_renormalised, "pass"),
    (normalised_over_queries, "skip"),
    (no_attention, "skip"),
    (signed_cog, "pass"),
    (signed_cog_zeroed_after, "fail"),
])
def test_softmax_mask_order_follows_every_spelling(attend, status):
    result = run_checks(OneHeadLM(attend), only="softmax-mask-order")["softmax-mask-order"]
    assert result.status.value == status, result.message
    if status == "skip":
        assert "no softmax output reached a product with V" in result.message


def test_x_transformers_cog_attention_is_not_a_mask_after_the_softmax():
    """x-transformers' attn_cog_signed puts the scores' signs back after the softmax by design."""
    from x_transformers import Decoder, TransformerWrapper

    model = TransformerWrapper(num_tokens=128, max_seq_len=32,
                               attn_layers=Decoder(dim=32, depth=1, heads=2, attn_cog_signed=True))
    result = run_checks(model, only="softmax-mask-order", seq_len=16)["softmax-mask-order"]
    assert result.status.value == "pass", result.message
    assert "signed" in result.message


def _where_minus_1e9(fully_masked_first_row):
    def attend(q, k, v):
        T = q.shape[1]
        allowed = _tril(T)
        if fully_masked_first_row:  # as a left-padded row whose first query sees only pads
            allowed[0] = False
        att = torch.where(allowed, _scores(q, k), -1e9)  # saturates to -inf in float16
        return att.softmax(-1) @ v

    return attend


def test_constant_that_silently_saturates_passes_with_a_note_where_no_row_can_be_fully_masked():
    """No pad id: no row is ever fully masked, so -1e9 becoming -inf in float16 changes nothing."""
    result = run_checks(OneHeadLM(_where_minus_1e9(False)), only="half-precision-mask")["half-precision-mask"]
    assert result.status.value == "pass", result.message
    assert result.details["runs"]["float16"]["outcome"] == "finite"
    constant = result.details["runs"]["float16"]["constants"][0]
    assert (constant["value"], constant["op"], constant["raised"]) == (-1e9, "where", False)
    assert result.details["runs"]["float16"]["constants_seen"] == 1  # one attention, one forward
    assert result.details["runs"]["bfloat16"]["constants"] == []
    assert result.details["padded_runs"] is None
    assert "note: the constant -1e+09" in result.message and "--pad-id" in result.message


def test_saturating_constant_fails_where_a_padded_row_turns_nan_and_the_correct_mask_passes():
    bad = run_checks(build_fixture("gpt_pad_where_1e9"), only="half-precision-mask")["half-precision-mask"]
    assert bad.status.value == "fail", bad.message
    assert bad.details["runs"]["float16"]["outcome"] == "finite"  # no padding: harmless
    assert bad.details["padded_runs"]["float16"]["outcome"] == "non-finite"
    assert "fully padded row" in bad.message and "-1e+09" in bad.message
    good = run_checks(build_fixture("gpt_pad_masked"), only="half-precision-mask")["half-precision-mask"]
    assert good.status.value == "pass", good.message


class BufferLM(nn.Module):
    """Writes a projection into a float32 buffer in place with index_add_ (as an MoE layer gathers its
    experts' outputs): under float16 autocast the projection is float16 and index_add_ refuses it."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)  # (B, T, d), float32
        out = torch.zeros_like(x).flatten(0, 1)
        rows = torch.arange(out.shape[0])
        out.index_add_(0, rows, self.proj(x).flatten(0, 1))  # float16 under autocast: dtype mismatch
        return self.head(out.view_as(x))


def test_a_forward_that_cannot_run_under_autocast_gets_a_named_warning_not_an_error():
    result = run_checks(BufferLM(), only="half-precision-mask")["half-precision-mask"]
    assert result.status.value == "warn", result.message
    run = result.details["runs"]["float16"]
    assert run["outcome"] == "raised" and run["error"].startswith("RuntimeError: ")
    assert "cannot run under float16 autocast" in result.message and "index_add_" in result.message
    # where the model made the call, not the frame of tfdoctor's constant watcher that re-ran the op
    assert run["at"].startswith("tests/test_numerics.py:") and run["at"].endswith(" in forward"), run["at"]


def test_non_finite_outputs_only_in_float16_fail():
    result = run_checks(OneHeadLM(_where_minus_1e9(True)), only="half-precision-mask")["half-precision-mask"]
    assert result.status.value == "fail", result.message
    fp16 = result.details["runs"]["float16"]
    assert fp16["outcome"] == "non-finite" and fp16["nonfinite_outputs"] == 2 * 50  # row 0 of each sequence
    assert result.details["runs"]["bfloat16"]["outcome"] == "finite"
    assert "NaN/Inf" in result.message and "-1e+09" in result.message


class TinySeq2Seq(nn.Module):
    def __init__(self, vocab=60, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.transformer = nn.Transformer(d, 4, 1, 1, 64, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.transformer(self.emb(src), self.emb(tgt), tgt_mask=mask))


def test_torch_nn_transformer_seq2seq_passes_both():
    report = run_checks(Subject(TinySeq2Seq(), kind="seq2seq"), only=NUMERICS_CHECKS)
    assert statuses(report) == ("pass", "pass"), [r.message for r in report.results]
    assert "multi_head_attention_forward" in report["softmax-mask-order"].details["fused_attention_calls"]


def test_encoder_kind_is_examined_too():
    report = run_checks(Subject(build_fixture("gpt_softmax_then_mask"), kind="encoder"), only=NUMERICS_CHECKS)
    assert statuses(report) == ("fail", "pass")


def test_model_and_process_left_as_found():
    model = build_fixture("gpt_mask_minus_1e9")
    model.train()
    model.blocks[1].eval()  # mixed flags must come back as they were
    flags = [m.training for m in model.modules()]
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    run_checks(model, only=NUMERICS_CHECKS)
    assert [m.training for m in model.modules()] == flags
    assert all(torch.equal(p, params[name]) and p.dtype == torch.float32 for name, p in model.named_parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not torch.is_autocast_enabled("cpu")
    assert torch.randn(1).dtype == torch.float32
    out = model(torch.randint(0, 96, (1, 8)))  # no function mode left behind: plain float32 forward
    assert out.dtype == torch.float32 and torch.overrides._get_current_function_mode_stack() == []


# ------------------------------------------------------------------------------------------------
# masked-row-nan names the op where the first NaN appears (issue 17 item 7)


def test_nan_gradient_from_a_root_at_zero_is_not_blamed_on_the_softmax():
    """eps outside the root of a zero pad embedding's mean square: the gradient is NaN at the pads,
    the attention's finfo.min mask is innocent. The same model with eps inside the root is quiet."""
    bad = run_checks(build_fixture("gpt_pad_rms_root"), only="masked-row-nan")["masked-row-nan"]
    assert bad.status.value == "fail", bad.message
    assert bad.details["first_nonfinite"] == {"phase": "backward", "op": "pow", "module": "emb_norm",
                                              "node": "PowBackward0"}
    assert "softmax(-inf" not in bad.message and "not at an attention softmax" in bad.message
    assert "inside the root" in bad.hint
    good = run_checks(build_fixture("gpt_pad_rms"), only="masked-row-nan")["masked-row-nan"]
    assert good.status.value == "pass", good.message


def test_nan_from_a_fully_masked_softmax_row_is_blamed_on_it():
    result = run_checks(build_fixture("gpt_pad_neg_inf"), only="masked-row-nan")["masked-row-nan"]
    assert result.status.value == "fail"
    assert result.details["first_nonfinite"]["op"] == "softmax"
    assert result.details["first_nonfinite"]["module"] == "blocks.0.attn"
    assert "softmax(-inf, ..., -inf) = NaN" in result.message


# ------------------------------------------------------------------------------------------------
# finite-logits: NaN on valid random tokens is a failed check, not a usage error (issue 17 item 17)


@pytest.fixture
def diagonal_blocked_report(checks_report):
    return checks_report("gpt_diagonal_blocked", ["future-leak", "init-loss"])


def test_nan_logits_fail_finite_logits_naming_rows_positions_and_the_mask_row(diagonal_blocked_report):
    report = diagonal_blocked_report
    assert [r.id for r in report.results] == ["finite-logits", "future-leak", "init-loss"]
    result = report["finite-logits"]
    assert result.status.value == "fail" and report.exit_code() == 1
    assert result.details["nan_in_every_row"] == [0]
    assert result.details["rows"] == {str(row): [0] for row in range(4)}  # the probe batch: 4 rows
    assert result.details["first_nonfinite"]["op"] == "softmax"
    assert "position 0 is NaN in every row" in result.message and "diagonal=1" in result.hint


def test_model_checks_skip_on_nan_logits_saying_why(diagonal_blocked_report):
    for check_id in ("future-leak", "init-loss"):
        assert diagonal_blocked_report[check_id].status.value == "skip"
        assert "see finite-logits" in diagonal_blocked_report[check_id].message


def test_finite_logits_passes_a_correct_model(checks_report):
    result = checks_report("gpt_correct", ["finite-logits"])["finite-logits"]
    assert result.status.value == "pass" and result.details["nonfinite_positions"] == 0


@pytest.mark.e2e
def test_nan_logits_exit_1_from_the_command():
    import json

    from helpers import tfdoctor

    done = tfdoctor("check", "tests/targets/hostile.py:nan_logits", "--only", "init-loss", "--format", "json",
                    module=True, timeout=120)
    assert done.returncode == 1, done.stderr
    checks = {c["id"]: c["status"] for c in json.loads(done.stdout)["checks"]}
    assert checks == {"finite-logits": "fail", "init-loss": "skip"}


class _CodebookRows(nn.Module):
    """Correct: like MusicGen, whose batch rows are the codebooks of its samples, it takes only an even
    number of rows (two codebooks per sample) and raises otherwise, in its own code."""

    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(2 * d, 2 * vocab)

    def forward(self, ids):
        B, T = ids.shape
        x = self.emb(ids).reshape(-1, 2, T, self.emb.embedding_dim).transpose(1, 2).reshape(B // 2, T, -1)
        out = torch.cumsum(x, dim=1) / torch.arange(1, T + 1).view(1, T, 1)  # (B/2, T, 2d): the past only
        return self.head(out).reshape(B // 2, T, 2, -1).transpose(1, 2).reshape(B, T, -1)


def test_finite_logits_probes_the_batch_size_the_other_checks_use():
    result = run_checks(_CodebookRows(), only="finite-logits")["finite-logits"]
    assert result.status.value == "pass", result.message
