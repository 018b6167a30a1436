import pytest
import torch

from helpers import build_fixture
from tfdoctor import Subject, run_checks
from tfdoctor.errors import UsageError
from tfdoctor.probes.padding import pad_counts
from tfdoctor.recording.loop import train_batches
from tfdoctor.subject import resolve

PAD_CHECKS = ["padding-mask", "masked-row-nan"]

# fixture -> (padding-mask, masked-row-nan)
EXPECTED = {
    "gpt_pad_masked": ("pass", "pass"),
    "gpt_pad_unmasked": ("warn", "pass"),  # side unknown: left-pad attention matters only when left-padded
    "gpt_pad_neg_inf": ("pass", "fail"),  # right padding is clean; left and fully padded rows go NaN
    "gpt_right_padded": ("pass", "pass"),  # no key mask, right padding: the causal mask hides the pads
    "gpt_left_padded": ("fail", "pass"),
    "encoder_correct": ("pass", "pass"),
    "encoder_causal": ("pass", "pass"),
    "seq2seq_correct": ("pass", "pass"),
    "seq2seq_causal_cross": ("pass", "pass"),
    "seq2seq_seq_first": ("pass", "pass"),
}
REAL_POSITIONS = 4 * 32 - sum(pad_counts(4, 32))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_padding_checks_on_fixtures(name, checks_report):
    report = checks_report(name, PAD_CHECKS)
    assert tuple(r.status.value for r in report.results) == EXPECTED[name], [r.message for r in report.results]


def test_padding_mask_names_the_moved_positions_and_the_key_mask():
    result = run_checks(build_fixture("gpt_left_padded"), only="padding-mask")["padding-mask"]
    assert result.status.value == "fail"
    assert (result.details["pad_side"], result.details["declared_side"]) == ("left", "left")
    assert result.details["moved_count"] == REAL_POSITIONS  # every real position
    first = result.details["moved_positions"][0]
    assert first["position"] >= result.details["pads_per_row"][first["row"]]  # a real (non-pad) position
    assert "(B, 1, 1, T)" in result.hint and "pad id 0 is not masked" in result.message
    assert "as declared" in result.message and list(result.details["sides"]) == ["left"]


def test_unknown_side_left_pad_attention_warns_and_says_when_it_matters():
    result = run_checks(build_fixture("gpt_pad_unmasked"), only="padding-mask")["padding-mask"]
    assert result.status.value == "warn"
    assert result.details["declared_side"] is None and result.details["pad_side"] == "left"
    assert result.details["moved_count"] == REAL_POSITIONS
    right = result.details["sides"]["right"]
    assert "moved_count" not in right and right["largest_change"] <= right["tolerance"]
    assert "batched generation" in result.message and "left-padded" in result.message
    assert "--padding-side right" in result.hint and "(B, 1, 1, T)" in result.hint


@pytest.mark.parametrize("side, expected", [("right", "pass"), ("left", "fail")])
def test_declared_side_decides_on_a_model_without_key_mask(side, expected):
    """The same causal-only model: correct when trained right-padded, a bug when left-padded."""
    report = run_checks(build_fixture("gpt_pad_unmasked"), only="padding-mask", padding_side=side)
    result = report["padding-mask"]
    assert result.status.value == expected, result.message
    assert result.details["declared_side"] == side and list(result.details["sides"]) == [side]


def test_a_causal_model_that_reads_trailing_pads_fails_on_the_right():
    """No causal mask at all: real positions read the pads after them, whatever the side."""
    result = run_checks(Subject(build_fixture("gpt_no_mask"), pad_id=0), only="padding-mask")["padding-mask"]
    assert result.status.value == "fail"
    assert result.details["pad_side"] == "right" and "read the pads after them" in result.message


def _tokenizer(padding_side: str):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "world": 3}
    words = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words,
                                   pad_token="[PAD]", unk_token="[UNK]", padding_side=padding_side)


@pytest.mark.parametrize("side, expected", [("right", "pass"), ("left", "fail")])
def test_a_hugging_face_tokenizer_gives_the_side_and_the_pad_id(side, expected):
    from gpt_right_padded import CausalAttention
    from tinygpt import GPT

    tokenizer = _tokenizer(side)
    assert tokenizer(["hello", "hello world"], padding=True)["input_ids"][0] == ([2, 0] if side == "right" else [0, 2])
    subject = Subject(GPT(CausalAttention), tokenizer=tokenizer)
    assert (resolve(subject).pad_id, resolve(subject).padding_side) == (0, side)
    assert run_checks(subject, only="padding-mask")["padding-mask"].status.value == expected


def test_the_declared_side_wins_over_the_tokenizer():
    from gpt_right_padded import CausalAttention
    from tinygpt import GPT

    subject = Subject(GPT(CausalAttention), tokenizer=_tokenizer("left"), padding_side="right")
    assert resolve(subject).padding_side == "right"


@pytest.mark.parametrize("side, expected", [("right", "pass"), ("left", "fail")])
def test_padding_mask_on_a_sequence_first_model(side, expected):
    """The embedding sees the ids as [T, B]: the pads are perturbed where they sit there."""
    from word_lm import TransformerModel

    result = run_checks(Subject(TransformerModel(), pad_id=0, padding_side=side), only="padding-mask")["padding-mask"]
    assert result.status.value == expected, result.message
    if expected == "fail":
        assert result.details["moved_count"] == REAL_POSITIONS


def test_masked_row_nan_pads_the_declared_side():
    result = run_checks(build_fixture("gpt_right_padded"), only="masked-row-nan")["masked-row-nan"]
    assert result.details["pad_side"] == "right"
    fully_padded = run_checks(build_fixture("gpt_pad_neg_inf"), only="masked-row-nan", padding_side="right")
    assert fully_padded["masked-row-nan"].status.value == "fail"  # the fully padded row is NaN on either side


def test_an_unknown_padding_side_is_a_usage_error():
    with pytest.raises(UsageError, match="padding side"):
        run_checks(build_fixture("gpt_pad_masked"), only="padding-mask", padding_side="middle")


@pytest.mark.parametrize("side", [None, "right", "left"])
def test_the_loop_is_fed_the_declared_side(side):
    subject = resolve(Subject(build_fixture("gpt_pad_unmasked").model, pad_id=0, padding_side=side))
    (batch,) = train_batches(subject, 1, torch.Generator().manual_seed(0))
    padded = batch == 0
    assert not padded[0].any()  # one full row, as a batch padded to its longest row
    lengths = (~padded).sum(1)
    positions = torch.arange(batch.shape[1])
    for row, length in enumerate(lengths.tolist()):
        real = positions >= batch.shape[1] - length if side == "left" else positions < length
        assert torch.equal(~padded[row], real)
    assert lengths[1:].lt(batch.shape[1]).any()  # and some rows really padded


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


@pytest.mark.parametrize("name, expected", [
    ("build_tuple", ("pass", "pass")),  # get_input_embeddings() returns (embedding, scale)
    ("build_tuple_unmasked", ("fail", "fail")),  # the same, attending to its pads
    ("build_fixed_queries", ("skip", "skip")),  # a Parameter for embeddings; a fixed number of outputs
])
def test_padding_checks_reach_embeddings_that_are_not_a_tensor_module(name, expected):
    import hf_odd_embeddings

    report = run_checks(getattr(hf_odd_embeddings, name)(), only=["padding-mask", "padding-equivalence"])
    assert tuple(r.status.value for r in report.results) == expected, [r.message for r in report.results]
    if name == "build_fixed_queries":
        assert "16 outputs for 8 input tokens" in report["padding-equivalence"].message


def test_padding_checks_on_ibert_and_perceiver():
    """I-BERT's embedding returns a tuple; Perceiver's get_input_embeddings() is its latent array and
    its decoder answers with a fixed number of outputs."""
    import transformers as tf

    small = dict(vocab_size=128, num_hidden_layers=1, num_attention_heads=2)
    ibert = tf.IBertForMaskedLM(tf.IBertConfig(hidden_size=32, intermediate_size=64, max_position_embeddings=40,
                                               **small))
    report = run_checks(Subject(ibert, pad_id=1), only=["padding-mask", "padding-equivalence"])
    assert [r.status.value for r in report.results] == ["pass", "pass"], [r.message for r in report.results]
    perceiver = tf.PerceiverForMaskedLM(tf.PerceiverConfig(
        vocab_size=128, d_model=32, d_latents=32, num_latents=8, num_blocks=1, num_self_attends_per_block=1,
        num_self_attention_heads=2, num_cross_attention_heads=2, max_position_embeddings=64, qk_channels=32,
        v_channels=32))
    assert resolve(Subject(perceiver)).seq_len == 64  # probed where its 64 outputs line up with the inputs
    report = run_checks(Subject(perceiver, pad_id=1), only=["padding-mask", "padding-equivalence", "overfit-batch"])
    assert [r.status.value for r in report.results] == ["skip"] * 3, [r.message for r in report.results]
    assert "64 outputs for 32 input tokens" in report["padding-equivalence"].message
    assert "64 outputs for 32 input tokens" in report["overfit-batch"].message  # not a ValueError of the loss


@pytest.fixture(scope="module")
def mask_arg_reports():
    import gpt_mask_arg

    checks = ["padding-mask", "padding-equivalence"]
    reports = {name: run_checks(getattr(gpt_mask_arg, name)(), only=checks)
               for name in ("build", "build_correct", "build_unmasked_left")}
    reports.update({f"{name}@left": run_checks(getattr(gpt_mask_arg, name)("left"), only=checks)
                    for name in ("build", "build_unmasked_left")})
    return reports


def test_a_key_mask_is_no_evidence_of_left_padding(mask_arg_reports):
    """Side undeclared, a hand-written model handed a key mask: a left-padding bug warns naming
    --padding-side (a model padded only on the right needs the mask too); declared left, it fails."""
    result = mask_arg_reports["build"]["padding-equivalence"]
    assert result.status.value == "warn", result.message
    assert result.details["cause"] == "positions" and result.details["largest_attention_on_pads"] == 0.0
    assert result.details["left_padding_evidence"] is None
    assert "--padding-side right" in result.hint and "--padding-side left" in result.hint
    assert "no side is declared" in result.message
    declared = mask_arg_reports["build@left"]["padding-equivalence"]
    assert declared.status.value == "fail" and declared.details["cause"] == "positions", declared.message
    assert "as declared" in declared.message
    attends = mask_arg_reports["build_unmasked_left"]["padding-mask"]
    assert attends.status.value == "warn" and attends.details["pad_side"] == "left", attends.message
    declared = mask_arg_reports["build_unmasked_left@left"]["padding-mask"]
    assert declared.status.value == "fail" and declared.details["pad_side"] == "left", declared.message
    assert [r.status.value for r in mask_arg_reports["build_correct"].results] == ["pass", "pass"]


def test_attention_to_pads_whose_content_is_overwritten_is_named_as_attention():
    """XLM as a causal LM zeroes its pads' states but its causal mask lets real tokens attend to
    them: the pads' content changes nothing, their number does. The softmax weights say why."""
    from test_kinds import _xlm_family

    result = run_checks(_xlm_family("XLM", True), only="padding-equivalence")["padding-equivalence"]
    assert result.status.value == "fail" and result.details["pad_side"] == "left"
    assert result.details["cause"] == "pads-attended" and result.details["largest_attention_on_pads"] > 0.1
    assert "attend to the pads" in result.message and "positions are counted" not in result.message


def test_a_mask_taken_but_never_read_is_no_key_mask():
    """attention_mask in the signature, ignored in the forward (RWKV): left pads read only warn."""
    from hf_custom_lmhead import build_causal_mask_unused

    result = run_checks(Subject(build_causal_mask_unused(), pad_id=0), only="padding-mask")["padding-mask"]
    assert result.status.value == "warn" and result.details["pad_side"] == "left", result.message
    assert "takes a key mask" not in result.message


def test_how_pads_are_read_is_the_way_measured():
    """Softmax weights on pad keys say attention; none, with the pads still read, says the path is
    another (ConvBERT's convolution runs over the pads while its attention masks them)."""
    import transformers as tf

    attends = run_checks(build_fixture("gpt_pad_unmasked"), only="padding-mask")["padding-mask"]
    assert attends.details["largest_attention_on_pads"] > 0.1 and "attend to the pads" in attends.message
    convbert = tf.ConvBertForMaskedLM(tf.ConvBertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                                        num_attention_heads=2, intermediate_size=64,
                                                        max_position_embeddings=64, pad_token_id=0))
    result = run_checks(convbert, only="padding-mask")["padding-mask"]
    assert result.status.value == "fail" and result.details["largest_attention_on_pads"] == 0.0, result.message
    assert "no attention weight reaches them" in result.message and "zero the pads" in result.hint


def test_a_difference_in_some_padded_rows_only_is_not_called_positions():
    import gpt_mask_arg

    result = run_checks(gpt_mask_arg.build_length_bucket(), only="padding-equivalence")["padding-equivalence"]
    assert result.status.value == "warn" and result.details["cause"] == "unexplained", result.message
    assert "would not do" in result.message and "candidates" in result.message
