"""stale-update: an optimizer step that leaves low-precision weights unchanged although their
gradients are non-zero (pure bfloat16 weights at a small rate), judged on the recorded loop under
`check --train` (fixtures/loops/), `run` (fixtures/scripts/) and on a real Hugging Face Llama."""

import json

import pytest

from helpers import SCRIPTS, tfdoctor, train_fn
from real_models import hf_gpt2, hf_llama
from tfdoctor import run_checks
from tfdoctor.checks.step import HALF_ULP, STALE_FAIL_SHARE

ID = ["stale-update"]


def test_pure_bf16_weights_at_a_small_rate_fail(checks_report):
    result = checks_report("gpt_correct", ID, train="bf16_weights")["stale-update"]
    assert result.status.value == "fail", result.message
    d = result.details
    assert d["dtypes"] == ["bfloat16"] and d["lrs"] == [1e-5] and d["steps_watched"] == 3
    assert d["stalled_weight_share"] >= STALE_FAIL_SHARE and "tok_emb.weight" in d["stalled"]
    assert 0 < d["largest_update_ratio"] < HALF_ULP["bfloat16"]
    assert "bfloat16" in result.message and "lr 1e-05" in result.message and "AdamW" in result.message
    assert "float32" in result.hint and "autocast" in result.hint
    assert d["location"].startswith("fixtures/loops/bf16_weights.py:")
    json.dumps(d)


def test_float32_weights_under_autocast_pass(checks_report):
    result = checks_report("gpt_correct", ID, train="bf16_autocast")["stale-update"]
    assert result.status.value == "pass", result.message
    assert result.details["low_precision_tensors"] == 0 and result.details["wide_dtypes"] == ["float32"]


@pytest.mark.parametrize("loop", ["correct", "frozen_midway", "lbfgs_closure", "muon_aux_adam", "manual_warmup"])
def test_quiet_on_float32_loops(loop, loop_audit_stale):
    result = loop_audit_stale(loop)
    assert result.status.value in ("pass", "skip"), result.message


@pytest.fixture(scope="module")
def loop_audit_stale():
    from helpers import PAD_ID, model_for

    def audit(loop):
        return run_checks(model_for(loop), only=ID, pad_id=PAD_ID, train=train_fn(loop)).results[0]

    return audit


def test_a_loop_without_an_optimizer_skips(loop_audit_stale):
    result = loop_audit_stale("manual_sgd")
    assert result.status.value == "skip" and "itself" in result.message


def test_frozen_and_zero_gradient_tensors_are_not_counted():
    """Only tensors with a non-zero gradient are judged: a frozen embedding in bfloat16 is not stale."""
    import torch
    import torch.nn.functional as F

    def train(model, batches):
        model.to(torch.bfloat16)
        model.tok_emb.weight.requires_grad_(False)  # frozen on purpose
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for ids in batches:
            logits = model(ids[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()

    from helpers import build_fixture

    result = run_checks(build_fixture("gpt_correct"), only=ID, train=train).results[0]
    assert result.status.value == "pass", result.message
    assert "tok_emb.weight" not in result.details.get("stalled", [])


def test_no_step_skips(loop_audit_stale):
    assert loop_audit_stale("no_epoch").status.value == "skip"


# --- a real library model: a tiny Hugging Face Llama and GPT-2 -------------------------------------------

@pytest.mark.parametrize("build", [hf_llama, hf_gpt2])
def test_hugging_face_model_fine_tuned_in_pure_bf16_fails(build):
    result = run_checks(build(), only=ID, train=train_fn("hf_bf16_finetune")).results[0]
    assert result.status.value == "fail", result.message
    assert result.details["dtypes"] == ["bfloat16"] and result.details["lrs"] == [2e-5]


@pytest.mark.parametrize("build", [hf_llama, hf_gpt2])
def test_hugging_face_model_under_bf16_autocast_passes(build):
    result = run_checks(build(), only=ID, train=train_fn("hf_bf16_autocast")).results[0]
    assert result.status.value == "pass", result.message


@pytest.mark.e2e
@pytest.mark.parametrize("args, status", [((), "fail"), (("--", "--autocast"), "pass")])
def test_run_judges_a_script_the_same_way(args, status):
    done = tfdoctor("run", f"{SCRIPTS}/hf_bf16_finetune.py", "--format", "json", "--only", "stale-update", *args)
    result = done.checks["stale-update"]
    assert result["status"] == status, result["message"]
    assert done.returncode == (1 if status == "fail" else 0), done.stderr


def test_norm_gains_stuck_at_one_warn_at_a_fine_rate():
    """At lr 1e-3 the weight matrices move in bfloat16, but a norm gain at 1.0 (ulp 2**-7) needs an update of
    3.9e-3: the gains alone stall, a notable share of the tensors and a sliver of the weights."""
    import torch
    import torch.nn.functional as F

    from helpers import build_fixture

    def train(model, batches):
        model.to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for ids in batches:
            logits = model(ids[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()

    result = run_checks(build_fixture("gpt_correct"), only=ID, train=train, options={"train_batches": 4}).results[0]
    assert result.status.value == "warn", result.message
    assert result.details["stalled"] and all("ln" in name for name in result.details["stalled"])
    assert result.details["stalled_weight_share"] < 0.01 and result.details["steps_watched"] == 3


def test_optimizers_stepped_together_count_as_one_step(loop_audit_stale):
    assert loop_audit_stale("muon_aux_adam").details["steps_watched"] == 3
