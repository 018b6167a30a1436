"""Classes of problem met running public training scripts unmodified (issue 17): each with a fixture
of its own shape. Hugging Face's run_clm.py and TRL's sft.py (gradient checkpointing, TRL's fused LM
head, forwards patched by TRL and accelerate), x-transformers' enwik8 model (a rate too high for it)."""


import pytest
import torch

from helpers import FIXTURES, ROOT, build_fixture
from tfdoctor import run_checks
from tfdoctor.loader import load_function


def test_a_forward_patched_on_the_instance_trains_the_copy_not_the_model():
    """TRL keeps `original = model.forward` in the closure of the forward it installs, accelerate wraps
    that in an object that refuses pickling: a deep copy still ran the user's weights, so overfit-batch
    trained nothing (flat at ln(V), a false fail) and left gradients on the user's model."""
    model = build_fixture("gpt_wrapped_forward")
    before = [p.detach().clone() for p in model.parameters()]
    result = run_checks(model, only="overfit-batch")["overfit-batch"]
    assert result.status.value == "pass", result.message
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_forwards_recomputed_inside_backward_are_not_the_scripts():
    """Gradient checkpointing (the Trainer's gradient_checkpointing=True, TRL's default) recomputes the
    layers inside backward() and stops early by raising: those calls were taken as the script's own
    forwards, one that never ended, so every later forward counted as nested and its scores unread
    (TRL's SFT: accumulation-scaling 0.41x; run_clm.py --gradient_checkpointing: 0.50x)."""
    from tfdoctor.recording.script import record_script

    run = record_script(str(ROOT / "fixtures/scripts/checkpointed_accum.py"), steps=2)
    forwards = [e for e in run.trace.events if e.kind == "forward"]
    assert len(forwards) == 4  # 2 steps x 2 micro-batches
    assert run.recorder.in_forward == 0
    assert [type(m).__name__ for m in run.recorder.top.values()] == ["CheckpointedLM"]


def _fused(loop: str):
    train = load_function(str(FIXTURES / "loops" / f"{loop}.py") + ":train")
    return run_checks(build_fixture("fused_head_gpt"), only=["accumulation-scaling", "token-weighting"],
                      pad_id=0, train=train)


@pytest.mark.parametrize("loop, status, factor", [("fused_head_completion_packed", "pass", 1.0),
                                                  ("fused_head_completion_per_micro_mean", "fail", 2.0)])
def test_a_fused_head_weighs_every_graded_token(loop, status, factor):
    """Issue 17 item 11: completion-only labels and packed rows through a fused LM head (per-token
    log_probs, no logits: TRL's SFTTrainer): each graded token's weight is read from the gradient at
    its log-probability, so the step's factor counts every graded token."""
    report = _fused(loop)
    result = report["accumulation-scaling"]
    assert result.status.value == status, result.message
    assert result.details["gradient_factor"] == pytest.approx(factor, rel=0.1)
    if status == "pass":
        assert report["token-weighting"].status.value == "pass", report["token-weighting"].message


def test_overfit_batch_retries_at_a_lower_rate_before_failing():
    """Issue 17 item 12: a deep post-LN model stalls at tfdoctor's first rate (3e-3) and memorises the
    batch at 1e-3: a pass naming the rate, with the stalled attempt as evidence (a model that cannot
    learn at any rate still fails: test_learning's gpt_ignores_tokens)."""
    result = run_checks(build_fixture("postln_deep"), only="overfit-batch")["overfit-batch"]
    assert result.status.value == "pass", result.message
    first, last = result.details["attempts"][0], result.details["attempts"][-1]
    assert first["lr"] == 3e-3 and first["best_loss"] > 1.0  # stalled far above the target
    assert last["lr"] < 3e-3 and last["best_loss"] < result.details["target_loss"]
    assert "before: AdamW lr 3e-03" in result.message


def test_gradients_wiped_inside_accumulation_are_blamed_on_zero_grad_alone():
    """llama2.c's train.py with zero_grad pasted after its backward: accumulation-scaling read 0.000x
    and blamed a division done "more than once"; the cause is the zero_grad, which zero-grad names."""
    train = load_function(str(FIXTURES / "loops" / "zero_grad_in_accumulation.py") + ":train")
    report = run_checks(build_fixture("gpt_correct"), only=["accumulation-scaling", "zero-grad"], pad_id=0,
                        train=train)
    assert report["zero-grad"].status.value == "fail", report["zero-grad"].message
    scaling = report["accumulation-scaling"]
    assert scaling.status.value == "skip" and "see zero-grad" in scaling.message


def test_rows_that_are_codebooks_skip_padding_equivalence_with_the_reason():
    """MusicGen's batch rows are the codebooks of its samples: a lone row raised a shape error inside
    padding-equivalence (an error); it skips and says why."""
    result = run_checks(build_fixture("codebook_rows"), only="padding-equivalence", pad_id=0,
                        batch_first=True)["padding-equivalence"]  # as a Hugging Face model is taken
    assert result.status.value == "skip", result.message
    assert "refuses a batch of one row" in result.message and "runs 4 rows together" in result.message
