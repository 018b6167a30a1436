"""The run judges on series read from training logs (what `tfdoctor judge` builds): real logs written by
the real libraries from tiny real runs (fixtures/logs/make.py: the HF Trainer's trainer_state.json,
Lightning's CSVLogger, a loop's TensorBoard events and JSON lines), each planted failure named by its
judge, each healthy log quiet across every judge; and series built by hand for what no planted run
shows (a schedule restarted on resume, an evaluation below training, a logged loss scale, series a log
lacks). The logs are read by tfdoctor/logs/, as `tfdoctor judge` reads them."""

import importlib.util
import math
from pathlib import Path

import pytest

from helpers import ROOT
from tfdoctor.checks import curves, grad_norm, run_health, run_schedule
from tfdoctor.checks.verdicts import logged
from tfdoctor.logs import find_runs
from tfdoctor.watching.judging import judge_run
from tfdoctor.watching.series import EvalPoint, RunSeries, StepRow

_spec = importlib.util.spec_from_file_location("fixtures_logs_make", ROOT / "fixtures" / "logs" / "make.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)

QUIET = ("pass", "skip")


def judged(series: RunSeries) -> dict:
    return {result.id: result for result in judge_run(series)}


def loud(results: dict) -> dict:
    return {id: (r.status.value, r.message) for id, r in results.items() if r.status.value not in QUIET}


def read(path) -> RunSeries:
    """The one run `tfdoctor judge PATH` finds in the log, as its judges see it."""
    runs = find_runs(path, {})
    assert len(runs) == 1, [run.name for run in runs]
    return runs[0].series


def nonfinite(value) -> bool:
    return value is not None and not math.isfinite(value)


def _written(tmp_path_factory, name: str):
    return getattr(make, name)(tmp_path_factory.mktemp(name))


# ---------------------------------------------------------------------------------- the logs, one run each


@pytest.fixture(scope="module")
def trainer_logs(tmp_path_factory):
    names = ("trainer_healthy", "trainer_dropout", "trainer_rate_spike", "trainer_nan_hidden", "trainer_plateau")
    return {name: read(_written(tmp_path_factory, name)) for name in names}


@pytest.fixture(scope="module")
def lightning_logs(tmp_path_factory):
    return {name: read(_written(tmp_path_factory, name))
            for name in ("lightning_healthy", "lightning_rate_spike")}


@pytest.fixture(scope="module")
def loop_logs(tmp_path_factory):
    """Each loop run's two logs: {"<name>:jsonl": series, "<name>:tensorboard": series}."""
    out = {}
    for name in ("loop_healthy", "loop_rate_spike", "loop_divergence", "loop_plateau", "loop_grad_growth"):
        paths = _written(tmp_path_factory, name)
        out[f"{name}:jsonl"] = read(paths["jsonl"])
        out[f"{name}:tensorboard"] = read(paths["tensorboard"])
    return out


@pytest.fixture(scope="module")
def logs(trainer_logs, lightning_logs, loop_logs):
    return {**trainer_logs, **lightning_logs, **loop_logs}


# ---------------------------------------------------------------------------------------- healthy logs


@pytest.mark.parametrize("name", ["trainer_healthy", "trainer_dropout", "lightning_healthy", "loop_healthy:jsonl",
                                  "loop_healthy:tensorboard"])
def test_healthy_logs_are_quiet_across_every_judge(logs, name):
    results = judged(logs[name])
    assert not loud(results), loud(results)
    # the judges with the log's signal judged it; the ones without said which series the log lacks
    for judge in ("loss-spike", "loss-divergence", "grad-norm-trend", "lr-trajectory", "eval-gap"):
        assert results[judge].status.value == "pass", (judge, results[judge].message)
    assert "the log has no time spent waiting for batches (data_wait)" in results["data-wait"].message
    assert "the log has no memory series" in results["memory-growth"].message
    assert "the log has no loss scale" in results["scaler-overflow"].message
    assert "the log has no training mode" in results["eval-mode-steps"].message
    assert "cannot be checked" in results["eval-gap"].message  # no fingerprints on a log


def test_logs_are_sparse_as_logged(logs):
    # the judges above read the logged points, not a step-by-step record
    assert logged.interval(logs["trainer_healthy"]) == 5
    assert logged.interval(logs["loop_healthy:jsonl"]) == make.LOG_EVERY
    assert logged.interval(logs["loop_healthy:tensorboard"]) == 1


def test_dropout_keeps_the_evaluation_below_training_but_within_the_margin(logs):
    result = judged(logs["trainer_dropout"])["eval-gap"]
    gaps = [(p["train"] - p["eval"]) / p["train"] for p in result.details["points"]]
    assert max(gaps) > 0.01  # dropout does put the evaluation below training ...
    assert max(gaps) < run_health.LOG_BELOW_MARGIN  # ... by less than the margin


# ---------------------------------------------------------------------------------------- planted logs


@pytest.mark.parametrize("name", ["trainer_rate_spike", "lightning_rate_spike", "loop_rate_spike:jsonl",
                                  "loop_rate_spike:tensorboard"])
def test_rate_spike_is_named_by_loss_spike(logs, name):
    results = judged(logs[name])
    result = results["loss-spike"]
    assert result.status.value in ("warn", "fail"), result.message
    # the rate of steps SPIKE_AT .. SPIKE_AT + 2 (0-based) was 50x: the loss is up at the next logged point
    every = logged.interval(logs[name])
    assert make.SPIKE_AT < result.details["step"] <= make.SPIKE_AT + make.SPIKE_WIDTH + every
    assert result.details["recovered_after"] is not None
    if every > 1:
        assert f"{every} steps apart" in result.message
    assert results["loss-divergence"].status.value == "pass", results["loss-divergence"].message


def test_divergence_hidden_by_the_trainers_nan_filter_is_named(logs):
    series = logs["trainer_nan_hidden"]
    # what the Trainer wrote: loss 0.0 where every loss was NaN, a NaN grad_norm and eval_loss
    zeros = [row.step for row in series.steps if row.loss == 0.0]
    assert zeros and not any(nonfinite(row.loss) for row in series.steps)
    assert nonfinite(series.steps[-1].grad_norm) and math.isnan(series.evals[-1].loss)
    result = judged(series)["loss-divergence"]
    assert result.status.value == "fail", result.message
    assert set(result.details["series"]) == {"loss", "grad_norm", "eval_loss"}
    assert result.details["step"] < zeros[0]  # the gradient norm showed it before the zeros began
    assert "logging_nan_inf_filter" in result.message and "logging_nan_inf_filter=False" in result.hint


@pytest.mark.parametrize("name", ["loop_divergence:jsonl", "loop_divergence:tensorboard"])
def test_nan_logged_as_nan_is_named_at_its_first_point(logs, name):
    series = logs[name]
    first_nan = next(row.step for row in series.steps if nonfinite(row.loss))
    result = judged(series)["loss-divergence"]
    assert result.status.value == "fail" and result.details["step"] == first_nan


def test_plateau_at_ln_v_fails_where_the_trainer_saved_its_config(logs):
    """The Trainer's output folder holds the model's config.json (save_model): its vocabulary makes the
    stuck level ln V, a uniform guess, which fails (31/32 of ln V here: see below)."""
    series = logs["trainer_plateau"]
    assert series.facts["vocab"] == make.VOCAB
    result = judged(series)["loss-plateau"]
    assert result.status.value == "fail", result.message
    assert result.details["level"] == "ln V" and "uniform guess over the vocabulary" in result.message


def test_a_trainer_log_without_its_config_has_no_vocabulary(logs, tmp_path):
    state = tmp_path / "trainer_state.json"  # the state file alone, copied out of its output folder
    state.write_text((Path(logs["trainer_plateau"].facts["logged"]["path"])).read_text())
    assert "vocab" not in read(state).facts


@pytest.mark.parametrize("name", ["loop_plateau:jsonl", "loop_plateau:tensorboard"])
def test_plateau_at_the_start_is_named(logs, name):
    result = judged(logs[name])["loss-plateau"]
    assert result.status.value in ("warn", "fail"), result.message
    # no vocabulary in a log: the level is the run's start, ln V for a model trained from scratch (the
    # Trainer divides the summed loss by every label token, the first included: 31/32 of ln 64 here)
    assert result.details["level"] == "its start"
    assert abs(result.details["final"] - math.log(make.VOCAB)) < 0.2


def test_rate_zero_is_named_by_lr_trajectory(logs):
    result = judged(logs["loop_plateau:jsonl"])["lr-trajectory"]
    assert result.status.value == "fail" and "was 0 at every one of" in result.message


@pytest.mark.parametrize("name", ["loop_grad_growth:jsonl", "loop_grad_growth:tensorboard"])
def test_summed_micro_batches_grow_the_logged_gradient_norm(logs, name):
    results = judged(logs[name])
    result = results["grad-norm-trend"]
    assert result.status.value == "warn", result.message
    assert result.details["factor"] >= grad_norm.NORM_GROWTH
    for judge in ("loss-spike", "loss-divergence"):
        assert results[judge].status.value == "pass", (judge, results[judge].message)


# ------------------------------------------------------------------------------------- series by hand


def log_series(losses, *, every=10, lrs=None, norms=None, evals=(), sources=None, **columns) -> RunSeries:
    rows = []
    for i, loss in enumerate(losses):
        row = StepRow((i + 1) * every, loss, grad_norm=norms[i] if norms else None, lrs=[lrs[i]] if lrs else [])
        for name, values in columns.items():
            setattr(row, name, values[i])
        rows.append(row)
    names = sources or {"loss": "loss", **({"lr": "lr"} if lrs else {}),
                        **({"grad_norm": "grad_norm"} if norms else {})}
    series = RunSeries(rows, [EvalPoint(step, loss, source="val_loss") for step, loss in evals])
    series.facts = {"logged": {"format": "jsonl", "path": "log.jsonl", "interval": every, "sources": names,
                               "still_written": False}, "ended": "log"}
    return series


def falling(n, start=4.0, floor=2.0):
    return [floor + (start - floor) * math.exp(-i / 8) + 0.01 * ((i * 7919) % 5 - 2) for i in range(n)]


def cosine(n, peak=3e-3, warm=2):
    return [peak * (i + 1) / warm if i < warm else peak * 0.5 * (1 + math.cos(math.pi * (i - warm) / (n - warm)))
            for i in range(n)]


def test_log_without_gradient_norm_skips_naming_the_series():
    result = grad_norm.grad_norm_trend(log_series(falling(40)))
    assert result.status.value == "skip" and result.message == "the log has no gradient norm (grad_norm)"
    result = run_schedule.lr_trajectory(log_series(falling(40), sources={"loss": "train/loss"}))
    assert result.status.value == "skip" and "the log has no learning rate" in result.message


def test_schedule_started_over_on_resume_fails_and_warm_restarts_pass():
    for warm in (0, 4):  # a schedule without and with a warm-up (4 points: 40 steps)
        first = cosine(40, warm=warm)
        resumed = first[:25] + first[:15]  # resumed after point 25 with a scheduler created anew
        result = run_schedule.lr_trajectory(log_series(falling(40), lrs=resumed))
        assert result.status.value == "fail", (warm, result.message)
        assert result.details["step"] == 260 and result.details["replays_start"]
    assert "load_state_dict" in result.hint
    restarts = cosine(15, warm=0)[:-1] * 3  # three even cycles, straight back to the peak
    assert run_schedule.lr_trajectory(log_series(falling(42), lrs=restarts)).status.value == "pass"
    for quiet in (cosine(40), [3e-3 * min(1.0, (i + 1) / 3) for i in range(40)]):  # cosine, constant after warm-up
        assert run_schedule.lr_trajectory(log_series(falling(40), lrs=quiet)).status.value == "pass"


def test_a_rate_jump_that_is_no_replay_warns():
    rates = cosine(40)
    jumped = rates[:25] + [2.5e-3] * 15  # back up to a new constant: neither the start's rates nor periodic
    result = run_schedule.lr_trajectory(log_series(falling(40), lrs=jumped))
    assert result.status.value == "warn" and not result.details["replays_start"]


def test_evaluation_below_training_on_a_log_warns_and_says_what_it_cannot_check():
    losses = falling(40)
    below = [(s, losses[s // 10 - 1] * 0.8) for s in (50, 100, 150, 200, 250, 300)]  # 20% below at every one
    result = run_health.eval_gap(log_series(losses, evals=below))
    assert result.status.value == "warn", result.message
    assert result.details["below"] == 6 and "cannot be checked" in result.message
    near = [(s, losses[s // 10 - 1] * 0.97) for s in (50, 100, 150, 200)]  # 3% below: dropout's size
    assert run_health.eval_gap(log_series(losses, evals=near)).status.value == "pass"


def test_data_wait_judged_only_where_the_log_has_it():
    losses = falling(30)
    assert run_health.data_wait(log_series(losses, wall=[0.1] * 30)).status.value == "skip"
    series = log_series(losses, wall=[0.1] * 30, data_wait=[0.05] * 30,
                        sources={"loss": "loss", "wall": "step_time", "data_wait": "data_time"})
    result = run_health.data_wait(series)
    assert result.status.value == "warn" and "does not say how the DataLoader" in result.message


def test_logged_loss_scale_falling_below_one_fails():
    scales = [2.0 ** (16 - i) for i in range(20)]  # halved at every logged point, down to 1/8
    series = log_series(falling(20), scale=scales, sources={"loss": "loss", "scale": "loss_scale"})
    result = run_health.scaler_overflow(series)
    assert result.status.value == "fail" and "loss_scale" in result.message
    steady = [65536.0] * 10 + [131072.0] * 10  # grew once: settled
    series = log_series(falling(20), scale=steady, sources={"loss": "loss", "scale": "loss_scale"})
    assert run_health.scaler_overflow(series).status.value == "pass"


def test_memorised_loss_reaching_zero_is_no_divergence():
    memorised = [2.0 * 0.3 ** i for i in range(30)] + [0.0] * 10  # orders of magnitude, point after point
    assert curves.loss_divergence(log_series(memorised)).status.value == "pass"
    collapsed = falling(30) + [0.0] * 10  # from 2.0 to exactly 0.0 in one interval: the NaN filter
    result = curves.loss_divergence(log_series(collapsed))
    assert result.status.value == "fail" and result.details["step"] == 310


def test_an_fp16_inf_norm_now_and_then_is_no_divergence():
    norms = [1.0] * 40
    norms[10] = norms[30] = math.inf  # the GradScaler's skipped steps, logged where a point fell on one
    norms[-1] = math.inf
    assert curves.loss_divergence(log_series(falling(40), norms=norms)).status.value == "pass"
