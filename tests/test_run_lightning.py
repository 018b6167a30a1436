"""`tfdoctor run` on Lightning scripts (`L.Trainer(...).fit(module, loader)`), through the installed
command: Lightning steps with `optimizer.step(closure)` (the window's last forward and backward run
inside the step), wraps the optimizer, clears the gradients, accumulates, clips and casts itself,
and catches what `fit` raises; the audit must see through all of it (fixtures/scripts/lightning_*.py).
"""

import subprocess
import sys

import pytest

from helpers import E2E, ROOT, SCRIPTS, tfdoctor

pytest.importorskip("lightning")
pytestmark = E2E
# The model checks that cost seconds; skipped where a test is about the loop.
SLOW_MODEL_CHECKS = ["--skip", "future-leak,mask-direction,softmax-mask-order,half-precision-mask,padding-mask,"
                               "masked-row-nan,padding-equivalence,overfit-batch,generation,memory"]


def audit(script: str, *args):
    """Run the script under `tfdoctor run --format json`: (exit code, report, the script's stderr)."""
    done = tfdoctor("run", f"{SCRIPTS}/{script}", "--format", "json", *args)
    assert done.stdout.startswith("{"), done.stderr  # stdout is the JSON report alone
    return done.returncode, done.json, done.stderr


def _line(script: str, start: str) -> int:
    lines = (ROOT / SCRIPTS / script).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if line.startswith(start))


def statuses(report) -> dict:
    return {c["id"]: c["status"] for c in report["checks"]}


def findings(report) -> list:
    return [(c["id"], c["status"], c["message"]) for c in report["checks"] if c["status"] in ("fail", "warn", "error")]


def test_correct_lightning_script_is_quiet_and_discovered():
    code, report, stderr = audit("lightning_correct.py")
    assert code == 0 and not findings(report)
    found = report["discovered"]
    assert found["model"] == "LitLM" and found["called_as"] == "model(ids)" and found["optimizers"] == ["AdamW"]
    assert found["model_defined_in"] == f"{SCRIPTS}/lightning_correct.py:{_line('lightning_correct.py', 'class LitLM')}"
    assert found["lightning"] == {"module": "LitLM", "audited": "the LightningModule",
                                  "strategy": "SingleDeviceStrategy", "precision": "32-true",
                                  "accumulate_grad_batches": 2, "gradient_clip_val": 1.0}
    assert (found["pad_id"], found["pad_id_source"], found["padding_side"]) == (0, "targets set to ignore_index",
                                                                                "right")
    assert found["steps"] == 2 and found["ended"] == "stopped"
    checks = statuses(report)
    # accumulate_grad_batches=2, gradient_clip_val and the warm-up: each seen and judged on the real trace
    for check in ("accumulation-scaling", "token-weighting", "clip-global-norm", "scheduler-placement",
                  "zero-grad", "lr-schedule", "ignore-index", "objective", "grad-health", "init-loss",
                  "padding-mask", "future-leak"):
        assert checks[check] == "pass", check
    by_id = {c["id"]: c for c in report["checks"]}
    assert by_id["accumulation-scaling"]["details"]["micro_batches_per_step"] == 2
    # the norm handed to the step is the accumulated one the clip saw, not the first micro-batch's
    norms = by_id["zero-grad"]["details"]["grad_norm_at_step"]
    assert norms == pytest.approx(by_id["grad-health"]["details"]["pre_clip_norms"])
    # stopped inside the second optimizer step: four micro-batches ran, nothing after fit()
    assert "batch 3 loss" in stderr and "batch 4 loss" not in stderr and "training done" not in stderr
    assert "Traceback" not in stderr


def test_without_accumulation_every_step_is_one_window_and_the_stop_holds():
    # Each step's only forward and backward run inside optimizer.step(closure): before the closure was
    # followed, every step joined the previous one's window and the script was never stopped.
    code, report, stderr = audit("lightning_correct.py", "--steps", "3", *SLOW_MODEL_CHECKS, "--", "--accum", "1")
    assert code == 0 and not findings(report)
    assert report["discovered"]["steps"] == 3 and report["discovered"]["ended"] == "stopped"
    assert "batch 2 loss" in stderr and "batch 3 loss" not in stderr
    checks = statuses(report)
    assert checks["accumulation-scaling"] == "skip" and checks["zero-grad"] == "pass"
    assert checks["optimizer-coverage"] == "pass" and checks["grad-health"] == "pass"


@pytest.mark.parametrize("precision, amp", [("--precision=bf16-mixed", "pass"), ("--cpu-scaler", "pass")])
def test_mixed_precision_plugins_are_seen(precision, amp):
    # "16-mixed" on a CPU is run by Lightning as bf16-mixed; --cpu-scaler is its GPU path
    # (GradScaler: scale, unscale_, clip, scaler.step) run on a CPU scaler
    code, report, _ = audit("lightning_correct.py", *SLOW_MODEL_CHECKS, "--", precision)
    assert code == 0 and not findings(report)
    checks = statuses(report)
    assert checks["amp-loss-scaling"] == amp and checks["accumulation-scaling"] == "pass"
    assert checks["unscale-before-clip"] == ("pass" if precision == "--cpu-scaler" else "skip")


def test_default_trainer_writes_no_checkpoint_before_the_stop(tmp_path):
    # --max-steps 2: Lightning's default ModelCheckpoint saves right after the second step, the stop point
    bare = subprocess.run([sys.executable, "lightning_correct.py", "--max-steps", "2", "--default-trainer", "--root",
                           str(tmp_path / "bare")], cwd=ROOT / SCRIPTS, capture_output=True, text=True, timeout=300)
    assert bare.returncode == 0, bare.stderr
    assert list((tmp_path / "bare").rglob("*.ckpt"))  # the script alone does write one
    code, report, stderr = audit("lightning_correct.py", "--only", "zero-grad", "--", "--max-steps", "2",
                                 "--default-trainer", "--root", str(tmp_path / "audited"))
    assert code == 0 and report["discovered"]["ended"] == "stopped"
    assert not list((tmp_path / "audited").rglob("*.ckpt")) and "training done" not in stderr
    # nor tried to: the sandbox would have kept it from the folder anyway (tfdoctor/process/sandbox)
    assert not [path for path in report.get("sandbox", {}).get("written", []) if path.endswith(".ckpt")]


# The two LightningModules that hold their LM (no forward of their own that returns logits): the
# model checks must judge that LM, the TinyLM of tinylm.py, not the LightningModule.
HOLDS_ITS_LM = {"lightning_targets_equal_inputs.py": "training_step calls self.lm(x)",
                "lightning_mean_per_micro_batch.py": "forward(x, y) returns the loss"}


@pytest.mark.parametrize("script, check, status, evidence", [
    ("lightning_pads_graded.py", "ignore-index", "fail", "pad targets (pad_id=0)"),
    ("lightning_targets_equal_inputs.py", "objective", "fail", "graded on the token it was given"),
    ("lightning_mean_per_micro_batch.py", "token-weighting", "warn", "each micro-batch is averaged over its own"),
])
def test_planted_lightning_bug_is_the_only_finding(script, check, status, evidence):
    code, report, _ = audit(script, *SLOW_MODEL_CHECKS)
    assert code == (1 if status == "fail" else 0)
    (finding,) = findings(report)
    assert finding[:2] == (check, status) and evidence in finding[2]
    if check != "token-weighting":  # judged on the loss: the finding names its line in the LightningModule
        loss_line = _line("lightning_correct.py", "        summed = F.cross_entropy(")
        details = next(c["details"] for c in report["checks"] if c["id"] == check)
        assert details["location"] == f"{SCRIPTS}/lightning_correct.py:{loss_line}"
    found = report["discovered"]
    if script in HOLDS_ITS_LM:
        assert (found["model"] == "TinyLM"
                and found["model_defined_in"] == f"{SCRIPTS}/tinylm.py:8"), HOLDS_ITS_LM[script]
        assert found["lightning"]["audited"] == "its .lm" and found["called_as"] == "model(ids)"
    else:
        assert found["model"] == "LitLM" and found["lightning"]["audited"] == "the LightningModule"
    assert statuses(report)["init-loss"] == "pass"  # the model checks ran on the audited model


def test_ddp_strategy_wrapper_is_seen_through():
    # strategy="ddp" wraps the LightningModule in DistributedDataParallel and runs training_step through
    # the wrapper's forward (Lightning's forward redirection): that call is not the model's
    code, report, _ = audit("lightning_correct.py", "--only", "init-loss,padding-mask,accumulation-scaling,zero-grad,"
                            "token-weighting", "--", "--strategy", "ddp")
    assert code == 0 and not findings(report)
    found = report["discovered"]
    assert found["model"] == "LitLM" and found["called_as"] == "model(ids)" and found["batch_shape"] == [4, 16]
    assert found["lightning"]["strategy"] == "DDPStrategy" and found["steps"] == 2
    assert set(statuses(report).values()) == {"pass"}


@pytest.mark.parametrize("optimizer", ["lbfgs", "adamw"])
def test_plain_closure_loop_is_quiet_and_stopped(optimizer):
    # LBFGS evaluates the closure 4 times per step: its iterations are not 4 accumulated micro-batches
    code, report, stderr = audit("closure_loop.py", *SLOW_MODEL_CHECKS, "--", "--optimizer", optimizer)
    assert code == 0 and not findings(report)
    assert report["discovered"]["steps"] == 2 and report["discovered"]["ended"] == "stopped"
    assert "step 1 loss" in stderr and "step 2 loss" not in stderr  # stopped inside the second step
    checks = statuses(report)
    assert checks["accumulation-scaling"] == "skip" and checks["zero-grad"] == "pass"
    assert checks["clip-global-norm"] == "pass" and checks["objective"] == "pass"
