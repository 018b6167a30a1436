"""The run health judges (tfdoctor/checks/run_health.py): scaler-overflow, lr-trajectory, data-wait,
memory-growth and eval-gap. Edge cases on RunSeries built here from numbers the fixtures' runs showed
(skipped steps, scales, rates, step times, memory), then each judge on a whole watched run of its
bad fixture in fixtures/watch/ (right status, right step) and quiet on the healthy runs."""

import math
import re

import pytest

from tfdoctor.result import Status
from tfdoctor.watching.judging import judge_run
from tfdoctor.watching.series import EvalPoint, RunSeries, StepRow

MIB = 2 ** 20
HEALTH = ("scaler-overflow", "lr-trajectory", "data-wait", "memory-growth", "eval-gap")


def judge(series: RunSeries, check_id: str):
    (result,) = judge_run(series, only=[check_id])
    return result


def rows(n: int, **columns) -> list[StepRow]:
    """n StepRows; each keyword is a function of the step giving that field."""
    return [StepRow(**{"step": i, "loss": None, **{name: f(i) for name, f in columns.items()}}) for i in range(n)]


# ---------------------------------------------------------------------------------- empty series

@pytest.mark.parametrize("check_id", HEALTH)
def test_an_empty_series_is_skipped_with_a_reason(check_id):
    result = judge(RunSeries(facts={"loader": {"num_workers": 0}}), check_id)
    assert result.status == Status.SKIP
    assert result.message


# ---------------------------------------------------------------------------------- scaler-overflow

def scaler_run(n: int, skipped_steps, init: float = 2.0 ** 24, growth_interval: int = 2000) -> RunSeries:
    """The GradScaler's own arithmetic (halve on a skip, double after growth_interval clean steps) over
    the skipped steps a real run showed."""
    skipped, out, scale, clean = set(skipped_steps), [], init, 0
    for i in range(n):
        if i in skipped:
            scale, clean = scale * 0.5, 0
        else:
            clean += 1
            if clean == growth_interval:
                scale, clean = scale * 2, 0
        out.append(StepRow(step=i, loss=None, scale=scale, skipped=i in skipped))
    return RunSeries(out)


def test_scaler_calibrating_then_probing_now_and_then_passes():
    # fp16_healthy.py's pattern on a CPU (init_scale 2**24, growth_interval 50): steps 0-3 and 6 while
    # it found its ceiling, then one probe every hundred steps or so
    result = judge(scaler_run(300, [0, 1, 2, 3, 6, 107, 153, 254, 268], growth_interval=50), "scaler-overflow")
    assert result.status == Status.PASS, result.message
    assert result.details["calibration_skipped"] == 5
    assert result.details["share_after_calibration"] < 0.05


def test_scaler_skipping_every_other_step_fails_at_its_first_overflow():
    # fp16_overflow.py (growth_interval=1): from step 5 on, every other step overflows again
    skipped = [5, 6] + list(range(8, 200, 2))
    series = scaler_run(200, skipped, init=65536.0, growth_interval=1)
    series.facts["amp"] = {"scaler": {"growth_interval": 1, "growth_factor": 2.0, "backoff_factor": 0.5}}
    result = judge(series, "scaler-overflow")
    assert result.status == Status.FAIL
    assert "GradScaler(growth_interval=1, growth_factor=2, backoff_factor=0.5)" in result.message
    assert not result.details["settled"]
    assert result.details["share_after_calibration"] > 0.4
    assert result.details["step"] == 5


def test_scaler_collapsing_to_the_end_fails_where_the_skipping_began():
    # a float16 overflow in the forward: inf at any scale, every step from 120 on skipped
    result = judge(scaler_run(200, range(120, 200), init=65536.0), "scaler-overflow")
    assert result.status == Status.FAIL
    assert result.details["step"] == 120
    assert result.details["scale_last"] < 1.0
    assert "fell without recovering" in result.message


def test_scaler_some_skipping_warns():
    skipped = [0, 1, 2] + list(range(20, 300, 12))  # one step in 12 after calibration
    result = judge(scaler_run(300, skipped, growth_interval=11), "scaler-overflow")
    assert result.status == Status.WARN, result.message
    assert result.details["step"] == 20


def test_scaler_skips_without_a_scaler_or_with_too_few_steps():
    assert judge(RunSeries(rows(100)), "scaler-overflow").status == Status.SKIP
    assert judge(scaler_run(12, [0]), "scaler-overflow").status == Status.SKIP


# ---------------------------------------------------------------------------------- lr-trajectory

def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """watchlm.warmup_cosine: the healthy runs' schedule."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def rated(n: int, factor, ended: str = "finished", schedulers=None, base: float = 3e-3) -> RunSeries:
    return RunSeries(rows(n, lrs=lambda i: [base * factor(i)]),
                     facts={"ended": ended, "schedulers": schedulers or [{"name": "LambdaLR"}]})


@pytest.mark.parametrize("floor", [0.1, 0.0])
def test_lr_warmup_then_cosine_passes_even_to_zero(floor):
    result = judge(rated(300, lambda s: warmup_cosine(s, 20, 300, floor)), "lr-trajectory")
    assert result.status == Status.PASS, result.message


def test_lr_linear_decay_to_zero_at_half_the_run_fails_where_it_reached_zero():
    # lr_zero_halfway.py: linear warm-up over 10 steps, decay to 0 at 128 of 256 steps
    def linear(s):
        return (s + 1) / 10 if s < 10 else max(0.0, (128 - s) / 118)

    result = judge(rated(256, linear), "lr-trajectory")
    assert result.status == Status.FAIL
    assert result.details["step"] == next(s for s in range(256) if linear(s) <= 0.01)
    assert 0.45 < result.details["share_at_zero"] < 0.55
    assert "LambdaLR" in result.message


def test_lr_at_zero_for_a_tenth_of_the_run_warns_and_plateau_scheduler_only_warns():
    assert judge(rated(300, lambda s: max(0.0, 1 - s / 255)), "lr-trajectory").status == Status.WARN
    plateau = rated(300, lambda s: 1.0 if s < 100 else 1e-3, schedulers=[{"name": "ReduceLROnPlateau"}])
    assert judge(plateau, "lr-trajectory").status == Status.WARN


def test_lr_spike_of_two_steps_is_not_the_peak_the_decay_is_measured_from():
    # lr_spike.py's schedule: healthy.py's with a factor of 50 for two steps at 150
    result = judge(rated(300, lambda s: warmup_cosine(s, 20, 300) * (50 if s in (150, 151) else 1)), "lr-trajectory")
    assert result.status == Status.PASS, result.message
    assert result.details["peak"] == pytest.approx(3e-3, rel=0.01)


def test_lr_stuck_at_zero_fails_at_step_zero():
    result = judge(rated(100, lambda s: 0.0), "lr-trajectory")
    assert result.status == Status.FAIL
    assert result.details["step"] == 0


def test_lr_warmup_never_finishing_warns_only_on_a_run_that_ended_on_its_own():
    never = lambda s: (s + 1) / 4000  # noqa: E731 - a warm-up of 4000 steps in a 300-step run
    result = judge(rated(300, never), "lr-trajectory")
    assert result.status == Status.WARN
    assert result.details["step"] == 299
    assert judge(rated(300, never, ended="max-steps"), "lr-trajectory").status == Status.PASS
    assert judge(rated(20, never), "lr-trajectory").status == Status.PASS  # a smoke test's 20 steps


def test_lr_constant_passes_and_too_few_steps_skip():
    assert judge(rated(300, lambda s: 1.0), "lr-trajectory").status == Status.PASS
    assert judge(rated(10, lambda s: 1.0), "lr-trajectory").status == Status.SKIP


# ---------------------------------------------------------------------------------- lr-trajectory: the promise

def promised(n: int, factor, position, ended: str = "finished", horizon: int | None = None, skipped=(),
             calls: int | None = None, base: float = 3e-3, **facts) -> RunSeries:
    """n steps whose rate is the scheduler's promise (base * factor(k) after k step() calls) at the
    position `position(i)` the loop had stepped it to by optimizer step i."""
    promise = [base * factor(k) for k in range(horizon or 2 * n + 2)]
    steps = [StepRow(step=i, loss=None, lrs=[promise[position(i)]], scheduler_steps=position(i), skipped=i in skipped)
             for i in range(n)]
    scheduler = {"name": "LambdaLR", "watched": True, "promise": promise,
                 "steps_called": position(n - 1) + 1 if calls is None else calls}
    return RunSeries(steps, facts={"ended": ended, "schedulers": [scheduler], **facts})


def warmup_then_cosine(k: int) -> float:
    return warmup_cosine(k, 30, 120)  # lightning_warmup.py's schedule: 30 warm-up steps of 120


EPOCH = {"loader": {"num_workers": 0, "batches_per_epoch": 40}}


def test_lr_warmup_stepped_per_epoch_fails_with_the_rates_used_and_promised():
    # lightning_warmup_per_epoch.py: 3 epochs of 40 steps, Lightning steps the scheduler at each epoch's end
    result = judge(promised(120, warmup_then_cosine, lambda i: i // 40, **EPOCH), "lr-trajectory")
    assert result.status == Status.FAIL, result.message
    assert "once per epoch (every 40 optimizer steps)" in result.message
    assert "'interval': 'step'" in result.hint
    stepping = result.details["stepping"]
    assert stepping["progress"] < 0.1
    assert result.details["step"] == 1  # the first step whose rate is not the schedule's for it
    at_30 = next(p for p in stepping["points"] if p["step"] == 30)
    assert at_30["used"] == pytest.approx(3e-3 / 30) and at_30["promised"] == pytest.approx(3e-3)


def test_lr_scheduler_stepped_once_per_step_is_judged_as_before():
    result = judge(promised(120, warmup_then_cosine, lambda i: i, **EPOCH), "lr-trajectory")
    assert result.status == Status.PASS, result.message
    assert result.details["stepping"]["calls_per_step"] == 1
    # stepped before optimizer.step() (the pre-1.1 order): one step ahead all along, still once per step
    assert judge(promised(120, warmup_then_cosine, lambda i: i + 1), "lr-trajectory").status == Status.PASS


def test_lr_scheduler_never_stepped_fails():
    result = judge(promised(120, warmup_then_cosine, lambda i: 0, calls=0), "lr-trajectory")
    assert result.status == Status.FAIL
    assert "never called" in result.message


def test_lr_scheduler_stepped_per_micro_batch_fails_when_written_in_optimizer_steps():
    # a linear warm-up and decay over the run's 200 optimizer steps, stepped for each of 4 micro-batches
    def linear(k):
        return min((k + 1) / 10, max(0.0, (200 - k) / 190))

    result = judge(promised(200, linear, lambda i: 4 * i, horizon=1000), "lr-trajectory")
    assert result.status == Status.FAIL
    assert "4 times per optimizer step" in result.message and "micro-batch" in result.hint
    # written for the 800 micro-batches it is stepped at: it ends with the run
    def per_micro(k):
        return min((k + 1) / 40, max(0.0, (800 - k) / 760))

    assert judge(promised(200, per_micro, lambda i: 4 * i, horizon=1000), "lr-trajectory").status == Status.PASS


def test_lr_schedules_written_in_epochs_pass_stepped_per_epoch():
    def cosine(k, t_max=30):  # CosineAnnealingLR(T_max=max_epochs), periodic past T_max
        return 0.5 * (1 + math.cos(math.pi * k / t_max))

    per_epoch = lambda i: i // 10  # noqa: E731 - 10 steps an epoch
    assert judge(promised(300, cosine, per_epoch), "lr-trajectory").status == Status.PASS
    step_lr = lambda k: 0.1 ** (k // 30)  # noqa: E731 - StepLR(step_size=30), 90 epochs
    assert judge(promised(900, step_lr, per_epoch), "lr-trajectory").status == Status.PASS
    exponential = lambda k: 0.95 ** k  # noqa: E731 - ExponentialLR(0.95), 30 epochs
    assert judge(promised(300, exponential, per_epoch), "lr-trajectory").status == Status.PASS


def test_lr_stepped_per_epoch_is_not_judged_before_the_plan_is_known():
    # stopped by --max-steps after 3 epochs: a schedule meant per epoch cannot be told from a mistake yet
    series = promised(120, warmup_then_cosine, lambda i: i // 40, ended="max-steps", planned_steps=120,
                      planned_from="--max-steps", **EPOCH)
    assert judge(series, "lr-trajectory").status == Status.PASS
    # a Trainer's plan of 120 steps, judged live at step 120: it can
    series.facts.update(ended="running", planned_from="the Trainer's state.max_steps")
    assert judge(series, "lr-trajectory").status == Status.FAIL


def test_lr_steps_the_grad_scaler_skipped_do_not_count():
    # the Hugging Face Trainer does not step the scheduler when the GradScaler skipped the optimizer step
    skipped = set(range(0, 6)) | {50, 90}
    position = lambda i: i - sum(s < i for s in skipped)  # noqa: E731
    series = promised(120, warmup_then_cosine, position, skipped=skipped)
    result = judge(series, "lr-trajectory")
    assert result.status == Status.PASS, result.message
    assert result.details["stepping"]["calls_per_step"] == 1


def test_lr_set_by_something_else_is_judged_on_the_rate_alone():
    # nanoGPT's loop sets param_group["lr"] itself; a scheduler made on the side is not what the rate follows
    series = promised(120, warmup_then_cosine, lambda i: 0, calls=0)
    for row in series.steps:
        row.lrs = [6e-4]
    result = judge(series, "lr-trajectory")
    assert result.status == Status.PASS
    assert "stepping" not in result.details


# ---------------------------------------------------------------------------------- data-wait

def timed(n: int, wait, wall, loader=None, device: str = "cpu") -> RunSeries:
    return RunSeries(rows(n, data_wait=wait, wall=wall),
                     facts={"loader": loader or {"num_workers": 0, "pin_memory": False, "batch_size": 16},
                            "device": device})


def test_data_wait_of_a_tensor_dataset_passes():
    # healthy.py: about 0.2 ms of a 120 ms step
    assert judge(timed(300, lambda i: 2e-4, lambda i: 0.12), "data-wait").status == Status.PASS


def test_data_wait_of_a_sleeping_dataset_warns_with_num_workers_zero():
    # slow_loader.py: about 60 ms of a 220 ms step on a loaded CPU
    result = judge(timed(200, lambda i: 0.06, lambda i: 0.22), "data-wait")
    assert result.status == Status.WARN
    assert "num_workers=0" in result.message and "num_workers=4" in result.hint
    assert result.details["step"] == 0


def test_data_wait_names_workers_and_pinning_on_a_gpu():
    loader = {"num_workers": 2, "pin_memory": False, "batch_size": 16}
    result = judge(timed(200, lambda i: 0.05, lambda i: 0.1, loader, "cuda:0"), "data-wait")
    assert result.status == Status.WARN
    assert "2 workers" in result.message and "pin_memory=True" in result.hint


def test_data_wait_at_epoch_starts_only_passes():
    # workers started again at every epoch (128 steps): one long wait per epoch is not starvation
    result = judge(timed(300, lambda i: 1.5 if i % 128 == 0 else 1e-3, lambda i: 0.03 + (1.5 if i % 128 == 0 else 0)),
                   "data-wait")
    assert result.status == Status.PASS, result.message


def test_data_wait_skips_without_a_loader():
    series = timed(300, lambda i: 0.1, lambda i: 0.12)
    del series.facts["loader"]
    assert judge(series, "data-wait").status == Status.SKIP


# ---------------------------------------------------------------------------------- memory-growth

def test_memory_rising_then_level_passes():
    # healthy.py: RSS from 300 MiB to 319 MiB over the first steps, then within a MiB
    series = RunSeries(rows(300, rss=lambda i: int((300 + min(i, 40) * 0.5 + (i % 3) * 0.3) * MIB)))
    assert judge(series, "memory-growth").status == Status.PASS


def test_memory_of_tfdoctor_s_own_records_is_not_a_leak_of_the_run():
    # 40,000 healthy steps of a small CPU run: the series and fingerprints tfdoctor keeps grow ~0.8 KB
    # a step (32 MB in all), which the process's RSS holds too; judged less them, it is level
    own = lambda i: (i + 1) * 800  # noqa: E731
    grown = rows(40_000, rss=lambda i: int(320 * MIB) + own(i), own_bytes=own)
    assert judge(RunSeries(grown), "memory-growth").status == Status.PASS
    unaccounted = rows(40_000, rss=lambda i: int(320 * MIB) + own(i))
    assert judge(RunSeries(unaccounted), "memory-growth").status == Status.FAIL


def test_the_monitor_counts_its_own_records():
    import sys

    import torch

    from tfdoctor.watching.hooks import watching
    from tfdoctor.watching.monitor import Monitor

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor()
    with watching(monitor):
        for _ in range(40):
            x = torch.randint(0, 8, (2, 5))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x).reshape(-1, 8), x.reshape(-1)).backward()
            opt.step()
    steps = monitor.finish("finished").steps
    first = steps[0]
    one_row = sys.getsizeof(first) + sys.getsizeof(first.__dict__)
    assert steps[-1].own_bytes >= 40 * one_row  # every row counted, and the trained rows' prints
    assert steps[-1].own_bytes - steps[-2].own_bytes < 4096


def test_memory_rising_every_step_fails_where_the_rise_passed_the_threshold():
    # leaky_total_loss.py: about 300 KiB a step on top of 336 MiB
    series = RunSeries(rows(200, rss=lambda i: int(336 * MIB + i * 300 * 1024)))
    result = judge(series, "memory-growth")
    assert result.status == Status.FAIL
    crossed, threshold = result.details["step"], result.details["settled_mib"] + result.details["needed_mib"]
    assert series.steps[crossed].rss / MIB > threshold >= series.steps[crossed - 1].rss / MIB


def test_memory_levelling_off_warns():
    series = RunSeries(rows(300, rss=lambda i: int(400 * MIB * (1 - math.exp(-i / 80)) + 300 * MIB)))
    assert judge(series, "memory-growth").status == Status.WARN


def test_memory_rising_unevenly_is_not_levelling_off():
    # a leak whose RSS rose 30, 10, 31, 8 MiB a window (leaky_total_loss.py once): step after step, at a
    # rate the allocator varies from window to window
    rates = [30 / 40, 10 / 40, 31 / 40, 8 / 40, 8 / 40]  # MiB per step in each 40-step window from step 50

    def rss(i):
        done = max(0, i - 50)
        return int((296 + sum(rates[w] * min(40, max(0, done - 40 * w)) for w in range(5))) * MIB)

    result = judge(RunSeries(rows(250, rss=rss)), "memory-growth")
    assert result.status == Status.FAIL, result.message
    assert not result.details["slowing"]


def test_memory_in_allocator_stairs_passes_however_high_they_climb():
    # a healthy run's RSS: a jump of 10 MiB at each of four evaluations, level between them; the old
    # rule (higher in every window, 16 MiB in all) failed it
    series = RunSeries(rows(500, rss=lambda i: (320 + 10 * sum(i > e for e in (120, 200, 280, 360, 440))) * MIB))
    result = judge(series, "memory-growth")
    assert result.status == Status.PASS, result.message
    assert result.details["rising_every_window"] and result.details["jump_share"] >= 0.5
    assert "stairs" in result.message


def test_memory_slow_steady_leak_on_a_tiny_model_fails_on_its_cost_over_the_plan():
    # slow_leak.py: 53 KiB a step on 329 MiB, 1 MiB of page-sized noise: 14 MiB over its 270 steps
    noisy = lambda i: int(329 * MIB + i * 53 * 1024 + (i * 7919 % 13) * 80 * 1024)  # noqa: E731
    result = judge(RunSeries(rows(270, rss=noisy), facts={"ended": "finished"}), "memory-growth")
    assert result.status == Status.FAIL, result.message
    assert result.details["r2"] > 0.9 and result.details["planned_steps"] == 270
    assert 12 < result.details["cost_mib"] < 16
    # the same slope over a 60-step run costs 3 MiB: under the 8 MiB floor
    short = judge(RunSeries(rows(60, rss=noisy), facts={"ended": "finished"}), "memory-growth")
    assert short.status == Status.PASS, short.message
    # ... and watched for 60 steps of a Trainer's 100,000, 5 GiB
    planned = RunSeries(rows(60, rss=noisy), facts={"ended": "running", "planned_steps": 100_000,
                                                    "planned_from": "the Trainer's max_steps"})
    result = judge(planned, "memory-growth")
    assert result.status == Status.FAIL, result.message
    assert "100000 steps (the Trainer's max_steps" in result.message


def test_memory_noise_is_not_a_steady_rise():
    # healthy.py after settling: within 2 MiB, no line through it (R2 0.2)
    noisy = lambda i: int(321 * MIB + (i * 7919 % 23) * 90 * 1024 + i * 2 * 1024)  # noqa: E731
    result = judge(RunSeries(rows(300, rss=noisy), facts={"ended": "finished"}), "memory-growth")
    assert result.status == Status.PASS, result.message
    assert not result.details["steady"]


def test_memory_judges_cuda_allocated_first():
    # RSS noisy and level, CUDA allocated rising 1 MiB a step: a GPU leak
    series = RunSeries(rows(200, rss=lambda i: (2000 + (i % 7)) * MIB, cuda_allocated=lambda i: (500 + i) * MIB))
    result = judge(series, "memory-growth")
    assert result.status == Status.FAIL
    assert result.details["signal"] == "cuda_allocated"
    assert result.details["signals"] == ["cuda_allocated", "rss"]


def test_memory_on_a_gpu_still_sees_a_host_leak():
    # `total_loss += loss` on a GPU: backward() freed the saved activations (CUDA memory level), the
    # graph's nodes pile up on the host (RSS rises)
    series = RunSeries(rows(1000, rss=lambda i: (800 * MIB + i * 300 * 1024), cuda_allocated=lambda i: 500 * MIB))
    result = judge(series, "memory-growth")
    assert result.status == Status.FAIL
    assert result.details["signal"] == "rss"


def test_memory_too_few_steps_skip():
    assert judge(RunSeries(rows(20, rss=lambda i: (300 + i) * MIB)), "memory-growth").status == Status.SKIP


# ---------------------------------------------------------------------------------- eval-gap

def trained(n: int = 300, evals=(), dropout: bool = False) -> RunSeries:
    """A training loss falling from ln 64 to 1.8 with batch noise, as healthy.py's."""
    def loss(i):
        return 1.8 + (math.log(64) - 1.8) * math.exp(-i / 60) + 0.08 * math.sin(i * 2.3)

    return RunSeries(rows(n, loss=loss), list(evals), facts={"dropout": dropout})


def held_out(step, loss, rows=128, trained=0, source="train.py:40#1"):
    return EvalPoint(step, loss, rows=rows, trained_rows=trained, source=source, split="held-out")


def train_split(step, loss, rows=320, trained=290, source="train.py:40#1"):
    return EvalPoint(step, loss, rows=rows, trained_rows=trained, source=source, split="training-split")


def healthy_eval(s):
    return 1.8 + (math.log(64) - 1.8) * math.exp(-s / 60) + 0.1


def test_eval_held_out_and_above_training_passes():
    series = trained(evals=[held_out(s, healthy_eval(s)) for s in (50, 100, 150, 200, 250, 300)])
    result = judge(series, "eval-gap")
    assert result.status == Status.PASS, result.message
    assert "none of the 768 rows of the held-out evaluation train.py:40#1" in result.message


def test_eval_on_trained_rows_fails_at_the_first_evaluation_with_them():
    # the first evaluation's batches had no token ids to fingerprint (rows=0): the finding dates from 100
    evals = [held_out(s, 2.0, rows=128 if s >= 100 else 0, trained=128 if s >= 100 else 0) for s in (50, 100, 150)]
    result = judge(trained(evals=evals), "eval-gap")
    assert result.status == Status.FAIL
    assert result.details["step"] == 100


def test_a_train_split_estimate_beside_a_held_out_one_is_no_leak():
    """nanoGPT's estimate_loss: the train split (rows the loop trains on, by design) and the val split
    (none), two sources at one line; before, they were one point with 45% of its rows trained on."""
    evals = [p for s in (0, 100, 200, 300)
             for p in (train_split(s, healthy_eval(s) - 0.3, source="train.py:60#1"),
                       held_out(s, healthy_eval(s), rows=320, source="train.py:60#2"))]
    result = judge(trained(evals=evals), "eval-gap")
    assert result.status == Status.PASS, result.message
    assert "train-split estimate train.py:60#1 read 1160 trained rows of 1280" in result.message
    assert "none of the 1280 rows of the held-out evaluation train.py:60#2" in result.message
    assert result.details["leak_share"] == 0.0


@pytest.mark.parametrize("trained_rows, status", [(113, Status.FAIL), (64, Status.FAIL), (40, Status.WARN),
                                                  (12, Status.PASS)])
def test_a_held_out_set_partly_made_of_trained_rows(trained_rows, status):
    """113 of 128 rows (88%): a leak, even beside a training-split estimate that once excused it; from
    half, most of the evaluation is memorisation (fail); from a tenth, a partial leak (warn)."""
    evals = [p for s in (50, 100, 150)
             for p in (train_split(s, healthy_eval(s) - 0.3, source="train.py:60#1"),
                       held_out(s, healthy_eval(s), trained=trained_rows, source="train.py:60#2"))]
    result = judge(trained(evals=evals), "eval-gap")
    assert result.status == status, result.message
    if status != Status.PASS:
        assert f"{3 * trained_rows} of the 384 rows of the held-out evaluation train.py:60#2" in result.message
        assert f"({trained_rows / 128:.0%})" in result.message
        assert result.details["step"] == 50


def test_eval_below_training_warns_without_dropout_and_passes_with_it():
    def below(s):
        return 0.8 * (1.8 + (math.log(64) - 1.8) * math.exp(-s / 60))

    evals = [held_out(s, below(s)) for s in (50, 100, 150, 200, 250)]
    result = judge(trained(evals=evals), "eval-gap")
    assert result.status == Status.WARN
    assert result.details["step"] == 50 and result.details["source"] == "train.py:40#1"
    assert judge(trained(evals=evals, dropout=True), "eval-gap").status == Status.PASS
    # a training-split estimate below the training loss is no finding: it is the training data
    estimates = [train_split(s, below(s)) for s in (50, 100, 150, 200, 250)]
    result = judge(trained(evals=estimates), "eval-gap")
    assert result.status == Status.PASS and "no held-out evaluation was seen" in result.message


# ---------------------------------------------------------------------------------- whole watched runs

# fixture -> the judge its planted bug must trip and with what status (tests/catalogue.py has the same)
PLANTED_RUNS = {
    "fp16_overflow": ("scaler-overflow", Status.FAIL),
    "lr_zero_halfway": ("lr-trajectory", Status.FAIL),
    "slow_loader": ("data-wait", Status.WARN),
    "leaky_total_loss": ("memory-growth", Status.FAIL),
    "slow_leak": ("memory-growth", Status.FAIL),
    "lightning_warmup_per_epoch": ("lr-trajectory", Status.FAIL),
    "eval_on_train": ("eval-gap", Status.FAIL),
    "val_copied": ("eval-gap", Status.FAIL),
}


def watched(watch_audit, name: str):
    report = watch_audit(name)
    return report, RunSeries.from_dict(report.series)


@pytest.mark.parametrize("name", ["healthy", "healthy_accum", "fp16_healthy", "lightning_warmup", "healthy_stairs",
                                  "nanogpt_splits", *PLANTED_RUNS])
def test_a_watched_run_trips_only_its_own_judge(name, watch_audit):
    report, _ = watched(watch_audit, name)
    tripped = {r.id: r.status for r in report if r.id in HEALTH and r.status not in (Status.PASS, Status.SKIP)}
    expected = dict([PLANTED_RUNS[name]]) if name in PLANTED_RUNS else {}
    assert tripped == expected, {r.id: r.message for r in report if r.id in HEALTH}


def test_fp16_healthy_scaler_calibrates_and_passes(watch_audit):
    report, series = watched(watch_audit, "fp16_healthy")
    result = report["scaler-overflow"]
    assert result.status == Status.PASS
    assert result.details["calibration_skipped"] >= 1  # the start really overflowed (init_scale 2**24)
    assert any(row.skipped for row in series.steps[result.details["calibration_steps"]:])  # and the probes


def test_fp16_overflow_fires_at_its_first_overflow_after_a_clean_step(watch_audit):
    report, series = watched(watch_audit, "fp16_overflow")
    result = report["scaler-overflow"]
    steps = series.steps
    first = next(row.step for i, row in enumerate(steps) if row.skipped and i and not steps[i - 1].skipped)
    assert result.details["step"] == first
    assert result.details["share_after_calibration"] >= 0.2
    assert sum(row.skipped for row in steps) == result.details["skipped"]
    assert "growth_interval=1" in result.message  # the setting that re-overflows, as the monitor read it


def test_lr_zero_halfway_fires_where_the_rate_reached_zero_half_way(watch_audit):
    report, series = watched(watch_audit, "lr_zero_halfway")
    result = report["lr-trajectory"]
    peak = max(max(row.lrs) for row in series.steps)
    zero = [row.step for row in series.steps if max(row.lrs) <= 0.01 * peak]
    assert result.details["step"] == zero[0]
    assert abs(result.details["step"] - len(series) / 2) <= 2  # total passed as one epoch of two
    assert "LambdaLR" in result.message


def test_slow_loader_fires_from_the_first_starved_step_and_names_num_workers(watch_audit):
    report, series = watched(watch_audit, "slow_loader")
    result = report["data-wait"]
    first = next(row.step for row in series.steps if row.data_wait >= 0.2 * row.wall)
    assert result.details["step"] == first <= 2
    assert "num_workers=0" in result.message
    assert series.facts["loader"]["num_workers"] == 0


def test_leaky_total_loss_fires_where_memory_passed_its_settled_level(watch_audit):
    report, series = watched(watch_audit, "leaky_total_loss")
    result = report["memory-growth"]
    crossed = result.details["step"]
    limit = (result.details["settled_mib"] + result.details["needed_mib"]) * MIB
    assert series.steps[crossed].rss > limit
    assert crossed < series.steps[-1].step  # found while the run went on, not at its end
    assert "total_loss += loss" in result.hint


def test_eval_on_train_fires_at_the_first_evaluation(watch_audit):
    report, series = watched(watch_audit, "eval_on_train")
    result = report["eval-gap"]
    assert result.details["step"] == series.evals[0].step == 50
    assert all(e.trained_rows == e.rows > 0 for e in series.evals)


def test_lightning_warmup_stepped_per_epoch_fails_against_its_own_promise(watch_audit):
    report, series = watched(watch_audit, "lightning_warmup_per_epoch")
    result = report["lr-trajectory"]
    (scheduler,) = [s for s in series.facts["schedulers"] if s.get("watched")]
    epoch = series.facts["loader"]["batches_per_epoch"]
    positions = series.column("scheduler_steps")
    assert positions == [i // epoch for i in range(len(series))]  # Lightning stepped it at each epoch's end
    for row in series.steps:  # the rate used is the scheduler's own promise at the position it was stepped to
        assert max(row.lrs) == pytest.approx(scheduler["promise"][row.scheduler_steps], rel=1e-9)
    assert "once per epoch" in result.message and "'interval': 'step'" in result.hint
    assert result.details["stepping"]["progress"] < 0.1
    assert result.details["step"] == 1


def test_lightning_warmup_stepped_per_step_follows_its_promise(watch_audit):
    report, series = watched(watch_audit, "lightning_warmup")
    assert series.column("scheduler_steps") == list(range(len(series)))
    assert report["lr-trajectory"].details["stepping"]["calls_per_step"] == 1


def test_slow_leak_fails_on_its_steady_rise_and_its_cost_over_the_run(watch_audit):
    report, series = watched(watch_audit, "slow_leak")
    result = report["memory-growth"]
    assert result.details["steady"] and result.details["r2"] >= 0.8
    assert result.details["planned_steps"] == len(series) == 270
    # caught by its steadiness and its cost over the planned run, whatever its size on this machine (11 MiB
    # forked from a preloaded interpreter, over 100 MiB in a fresh one)
    assert result.details["cost_mib"] > 0


def test_healthy_stairs_pass_however_the_allocator_climbs(watch_audit):
    report, series = watched(watch_audit, "healthy_stairs")
    result = report["memory-growth"]
    assert result.status == Status.PASS, result.message
    assert not result.details["growing"]


def test_nanogpt_estimate_loss_is_two_sources_and_the_evaluation_is_its_val_loss(watch_audit):
    """estimate_loss() computes the train split's losses, then the val split's, at one line: two sources,
    the val split the evaluation, equal to the val loss the script prints (it printed the mean of both)."""
    report, series = watched(watch_audit, "nanogpt_splits")
    printed = {int(step): (float(train), float(val)) for step, train, val in
               re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", report.script_output)}
    assert sorted(printed) == [0, 100, 200, 300]
    evaluation, estimate = series.evaluation(), series.training_split()
    assert {p.split for p in evaluation} == {"held-out"} and {p.split for p in estimate} == {"training-split"}
    assert evaluation[0].source != estimate[0].source and len(series.evals) == 8
    assert {p.step: p.loss for p in evaluation} == pytest.approx({s: v for s, (_, v) in printed.items()}, rel=1e-6)
    assert {p.step: p.loss for p in estimate} == pytest.approx({s: t for s, (t, _) in printed.items()}, rel=1e-6)
    assert printed[300][1] > printed[300][0] * 1.2  # a real gap between the splits
    assert all(p.trained_rows == 0 for p in evaluation) and all(p.trained_rows > p.rows / 2 for p in estimate)
    result = report["eval-gap"]
    assert result.status == Status.PASS
    assert "train-split estimate" in result.message and result.details["leak_share"] == 0.0
    from tfdoctor.report.watch_header import watched_lines

    header = " ".join(line.plain for line in watched_lines(report))
    assert f"evaluation {evaluation[-1].loss:.4g} at the end" in header  # the val split, as printed
    assert f"train-split estimate {estimate[-1].loss:.4g} at the end" in header


def test_val_copied_fails_naming_the_source_and_its_share(watch_audit):
    report, series = watched(watch_audit, "val_copied")
    result = report["eval-gap"]
    (source,) = series.sources()  # one pass: nothing along it changes
    assert all(p.split == "held-out" and (p.rows, p.trained_rows) == (128, 113) for p in series.evals)
    assert source in result.message and "(88%)" in result.message
    assert result.details["step"] == series.evals[0].step == 50
