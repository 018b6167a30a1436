import random

import pytest
import torch

from helpers import build_fixture
from tfdoctor import Subject, assert_healthy, run_checks
from tfdoctor.errors import SubjectError, UsageError
from tfdoctor.registry import all_checks, select
from tfdoctor.result import Status

ISSUE_2_IDS = ["future-leak", "mask-direction", "init-loss", "overfit-batch"]


def test_catalogue_has_the_core_checks_with_docs():
    specs = {spec.id: spec for spec in all_checks()}
    for check_id in ISSUE_2_IDS:
        assert check_id in specs
        assert specs[check_id].title and specs[check_id].summary


def test_select_only_and_skip():
    assert [s.id for s in select("init-loss,future-leak")] == ["future-leak", "init-loss"]
    assert "overfit-batch" not in [s.id for s in select(skip=["overfit-batch"])]
    with pytest.raises(UsageError, match="unknown check id"):
        select("no-such-check")


@pytest.mark.parametrize("name", ["gpt_correct", "gpt_pad_masked", "seq2seq_correct"])
def test_every_check_leaves_the_process_as_found(name):
    built = build_fixture(name)
    model = built.model if isinstance(built, Subject) else built
    model.train()
    list(model.children())[1].eval()  # a mixed state must come back exactly
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    random.seed(7)
    expected_torch, expected_python = torch.rand(3), random.random()
    torch.manual_seed(123)
    random.seed(7)

    run_checks(built)

    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_python
    assert [m.training for m in model.modules()] == flags
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks
    assert torch.get_num_threads() == threads
    assert torch.is_grad_enabled()
    assert all(p.grad is None for p in model.parameters())


class CrashesWithGrad(torch.nn.Module):
    """Fine under no_grad, raises when gradients are on: only the training check can see it."""

    def __init__(self):
        super().__init__()
        self.inner = build_fixture("gpt_correct")

    def forward(self, ids):
        if torch.is_grad_enabled():
            raise RuntimeError("boom in training")
        return self.inner(ids)


def test_a_crashing_check_is_an_error_and_the_others_still_run():
    report = run_checks(CrashesWithGrad(), only=ISSUE_2_IDS)
    statuses = {r.id: r.status.value for r in report.results}
    assert statuses == {"future-leak": "pass", "mask-direction": "pass", "init-loss": "pass",
                        "overfit-batch": "error"}
    error = report["overfit-batch"]
    assert "boom in training" in error.message and "traceback" in error.details
    assert report.exit_code() == 1


def test_wrong_output_shape_is_a_subject_error():
    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 10)

        def forward(self, ids):
            return self.emb(ids).mean(1)  # [B, V], not [B, T, V]

    with pytest.raises(SubjectError, match=r"\[B, T, V\] = \[2, 32, 10\] expected but got \[2, 10\]"):
        run_checks(Pooled())


def test_unknown_vocabulary_is_a_subject_error():
    class NoEmbedding(torch.nn.Module):
        def forward(self, ids):
            return torch.zeros(*ids.shape, 5)

    with pytest.raises(SubjectError, match="--vocab"):
        run_checks(NoEmbedding())
    assert run_checks(NoEmbedding(), only="future-leak", vocab_size=5)["future-leak"].status.value == "pass"


def test_seq_len_defaults_to_32_and_is_capped_by_max_positions():
    from tfdoctor.subject import resolve

    model = build_fixture("gpt_correct")
    assert resolve(Subject(model)).seq_len == 32
    model.block_size = 16
    assert resolve(Subject(model)).seq_len == 16
    assert resolve(Subject(model, seq_len=8, batch_size=2)).batch_size == 2


def test_subject_forward_adapter_and_tuple_outputs():
    model = build_fixture("gpt_triu_mask")
    subject = Subject(torch.nn.Sequential(), vocab_size=96, forward=lambda m, ids: (model(ids), None))
    subject.model = model
    assert run_checks(subject, only="mask-direction")["mask-direction"].details["pattern"] == "upper"


def test_assert_healthy_lists_failures():
    with pytest.raises(AssertionError) as caught:
        assert_healthy(build_fixture("gpt_triu_mask"), only=["future-leak", "mask-direction", "init-loss"])
    text = str(caught.value)
    assert "future-leak" in text and "mask-direction" in text and "init-loss" not in text
    assert "fix:" in text
    report = assert_healthy(build_fixture("gpt_correct"), only=["future-leak", "init-loss"])
    assert report.exit_code() == 0


def test_a_subject_wrapped_in_a_subject_keeps_the_inner_fields():
    inner = build_fixture("seq2seq_correct")  # Subject(kind="seq2seq", pad_id=0)
    report = run_checks(Subject(inner, seq_len=16), only=["init-loss"])
    assert report["init-loss"].status.value == "pass"
    from tfdoctor.runner import as_subject

    merged = as_subject(Subject(inner, seq_len=16))
    assert (merged.kind, merged.pad_id, merged.seq_len, merged.model) == ("seq2seq", 0, 16, inner.model)


@pytest.mark.parametrize("field", ["seq_len", "batch_size", "vocab_size"])
def test_zero_is_a_usage_error_not_the_default(field):
    with pytest.raises(UsageError, match=f"{field} must be positive, got 0"):
        run_checks(Subject(build_fixture("gpt_correct"), **{field: 0}), only=["init-loss"])


def test_a_probe_length_beyond_the_models_positions_is_a_usage_error():
    with pytest.raises(UsageError, match="longer than the model's 64 positions"):
        run_checks(Subject(build_fixture("gpt_correct"), seq_len=100), only=["init-loss"])


def test_ids_handed_to_the_forward_are_contiguous():
    from bad_targets import views_its_ids

    report = run_checks(views_its_ids(), only=["init-loss", "overfit-batch", "future-leak"])
    assert not [r.message for r in report.results if r.status.value == "error"]


class FlipsProcessSwitches(torch.nn.Module):
    """A forward that flips every process-wide switch it can reach, as user code sometimes does."""

    def __init__(self):
        super().__init__()
        self.inner = build_fixture("gpt_correct")

    def forward(self, ids):
        import numpy

        numpy.random.rand(3)
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_anomaly_enabled(True)
        torch.set_float32_matmul_precision("medium")
        torch.backends.mkldnn.enabled = False
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        return self.inner(ids)


def test_process_wide_switches_come_back_after_every_check():
    numpy = pytest.importorskip("numpy")
    numpy.random.seed(5)
    expected_numpy = numpy.random.rand()
    numpy.random.seed(5)
    before = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled(),
              torch.get_float32_matmul_precision(), torch.backends.mkldnn.enabled, torch.backends.cudnn.benchmark,
              torch.backends.cuda.matmul.allow_tf32)
    report = run_checks(FlipsProcessSwitches(), only=["future-leak", "init-loss"])
    after = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled(),
             torch.get_float32_matmul_precision(), torch.backends.mkldnn.enabled, torch.backends.cudnn.benchmark,
             torch.backends.cuda.matmul.allow_tf32)
    assert after == before
    assert numpy.random.rand() == expected_numpy
    assert report["init-loss"].status.value == "pass"


def test_the_catalogue_states_every_registered_id_in_its_order():
    from tfdoctor.registry import CATALOGUE

    ids = [spec.id for spec in all_checks()]
    assert ids == [check_id for check_id in CATALOGUE if check_id in ids] and set(CATALOGUE) <= set(ids)


def test_a_trace_handed_in_is_judged_and_absent_inputs_skip_with_their_reason():
    """`tfdoctor run`'s single call: the loop checks judge the trace handed in (no Subject.train), a
    check that reads an absent input skips with the reason given, word for word."""
    from tfdoctor.recording.trace import Trace

    trace = Trace([], 0, [], [], [], 0, ranks=[])
    report = run_checks(build_fixture("gpt_correct"), "init-loss,finite-logits,rank-sync", trace=trace,
                        absent={"model": "no copy of the model", "initial_weights": "trained weights"})
    assert [(r.id, r.status.value, r.message) for r in report.results][:2] == [
        ("finite-logits", "skip", "no copy of the model"), ("init-loss", "skip", "no copy of the model")]
    assert report["rank-sync"].status.value == "skip" and report["rank-sync"].message.startswith("one process")
    later = run_checks(build_fixture("gpt_correct"), "init-loss", absent={"initial_weights": "trained weights"})
    assert later["init-loss"].message == "trained weights" and later["init-loss"].title
    untraced = run_checks(build_fixture("gpt_correct"), "rank-sync")["rank-sync"]
    assert untraced.message == "needs train (pass --train MODULE:FN or Subject(train=fn))"


def test_what_a_check_reads_and_needs_comes_from_its_signature():
    """As pytest hands a test the fixtures its parameters name: `(subject)` reads the model,
    `(subject, trace)` the recorded loop (so it needs train, first among its needs), `(series)` a whole
    watched run; a parameter the runner cannot hand in is refused when the check is registered."""
    from tfdoctor.registry import derived_inputs

    def model_check(subject): ...
    def loop_check(subject, trace): ...
    def run_judge(series): ...
    def misspelt(subject, trcae): ...
    def no_subject(model): ...

    assert derived_inputs(model_check) == (("model",), ())
    assert derived_inputs(loop_check) == (("trace",), ("train",))
    assert derived_inputs(run_judge) == (("series",), ())
    for wrong in (misspelt, no_subject):
        with pytest.raises(TypeError, match="first parameter is one of subject, series"):
            derived_inputs(wrong)
    specs = {spec.id: spec for spec in all_checks()}
    assert specs["ignore-index"].needs == ("train", "pad_id") and specs["ignore-index"].inputs == ("trace",)
    assert specs["loss-spike"].judges_run and specs["loss-spike"].inputs == ("series",)
    assert specs["init-loss"].inputs == ("model", "initial_weights")  # named where the signature cannot say
    assert all(("trace" in spec.fixtures) == ("train" in spec.needs) for spec in specs.values())


def test_a_check_that_needs_the_loop_but_takes_no_trace_is_refused():
    from tfdoctor.registry import check

    with pytest.raises(TypeError, match="take the recorded loop as a `trace` parameter"):
        check("no-such-loop-check", title="never registered", needs=("train",))(lambda subject: None)


def test_a_run_judge_that_crashes_is_its_own_error_and_the_others_still_run():
    """The run judges go through the checks' runner core: a judge handed a series it cannot read (None
    here) becomes that judge's error, said to be tfdoctor's bug, and the next judge still runs."""
    from tfdoctor.watching.judging import judge_run

    heard = []
    results = judge_run(None, only=["loss-spike", "data-wait"], listener=lambda event, _: heard.append(event))
    assert sorted(r.id for r in results) == ["data-wait", "loss-spike"] and heard == ["start", "result"] * 2
    for result in results:
        assert result.status is Status.ERROR and result.title, result.message
        assert result.message.startswith(f"tfdoctor's own {result.id} judge crashed: AttributeError: ")
        assert result.hint == "a bug in tfdoctor, not in your run: please report it"
