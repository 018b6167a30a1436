"""The training-loop audit (`--train`): every loop fixture gets the exact status of every train check.

Each buggy loop in fixtures/loops/ fails (or warns) on its own check only; the correct loops pass
everything that applies to them. The loops run for real on the fixture GPT (or a tiny Hugging Face
GPT-2), fed tfdoctor's random padded batches.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES, ROOT, build_fixture
from tfdoctor import run_checks
from tfdoctor.checks.trainloop import LR_FAIL_LOW
from tfdoctor.loader import load_function
from tfdoctor.result import Status

sys.path.insert(0, str(FIXTURES / "loops"))

TRAIN_IDS = ["objective", "ignore-index", "unscale-before-clip", "accumulation-scaling", "scheduler-placement",
             "zero-grad", "clip-global-norm", "lr-schedule", "amp-loss-scaling", "grad-health"]
PAD_ID = 0  # the pad id every loop fixture was written for

# The status of every train check on every loop fixture, with pad_id=0. "skip" marks what a loop
# does not do (no GradScaler, no accumulation, no autocast).
P, F, W, S = "pass", "fail", "warn", "skip"
SIMPLE = dict(zip(TRAIN_IDS, [P, P, S, S, P, P, P, P, S, P]))  # fp32, one backward per step
ACCUM = dict(SIMPLE, **{"accumulation-scaling": P})
EXPECTED = {
    "correct": dict(zip(TRAIN_IDS, [P] * 10)),
    "hf_labels": SIMPLE,
    "identity_objective": dict(SIMPLE, objective=F),
    "hf_double_shift": dict(SIMPLE, objective=F),
    "no_ignore_index": dict(SIMPLE, **{"ignore-index": F}),
    "clip_before_unscale_cuda": dict(SIMPLE, **{"unscale-before-clip": F, "amp-loss-scaling": P}),
    "no_loss_division": dict(ACCUM, **{"accumulation-scaling": F}),
    "scheduler_every_batch": dict(ACCUM, **{"scheduler-placement": F}),
    "no_zero_grad": dict(SIMPLE, **{"zero-grad": F}),
    "per_parameter_clip": dict(SIMPLE, **{"clip-global-norm": W}),
    "noam_default_lr": dict(SIMPLE, **{"lr-schedule": F}),
    "fp16_no_scaler_cuda": dict(SIMPLE, **{"amp-loss-scaling": F}),
    "nan_penalty": dict(SIMPLE, **{"grad-health": F}),
}


def model_for(loop: str):
    return build_fixture("hf_gpt2") if loop.startswith("hf_") else build_fixture("gpt_correct")


def train_fn(loop: str):
    return load_function(str(FIXTURES / "loops" / f"{loop}.py") + ":train")


_reports: dict = {}


def audit(loop: str):
    """One run of the train checks per loop fixture, shared by the tests below."""
    if loop not in _reports:
        torch.manual_seed(0)
        _reports[loop] = run_checks(model_for(loop), only=TRAIN_IDS, pad_id=PAD_ID, train=train_fn(loop))
    return _reports[loop]


@pytest.mark.parametrize("loop", sorted(EXPECTED))
def test_every_train_check_has_its_expected_status(loop):
    report = audit(loop)
    got = {r.id: r.status.value for r in report.results}
    assert got == EXPECTED[loop], {r.id: r.message for r in report.results if got[r.id] != EXPECTED[loop][r.id]}
    for result in report.results:
        json.dumps(result.details)  # evidence is JSON-safe
        if result.status in (Status.FAIL, Status.WARN):
            assert result.hint, result.id


def test_identity_objective_reports_offset_zero():
    result = audit("identity_objective")["objective"]
    assert result.details["offset"] == 0
    assert result.details["share_by_offset"]["+0"] == 1.0
    assert "ids[:, 1:]" in result.hint


def test_double_shift_inside_a_hugging_face_forward_reports_offset_two():
    result = audit("hf_double_shift")["objective"]
    assert result.details["offset"] == 2 and "shifted twice" in result.message
    assert audit("hf_labels")["objective"].details["offset"] == 1


def test_padding_share_is_measured_from_the_gradient():
    result = audit("no_ignore_index")["ignore-index"]
    assert result.details["ignore_index"] == [-100]
    assert 0.05 < result.details["pad_weight_share"] < 0.5
    assert "ignore_index=0" in result.hint
    assert audit("correct")["ignore-index"].details["pad_weight_share"] == 0.0


def test_clip_before_unscale_is_judged_on_order_even_with_a_disabled_cuda_scaler():
    result = audit("clip_before_unscale_cuda")["unscale-before-clip"]
    assert result.details["scaler_device"] == "cuda" and result.details["scaler_enabled_here"] is False
    assert result.details["order"].index("clip") < result.details["order"].index("unscale_")
    assert "65536" in result.message
    order = audit("correct")["unscale-before-clip"].details["order"]
    assert order.index("unscale_") < order.index("clip")


def test_missing_division_reports_the_factor():
    result = audit("no_loss_division")["accumulation-scaling"]
    assert result.details["micro_batches_per_step"] == 4
    assert result.details["gradient_factor"] == pytest.approx(4.0, rel=1e-3)
    assert "4.00x" in result.message
    assert audit("correct")["accumulation-scaling"].details["gradient_factor"] == pytest.approx(1.0, rel=1e-3)


def test_scheduler_per_micro_batch_reports_the_speed_up():
    result = audit("scheduler_every_batch")["scheduler-placement"]
    assert (result.details["scheduler_steps"], result.details["optimizer_steps"]) == (16, 4)
    assert "4.0x" in result.message


def test_stale_gradients_are_found_without_a_zero_grad_call():
    result = audit("no_zero_grad")["zero-grad"]
    assert result.details["zero_grad_calls"] == 0
    assert result.details["steps_not_cleared"] == result.details["steps_checked"] == 15


def test_per_parameter_clip_warns():
    result = audit("per_parameter_clip")["clip-global-norm"]
    assert result.details["by_kind"] == {"per-parameter": 16}
    assert result.details["calls_per_step"] == 29


def test_noam_on_default_lr_peaks_near_7e_7():
    result = audit("noam_default_lr")["lr-schedule"]
    assert result.details["peak_lr"] == pytest.approx(512 ** -0.5 * 4000 ** -0.5 * 1e-3, rel=1e-3)
    assert result.details["peak_lr"] < LR_FAIL_LOW
    assert result.details["peak_step"] == 4000
    assert result.details["betas"] == [0.9, 0.98] and result.details["eps"] == 1e-9
    assert "lr=1.0" in result.hint


def test_fp16_autocast_written_for_cuda_is_seen_on_cpu():
    result = audit("fp16_no_scaler_cuda")["amp-loss-scaling"]
    assert result.details["autocast"] == ["cuda:float16"]
    assert result.details["grad_scaler"] is False
    assert "GradScaler" in result.hint


def test_nan_gradients_fail_grad_health():
    result = audit("nan_penalty")["grad-health"]
    assert result.details["non_finite_steps"][0] == 1
    norms = audit("correct")["grad-health"].details["pre_clip_norms"]
    assert len(norms) == 4 and all(0 < n < 100 for n in norms)


# ------------------------------------------------------------------------------------------------
# Small loops written here for the cases the fixtures do not cover


def _cpu_scaler_loop(clip_first: bool):
    """A loop with a GradScaler enabled on this CPU machine (scale 65536), accumulation 2."""

    def train(model, batches):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        for i, ids in enumerate(batches):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), ignore_index=PAD_ID)
            scaler.scale(loss / 2).backward()
            if i % 2 == 1:
                if not clip_first:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()

    return train


def test_an_enabled_scaler_is_not_mistaken_for_a_missing_division():
    report = run_checks(build_fixture("gpt_correct"), only=["accumulation-scaling", "unscale-before-clip"],
                        pad_id=PAD_ID, train=_cpu_scaler_loop(clip_first=False))
    assert report["accumulation-scaling"].status.value == "pass"
    assert report["accumulation-scaling"].details["scale"] == 65536.0
    assert report["unscale-before-clip"].status.value == "pass"


def test_clip_before_unscale_with_an_enabled_scaler_fails():
    result = run_checks(build_fixture("gpt_correct"), only="unscale-before-clip", pad_id=PAD_ID,
                        train=_cpu_scaler_loop(clip_first=True))["unscale-before-clip"]
    assert result.status.value == "fail" and result.details["scaler_enabled_here"] is True
    assert "disabled" not in result.message


def test_value_clipping_warns_and_no_clipping_is_a_note():
    def train(model, batches, clip=True):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for ids in batches:
            optimizer.zero_grad()
            logits = model(ids[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
            if clip:
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
            optimizer.step()

    value = run_checks(build_fixture("gpt_correct"), only="clip-global-norm", train=train)["clip-global-norm"]
    assert value.status.value == "warn" and "clip_grad_value_" in value.message
    none = run_checks(build_fixture("gpt_correct"), only=["clip-global-norm", "lr-schedule"],
                      train=lambda m, b: train(m, b, clip=False))
    assert none["clip-global-norm"].status.value == "pass" and "not clip" in none["clip-global-norm"].message
    assert none["lr-schedule"].status.value == "warn" and "no warm-up" in none["lr-schedule"].message


def test_a_loop_that_raises_is_an_error_and_everything_is_restored():
    from torch.amp.autocast_mode import autocast
    from torch.optim import optimizer as optim_module

    originals = (torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler.scale, torch.optim.Optimizer.zero_grad,
                 torch.nn.Module.zero_grad, torch.optim.lr_scheduler.LRScheduler.step, autocast.__enter__)
    hooks = len(optim_module._global_optimizer_pre_hooks)
    calls = []

    def train(model, batches):
        calls.append(1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            for ids in batches:
                model(ids).sum().backward()
                optimizer.step()
                raise ValueError("my loop broke")

    report = run_checks(build_fixture("gpt_correct"), only=TRAIN_IDS, train=train)
    assert len(calls) == 1  # recorded once, judged by every check
    for result in report.results:
        if result.id == "ignore-index":
            assert result.status.value == "skip"  # needs pad_id, never runs the loop
        else:
            assert result.status.value == "error" and result.message == "ValueError: my loop broke", result.id
    assert originals == (torch.nn.utils.clip_grad_norm_, torch.amp.GradScaler.scale, torch.optim.Optimizer.zero_grad,
                         torch.nn.Module.zero_grad, torch.optim.lr_scheduler.LRScheduler.step, autocast.__enter__)
    assert len(optim_module._global_optimizer_pre_hooks) == hooks
    assert not torch._C._is_torch_function_mode_enabled()


def test_the_users_model_is_left_as_found():
    model = build_fixture("gpt_correct")
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run_checks(model, only=TRAIN_IDS + ["overfit-batch"], pad_id=PAD_ID, train=train_fn("no_zero_grad"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not model.training


def test_train_batches_option_feeds_more_batches():
    report = run_checks(build_fixture("gpt_correct"), only="scheduler-placement", pad_id=PAD_ID,
                        train=train_fn("correct"), options={"train_batches": 32})
    assert report["scheduler-placement"].details["optimizer_steps"] == 8


def test_train_checks_skip_without_a_loop_and_objective_skips_encoders():
    report = run_checks(build_fixture("gpt_correct"), only=TRAIN_IDS)
    assert {r.status.value for r in report.results} == {"skip"}
    assert "--train" in report["objective"].message
    encoder = run_checks(build_fixture("gpt_correct"), only="objective", kind="encoder", train=train_fn("correct"))
    assert encoder["objective"].status.value == "skip"


def test_overfit_batch_runs_the_users_loop():
    good = run_checks(build_fixture("gpt_correct"), only="overfit-batch", pad_id=PAD_ID,
                      train=train_fn("correct"))["overfit-batch"]
    assert good.status.value == "pass" and good.details["loop"] is True
    assert good.details["final_loss"] < 0.9 * good.details["start_loss"]
    noam = run_checks(build_fixture("gpt_correct"), only="overfit-batch", pad_id=PAD_ID,
                      train=train_fn("noam_default_lr"))["overfit-batch"]
    assert noam.status.value == "fail"
    assert noam.details["final_loss"] == pytest.approx(noam.details["start_loss"], abs=0.05)


def test_check_modules_stay_torch_free():
    code = "import sys, tfdoctor.checks.trainloop; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------------------------------------
# End to end through the installed command


def _tfdoctor(*args):
    env = dict(os.environ, COLUMNS="100")
    return subprocess.run(["tfdoctor", "check", "fixtures/gpt_correct.py:build", *args, "--format", "json"],
                          cwd=ROOT, capture_output=True, text=True, env=env)


def test_cli_exit_0_on_the_correct_loop():
    done = _tfdoctor("--train", "fixtures/loops/correct.py:train", "--only", ",".join(TRAIN_IDS + ["overfit-batch"]))
    assert done.returncode == 0, done.stdout + done.stderr
    statuses = {c["id"]: c["status"] for c in json.loads(done.stdout)["checks"]}
    assert statuses.pop("ignore-index") == "skip"  # no --pad-id: the batches carry no padding
    assert set(statuses.values()) == {"pass"}


def test_cli_exit_1_names_the_planted_bug():
    done = _tfdoctor("--train", "fixtures/loops/no_loss_division.py:train", "--only", ",".join(TRAIN_IDS))
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [c for c in json.loads(done.stdout)["checks"] if c["status"] in ("fail", "error")]
    assert [c["id"] for c in failed] == ["accumulation-scaling"]
    assert "4.00x" in failed[0]["message"] and "loss / 4" in failed[0]["hint"]
