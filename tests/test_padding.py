import pytest
import torch

from conftest import build_fixture
from tfdoctor import Subject, run_checks
from tfdoctor.probes.padding import pad_counts

PAD_CHECKS = ["padding-mask", "masked-row-nan"]

# fixture -> (padding-mask, masked-row-nan)
EXPECTED = {
    "gpt_pad_masked": ("pass", "pass"),
    "gpt_pad_unmasked": ("fail", "pass"),
    "gpt_pad_neg_inf": ("skip", "fail"),  # its real positions are NaN already: masked-row-nan says why
    "encoder_correct": ("pass", "pass"),
    "encoder_causal": ("pass", "pass"),
    "seq2seq_correct": ("pass", "pass"),
    "seq2seq_causal_cross": ("pass", "pass"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_padding_checks_on_fixtures(name):
    report = run_checks(build_fixture(name), only=PAD_CHECKS)
    assert tuple(r.status.value for r in report.results) == EXPECTED[name], [r.message for r in report.results]


def test_padding_mask_names_the_moved_positions_and_the_key_mask():
    result = run_checks(build_fixture("gpt_pad_unmasked"), only="padding-mask")["padding-mask"]
    assert result.details["pad_side"] == "left"
    assert result.details["moved_count"] == 4 * 32 - sum(pad_counts(4, 32))  # every real position
    first = result.details["moved_positions"][0]
    assert first["position"] >= result.details["pads_per_row"][first["row"]]  # a real (non-pad) position
    assert "(B, 1, 1, T)" in result.hint and "pad id 0 is not masked" in result.message


def test_masked_row_nan_reports_outputs_and_gradients():
    result = run_checks(build_fixture("gpt_pad_neg_inf"), only="masked-row-nan")["masked-row-nan"]
    assert result.details["nonfinite_rows"][0] == 0  # the fully padded row
    assert result.details["nonfinite_grad_param_count"] > 0
    assert "torch.finfo" in result.hint


def test_masked_row_nan_leaves_grads_untouched():
    subject = build_fixture("gpt_pad_neg_inf")
    run_checks(subject, only="masked-row-nan")
    assert all(p.grad is None for p in subject.model.parameters())


def test_padding_checks_skip_without_pad_id():
    report = run_checks(build_fixture("gpt_correct"), only=PAD_CHECKS)
    assert [r.status.value for r in report.results] == ["skip", "skip"]
    assert "--pad-id" in report["padding-mask"].message


def test_padding_mask_skips_when_no_embedding_is_found():
    class OneHot(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, ids):
            return self.proj(torch.nn.functional.one_hot(ids, 16).float())

    result = run_checks(Subject(OneHot(), vocab_size=16, pad_id=0), only="padding-mask")["padding-mask"]
    assert result.status.value == "skip" and "embedding" in result.message


def test_pad_counts_cover_short_and_long_padding():
    counts = pad_counts(4, 32)
    assert counts[0] >= 1 and counts[-1] < 32 and counts == sorted(counts)
