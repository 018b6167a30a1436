"""The task heads issue 29 left refused (question answering, multiple choice), a token classifier's labels
as users give them, a classifier's own loop under check --train, and a representative sweep of real
Hugging Face task heads across model types (the whole sweep: bench/hf_sweep.py --heads)."""

import math
import sys

import pytest
import torch

from catalogue import CLASSIFIER, TAGGING
from helpers import ROOT, build_fixture, tfdoctor
from tfdoctor import Subject, run_checks
from tfdoctor.subject import resolve

sys.path.insert(0, str(ROOT / "bench"))
from hf_tiny_configs import build_model  # noqa: E402 - bench/ is not a package

LOUD = ("fail", "warn", "error")
# The suite's share of the sweep: the encoder and decoder families the brief names, each head they have,
# one seq2seq of each head kind. Each takes 3-10 s here; the rest run in bench/hf_sweep.py --heads.
REPRESENTATIVE = ["bert/qa", "bert/mc", "roberta/mc", "distilbert/qa", "deberta-v2/tokcls", "electra/mc",
                  "albert/qa", "xlm-roberta/tokcls", "modernbert/qa", "gpt2/qa", "gpt2/tokcls", "llama/qa",
                  "mistral/seqcls", "t5/qa", "bart/seqcls"]

SEQ2SEQ = ("t5", "bart")


class SpanHead(torch.nn.Module):
    """A hand-written extractive QA head: token and position embeddings mixed by one encoder layer, then
    start and end scores per position, returned as the pair users write (`return start, end`)."""

    def __init__(self, vocab=64, d=32, max_len=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(max_len, d)
        self.mix = torch.nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True)
        self.qa = torch.nn.Linear(d, 2)

    def forward(self, ids):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        start, end = self.qa(self.mix(x)).unbind(-1)
        return start, end  # (B, T) each


class QuestionMaskedSpanHead(SpanHead):
    """A span head that takes its question's positions (up to the first SEP) out of the competition, as
    BigBird's question-answering head does: their scores lowered by 1e6, so no answer is ever put there."""

    SEP = 7

    def forward(self, ids):
        start, end = super().forward(ids)
        question = torch.cumsum((ids == self.SEP).long(), 1) == 0  # before the first SEP
        question[:, 0] = False  # the first position (CLS) answers "no answer"
        return start - 1e6 * question, end - 1e6 * question


class ChoiceHead(torch.nn.Module):
    """A hand-written multiple-choice head: ids [B, C, T] -> one score per choice [B, C]."""

    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.score = torch.nn.Linear(d, 1)

    def forward(self, ids):
        B, C, T = ids.shape
        pooled = self.emb(ids.view(B * C, T)).mean(1)  # (B*C, d)
        return self.score(pooled).view(B, C)


@pytest.mark.parametrize("spec, kind, task", [
    ("bert/qa", "encoder", "question-answering"), ("gpt2/qa", "causal", "question-answering"),
    ("bert/mc", "encoder", "multiple-choice"), ("t5/qa", "seq2seq", "question-answering"),
])
def test_a_hugging_face_span_or_choice_head_says_its_task(spec, kind, task):
    subject = resolve(Subject(build_model(spec)))
    assert (subject.kind, subject.task) == (kind, task)


def test_a_pair_of_start_and_end_scores_is_a_span_head_and_a_choice_head_is_declared():
    span = resolve(Subject(SpanHead()))
    assert span.task == "question-answering" and span.num_labels == 2
    assert span.kind == "encoder"  # it reads later tokens, and nothing asks it to predict them
    choice = resolve(Subject(ChoiceHead(), task="multiple-choice"))
    assert choice.task == "multiple-choice"
    from tfdoctor.errors import SubjectError

    with pytest.raises(SubjectError):  # not declared: ids [B, T] are not [B, C, T]
        resolve(Subject(ChoiceHead()))


def test_hand_written_span_and_choice_heads_start_at_chance():
    report = run_checks(Subject(SpanHead()), only=["init-loss", "overfit-batch"])
    init = report["init-loss"]
    assert init.status.value == "pass" and "ln(T)" in init.message
    assert math.isclose(init.details["ln_classes"], math.log(32))
    assert report["overfit-batch"].status.value == "pass"
    report = run_checks(Subject(ChoiceHead(), task="multiple-choice"), only=["init-loss"])
    assert report["init-loss"].status.value == "pass"
    assert math.isclose(report["init-loss"].details["ln_classes"], math.log(4))


def test_a_span_head_that_masks_its_question_is_judged_over_the_positions_it_keeps():
    """Random ids put the SEP at varying places, so the head takes a varying number of positions out; an
    answer drawn there would cost 1e6 nats and fail a correct head as "confidently wrong"."""
    report = run_checks(Subject(QuestionMaskedSpanHead()), only=["init-loss"])
    init = report["init-loss"]
    assert init.status.value == "pass", init.message
    assert init.details["positions_removed"] > 1 and init.details["ln_classes"] < math.log(32)
    assert "out of the competition" in init.message


def test_a_top_k_selection_whose_tie_order_moves_with_the_length_is_not_taken_for_padding():
    """transformers' AXK2 (DeepSeek sparse attention: top-k keys over ReLU'd index scores, many tied at 0):
    a padded row may select other tied keys than the row alone. With ties broken by position the rows
    match, so padding-equivalence passes and says what moved them (probes/ties.py)."""
    result = run_checks(Subject(build_model("axk2/seqcls")), only=["padding-equivalence"])["padding-equivalence"]
    assert result.status.value == "pass", result.message
    assert "ties by position" in result.message
    assert result.details["largest_difference_with_ties_by_position"] <= result.details["tolerance"]
    assert max(result.details["row_differences"]) > result.details["tolerance"]  # they did differ, through ties


def test_a_top_k_tie_order_is_not_taken_for_padding_in_a_language_model_either():
    """The AXK2 causal LM, left-padded: one row differs by 0.03 of a 0.65 logit scale, through tied
    index scores only."""
    result = run_checks(Subject(build_model("axk2"), pad_id=5), only=["padding-equivalence"])["padding-equivalence"]
    assert result.status.value == "pass", result.message
    left = result.details["sides"]["left"]
    assert left["largest_difference"] > left["tolerance"] >= left["largest_difference_with_ties_by_position"]
    assert "tied scores" in result.message


def test_a_model_that_mixes_positions_without_attention_is_not_said_to_attend():
    """FNet mixes every position with a Fourier transform that takes no mask: its pads do reach the real
    positions (a true finding), but through no attention, and its fix is a fixed padded length."""
    result = run_checks(Subject(build_model("fnet/seqcls"), pad_id=3), only=["padding-mask"])["padding-mask"]
    assert result.status.value == "fail" and result.details["cause"] == "mixes-pads"
    assert "not through attention" in result.message and "padding='max_length'" in result.hint


def test_pads_mixed_in_without_attention_to_them_are_not_blamed_on_the_pooling():
    """Nystromformer's landmarks (means over every position) carry the pads into the real positions' states
    while no real query attends to a pad: the pooling (the first token's state) is not what reads them."""
    model = build_model("nystromformer/seqcls")
    result = run_checks(Subject(model, pad_id=model.config.pad_token_id), only=["padding-mask"])["padding-mask"]
    assert result.status.value == "fail" and result.details["cause"] == "mixes-pads", result.message
    assert result.details["largest_attention_on_pads"] < 0.01
    assert result.details["largest_real_state_change_from_pad_content"] > result.details["tolerance"]


@pytest.mark.parametrize("spec", ["mobilebert/seqcls", "mobilebert/tokcls"])
def test_a_leak_of_a_pad_embedding_that_never_changes_passes(spec):
    """MobileBERT's trigram input concatenates the next position's token embedding into the last real token:
    the pads' token embedding leaks, but nn.Embedding(padding_idx=pad) keeps it fixed (zero), and padded rows
    match the rows alone."""
    model = build_model(spec)
    result = run_checks(Subject(model, pad_id=model.config.pad_token_id), only=["padding-mask"])["padding-mask"]
    assert result.status.value == "pass", result.message
    assert "padding_idx=0" in result.message and "nothing about the pads reaches them" in result.message


def test_a_pinned_pad_embedding_does_not_excuse_attending_to_the_pads():
    """The encoder of fixtures/classifier_attends_pads.py (no pad mask) with its pad row pinned: the pads
    still carry their positions into the real tokens' attention, so padded rows differ from the rows
    alone and padding-mask still fails."""
    sys.path.insert(0, str(ROOT / "fixtures"))
    from classifiers import PAD_ID, TextClassifier

    model = TextClassifier(pooling="masked-mean", mask_pads=False)
    model.tok_emb = torch.nn.Embedding(model.tok_emb.num_embeddings, model.tok_emb.embedding_dim, padding_idx=PAD_ID)
    result = run_checks(Subject(model, pad_id=PAD_ID, padding_side="right"), only=["padding-mask"])["padding-mask"]
    assert result.status.value == "fail" and result.details["cause"] == "attends-pads", result.message


def test_an_overfit_that_collapses_rows_names_the_collapse():
    """MobileBERT's tiny sequence classifier: no normalisation lets the first token's state grow from RMS 0.03
    to ~1000 within 50 steps, its tanh pooler saturates (every unit at +-1) and two rows with different labels
    end as one output, at every rate. The failure says what was measured, not "something is broken"."""
    result = run_checks(Subject(build_model("mobilebert/seqcls")), only=["overfit-batch"])["overfit-batch"]
    assert result.status.value == "fail"
    assert result.details["collapsed_rows"] and "end with the same scores" in result.message
    assert "something between the input tokens and the loss is broken" not in result.message


def test_a_choice_head_whose_score_moves_with_its_pads_fails_padding_equivalence():
    """ChoiceHead averages every position, pads included: each choice's score depends on its padding."""
    report = run_checks(Subject(ChoiceHead(), task="multiple-choice", pad_id=0), only=["padding-equivalence"])
    assert report["padding-equivalence"].status.value == "fail"
    assert report["padding-equivalence"].details["cause"] == "reads-pads"  # no attention to tell pooling apart


@pytest.fixture(scope="module")
def heads():
    reports = {}

    def report(spec):
        if spec not in reports:
            torch.manual_seed(0)
            reports[spec] = run_checks(build_model(spec), skip=["memory"])
        return reports[spec]

    return report


@pytest.mark.parametrize("spec", REPRESENTATIVE)
def test_real_task_heads_across_model_types_are_quiet(spec, heads):
    report = heads(spec)
    loud = [(r.id, r.status.value, r.message) for r in report.results if r.status.value in LOUD]
    assert not loud
    assert all(r.message for r in report.results if r.status.value == "skip")
    ran = {r.id for r in report.results if r.status.value == "pass"}
    assert {"finite-logits", "init-loss", "overfit-batch"} <= ran, ran
    if spec.split("/")[0] not in SEQ2SEQ:  # a seq2seq source's padding is padding-mask's, where it can reach it
        assert "padding-equivalence" in ran


def test_a_span_head_is_judged_at_its_real_positions_against_ln_t(heads):
    report = heads("bert/qa")
    assert report["init-loss"].message.split(" vs ")[1].startswith("ln(T)")
    assert "real position" in report["padding-mask"].message
    assert "ln(C)" in heads("bert/mc")["init-loss"].message


# --- a token classifier's labels, as the Hugging Face recipe aligns them ---------------------------------

@pytest.mark.parametrize("loop, status", [("tagging", "pass"), ("tagging_pads_graded", "fail")])
def test_token_labels_read_as_given(loop, status, checks_report):
    report = checks_report("tagger_correct", TAGGING, train=loop)
    result = report["ignore-index"]
    assert result.status.value == status, result.message
    details = result.details
    assert details["labels"] == 5  # the tagger's labels, not the 96-token vocabulary
    # the continuation pieces are ignored in both loops, and never taken for padding
    assert 0 < details["graded_real_positions"] < details["real_positions"]
    if status == "fail":
        assert details["graded_pad_positions"] == details["pad_positions"] > 0
        assert details["labels_on_graded_pads"] == {0: details["pad_positions"]}
        assert "-100" in result.hint
    else:
        assert details["graded_pad_positions"] == 0
    assert report["objective"].status.value == "skip"


@pytest.mark.e2e
@pytest.mark.parametrize("script, status, labels", [
    ("tagger", "pass", 5), ("tagger_pads_graded", "fail", 5),  # a loss over the model's output, outside it
    ("hf_tagger", "pass", 7), ("hf_tagger_pads_graded", "fail", 7),  # the model's own loss from labels=
])
def test_a_tagger_script_has_its_labels_read_under_run(script, status, labels):
    """Under run nothing declares the labels: the scores over C classes, one row per input position,
    are recorded as the loss grades them (the vocabulary is 120 / 200), and the whole report is quiet
    on the correct twins."""
    if script.startswith("hf_"):
        pytest.importorskip("transformers")
    done = tfdoctor("run", f"fixtures/scripts/{script}.py", "--format", "json")
    assert done.returncode == (1 if status == "fail" else 0), done.stderr
    assert done.json["discovered"]["task"] == "token-classification"
    result = done.checks["ignore-index"]
    assert result["status"] == status, result["message"]
    assert result["details"]["labels"] == labels
    assert result["details"]["pad_positions"] > 0
    if status == "fail":
        assert result["details"]["labels_on_graded_pads"] == {"0": result["details"]["pad_positions"]}
        assert [p[0] for p in done.problems] == ["ignore-index"]
    else:
        assert not done.problems


def test_a_tagger_is_measured_as_the_encoder_it_is():
    assert resolve(build_fixture("tagger_correct")).kind == "encoder"


# --- a sequence classifier's own loop under check --train ------------------------------------------------

@pytest.fixture(scope="module")
def classifier_loops():
    return {model: tfdoctor("check", f"fixtures/{model}.py:build", "--train", "fixtures/loops/classifying.py:train",
                            "--format", "json")
            for model in ("classifier_correct", "classifier_mean_over_pads")}


@pytest.mark.e2e
def test_a_classifier_loop_is_quiet_on_correct_code(classifier_loops):
    done = classifier_loops["classifier_correct"]
    assert done.returncode == 0, done.stderr
    assert not [(c, s) for c, s in done.statuses.items() if s in LOUD]
    for check_id in ("zero-grad", "clip-global-norm", "grad-health", "optimizer-coverage", *CLASSIFIER):
        assert done.statuses[check_id] == "pass", done.checks[check_id]["message"]


@pytest.mark.e2e
def test_a_classifier_loop_on_a_pooling_bug_fails_naming_it(classifier_loops):
    done = classifier_loops["classifier_mean_over_pads"]
    assert done.returncode == 1
    assert {c for c, s in done.statuses.items() if s in LOUD} == {"padding-mask", "padding-equivalence"}
    assert done.checks["padding-equivalence"]["details"]["cause"] == "pools-pads"


@pytest.mark.parametrize("side, status, cause", [(None, "warn", "edge-position"), ("right", "fail", "edge-position"),
                                                 ("left", "fail", "pad-count")])
def test_a_last_position_pooler_is_failed_only_on_a_side_it_is_wrong_for(side, status, cause):
    """x[:, -1] pools a pad of a right-padded row and the last real token of a left-padded one (XLNet's
    summary does the same, and its tokenizer pads left): with no side declared it warns, naming the flag.
    Declared left, this model still fails, for another cause: its learned positions count from the row's
    start, so left pads shift every token's position (XLNet's relative positions do not: it passes)."""
    from classifiers import PAD_ID, TextClassifier

    torch.manual_seed(0)
    subject = Subject(TextClassifier(pooling="last-position"), pad_id=PAD_ID, padding_side=side)
    result = run_checks(subject, only=["padding-equivalence"])["padding-equivalence"]
    assert result.status.value == status, result.message
    assert result.details["cause"] == cause
    if status == "warn":
        assert "--padding-side left" in result.message and result.details["cause"] == "edge-position"
