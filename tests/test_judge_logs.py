"""tfdoctor.logs: the logs users keep, read into the RunSeries the run judges read. Each log is written in
the test by the library that writes it for users (the Hugging Face Trainer, Lightning's CSVLogger with a
LearningRateMonitor, torch.utils.tensorboard's SummaryWriter, a JSON-lines loop, MLflow's file store laid
out as MLflow writes it), tiny and on the CPU; the series read must equal what the library logged, read
back another way (the Trainer's state in memory, the CSVLogger's rows in memory, the values handed to the
writer). No run here has a planted bug: the judges' planted failures are another module's."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ROOT
from tfdoctor.errors import UsageError
from tfdoctor.logs import LoggedRun, NothingLogged, find_runs
from tfdoctor.logs.names import normal, parse_tags, role_of
from tfdoctor.watching.series import UNKNOWN

FIXTURES = ROOT / "fixtures" / "watch"


def only_run(path, tags=None) -> LoggedRun:
    runs = find_runs(path, tags or {})
    assert len(runs) == 1, [run.name for run in runs]
    return runs[0]


def losses_of(run: LoggedRun) -> dict:
    return {row.step: row.loss for row in run.series.steps if row.loss is not None}


# ------------------------------------------------------------------------------ the Hugging Face Trainer


@pytest.fixture(scope="module")
def trainer_output(tmp_path_factory):
    """A tiny GPT-2 (config built here, nothing downloaded) trained 40 steps, logging every 2, evaluating
    every 10, saving a checkpoint every 20, and save_state() at the end, as a user's script does."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            self.rows = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i], "labels": self.rows[i]}

    out = tmp_path_factory.mktemp("trainer") / "out"
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    args = TrainingArguments(output_dir=str(out), report_to="none", use_cpu=True, seed=0, max_steps=40,
                             per_device_train_batch_size=8, logging_steps=2, eval_strategy="steps", eval_steps=10,
                             save_strategy="steps", save_steps=20, disable_tqdm=True, learning_rate=1e-3)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Rows(512, 1), eval_dataset=Rows(32, 2))
    trainer.train()
    trainer.save_state()
    return out, trainer.state


def test_trainer_state_is_read_as_the_trainer_logged_it(trainer_output):
    out, state = trainer_output
    run = only_run(out)
    assert run.format == "trainer-state" and run.path == str(out / "trainer_state.json")
    logged = [row for row in state.log_history if "loss" in row]
    assert losses_of(run) == {row["step"]: row["loss"] for row in logged}
    assert [row.step for row in run.series.steps] == [row["step"] for row in logged]  # sparse: every 2nd step
    assert [row.grad_norm for row in run.series.steps] == [row["grad_norm"] for row in logged]
    assert [row.lrs for row in run.series.steps] == [[row["learning_rate"]] for row in logged]
    evals = [row for row in state.log_history if "eval_loss" in row]
    assert [(p.step, p.loss, p.source, p.split) for p in run.series.evals] == \
        [(row["step"], row["eval_loss"], "eval_loss", UNKNOWN) for row in evals]
    assert run.interval == state.logging_steps == 2
    assert run.sources == {"loss": "loss", "grad_norm": "grad_norm", "lr": "learning_rate",
                           "eval:eval_loss": "eval_loss"}
    facts = run.series.facts
    assert facts["max_steps"] == facts["planned_steps"] == state.max_steps and facts["ended"] == "log"
    assert facts["logged"]["format"] == "trainer-state" and facts["logged"]["interval"] == 2
    assert run.complete is True and facts["logged"]["still_written"] is False
    # the summary row's train_loss is the whole run's mean: no point of the curve
    assert len(run.series) == len(logged) and "train_loss" not in run.unread
    assert any("most complete of 3 snapshots" in note for note in run.notes)


def test_trainer_checkpoint_copy_is_read_when_the_state_is_cut_short(trainer_output, tmp_path):
    """A trainer_state.json caught mid-write does not parse: the newest checkpoint's copy is read."""
    out = tmp_path / "out"
    shutil.copytree(trainer_output[0], out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.pt*"))
    whole = (out / "trainer_state.json").read_text()
    (out / "trainer_state.json").write_text(whole[: len(whole) // 2])
    for path in (out, out / "trainer_state.json"):
        run = only_run(path)
        assert run.path == str(out / "checkpoint-40" / "trainer_state.json")
        newest = json.loads((out / "checkpoint-40" / "trainer_state.json").read_text())
        assert losses_of(run) == {row["step"]: row["loss"] for row in newest["log_history"] if "loss" in row}


def test_trainer_checkpoints_alone_read_the_newest(trainer_output, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trainer_output[0], out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.pt*"))
    (out / "trainer_state.json").unlink()
    run = only_run(out)
    assert run.path.endswith("checkpoint-40/trainer_state.json") and run.name == "out"
    earlier = json.loads((out / "checkpoint-20" / "trainer_state.json").read_text())
    assert earlier["global_step"] == 20 and max(losses_of(run)) == 40


# ------------------------------------------------------------------------------ Lightning's CSVLogger


@pytest.fixture(scope="module")
def lightning_logs(tmp_path_factory):
    """A LightningModule with two parameter groups, logged by CSVLogger every 2 steps with a
    LearningRateMonitor (lr-AdamW/pg1, /pg2), its training loss on_step and on_epoch, its validation loss
    every 10 steps; 30 steps."""
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.body, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

        def forward(self, x):
            return self.head(torch.relu(self.body(x))).squeeze(-1)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW([{"params": self.body.parameters(), "lr": 1e-2},
                                           {"params": self.head.parameters(), "lr": 1e-3}])
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class Recorded(CSVLogger):
        """The CSVLogger itself, keeping in memory what Lightning handed it (the CSV's rows, read another way)."""

        handed: list = []

        def log_metrics(self, metrics, step=None):
            self.handed.append({"step": step, **{k: float(v) for k, v in metrics.items()}})
            super().log_metrics(metrics, step)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(-1)
    logger = Recorded(str(tmp_path_factory.mktemp("lightning")), name="lightning_logs")
    trainer = L.Trainer(max_steps=30, accelerator="cpu", logger=logger, log_every_n_steps=2,
                        callbacks=[LearningRateMonitor(logging_interval="step")], enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, val_check_interval=10,
                        check_val_every_n_epoch=None)
    trainer.fit(Regression(), DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True),
                DataLoader(TensorDataset(x[:64], y[:64]), batch_size=32))
    return logger.log_dir, logger.handed


def _logged(metrics: list, name: str) -> dict:
    return {int(row["step"]): row[name] for row in metrics if row.get(name) is not None}


def test_lightning_csv_is_read_as_the_csvlogger_wrote_it(lightning_logs):
    log_dir, metrics = lightning_logs
    run = only_run(log_dir)
    assert run.format == "lightning-csv" and run.path.endswith("metrics.csv")
    assert run.sources["loss"] == "train_loss_step"  # the per-step curve, not the epoch mean
    assert run.sources["lr"] == "lr-AdamW/pg1" and run.sources["lr:1"] == "lr-AdamW/pg2"
    assert run.sources["eval:val_loss"] == "val_loss"
    assert losses_of(run) == pytest.approx(_logged(metrics, "train_loss_step"), rel=1e-6)
    first, second = _logged(metrics, "lr-AdamW/pg1"), _logged(metrics, "lr-AdamW/pg2")
    rates = {row.step: row.lrs for row in run.series.steps if row.lrs}
    assert rates == pytest.approx({step: [first[step], second[step]] for step in first}, rel=1e-6)
    assert {p.step: p.loss for p in run.series.evals} == pytest.approx(_logged(metrics, "val_loss"), rel=1e-6)
    assert run.interval == 2
    assert "train_loss_epoch" in run.unread  # listed: --tag loss=train_loss_epoch maps it


def test_lightning_version_folder_is_found_under_its_logger_folder(lightning_logs):
    log_dir = lightning_logs[0]
    runs = find_runs(os.path.dirname(os.path.dirname(log_dir)), {})
    assert [run.name for run in runs] == ["lightning_logs/" + os.path.basename(log_dir)]


# ------------------------------------------------------------------------------ TensorBoard


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    """torch.utils.tensorboard's SummaryWriter, as a loop logs to it: train/loss and lr every 5 steps,
    val/loss every 20, over 100 steps (the values a decaying curve with noise)."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path_factory.mktemp("tb") / "runs" / "exp1"
    g = torch.Generator().manual_seed(0)
    written = {"train/loss": {}, "lr": {}, "val/loss": {}}
    with SummaryWriter(str(folder)) as writer:
        for step in range(5, 101, 5):
            loss = 4.0 * math.exp(-step / 60) + 0.05 * torch.rand(1, generator=g).item()
            writer.add_scalar("train/loss", loss, step)
            writer.add_scalar("lr", 3e-4 * min(1.0, step / 20), step)
            written["train/loss"][step], written["lr"][step] = loss, 3e-4 * min(1.0, step / 20)
            if step % 20 == 0:
                writer.add_scalar("val/loss", loss + 0.1, step)
                written["val/loss"][step] = loss + 0.1
            writer.add_scalar("samples_seen", step * 32, step)
    return folder, written


def test_tensorboard_scalars_are_read_by_tag(tensorboard_run):
    folder, written = tensorboard_run
    run = only_run(folder.parent.parent)
    assert run.format == "tensorboard" and run.name == "runs/exp1"
    # float32 on disk: equal to what was handed to the writer within float32's precision
    assert losses_of(run) == pytest.approx(written["train/loss"], rel=1e-6)
    assert {row.step: row.lrs[0] for row in run.series.steps} == pytest.approx(written["lr"], rel=1e-6)
    assert {p.step: p.loss for p in run.series.evals} == pytest.approx(written["val/loss"], rel=1e-6)
    assert run.interval == 5 and run.sources["eval:val/loss"] == "val/loss"
    assert run.sources["wall"].startswith("the tensorboard timestamps")  # the events' wall_time
    assert run.unread == ["samples_seen"]


def test_tensorboard_file_cut_short_is_read_up_to_the_cut(tensorboard_run, tmp_path):
    folder, written = tensorboard_run
    (event,) = [p for p in folder.iterdir() if p.name.startswith("events.out.tfevents.")]
    data = event.read_bytes()
    cut = tmp_path / event.name
    cut.write_bytes(data[: int(len(data) * 0.6)])  # mid-record: a writer caught between flushes
    run = only_run(cut)
    steps = sorted(losses_of(run))
    assert 0 < len(steps) < len(written["train/loss"])
    assert losses_of(run) == pytest.approx({s: written["train/loss"][s] for s in steps}, rel=1e-6)


# ------------------------------------------------------------------------------ JSON lines, CSV


@pytest.fixture(scope="module")
def jsonl_log(tmp_path_factory):
    """fixtures/watch/jsonl_log_healthy.py's own log (its loop writes one JSON object per step)."""
    log = tmp_path_factory.mktemp("jsonl") / "train_log.jsonl"
    subprocess.run([sys.executable, str(FIXTURES / "jsonl_log_healthy.py"), str(log), "--steps", "60"],
                   check=True, cwd=FIXTURES, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    return log


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_jsonl_is_read_by_its_iter_column(jsonl_log):
    run = only_run(jsonl_log)
    lines = _lines(jsonl_log)
    train = [line for line in lines if "loss" in line]
    assert run.format == "jsonl" and run.series.facts["logged"]["step_from"] == "the step column 'iter'"
    assert losses_of(run) == {line["iter"]: line["loss"] for line in train}
    assert [row.grad_norm for row in run.series.steps] == [line["grad_norm"] for line in train]
    assert [p.loss for p in run.series.evals] == [line["val_loss"] for line in lines if "val_loss" in line]
    # seconds per step: the clock's differences over the steps between points
    walls = [b["time"] - a["time"] for a, b in zip(train, train[1:])]
    assert [row.wall for row in run.series.steps[1:]] == pytest.approx(walls)
    assert run.interval == 1 and run.sources["wall"] == "time (differences)"


def test_half_written_last_line_is_left_out_and_said(jsonl_log, tmp_path):
    text = jsonl_log.read_text()
    cut = tmp_path / "cut.jsonl"
    cut.write_text(text + '{"iter": 61, "loss": 1.9')
    run = only_run(cut)
    assert max(losses_of(run)) == max(line["iter"] for line in _lines(jsonl_log))
    assert any("half-written" in note for note in run.notes)
    csv_log = tmp_path / "log.csv"
    train = [line for line in _lines(jsonl_log) if "loss" in line]
    csv_log.write_text("step,train_loss,learning_rate\n" + "".join(f"{row['iter']},{row['loss']!r},{row['lr']!r}\n"
                                                                   for row in train) + "61,1.9")
    run = only_run(csv_log)
    assert run.format == "csv" and losses_of(run) == {row["iter"]: row["loss"] for row in train}
    assert any("half-written" in note for note in run.notes)


def test_nan_and_zero_losses_stay_as_logged(tmp_path):
    """The Trainer writes NaN as the JSON token NaN; its NaN filter logs 0.0. Both are evidence."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": NaN, "grad_norm": Infinity}\n'
                   '{"step": 3, "loss": 0.0, "eval_loss": NaN}\n')
    run = only_run(log)
    losses = [row.loss for row in run.series.steps]
    assert losses[0] == 2.5 and math.isnan(losses[1]) and losses[2] == 0.0
    assert run.series.steps[1].grad_norm == math.inf and math.isnan(run.series.evals[0].loss)


def test_a_log_without_a_step_column_counts_lines_and_says_so(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"loss": 3.0 - i / 10}) + "\n" for i in range(5)))
    run = only_run(log)
    assert [row.step for row in run.series.steps] == list(range(5))
    assert any("line number" in note for note in run.notes)


def test_unfamiliar_names_are_listed_then_read_after_tag(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("n,objective,heldout_xent,warmup_factor\n" + "".join(f"{i},{3 - i / 50},{3.1 - i / 60},1\n"
                                                                         for i in range(1, 40)))
    with pytest.raises(NothingLogged) as said:
        find_runs(log, {})
    assert all(name in said.value.message for name in ("objective", "heldout_xent"))
    run = only_run(log, parse_tags(["loss=objective", "eval=heldout_xent", "step=n"]))
    assert losses_of(run) == {i: 3 - i / 50 for i in range(1, 40)}
    assert run.sources == {"loss": "objective", "eval:heldout_xent": "heldout_xent"}
    assert [p.step for p in run.series.evals] == list(range(1, 40)) and run.unread == ["warmup_factor"]
    with pytest.raises(UsageError, match="did you mean 'objective'"):
        find_runs(log, parse_tags(["loss=objectiv"]))
    with pytest.raises(UsageError, match="did you mean loss"):
        parse_tags(["los=objective"])


# ------------------------------------------------------------------------------ MLflow's file store


def _mlflow_run(root, run_id, name, metrics: dict, status=3, params=None):
    """A run folder as MLflow's FileStore writes it: meta.yaml, metrics/<key> with one `timestamp value
    step` line per logged value (a key with `/` a sub-folder), params/<key> holding the value."""
    run = root / "mlruns" / "0" / run_id
    (run / "metrics").mkdir(parents=True)
    (run / "meta.yaml").write_text(f"artifact_uri: file://{run}/artifacts\nend_time: null\nexperiment_id: '0'\n"
                                   f"lifecycle_stage: active\nrun_id: {run_id}\nrun_name: {name}\n"
                                   f"run_uuid: {run_id}\nstart_time: 1700000000000\nstatus: {status}\n"
                                   "tags: []\nuser_id: someone\n")
    (root / "mlruns" / "0" / "meta.yaml").write_text("experiment_id: '0'\nname: Default\n")
    for key, points in metrics.items():
        path = run / "metrics" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{stamp} {value} {step}\n" for stamp, value, step in points))
    for key, value in (params or {}).items():
        (run / "params").mkdir(exist_ok=True)
        (run / "params" / key).write_text(str(value))
    return run


def test_mlflow_file_store_run_is_read(tmp_path):
    start = 1_700_000_000_000
    losses = [(start + 250 * s, 4.0 - s / 100, s) for s in range(0, 100, 10)]
    rates = [(start + 250 * s, 1e-3, s) for s in range(0, 100, 10)]
    _mlflow_run(tmp_path, "a1b2", "brave-owl", {"train/loss": losses, "learning_rate": rates,
                                                "eval/loss": [(start + 25_000, 3.2, 50)]}, params={"max_steps": 100})
    run = only_run(tmp_path)
    assert run.format == "mlflow" and "brave-owl" in run.name and run.complete is True
    assert losses_of(run) == {step: value for _, value, step in losses}
    assert [(p.step, p.loss) for p in run.series.evals] == [(50, 3.2)]
    assert run.series.facts["planned_steps"] == 100
    assert [row.wall for row in run.series.steps[1:]] == pytest.approx([0.25] * 9)  # 250 ms a step


# ------------------------------------------------------------------------------ folders, names, nothing


def test_a_folder_of_several_runs_gives_each(trainer_output, tensorboard_run, jsonl_log, tmp_path):
    shutil.copytree(trainer_output[0], tmp_path / "hf", ignore=shutil.ignore_patterns("*.safetensors", "*.pt*"))
    shutil.copytree(tensorboard_run[0], tmp_path / "tb" / "exp1")
    shutil.copy(jsonl_log, tmp_path / "loop.jsonl")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "a data set, not a log", "label": 1}\n')
    (tmp_path / "hf" / "config.json").write_text('{"vocab_size": 64}\n')
    runs = {run.name: run.format for run in find_runs(tmp_path, {})}
    assert runs == {"hf": "trainer-state", "tb/exp1": "tensorboard", "loop.jsonl": "jsonl"}


def test_nothing_to_read_is_a_usage_error(tmp_path):
    with pytest.raises(NothingLogged, match="no training log found"):
        find_runs(tmp_path, {})
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NothingLogged, match="not a training log"):
        find_runs(tmp_path / "notes.txt", {})
    with pytest.raises(UsageError, match="did you mean"):
        find_runs(tmp_path / "notes.tx", {})


@pytest.mark.parametrize("name, series, group", [
    ("loss", "loss", 0), ("train/loss", "loss", 0), ("train_loss_step", "loss", 0), ("training_loss", "loss", 0),
    ("lr", "lr", 0), ("learning_rate", "lr", 0), ("lr-AdamW", "lr", 0), ("lr-SGD/pg2", "lr", 1),
    ("grad_norm", "grad_norm", 0), ("gradient_norm", "grad_norm", 0), ("val_loss", "eval", 0),
    ("eval_loss", "eval", 0), ("val/loss", "eval", 0), ("validation_loss", "eval", 0), ("loss_scale", "scale", 0),
    ("iter", "step", 0), ("global_step", "step", 0), ("lm loss validation", "eval", 0)])
def test_common_spellings(name, series, group):
    role = role_of(name)
    assert (role.series, role.group) == (series, group)


@pytest.mark.parametrize("name", ["lr-AdamW-momentum", "eval_runtime", "eval_accuracy", "aux_loss", "epoch",
                                  "train_loss_epoch", "val_ppl"])
def test_other_numbers_are_no_series(name):
    role = role_of(name)
    assert role is None or role.series not in ("loss", "eval", "lr"), normal(name)


def test_still_written_where_the_log_says_its_run_goes_on_or_it_is_followed(trainer_output, jsonl_log, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(trainer_output[0] / "checkpoint-20", out / "checkpoint-20",
                    ignore=shutil.ignore_patterns("*.safetensors", "*.pt*"))
    midway = only_run(out)  # global_step 20 of max_steps 40, no summary row: the Trainer had not ended
    assert midway.complete is False and midway.series.facts["logged"]["still_written"] is True
    assert only_run(trainer_output[0]).series.facts["logged"]["still_written"] is False
    assert only_run(jsonl_log).series.facts["logged"]["still_written"] is False  # a JSON-lines log cannot say
    (followed,) = find_runs(jsonl_log, {}, following=True)
    assert followed.complete is None and followed.series.facts["logged"]["still_written"] is True
