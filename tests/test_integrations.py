"""TfdoctorCallback inside the real Hugging Face Trainer and the real Lightning Trainer: tiny models,
on the CPU, a few seconds per run.

The healthy runs are correct code (no planted bug): a 2-layer GPT2LMHeadModel built from a local
config, and a LightningModule around fixtures/watch/watchlm.py's TinyLM, both on watchlm's Markov
corpus. The planted bugs: a learning rate of 100 (the loss diverges: loss-divergence must fail and
stop the run), an evaluation set drawn from the training rows (eval-gap, logged while the run goes
on), and a dataset / training_step that raises mid-run (the hooks must come off anyway).
"""

import importlib.util
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from helpers import ROOT
from tfdoctor.result import Status
from tfdoctor.watching.series import RunSeries

transformers = pytest.importorskip("transformers")

# What the monitor's hooks replace or add, as they are before any run: after every run they must be
# these again.
ORIGINALS = {"Tensor.backward": torch.Tensor.backward, "F.cross_entropy": F.cross_entropy,
             "F.nll_loss": F.nll_loss, "clip_grad_norm_": torch.nn.utils.clip_grad_norm_}


def _global_hooks() -> tuple[int, int, int]:
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (len(optimizer._global_optimizer_pre_hooks), len(optimizer._global_optimizer_post_hooks),
            len(module._global_forward_pre_hooks))


HOOKS_BEFORE = _global_hooks()


def assert_unhooked() -> None:
    now = {"Tensor.backward": torch.Tensor.backward, "F.cross_entropy": F.cross_entropy,
           "F.nll_loss": F.nll_loss, "clip_grad_norm_": torch.nn.utils.clip_grad_norm_}
    assert now == ORIGINALS
    assert _global_hooks() == HOOKS_BEFORE


def _watchlm():
    spec = importlib.util.spec_from_file_location("watchlm", ROOT / "fixtures" / "watch" / "watchlm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


watchlm = _watchlm()
SEQ = watchlm.SEQ  # 32 tokens a row


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread (as under xdist): a tiny model on several threads of 2 shared cores is
    slower, not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Logged(logging.Handler):
    """What the callback said on the logger "tfdoctor", INFO and up, while it is attached (the shared
    runs are module fixtures, which caplog cannot reach)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def lines(self) -> list[str]:
        return [record.getMessage() for record in self.records]

    def __enter__(self) -> "Logged":
        self.logger = logging.getLogger("tfdoctor")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def verdicts(logged: Logged) -> list[logging.LogRecord]:
    """The verdict lines: "tfdoctor: PASS|WARN|FAIL (...)"."""
    return [r for r in logged.records if r.getMessage().split(" (")[0] in ("tfdoctor: PASS", "tfdoctor: WARN",
                                                                           "tfdoctor: FAIL")]


def assert_ends_with_the_verdict(logged: Logged, word: str, level: int, steps: int, path=None) -> str:
    """The run's last line on "tfdoctor" is its one verdict line, at `level`, naming the report."""
    assert len(verdicts(logged)) == 1 and logged.records[-1] is verdicts(logged)[0], logged.lines
    line = logged.lines[-1]
    assert line.startswith(f"tfdoctor: {word} (") and logged.records[-1].levelno == level
    assert line.endswith(f"; report in {path}" if path is not None else f"({steps} optimizer steps)"), line
    assert "stop" not in line
    return line


def problems(report) -> list:
    return [(r.id, r.status.value, r.message) for r in report if r.status in (Status.WARN, Status.FAIL, Status.ERROR)]


# ---------------------------------------------------------------------------------- Hugging Face


class Rows(Dataset):
    """watchlm's rows as causal-LM examples. labels[0] = -100: the first token is never a target, and
    marking it so makes the Trainer's num_items_in_batch the number of predicted tokens, so that its
    logged loss is the per-token mean the monitor records (unmarked, the Trainer divides the summed loss
    by all 32 labels while 31 are predicted: its log reads 31/32 of the loss)."""

    def __init__(self, rows: torch.Tensor, fail_after: int = 0) -> None:
        self.rows, self.fail_after, self.served = rows[:, :SEQ], fail_after, 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        self.served += 1
        if self.fail_after and self.served > self.fail_after:
            raise RuntimeError("planted: the dataset fails mid-run")
        labels = self.rows[i].clone()
        labels[0] = -100
        return {"input_ids": self.rows[i], "labels": labels}


def hf_trainer(tmp_path, callback, max_steps=100, accumulation=1, lr=3e-3, fail_after=0, eval_steps=20):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=watchlm.VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, seed=0, max_steps=max_steps,
                             per_device_train_batch_size=16, per_device_eval_batch_size=32,
                             gradient_accumulation_steps=accumulation, learning_rate=lr, warmup_steps=10,
                             logging_strategy="steps", logging_steps=1, eval_strategy="steps", eval_steps=eval_steps,
                             save_strategy="no", disable_tqdm=True)
    return Trainer(model=GPT2LMHeadModel(config), args=args, callbacks=[callback] if callback is not None else [],
                   train_dataset=Rows(watchlm.corpus(2048, seed=1), fail_after),
                   eval_dataset=Rows(watchlm.corpus(70, seed=2)))  # 32 + 32 + a short last batch of 6


def hf_run(tmp_path_factory, **options):
    from tfdoctor.integrations.huggingface import TfdoctorCallback

    callback = TfdoctorCallback(judge_every=options.pop("judge_every", 50), stop_on=options.pop("stop_on", None))
    trainer = hf_trainer(tmp_path_factory.mktemp("hf"), callback, **options)
    trainer.train()
    return trainer, callback


@pytest.fixture(scope="module")
def hf_healthy(tmp_path_factory):
    with Logged() as logged:
        trainer, callback = hf_run(tmp_path_factory)
    return trainer, callback, logged


@pytest.fixture(scope="module")
def hf_accumulating(tmp_path_factory):
    return hf_run(tmp_path_factory, accumulation=2)


def assert_agrees_with_trainer_log(series: RunSeries, trainer) -> None:
    logged = [entry for entry in trainer.state.log_history if "loss" in entry and "step" in entry]
    assert len(logged) == trainer.state.global_step  # logging_steps=1: one training loss per step
    for entry in logged:
        row = series.steps[entry["step"] - 1]
        assert row.loss == pytest.approx(entry["loss"], rel=1e-5), entry


@pytest.mark.parametrize("run", ["hf_healthy", "hf_accumulating"])
def test_trainer_series_is_one_row_per_optimizer_step(run, request):
    trainer, callback = request.getfixturevalue(run)[:2]
    series = RunSeries.from_dict(callback.report.series)
    steps = trainer.state.global_step
    assert steps == trainer.args.max_steps and len(series) == steps
    assert [row.step for row in series.steps] == list(range(steps))
    accumulation = trainer.args.gradient_accumulation_steps
    assert all(len(row.micro_losses) == accumulation for row in series.steps)  # micro-batches within a row
    assert_agrees_with_trainer_log(series, trainer)
    # the rate the optimizer used at each step: the Trainer logs the one it stepped with
    rates = {entry["step"]: entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry}
    assert [series.steps[step - 1].lrs[0] for step in rates] == pytest.approx(list(rates.values()), rel=1e-6)
    # and the Trainer's scheduler, stepped once per optimizer step, gave the rates it promised
    assert series.column("scheduler_steps") == list(range(steps))
    (scheduler,) = [s for s in series.facts["schedulers"] if s.get("watched")]
    assert [scheduler["promise"][row.scheduler_steps] for row in series.steps] == pytest.approx(
        [max(row.lrs) for row in series.steps], rel=1e-9)
    assert series.facts["planned_steps"] == steps and series.facts["planned_from"] == "the Trainer's state.max_steps"
    assert all(row.grad_norm is not None and math.isfinite(row.grad_norm) and row.grad_norm > 0 for row in series.steps)
    assert_unhooked()


def test_trainer_healthy_run_is_quiet_and_its_evaluations_recorded(hf_healthy):
    trainer, callback, logged = hf_healthy
    report = callback.report
    assert not problems(report)
    assert_ends_with_the_verdict(logged, "PASS", logging.INFO, steps=100)
    assert [r for r in logged.records if r.levelno >= logging.WARNING] == []
    assert report.target == "watch Trainer GPT2LMHeadModel"
    series = RunSeries.from_dict(report.series)
    assert series.facts["ended"] == "finished"
    evals = {entry["step"]: entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry}
    evaluation = series.evaluation()
    assert evaluation == series.evals  # one source: the eval_dataset, held out
    assert [point.step for point in evaluation] == sorted(evals) == [20, 40, 60, 80, 100]
    for point in evaluation:
        # the Trainer's own eval_loss to float rounding: a mean over rows, the short last batch (6 of 70
        # rows) weighing 6 rows; one batch one vote would read (32, 32, 6) as thirds
        assert point.loss == pytest.approx(evals[point.step], rel=1e-6)
        assert point.weighting == "rows" and point.calls == 3 and point.split == "held-out"
        assert point.rows == 70 and point.trained_rows == 0  # held-out rows, fingerprinted


def test_trainer_report_written_in_the_suffix_format(tmp_path):
    """report=PATH.json: the JSON report of the chosen judges, series included (a 10-step run); the
    other suffixes give their formats, and an unknown one the rich text."""
    import json
    import xml.etree.ElementTree as ET

    from tfdoctor.integrations.common import write_report
    from tfdoctor.integrations.huggingface import TfdoctorCallback
    from tfdoctor.report import FORMATS

    path = tmp_path / "run.json"
    callback = TfdoctorCallback(report=path, only="loss-spike,loss-divergence")
    with Logged() as logged:
        hf_trainer(tmp_path, callback, max_steps=10).train()
    assert_ends_with_the_verdict(logged, "PASS", logging.INFO, steps=10, path=path)
    written = json.loads(path.read_text())
    assert written["target"] == "watch Trainer GPT2LMHeadModel"
    assert [check["id"] for check in written["checks"]] == ["loss-spike", "loss-divergence"]
    assert written["series"]["steps"]["loss"] == pytest.approx(callback.report.series["steps"]["loss"])
    assert len(written["series"]["steps"]["loss"]) == 10

    for suffix, fmt in ((".xml", "junit"), (".sarif", "sarif"), (".txt", "rich"), (".html", "html")):
        assert write_report(callback.report, tmp_path / f"run{suffix}") == (fmt if fmt in FORMATS else "rich")
    assert {case.get("name") for case in ET.parse(tmp_path / "run.xml").getroot().iter("testcase")} >= {"loss-spike"}
    assert json.loads((tmp_path / "run.sarif").read_text())["version"] == "2.1.0"
    assert "loss-divergence" in (tmp_path / "run.txt").read_text()


def test_trainer_stops_on_a_failure_and_logs_it(tmp_path, caplog):
    """Planted: a learning rate of 100. loss-divergence fails at a live judgement (every 10 steps),
    the finding is logged and the Trainer stops there, far before its 200 steps."""
    from tfdoctor.integrations.huggingface import TfdoctorCallback

    callback = TfdoctorCallback(stop_on="fail", judge_every=10)
    trainer = hf_trainer(tmp_path, callback, max_steps=200, lr=100.0)
    with caplog.at_level(logging.WARNING, logger="tfdoctor"), Logged() as said:
        trainer.train()
    steps = trainer.state.global_step
    assert steps < 200 and steps % 10 == 0
    report = callback.report
    assert report["loss-divergence"].status == Status.FAIL
    assert "loss-divergence" in report.stopped
    series = RunSeries.from_dict(report.series)
    assert len(series) == steps and series.facts["ended"] == "stopped"
    logged = [r for r in caplog.records if r.name == "tfdoctor" and "loss-divergence FAIL" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR  # logged once, not at every judgement
    line = assert_ends_with_the_verdict(said, "FAIL", logging.WARNING, steps=steps)
    assert "loss-divergence" in line
    stopping = [m for m in said.lines if "stopping the run" in m]
    assert len(stopping) == 1 and f"after optimizer step {steps} " in stopping[0]
    assert_unhooked()


def test_trainer_evaluating_on_training_rows_is_named_live(tmp_path, caplog):
    """Planted: the eval_dataset is 64 of the 256 training rows (an epoch is 16 steps, so by the first
    evaluation at step 20 every one was trained on). eval-gap fails on the evaluation at step 20; it
    is logged once, at the next judgement (step 40), and the run goes on to its end."""
    from tfdoctor.integrations.huggingface import TfdoctorCallback

    callback = TfdoctorCallback(judge_every=20)
    trainer = hf_trainer(tmp_path, callback)
    trainer.train_dataset = Rows(watchlm.corpus(256, seed=1))
    trainer.eval_dataset = Rows(trainer.train_dataset.rows[:64])
    with caplog.at_level(logging.WARNING, logger="tfdoctor"):
        trainer.train()
    assert trainer.state.global_step == 100  # no stop_on: the run is not stopped
    gap = callback.report["eval-gap"]
    assert gap.status == Status.FAIL and gap.details["step"] == 20
    series = RunSeries.from_dict(callback.report.series)
    assert [(point.rows, point.trained_rows) for point in series.evals] == [(64, 64)] * 5
    logged = [r.getMessage() for r in caplog.records if r.name == "tfdoctor" and "eval-gap FAIL" in r.getMessage()]
    assert len(logged) == 1 and "at step 20" in logged[0]


def test_trainer_failure_seen_at_the_last_step_is_reported_not_stopped(tmp_path):
    """Planted: the evaluation on training rows again, stop_on="fail", one judgement due at step 40,
    the run's last. The run ends there anyway: the callback must not say it stops it (it once logged
    "stopping the run after optimizer step 40" and marked the run stopped); the end says what it
    found, in the verdict line."""
    from tfdoctor.integrations.huggingface import TfdoctorCallback

    callback = TfdoctorCallback(stop_on="fail", judge_every=40)
    trainer = hf_trainer(tmp_path, callback, max_steps=40)
    trainer.train_dataset = Rows(watchlm.corpus(256, seed=1))
    trainer.eval_dataset = Rows(trainer.train_dataset.rows[:64])
    with Logged() as said:
        trainer.train()
    assert trainer.state.global_step == 40
    assert callback.report["eval-gap"].status == Status.FAIL and not callback.report.stopped
    assert RunSeries.from_dict(callback.report.series).facts["ended"] == "finished"
    assert not [line for line in said.lines if "stop" in line], said.lines
    assert len([line for line in said.lines if "eval-gap FAIL" in line]) == 1
    assert "eval-gap" in assert_ends_with_the_verdict(said, "FAIL", logging.WARNING, steps=40)


def test_trainer_that_raises_takes_the_hooks_off(tmp_path):
    """Planted: the dataset raises after 300 rows (~18 steps of 16). The Trainer has no event for it:
    the callback guards the train() of the Trainer it was given to."""
    from tfdoctor.integrations.huggingface import TfdoctorCallback

    callback = TfdoctorCallback()
    trainer = hf_trainer(tmp_path, callback, fail_after=300)
    with pytest.raises(RuntimeError, match="planted"):
        trainer.train()
    assert_unhooked()
    series = RunSeries.from_dict(callback.report.series)
    assert series.facts["ended"] == "raised" and 0 < len(series) == trainer.state.global_step
    assert "planted" in callback.report.discovered["error"]


def test_trainer_callback_added_late_says_how_to_take_the_hooks_off(tmp_path, caplog):
    """trainer.add_callback(...) after Trainer(...): the train() under way cannot be guarded, so the
    callback says so, and close() takes the hooks off after a raise; the next train() is guarded."""
    from tfdoctor.integrations.huggingface import TfdoctorCallback

    callback = TfdoctorCallback()
    trainer = hf_trainer(tmp_path, None, fail_after=100)
    trainer.add_callback(callback)
    with caplog.at_level(logging.WARNING, logger="tfdoctor"), pytest.raises(RuntimeError, match="planted"):
        trainer.train()
    assert any("callback.close()" in r.getMessage() for r in caplog.records if r.name == "tfdoctor")
    assert F.cross_entropy is not ORIGINALS["F.cross_entropy"]  # still on: close() is what takes them off
    callback.close()
    assert_unhooked()
    trainer.train_dataset.served = 0  # the next train() raises again: now guarded
    with pytest.raises(RuntimeError, match="planted"):
        trainer.train()
    assert_unhooked()


def test_trainer_guard_is_undone_once_the_callback_is_removed(tmp_path):
    """The callback wraps the Trainer's train() on the instance (usercode/patches.py): kept for the next
    train() while the callback is the trainer's, undone when a train() ends without it."""
    from tfdoctor.integrations.huggingface import TfdoctorCallback

    callback = TfdoctorCallback()
    trainer = hf_trainer(tmp_path, callback, max_steps=2, eval_steps=100)
    assert vars(trainer)["train"].tfdoctor_callback is callback
    trainer.remove_callback(callback)
    trainer.train()
    assert "train" not in vars(trainer)  # the class's own train() again, nothing left on the instance


# ---------------------------------------------------------------------------------- Lightning


def lightning_module(lr: float = 3e-3, fail_at: int = -1):
    import lightning.pytorch as L

    class LitLM(L.LightningModule):
        """TinyLM, AdamW with a 10-step warm-up; records the losses and gradient norms it computes so
        that the test can hold the monitor's series against them."""

        def __init__(self):
            super().__init__()
            self.model = watchlm.TinyLM()
            self.train_losses, self.grad_norms, self.val_losses = [], [], {}

        def _loss(self, rows):
            logits = self.model(rows[:, :-1])  # (B, T, V)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))

        def training_step(self, batch, batch_idx):
            if self.global_step == fail_at:
                raise RuntimeError("planted: training_step fails mid-run")
            loss = self._loss(batch[0])
            self.train_losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):  # after the backward, before any clip
            grads = [p.grad.pow(2).sum() for p in self.parameters() if p.grad is not None]
            self.grad_norms.append(torch.stack(grads).sum().sqrt().item())

        def validation_step(self, batch, batch_idx):
            if not self.trainer.sanity_checking:
                self.val_losses.setdefault(self.global_step, []).append(self._loss(batch[0]).item())

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=lr)
            warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    return LitLM()


def lightning_fit(callback, module, max_steps=100, rows=None, val_rows=None):
    import lightning.pytorch as L

    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, val_check_interval=25,
                        check_val_every_n_epoch=None,
                        callbacks=[callback] if not isinstance(callback, list) else callback)
    rows = watchlm.corpus(2048, seed=1) if rows is None else rows
    val_rows = watchlm.corpus(64, seed=2) if val_rows is None else val_rows
    train = DataLoader(TensorDataset(rows), batch_size=16, shuffle=True)
    trainer.fit(module, train, DataLoader(TensorDataset(val_rows), batch_size=32))
    return trainer


@pytest.fixture(scope="module")
def lightning_healthy():
    pytest.importorskip("lightning")
    from tfdoctor.integrations.lightning import TfdoctorCallback

    torch.manual_seed(0)
    callback, module = TfdoctorCallback(), lightning_module()
    with Logged() as said:
        trainer = lightning_fit(callback, module)
    return trainer, callback, module, said


def test_lightning_healthy_run_is_quiet_one_row_per_step(lightning_healthy):
    trainer, callback, module, said = lightning_healthy
    report = callback.report
    assert not problems(report)
    assert_ends_with_the_verdict(said, "PASS", logging.INFO, steps=100)
    series = RunSeries.from_dict(report.series)
    assert trainer.global_step == 100 and len(series) == trainer.global_step
    assert series.facts["ended"] == "finished"
    assert series.column("scheduler_steps") == list(range(100))  # "interval": "step"
    assert report["lr-trajectory"].details["stepping"]["calls_per_step"] == 1
    assert series.facts["planned_from"] == "the Trainer's max_steps"
    assert series.column("loss") == pytest.approx(module.train_losses, rel=1e-6)
    # optimizer.step(closure): the gradients of each step are the ones its own closure made, step 0's too
    assert series.column("grad_norm") == pytest.approx(module.grad_norms, rel=1e-4)
    assert {point.step: point.loss for point in series.evals} == pytest.approx(
        {step: sum(losses) / len(losses) for step, losses in module.val_losses.items()}, rel=1e-5)
    assert all(point.rows == 64 and point.trained_rows == 0 for point in series.evals)
    assert_unhooked()


def test_lightning_stops_on_a_failure(caplog):
    pytest.importorskip("lightning")
    from tfdoctor.integrations.lightning import TfdoctorCallback

    callback = TfdoctorCallback(stop_on="fail", judge_every=10)
    with caplog.at_level(logging.WARNING, logger="tfdoctor"):
        trainer = lightning_fit(callback, lightning_module(lr=100.0), max_steps=200)
    assert trainer.global_step < 200 and trainer.global_step % 10 == 0
    assert callback.report["loss-divergence"].status == Status.FAIL
    assert len(callback.report.series["steps"]["loss"]) == trainer.global_step
    assert any(r.name == "tfdoctor" and "loss-divergence FAIL" in r.getMessage() for r in caplog.records)
    assert_unhooked()


def test_lightning_failure_seen_at_the_last_step_is_reported_not_stopped():
    """Planted: validation rows drawn from the 256 training rows (16 steps an epoch: all trained on by
    the validation at step 25), stop_on="fail", one judgement due at step 50, the run's last: reported
    at the end, never "stopping"."""
    pytest.importorskip("lightning")
    from tfdoctor.integrations.lightning import TfdoctorCallback

    rows = watchlm.corpus(256, seed=1)
    callback = TfdoctorCallback(stop_on="fail", judge_every=50)
    with Logged() as said:
        trainer = lightning_fit(callback, lightning_module(), max_steps=50, rows=rows, val_rows=rows[:64])
    assert trainer.global_step == 50
    assert callback.report["eval-gap"].status == Status.FAIL and not callback.report.stopped
    assert RunSeries.from_dict(callback.report.series).facts["ended"] == "finished"
    assert not [line for line in said.lines if "stop" in line], said.lines
    assert "eval-gap" in assert_ends_with_the_verdict(said, "FAIL", logging.WARNING, steps=50)


def test_lightning_callback_stands_aside_under_a_tfdoctor_command():
    """Inside `tfdoctor run` (or check --train, or watch) the command audits the run: the callback
    installs nothing, stops nothing, writes nothing, and says so once."""
    pytest.importorskip("lightning")
    import lightning.pytorch as L

    from tfdoctor.integrations.lightning import TfdoctorCallback
    from tfdoctor.usercode.auditing import audited_by

    class HooksSeen(L.Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(_global_hooks() != HOOKS_BEFORE or F.cross_entropy is not ORIGINALS["F.cross_entropy"])

    callback, probe = TfdoctorCallback(stop_on="warn", judge_every=1), HooksSeen()
    with audited_by("tfdoctor run"), Logged() as said:
        trainer = lightning_fit([callback, probe], lightning_module(lr=100.0), max_steps=20)
    assert trainer.global_step == 20 and callback.report is None
    assert probe.seen == [False] * 20
    assert said.lines == ["tfdoctor: TfdoctorCallback stands aside: `tfdoctor run` is auditing this run (no hooks, "
                          "no stop_on, no report from the callback)"]
    assert_unhooked()


def test_bad_settings_are_refused_at_once():
    from tfdoctor.errors import UsageError
    from tfdoctor.integrations.common import LiveWatch

    with pytest.raises(ValueError, match="stop_on"):
        LiveWatch(stop_on="error")
    with pytest.raises(ValueError, match="judge_every"):
        LiveWatch(judge_every=0)
    with pytest.raises(UsageError, match="no-such-judge"):
        LiveWatch(only="no-such-judge")
    with pytest.raises(UsageError, match="does not exist"):
        LiveWatch(report=ROOT / "no-such-folder" / "run.html")


def test_lightning_that_raises_takes_the_hooks_off():
    pytest.importorskip("lightning")
    from tfdoctor.integrations.lightning import TfdoctorCallback

    callback = TfdoctorCallback()
    with pytest.raises(RuntimeError, match="planted"):
        lightning_fit(callback, lightning_module(fail_at=30))
    assert_unhooked()
    series = RunSeries.from_dict(callback.report.series)
    assert series.facts["ended"] == "raised" and len(series) == 30


# ---------------------------------------------------------------------------------- two ranks

RANK_SCRIPT = """
import os, sys, tempfile, torch
torch.set_num_threads(1)
import test_integrations as t
from tfdoctor.integrations.huggingface import TfdoctorCallback
callback = TfdoctorCallback(judge_every=10, stop_on="fail")
trainer = t.hf_trainer(tempfile.mkdtemp(), callback, max_steps=200, lr=100.0)
trainer.train()
rows = len(callback.report.series["steps"]["loss"]) if callback.report is not None else None
print("RANK", os.environ["RANK"], trainer.args.world_size, trainer.state.global_step, rows,
      hasattr(torch.Tensor.backward, "__wrapped__"), flush=True)  # now: torchrun may end a rank's teardown
# The Trainer leaves the process group up; without this, gloo's worker threads may abort the rank at
# interpreter exit ("terminate called without an active exception", pytorch/pytorch#190489).
torch.distributed.destroy_process_group()
"""


@pytest.mark.e2e
def test_trainer_on_two_ranks_stops_both_and_rank_0_alone_watches(tmp_path):
    """Planted: the rate of 100 under torchrun --nproc_per_node 2 (gloo, CPU). Rank 0 judges and stops;
    rank 1 records nothing and stops at the same step (else it would wait in its next all-reduce)."""
    script = tmp_path / "two_ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = sorted(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RANK "))
    assert len(ranks) == 2
    (rank0, world0, steps0, rows0, hooked0), (rank1, world1, steps1, rows1, hooked1) = ranks
    assert (world0, world1) == ("2", "2") and steps0 == steps1 and int(steps0) < 200
    assert rows0 == steps0 and rows1 == "None"
    assert hooked0 == hooked1 == "False"


# ---------------------------------------------------------------------------------- imports


FALLBACK_SCRIPT = """
import sys
sys.modules["lightning"] = sys.modules["lightning.pytorch"] = None  # as if only pytorch_lightning were there
import torch, torch.nn.functional as F
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
from tfdoctor.integrations.lightning import TfdoctorCallback

class Bigram(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(64, 64)

    def training_step(self, batch, batch_idx):
        rows = batch[0]
        return F.cross_entropy(self.table(rows[:, :-1]).reshape(-1, 64), rows[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

callback = TfdoctorCallback()
trainer = pl.Trainer(max_steps=20, accelerator="cpu", enable_progress_bar=False, logger=False,
                     enable_checkpointing=False, enable_model_summary=False, callbacks=[callback])
trainer.fit(Bigram(), DataLoader(TensorDataset(torch.randint(0, 64, (256, 9))), batch_size=8))
print("RESULT", type(callback).__mro__[1].__module__.split(".")[0], trainer.global_step,
      len(callback.report.series["steps"]["loss"]))
"""


@pytest.mark.e2e
def test_lightning_callback_falls_back_to_pytorch_lightning():
    pytest.importorskip("pytorch_lightning")
    done = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("RESULT")[-1].split() == ["pytorch_lightning", "20", "20"]


@pytest.mark.e2e
def test_importing_tfdoctor_imports_no_framework():
    code = ("import sys, tfdoctor, tfdoctor.integrations, tfdoctor.integrations.common; "
            "print(sorted(m for m in ('torch', 'transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
