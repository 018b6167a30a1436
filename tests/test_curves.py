"""The curve judges (tfdoctor/checks/curves.py): loss-spike, loss-divergence, loss-plateau and
grad-norm-trend, each on the watched run of its planted bug (fixtures/watch/, one run per fixture per
session through watch_audit) at the right step, quiet on the healthy runs, and on series built by hand
for the edges: no steps, no losses, NaN, a memorised batch, a run too short to tell."""

import math
import random

import pytest

from tfdoctor.checks import curves, grad_norm
from tfdoctor.watching.series import RunSeries, StepRow

JUDGES = ("loss-spike", "loss-divergence", "loss-plateau", "grad-norm-trend")
HEALTHY = ("healthy", "healthy_accum")


def series_of(report) -> RunSeries:
    return RunSeries.from_dict(report.series)


# ------------------------------------------------------------------------------------------ watched runs


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_runs_are_quiet(watch_audit, name):
    report = watch_audit(name)
    for judge in JUDGES:
        assert report[judge].status.value == "pass", (judge, report[judge].message)


@pytest.fixture(scope="module")
def spiked(watch_audit):
    return watch_audit("lr_spike")


def test_rate_spike_is_named_at_the_step_after_the_spiked_updates(spiked):
    result = spiked["loss-spike"]
    assert result.status.value == "fail", result.message
    # lr_spike.py multiplies the rate of the updates of steps 150 and 151; a step's loss is measured
    # before its own update, so the damage shows from step 151 on
    assert 151 <= result.details["step"] <= 152
    assert result.details["z"] > curves.SPIKE_Z and result.details["excess"] > curves.SPIKE_REL * 1.8
    assert result.details["lr_ratio"] >= 10  # the evidence names the rate that jumped
    assert result.details["grad_norm_ratio"] >= curves.MOVED_RATIO
    assert result.details["batch"] == result.details["step"] + 1  # one DataLoader batch per step
    assert result.details["recovered_after"] is not None
    assert "schedule" in result.hint


def test_rate_spike_is_not_a_divergence_once_the_run_recovers(spiked):
    assert spiked["loss-divergence"].status.value == "pass", spiked["loss-divergence"].message
    assert spiked["loss-plateau"].status.value == "pass"


def test_uncapped_warmup_diverges_at_the_first_nan(watch_audit):
    report = watch_audit("diverges")
    result = report["loss-divergence"]
    assert result.status.value == "fail", result.message
    losses = {row.step: row.loss for row in series_of(report).steps}
    first_nan = min(step for step, loss in losses.items() if not math.isfinite(loss))
    assert result.details["step"] == first_nan
    assert first_nan > 100  # the run learned first: the rate rose past what SGD can take
    assert math.isfinite(result.details["last_finite_loss"])
    assert min(loss for loss in losses.values() if math.isfinite(loss)) < 2.5


def test_shuffled_targets_plateau_at_ln_v_after_the_warmup(watch_audit):
    report = watch_audit("plateau")
    result = report["loss-plateau"]
    assert result.status.value == "fail", result.message
    assert result.details["level"] == "ln V"
    assert 15 <= result.details["warmup_end"] <= 20  # warmup_cosine's 20 steps, read from the rates
    assert result.details["step"] == result.details["warmup_end"] + curves.PLATEAU_AFTER
    assert abs(result.details["final"] - math.log(64)) <= result.details["tolerance"]
    assert report["loss-divergence"].status.value == "pass"


def test_summed_micro_batches_grow_the_gradient_norm(watch_audit):
    report = watch_audit("grad_growth")
    result = report["grad-norm-trend"]
    assert result.status.value == "warn", result.message
    assert result.details["factor"] >= grad_norm.NORM_GROWTH
    assert result.details["low_step"] < result.details["step"] < len(series_of(report))
    medians = result.details["window_medians"]
    assert medians[-1] > 4 * medians[0]
    # the clip hides the growth from the loss: no other curve judge sees it (200 steps are too few for
    # loss-plateau to judge)
    for judge in ("loss-spike", "loss-divergence"):
        assert report[judge].status.value == "pass", (judge, report[judge].message)
    assert report["loss-plateau"].status.value == "skip"


# ------------------------------------------------------------------------------ series built by hand


def noisy_run(steps=300, start=4.3, floor=1.8, noise=0.05, norm=0.5, warmup=20, seed=0) -> RunSeries:
    """A loss that falls from `start` towards `floor` with batch noise (the shape and noise of healthy.py's
    run), a flat gradient norm, warm-up then a constant rate."""
    rng = random.Random(seed)
    rows = []
    for step in range(steps):
        loss = floor + (start - floor) * math.exp(-step / 60) + rng.gauss(0, noise)
        rate = 3e-3 * min(1.0, (step + 1) / warmup)
        rows.append(StepRow(step, loss, grad_norm=norm * (1 + rng.gauss(0, 0.1)), lrs=[rate], batches=step + 1))
    return RunSeries(rows, facts={"vocab": 64})


def judge(series: RunSeries) -> dict:
    return {"loss-spike": curves.loss_spike(series), "loss-divergence": curves.loss_divergence(series),
            "loss-plateau": curves.loss_plateau(series), "grad-norm-trend": grad_norm.grad_norm_trend(series)}


def test_empty_series_skips_every_judge():
    for result in judge(RunSeries()).values():
        assert result.status.value == "skip"
        assert "no optimizer step" in result.message


def test_series_without_losses_or_norms_skips():
    series = RunSeries([StepRow(i, None, lrs=[1e-3]) for i in range(100)])
    for name, result in judge(series).items():
        assert result.status.value == "skip", name
    assert "no loss" in judge(series)["loss-spike"].message
    assert "no gradient norm" in judge(series)["grad-norm-trend"].message


def test_synthetic_healthy_run_is_quiet():
    for name, result in judge(noisy_run()).items():
        assert result.status.value == "pass", (name, result.message)


def test_a_planted_spike_fires_at_its_step_and_only_there():
    series = noisy_run()
    series.steps[200].loss += 0.9
    result = curves.loss_spike(series)
    assert result.status.value == "warn"  # 0.9 nats is under half of the 2.4 the run had learned
    assert result.details["step"] == 200 and result.details["spikes"] == 1
    assert result.details["batch"] == 201
    series.steps[200].loss += 0.6  # now it undoes more than half the progress
    assert curves.loss_spike(series).status.value == "fail"


def test_spike_evidence_names_a_falling_scaler_scale_and_a_quiet_gradient():
    series = noisy_run()
    for row in series.steps:
        row.scale = 65536.0 if row.step < 180 else 32768.0  # the scaler halved at step 180's update
    series.steps[180].loss += 1.0
    result = curves.loss_spike(series)
    assert result.details["step"] == 180
    assert (result.details["scale_before"], result.details["scale"]) == (65536.0, 32768.0)
    assert "65536 -> 32768" in result.message
    assert result.details["grad_norm_ratio"] < curves.MOVED_RATIO  # the norm stayed put:
    assert "inspect batch 181 itself" in result.hint  # so the batch is the suspect


def test_a_warmup_is_no_rate_jump():
    series = noisy_run(warmup=200)
    series.steps[150].loss += 1.0  # mid-warm-up: each rate is above the band's, by a few percent
    result = curves.loss_spike(series)
    assert result.details["step"] == 150 and result.details["lr_ratio"] < curves.MOVED_RATIO
    assert "schedule" not in result.hint


def test_noise_on_a_loss_near_zero_is_no_spike():
    series = noisy_run(start=0.5, floor=0.001, noise=0.0002)
    series.steps[250].loss = 0.01  # ten times its band, but a hundredth of a nat
    assert curves.loss_spike(series).status.value == "pass"


def test_nan_loss_fails_at_the_first_and_survives_the_json_trip():
    series = noisy_run()
    for row in series.steps[140:]:
        row.loss = float("nan")
    series.steps[150].loss = float("inf")
    shipped = RunSeries.from_dict(series.to_dict())  # NaN travels as the string "nan"
    for candidate in (series, shipped):
        result = curves.loss_divergence(candidate)
        assert result.status.value == "fail"
        assert result.details["step"] == 140 and result.details["last_finite_step"] == 139
        assert result.details["nonfinite_steps"] == 160
    assert curves.loss_spike(shipped).status.value == "pass"  # NaN is divergence's, not a spike


def test_sustained_rise_fails_and_a_small_one_warns():
    series = noisy_run()
    for row in series.steps[200:]:
        row.loss += 2.0  # gives back most of the 2.5 nats learned
    result = curves.loss_divergence(series)
    assert result.status.value == "fail"
    assert 200 <= result.details["step"] <= 200 + curves.DIVERGE_WINDOW
    series = noisy_run()
    for row in series.steps[200:]:
        row.loss += 0.7
    assert curves.loss_divergence(series).status.value == "warn"


def test_rise_cut_short_by_the_end_is_not_sustained():
    series = noisy_run()
    for row in series.steps[-10:]:
        row.loss += 2.0
    assert curves.loss_divergence(series).status.value == "pass"


def test_a_slow_learner_sinking_through_the_band_is_no_plateau():
    rng = random.Random(1)
    noise = [rng.gauss(0, 0.08) for _ in range(400)]
    slow = noisy_run(steps=400)
    for row in slow.steps:  # from ln V down 0.15 nats per 100 steps: slow, but learning
        row.loss = 4.18 - 0.0015 * row.step + noise[row.step]
    first = curves.PLATEAU_AFTER + curves.PLATEAU_STRETCH + 20  # the warm-up ends at step 17
    for cut in range(first, 401, 20):
        assert curves.loss_plateau(RunSeries(slow.steps[:cut], facts=slow.facts)).status.value == "pass", cut
    for row in slow.steps:  # the same noise around a flat 4.0
        row.loss = 4.0 + noise[row.step]
    assert curves.loss_plateau(slow).status.value == "fail"
    assert curves.loss_plateau(RunSeries(slow.steps[:first - 10], facts=slow.facts)).status.value == "skip"


def test_plateau_at_the_start_value_below_ln_v_warns():
    series = noisy_run(start=2.5, floor=2.5)  # a fine-tune that never moves
    result = curves.loss_plateau(series)
    assert result.status.value == "warn" and result.details["level"] == "its start"


def test_plateau_without_rates_or_vocabulary_is_judged_from_the_start():
    series = noisy_run(start=4.2, floor=4.2)
    for row in series.steps:
        row.lrs = []
    series.facts = {}
    result = curves.loss_plateau(series)
    assert result.status.value == "warn" and result.details["warmup_end"] is None


def test_plateau_skips_a_run_too_short_after_its_warmup():
    series = noisy_run(steps=300, warmup=200)  # the rate reaches 90% of its peak at step 179
    result = curves.loss_plateau(series)
    assert result.status.value == "skip" and "too short" in result.message


def test_norm_collapse_warns_unless_the_loss_goes_to_zero():
    series = noisy_run()
    for row in series.steps[150:]:
        row.grad_norm *= 1e-4
    result = grad_norm.grad_norm_trend(series)
    assert result.status.value == "warn" and "collapsed" in result.message
    assert 150 <= result.details["step"] < 150 + 2 * grad_norm.NORM_WINDOW
    memorised = noisy_run(start=3.0, floor=0.0, noise=0.0)
    for row in memorised.steps:
        row.grad_norm *= math.exp(-row.step / 30)  # the gradient fades with the loss
        row.loss = abs(row.loss)
    assert grad_norm.grad_norm_trend(memorised).status.value == "pass"


def test_norm_that_rises_then_falls_is_no_growth():
    series = noisy_run()
    for row in series.steps:
        row.grad_norm *= 1 + 8 * math.sin(math.pi * row.step / 300)  # up 9x and back down
    assert grad_norm.grad_norm_trend(series).status.value == "pass"


def test_norm_growth_skips_steps_the_scaler_skipped():
    series = noisy_run()
    for row in series.steps[::7]:
        row.grad_norm, row.skipped = float("inf"), True  # fp16 overflows: scaler-overflow's business
    assert grad_norm.grad_norm_trend(series).status.value == "pass"
