"""The watch monitor records what the loop really did, step by step: each row against the value the
loop itself computed (its loss, its clip's norm, its optimizer's rate, its GradScaler's skips), and
the process left as it was found."""

import math
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from helpers import ROOT
from tfdoctor.watching.hooks import watching
from tfdoctor.watching.monitor import Monitor, StopWatching

V = 16


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 8), nn.Linear(8, V))


def batch(g, rows=4, T=6):
    return torch.randint(0, V, (rows, T), generator=g)


def lm_loss(model, x, reduction="mean"):
    return F.cross_entropy(model(x).reshape(-1, V), x.reshape(-1), reduction=reduction)


def test_rows_are_optimizer_steps_and_the_loss_is_the_mean_of_the_micro_batches():
    model, g = tiny(), torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []
    monitor = Monitor()
    with watching(monitor):
        for _ in range(3):
            micro = []
            for _ in range(4):  # accumulation over 4 micro-batches, divided as it should be
                loss = lm_loss(model, batch(g))
                micro.append(loss.item())
                (loss / 4).backward()
            opt.step()
            opt.zero_grad()
            seen.append(micro)
    series = monitor.finish("finished")
    assert len(series) == 3
    for row, micro in zip(series.steps, seen):
        assert row.micro_losses == pytest.approx(micro, rel=1e-6)
        assert row.loss == pytest.approx(sum(micro) / 4, rel=1e-6)
        assert row.lrs == [1e-3]
        assert row.tokens == 4 * 4 * 6 or row.step == 0  # the model is bound at the first step


def test_the_gradient_norm_is_the_clip_s_pre_clip_norm_and_otherwise_the_gradient_s():
    model, g = tiny(), torch.Generator().manual_seed(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    monitor = Monitor()
    with watching(monitor):
        for step in range(4):
            opt.zero_grad()
            lm_loss(model, batch(g)).backward()
            if step % 2:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)))
            else:
                norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
            opt.step()
    rows = monitor.finish("finished").steps
    assert [r.grad_norm for r in rows] == pytest.approx(norms, rel=1e-5)
    assert norms[1] > 1e-2  # the clip cut it: the row holds the norm before it
    assert rows[1].group_norms == pytest.approx([norms[1]], rel=1e-4)


def test_a_clip_handed_a_consumed_iterator_is_not_taken_for_the_gradient_s_norm():
    model, g = tiny(), torch.Generator().manual_seed(2)
    params = filter(lambda p: p.requires_grad, model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)  # consumes the iterator: every later clip gets nothing
    monitor, norms, returned = Monitor(), [], []
    with watching(monitor):
        for _ in range(3):
            opt.zero_grad()
            lm_loss(model, batch(g)).backward()
            returned.append(float(torch.nn.utils.clip_grad_norm_(params, 1e-3)))
            norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
            opt.step()
        torch.nn.utils.clip_grad_norm_(parameters=list(model.parameters()), max_norm=1.0)  # keywords pass too
    assert returned == [0.0, 0.0, 0.0]  # what the loop saw
    rows = monitor.finish("finished").steps
    assert [r.grad_norm for r in rows] == pytest.approx(norms, rel=1e-5)  # what its gradients were


def test_a_summed_loss_is_read_per_token_as_a_hugging_face_model_divides_it():
    model, g = tiny(), torch.Generator().manual_seed(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = batch(g)
    monitor = Monitor()
    with watching(monitor):
        total = lm_loss(model, x, reduction="sum")
        (total / x.numel()).backward()
        opt.step()
    (row,) = monitor.finish("finished").steps
    assert row.loss == pytest.approx(total.item() / x.numel(), rel=1e-6)


def test_a_grad_scaler_that_overflows_skips_real_steps_and_the_scale_falls():
    model, g = tiny(), torch.Generator().manual_seed(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # far above what float16 holds
    monitor = Monitor()
    with watching(monitor):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(batch(g))
            loss = F.cross_entropy(logits.float().reshape(-1, V), torch.zeros(logits.shape[0] * logits.shape[1],
                                                                              dtype=torch.long))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    rows = monitor.finish("finished").steps
    assert [r.skipped for r in rows] == [True, True, True]
    assert all(math.isinf(r.grad_norm) for r in rows)
    assert rows[0].scale > rows[1].scale > rows[2].scale
    assert all(math.isfinite(r.loss) for r in rows)  # the loss, not the scaled loss


class SlowRows(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.full((6,), i % V)


def test_time_waiting_for_the_data_loader_is_measured():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(SlowRows(), batch_size=4)
    monitor = Monitor()
    with watching(monitor):
        for x in loader:
            opt.zero_grad()
            lm_loss(model, x).backward()
            opt.step()
    series = monitor.finish("finished")
    assert len(series) == 16
    assert all(r.data_wait >= 4 * 0.005 * 0.9 for r in series.steps[1:])
    assert series.facts["loader"]["num_workers"] == 0 and series.facts["loader"]["batch_size"] == 4


def test_an_evaluation_on_trained_rows_is_told_from_one_on_held_out_rows():
    model, g = tiny(), torch.Generator().manual_seed(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train, held_out = batch(g, rows=8), batch(g, rows=8)
    monitor = Monitor()
    with watching(monitor):
        for step in range(4):
            opt.zero_grad()
            lm_loss(model, train).backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                evaluated = lm_loss(model, train[:4] if step == 1 else held_out).item()
            model.train()
    series = monitor.finish("finished")
    assert [e.step for e in series.evals] == [1, 2, 3, 4]
    assert [e.trained_rows for e in series.evals] == [0, 4, 0, 0]
    assert all(e.rows in (4, 8) for e in series.evals)
    assert series.evals[-1].loss == pytest.approx(evaluated, rel=1e-6)


def test_max_steps_stops_the_loop_out_of_its_optimizer_step():
    model, g = tiny(), torch.Generator().manual_seed(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(max_steps=5)
    steps = 0
    with pytest.raises(StopWatching), watching(monitor):
        while True:
            opt.zero_grad()
            lm_loss(model, batch(g)).backward()
            opt.step()
            steps += 1
    assert len(monitor.finish("max-steps")) == 5 and steps == 4  # the 5th step raised


def test_the_process_is_left_as_found_also_when_the_loop_raises():
    originals = (torch.Tensor.backward, F.cross_entropy, F.nll_loss, torch.nn.utils.clip_grad_norm_,
                 torch.amp.GradScaler.step, torch.utils.data.DataLoader.__iter__,
                 torch.optim.lr_scheduler.LRScheduler.__init__)
    model = tiny()
    with pytest.raises(RuntimeError, match="the loop's own"):
        with watching(Monitor()):
            lm_loss(model, torch.zeros(2, 3, dtype=torch.long)).backward()
            raise RuntimeError("the loop's own error")
    after = (torch.Tensor.backward, F.cross_entropy, F.nll_loss, torch.nn.utils.clip_grad_norm_,
             torch.amp.GradScaler.step, torch.utils.data.DataLoader.__iter__,
             torch.optim.lr_scheduler.LRScheduler.__init__)
    assert after == originals
    assert not torch.nn.modules.module._global_forward_pre_hooks
    from torch.optim import optimizer

    assert not optimizer._global_optimizer_pre_hooks and not optimizer._global_optimizer_post_hooks
    assert not model._forward_pre_hooks


# ---------------------------------------------------------------------------------- a scheduler's promise

def _schedulers():
    from torch.optim import lr_scheduler as L
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    return {
        "LambdaLR": lambda o: L.LambdaLR(o, lambda s: min(1.0, (s + 1) / 10)),
        "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lambda s: 0.97),
        "StepLR": lambda o: L.StepLR(o, 7, 0.5),
        "MultiStepLR": lambda o: L.MultiStepLR(o, [5, 20], 0.3),
        "ExponentialLR": lambda o: L.ExponentialLR(o, 0.95),
        "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, 15, 1e-4),
        "LinearLR": lambda o: L.LinearLR(o, 0.1, 1.0, 8),
        "OneCycleLR": lambda o: L.OneCycleLR(o, 0.01, total_steps=30),
        "SequentialLR": lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, 1.0, 5), L.CosineAnnealingLR(o, 20)], [5]),
        "ChainedScheduler": lambda o: L.ChainedScheduler([L.ConstantLR(o, 0.5, 4), L.ExponentialLR(o, 0.9)]),
        "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, 6, 2),
        "get_cosine_schedule_with_warmup": lambda o: get_cosine_schedule_with_warmup(o, 5, 30),
        "get_linear_schedule_with_warmup": lambda o: get_linear_schedule_with_warmup(o, 5, 30),
    }


def _scheduled_run(make, steps: int = 30, per_step: int = 1):
    """`steps` SGD steps on two param groups (different rates) with the scheduler `make` made, stepped
    `per_step` times after each optimizer step; the rate each step used, and the series."""
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD([{"params": model.weight}, {"params": model.bias, "lr": 5e-3}], lr=1e-2, momentum=0.9)
    monitor, used = Monitor(), []
    with watching(monitor):
        scheduler = make(opt)
        for _ in range(steps):
            model(torch.randn(2, 3)).sum().backward()
            used.append(max(group["lr"] for group in opt.param_groups))
            opt.step()
            opt.zero_grad()
            for _ in range(per_step):
                scheduler.step()
    return used, monitor.finish("finished")


@pytest.mark.parametrize("name", list(_schedulers()))
def test_the_promise_is_the_rate_the_scheduler_sets_at_each_position(name):
    used, series = _scheduled_run(_schedulers()[name])
    (record,) = series.facts["schedulers"]  # a SequentialLR or ChainedScheduler in its children's place
    assert record["watched"] and record["steps_called"] == 30
    assert series.column("scheduler_steps") == list(range(30))
    promise = record["promise"]
    assert len(promise) >= 31 or "OneCycleLR" in name  # OneCycleLR raises past its total_steps
    assert [promise[row.scheduler_steps] for row in series.steps] == pytest.approx(used, rel=1e-12)


def test_a_scheduler_stepped_per_micro_batch_is_counted_each_time_and_projected_past_the_run():
    make = _schedulers()["get_linear_schedule_with_warmup"]
    used, series = _scheduled_run(lambda o: make(o), steps=20, per_step=4)
    assert series.column("scheduler_steps") == [4 * i for i in range(20)]
    (record,) = series.facts["schedulers"]
    assert record["steps_called"] == 80 and len(record["promise"]) >= 78
    assert [record["promise"][4 * i] for i in range(20)] == pytest.approx(used, rel=1e-12)


def test_plateau_has_no_promise_and_an_epoch_argument_is_said():
    from torch.optim import lr_scheduler as L

    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor()
    with watching(monitor):
        plateau, cosine = L.ReduceLROnPlateau(opt), L.CosineAnnealingWarmRestarts(opt, 10)
        for i in range(12):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            plateau.step(1.0)
            cosine.step(i + 0.5)
    records = {r["name"]: r for r in monitor.finish("finished").facts["schedulers"]}
    assert "promise" not in records["ReduceLROnPlateau"] and records["ReduceLROnPlateau"]["steps_called"] == 12
    assert records["CosineAnnealingWarmRestarts"]["epoch_given"]
    assert L.LRScheduler.step.__name__ == "step" and not hasattr(L.LRScheduler.step, "__wrapped__")  # hooks off


# ---------------------------------------------------------------------------------- evaluation sources

def evaluate_splits(model, splits: dict, iters: int = 6):
    """nanoGPT's estimate_loss: every split's losses computed at the same line, their plain mean each."""
    out = {}
    model.eval()
    with torch.no_grad():
        for split, rows in splits.items():
            losses = torch.zeros(iters)
            for k in range(iters):
                x = rows[torch.randint(len(rows), (4,))]
                losses[k] = lm_loss(model, x).item()
            out[split] = losses.mean().item()
    model.train()
    return out


def test_two_splits_at_one_line_are_two_sources_and_the_held_out_one_is_the_evaluation():
    model, g = tiny(), torch.Generator().manual_seed(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train, val = batch(g, rows=8), batch(g, rows=8)
    printed = []
    monitor = Monitor()
    with watching(monitor):
        for step in range(40):
            opt.zero_grad()
            lm_loss(model, train[torch.randint(8, (4,))]).backward()
            opt.step()
            if step % 20 == 19:
                printed.append(evaluate_splits(model, {"train": train, "val": val}))
    series = monitor.finish("finished")
    assert [(p.step, p.split) for p in series.evals] == [(20, "training-split"), (20, "held-out"),
                                                         (40, "training-split"), (40, "held-out")]
    site = series.evals[0].source.split("#")[0]
    assert site.startswith("test_monitor.py:") and [p.source for p in series.evals[:2]] == [site + "#1", site + "#2"]
    assert [p.loss for p in series.evaluation()] == pytest.approx([out["val"] for out in printed], rel=1e-6)
    assert [p.loss for p in series.training_split()] == pytest.approx([out["train"] for out in printed], rel=1e-6)


def test_a_pass_over_each_data_loader_is_a_source_of_its_own():
    from torch.utils.data import TensorDataset

    model, g = tiny(), torch.Generator().manual_seed(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(TensorDataset(batch(g, rows=16)), batch_size=4)
    val, test = (DataLoader(TensorDataset(batch(g, rows=8)), batch_size=4) for _ in range(2))

    def evaluate(loader):
        with torch.no_grad():
            return [lm_loss(model, x).item() for (x,) in loader]

    monitor = Monitor()
    with watching(monitor):
        for (x,) in train:
            opt.zero_grad()
            lm_loss(model, x).backward()
            opt.step()
        seen = {name: evaluate(loader) for name, loader in (("train", train), ("val", val), ("test", test))}
    series = monitor.finish("finished")
    assert [p.split for p in series.evals] == ["training-split", "held-out", "held-out"]
    assert len({p.source for p in series.evals}) == 3  # one call site, three passes
    for point, losses in zip(series.evals, seen.values()):
        assert point.loss == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    assert series.evaluation() == [series.evals[1]]  # the first held-out pass


@pytest.mark.parametrize("weighting", ["calls", "rows", "tokens"])
def test_an_evaluation_is_averaged_as_the_loop_averages_it(weighting):
    """Batches of 4, 4 and a short 1, some targets ignored: each weighting as its loop forms it."""
    model, g = tiny(), torch.Generator().manual_seed(9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = batch(g, rows=9)
    targets = held.clone()
    targets[:, :2] = -100  # prompt tokens: not counted
    targets[8, :5] = -100  # the short batch's row counts one token only
    monitor = Monitor(weighting=weighting)
    with watching(monitor):
        opt.zero_grad()
        lm_loss(model, batch(g)).backward()
        opt.step()
        with torch.no_grad():
            calls = [(F.cross_entropy(model(held[i:i + 4]).reshape(-1, V), targets[i:i + 4].reshape(-1)).item(),
                      len(held[i:i + 4]), int((targets[i:i + 4] != -100).sum())) for i in (0, 4, 8)]
    (point,) = monitor.finish("finished").evals
    by = {"calls": [(loss, 1) for loss, _, _ in calls], "rows": [(loss, n) for loss, n, _ in calls],
          "tokens": [(loss, t) for loss, _, t in calls]}
    means = {name: sum(v * w for v, w in pairs) / sum(w for _, w in pairs) for name, pairs in by.items()}
    assert point.weighting == weighting and point.loss == pytest.approx(means[weighting], rel=1e-6)
    assert (point.rows, point.tokens) == (9, 8 * 4 + 1)
    assert point.row_weighted == pytest.approx(means["rows"], rel=1e-6)
    assert point.token_weighted == pytest.approx(means["tokens"], rel=1e-6)
    assert len({round(m, 6) for m in means.values()}) == 3  # the three differ here


def test_evaluation_points_keep_their_source_through_json():
    from tfdoctor.watching.series import EvalPoint, RunSeries

    series = RunSeries(evals=[EvalPoint(0, 2.5, rows=8, trained_rows=7, calls=2, source="t.py:3#1",
                                        split="training-split", weighting="rows", tokens=40, row_weighted=2.5,
                                        token_weighted=2.4),
                              EvalPoint(0, 2.9, rows=8, source="t.py:3#2", split="held-out")])
    back = RunSeries.from_dict(series.to_dict())
    assert back.evals[0] == series.evals[0]
    assert back.evals[1].split == "held-out" and math.isnan(back.evals[1].token_weighted)
    assert back.evaluation() == [back.evals[1]] and back.training_split() == [back.evals[0]]
    old = RunSeries.from_dict({"evals": {"step": [5], "loss": [2.0], "rows": [4]}})  # before sources
    assert old.evals[0].split == "unknown" and old.evaluation() == old.evals


def test_a_pass_is_cut_only_where_the_trained_share_changes_beyond_chance():
    from tfdoctor.watching.sources import EvalCall, eval_points

    def calls(trained):
        return [EvalCall(1.0, "t.py:3", None, rows=16, trained=t) for t in trained]

    two = eval_points([(0, calls([15, 14, 16, 15, 0, 0, 1, 0]))], set())
    assert [(p.calls, p.split) for p in two] == [(4, "training-split"), (4, "held-out")]
    leaked = eval_points([(0, calls([14, 13, 15, 16, 12, 14, 15, 14]))], set())  # shuffled leak: no change
    assert [(p.calls, p.split, p.trained_rows) for p in leaked] == [(8, "held-out", 113)]
    unseen = eval_points([(0, [EvalCall(1.0, "t.py:3", None)] * 3)], set())  # no rows fingerprinted
    assert [(p.calls, p.split) for p in unseen] == [(3, "unknown")]


def test_a_small_share_is_cut_where_the_evaluations_pooled_say():
    """nanoGPT early in a run: ~3% of the train split's rows trained on, calls with none among them (the
    last ones here); each evaluation alone is cut too early, all of them pooled call by call at 4."""
    from tfdoctor.watching.sources import EvalCall, eval_points

    def calls(trained):
        return [EvalCall(1.0, "t.py:3", None, rows=64, trained=t) for t in trained]

    evaluations = [(0, calls([2, 3, 2, 0, 0, 0, 0, 0])), (100, calls([3, 2, 0, 2, 0, 0, 0, 0])),
                   (200, calls([0, 2, 3, 0, 0, 0, 0, 0])), (300, calls([3, 3, 3, 0, 0, 0, 0, 0]))]
    points = eval_points(evaluations, set())
    assert [(p.step, p.calls, p.split) for p in points] == [
        (step, 4, split) for step in (0, 100, 200, 300) for split in ("training-split", "held-out")]


@pytest.mark.parametrize("script", ["raises_early", "exits_early", "never_steps"])
def test_watch_refuses_a_script_without_a_step_in_run_s_words(script):
    """watch and run share one script driver core (usercode/as_main.py): a script that raises or exits
    before its first optimizer step is refused in the same sentence and hint by both; one that just
    ends without a step is said in each command's own terms."""
    from tfdoctor.recording.script import ScriptError, record_script
    from tfdoctor.watching.driver import WatchError, watch_script

    path = str(ROOT / f"fixtures/scripts/bad/{script}.py")
    with pytest.raises(WatchError) as watched:
        watch_script(path)
    with pytest.raises(ScriptError) as recorded:
        record_script(path)
    if script == "never_steps":
        assert watched.value.message.endswith("ended without an optimizer step, so there is no run to watch")
        assert "3 forward(s) of a model" in recorded.value.message
        return
    assert watched.value.message.endswith("before its first optimizer step") and watched.value.hint
    assert (watched.value.message, watched.value.hint) == (recorded.value.message, recorded.value.hint)
