"""What a new user meets on a first run, beyond the report formats (tests/test_report.py): no
deprecation line that tfdoctor itself causes, the fix that names the SDPA convention, and a training
length the model cannot take refused in one line."""

import logging
import warnings

import pytest

from tfdoctor import run_checks


def test_the_battery_on_a_hugging_face_model_triggers_no_deprecation():
    """transformers 5 logs "`past_key_values`/`cache_params` are deprecated" once per process when its
    output's cache is read by the old name: tfdoctor reads it by the name the installed version has."""
    pytest.importorskip("transformers")
    from real_models import hf_gpt2, with_pad

    subject = with_pad(hf_gpt2)()
    heard: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: heard.append(record.getMessage())
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    logging.Logger.warning_once.cache_clear()  # transformers says each warning once per process
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = run_checks(subject, skip="overfit-batch")
    finally:
        library.removeHandler(handler)
    assert not report.problems()
    said = heard + [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert not [line for line in said if "deprecat" in line.lower()], said


def test_a_blocked_triu_mask_given_to_sdpa_gets_the_sdpa_fix():
    from helpers import build_fixture

    report = run_checks(build_fixture("gpt_sdpa_blocked_triu"), only=["future-leak", "mask-direction"])
    leak, direction = report["future-leak"], report["mask-direction"]
    assert leak.status.value == "fail" and direction.status.value == "fail"
    assert direction.details["pattern"] == "upper" and "given to SDPA" in direction.message
    for hint in (leak.hint, direction.hint):
        assert "scaled_dot_product_attention" in hint and "True where a query MAY attend" in hint
        assert "is_causal=True" in hint and "torch.tril" in hint
    # the same blocked mask given to masked_fill is correct; a triu allowed mask without SDPA keeps its fix
    assert not run_checks(build_fixture("gpt_blocked_triu"), only=["future-leak", "mask-direction"]).problems()
    plain = run_checks(build_fixture("gpt_triu_mask"), only=["mask-direction"])["mask-direction"]
    assert plain.status.value == "fail" and "scaled_dot_product_attention" not in plain.hint


def test_a_training_length_beyond_what_the_model_takes_is_a_usage_error():
    from helpers import build_fixture
    from tfdoctor.errors import UsageError
    from tfdoctor.memory.seq_limit import refuse_unfit_seq
    from tfdoctor.runner import as_subject

    undeclared = as_subject(build_fixture("gpt_undeclared_context"))
    with pytest.raises(UsageError) as raised:  # found by the forward that raises (no config says 64)
        refuse_unfit_seq(undeclared, 5000, "--train-seq")
    assert "--train-seq 5000 is longer than the model takes" in str(raised.value)
    assert "pass --train-seq 64 or less" in raised.value.one_line()
    refuse_unfit_seq(undeclared, 64, "--train-seq")  # its own length runs: no refusal
    with pytest.raises(UsageError, match="--seq 65 is longer than the model's 64 positions"):
        refuse_unfit_seq(as_subject(build_fixture("gpt_correct")), 65, "--seq")  # found from its position table


@pytest.mark.e2e
def test_check_refuses_a_train_seq_beyond_the_models_positions_in_one_line():
    import os

    from helpers import ROOT, tfdoctor

    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = tfdoctor("check", "fixtures/gpt_correct.py:build", "--train-batch", "8", "--train-seq", "5000",
                    module=True, env=env)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.strip().splitlines() == [
        "tfdoctor: error: --train-seq 5000 is longer than the model's 64 positions; pass --train-seq 64 or less, "
        "or build the model with more positions"]
