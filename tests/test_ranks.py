"""The rank checks (tfdoctor/checks/ranks.py) on real 2-process gloo runs of fixtures/scripts/ddp_*.py.

Each fixture runs once, as 2 processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), each rank under `record_script(..., steps=4)` inside a RankRecorder (tests/rank_worker.py);
the digests are gathered here and judged as rank 0 will judge them, on a Trace whose `ranks` holds
them. The end-to-end runs through `tfdoctor run --nproc` live with the distributed driver's tests.
"""

import pickle

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers import RANK_STEPS as STEPS, ROOT, WORLD, judge_ranks, rank_checks, rank_subject, trace_of
from tfdoctor.checks.ranks import rank_data, rank_sync
from tfdoctor.recording.ranks import RankRecorder
from tfdoctor.recording.trace import Event
from tfdoctor.result import Result

SCRIPTS = "fixtures/scripts"
CHECKS = rank_checks()
judge = judge_ranks
SUBJECT = rank_subject()


def statuses(results: dict) -> dict:
    return {check_id: r.status.value for check_id, r in results.items()}


def line_of(name: str, text: str) -> str:
    """fixtures/scripts/NAME:LINE of the first line of the fixture that contains `text`."""
    lines = (ROOT / SCRIPTS / name).read_text().splitlines()
    return f"{SCRIPTS}/{name}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


# ------------------------------------------------------------------------------------------------
# the fixtures, judged


@pytest.mark.e2e
def test_correct_ddp_passes_every_rank_check(rank_digests):
    ranks = rank_digests("correct")
    results = judge(ranks)
    assert statuses(results) == dict.fromkeys(CHECKS, "pass"), {k: r.message for k, r in results.items()}
    assert results["rank-data"].details["epochs_seen"] == {0: 2, 1: 2}  # both epochs were seen, in new orders
    assert results["rank-sync"].details["steps_compared"] == STEPS
    assert results["rank-sync"].details["tensors_compared"] == len(ranks[0]["params"][0]["names"])
    assert results["ddp-accumulation"].details["accumulating_steps"] == STEPS
    assert results["rank-equivalence"].details["steps_clip_compared"] == STEPS
    assert "tokens_not_compared" in results["rank-equivalence"].details  # no padding: equal counts


@pytest.mark.e2e
def test_digest_is_small_plain_data(rank_digests):
    ranks = rank_digests("correct")
    assert [d["rank"] for d in ranks] == [0, 1] and all(d["world_size"] == WORLD for d in ranks)

    def plain(value):
        if isinstance(value, dict):
            return all(isinstance(k, (str, int)) and plain(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (bool, int, float, str))

    assert all(plain(d) for d in ranks)
    assert len(pickle.dumps(ranks[0])) < 20_000
    # the last step's weights are there: the start and all 4 steps
    assert len(ranks[0]["params"][0]["states"]) == STEPS + 1


@pytest.mark.e2e
def test_no_sampler_fails_rank_data_at_the_loader(rank_digests):
    results = judge(rank_digests("no_sampler"))
    assert statuses(results) == {"rank-data": "fail", "rank-sync": "pass", "ddp-accumulation": "pass",
                                 "rank-uniform": "pass", "rank-equivalence": "pass"}
    found = results["rank-data"]
    assert found.details["same_ranks"] == [[0, 1]]
    assert found.details["shared_batches"] == {0: 8, 1: 8}
    assert found.details["loaders"][0]["sampler"] == "RandomSampler"
    assert found.details["location"] == line_of("ddp_no_sampler.py", "for i, (x, y) in enumerate(loader)")
    assert "both ranks trained on the same 8 batches" in found.message and "DistributedSampler" in found.hint


@pytest.mark.e2e
def test_no_set_epoch_warns_that_the_epoch_order_repeats(rank_digests):
    results = judge(rank_digests("no_set_epoch"))
    assert statuses(results) == {"rank-data": "warn", "rank-sync": "pass", "ddp-accumulation": "pass",
                                 "rank-uniform": "pass", "rank-equivalence": "pass"}
    found = results["rank-data"]
    replays = found.details["replays"]
    assert [r["rank"] for r in replays] == [0, 1]
    assert all((r["epoch"], r["first_at_step"], r["again_at_step"], r["set_epoch_calls"]) == (0, 0, 2, 0)
               for r in replays)
    assert found.details["location"] == line_of("ddp_no_set_epoch.py", "for i, (x, y) in enumerate(loader)")
    assert "set_epoch() is never called" in found.message and "set_epoch(epoch)" in found.hint


@pytest.mark.e2e
def test_accumulation_outside_no_sync_warns_with_the_wasted_all_reduces(rank_digests):
    results = judge(rank_digests("accum_no_no_sync"))
    assert statuses(results) == {"rank-data": "pass", "rank-sync": "pass", "ddp-accumulation": "warn",
                                 "rank-uniform": "pass", "rank-equivalence": "pass"}
    found = results["ddp-accumulation"]
    assert found.details["wasted_all_reduces_per_step"] == 1
    assert found.details["micro_batches_per_step"] == 2 and found.details["first_step"] == 1
    assert found.details["location"] == line_of("ddp_accum_no_no_sync.py", "logits = model(x)")
    assert "1 all-reduce per step wasted" in found.message and "no_sync()" in found.hint


@pytest.mark.e2e
def test_rank0_clip_fails_rank_uniform_and_rank_sync(rank_digests):
    results = judge(rank_digests("rank0_clip"))
    # the clip made on rank 0 only is compared with nothing, and the ranks grade the same token counts
    assert statuses(results) == {"rank-data": "pass", "rank-sync": "fail", "ddp-accumulation": "pass",
                                 "rank-uniform": "fail", "rank-equivalence": "skip"}
    uniform = results["rank-uniform"]
    assert (uniform.details["step"], uniform.details["counted"], uniform.details["counts"]) == \
        (1, "clip_grad_norm_", {0: 1, 1: 0})
    assert uniform.details["location"] == line_of("ddp_rank0_clip.py", "torch.nn.utils.clip_grad_norm_")
    assert "rank 0 called it once, rank 1 never" in uniform.message
    sync = results["rank-sync"]
    assert sync.details["first_step"] == 1  # identical at the start (DDP broadcast), apart after the first step
    assert sync.details["differing_tensors"] > 0 and sync.details["max_relative_norm_drift"] > 0
    assert sync.details["drift_at_last_step"] >= sync.details["max_relative_norm_drift"]
    assert "after optimizer step 1" in sync.message


@pytest.mark.e2e
def test_clip_before_the_all_reduce_fails_rank_equivalence_only(rank_digests):
    results = judge(rank_digests("clip_before_all_reduce"))
    assert statuses(results) == {"rank-data": "pass", "rank-sync": "pass", "ddp-accumulation": "skip",
                                 "rank-uniform": "pass", "rank-equivalence": "fail"}
    found = results["rank-equivalence"]
    norms = found.details["clip_norms"]
    assert found.details["step"] == 1 and len(norms) == 2 and len(set(norms.values())) == 2
    assert found.details["location"] == line_of("ddp_clip_before_all_reduce.py", "torch.nn.utils.clip_grad_norm_")
    assert "clipped each rank's own gradient" in found.message and "clip after the all-reduce" in found.hint


@pytest.mark.e2e
@pytest.mark.parametrize("name, status", [("mean_of_means", "warn"), ("global_token_mean", "pass")])
def test_rank_equivalence_weighs_a_target_alike_on_every_rank(rank_digests, name, status):
    """Rank 0 grades 8 real targets per row, rank 1 all 16: a mean of per-rank means weighs rank 0's
    targets twice; the loss normalised by the all-reduced count weighs them alike."""
    found = judge(rank_digests(name))["rank-equivalence"]
    assert found.status.value == status, found.message
    assert found.details["graded_per_rank"] == {0: 32, 1: 64}  # 4 rows per step
    ratio = found.details["weight_ratio"]
    assert abs(ratio - 2.0) < 0.01 if status == "warn" else abs(ratio - 1.0) < 0.01
    if status == "warn":
        assert "a target on rank 0 (32 graded) weighs 2.00x one on rank 1 (64 graded)" in found.message


@pytest.mark.e2e
def test_rank_sync_names_a_start_that_differs(rank_digests):
    """The same checksums with one tensor's start changed on rank 1: the ranks start apart."""
    ranks = pickle.loads(pickle.dumps(rank_digests("correct")))
    names = ranks[1]["params"][0]["names"]
    i = names.index("head.weight")
    total, squares = ranks[1]["params"][0]["states"][0][i]
    ranks[1]["params"][0]["states"][0][i] = [total + 1.0, squares * 1.01]
    found = rank_sync(SUBJECT, trace_of(ranks))
    assert found.status.value == "fail" and found.details["first_step"] == 0
    assert found.details["differing"] == ["head.weight"]
    assert "at the start" in found.message and "DistributedDataParallel" in found.hint


@pytest.mark.e2e
def test_one_process_skips_every_rank_check(rank_digests):
    for ranks in ([], rank_digests("correct")[:1]):
        results = judge(ranks)
        assert statuses(results) == dict.fromkeys(CHECKS, "skip")
        assert all(r.message.startswith("one process:") for r in results.values())


# ------------------------------------------------------------------------------------------------
# the recorder in one process: samplers, and leaving the process as it found it


def _rows(n: int = 16) -> TensorDataset:
    ids = torch.randint(0, 50, (n, 9), generator=torch.Generator().manual_seed(0))
    return TensorDataset(ids[:, :-1])


def _epochs(loader, plan) -> list:
    """Iterate `loader` per `plan` (a list of (set_epoch value or None, batches to take or None for
    all)); the forward events a script recorder would have made of the batches taken."""
    events = []
    for epoch, take in plan:
        if epoch is not None:
            loader.sampler.set_epoch(epoch)
        for i, (ids,) in enumerate(loader):
            if take is not None and i >= take:
                break
            events.append(Event("forward", 0, {"inputs": [("0", ids)], "grad": True}))
    return events


def _sampler_verdict(shuffle: bool, plan) -> Result:
    digests = []
    for rank in range(WORLD):
        sampler = DistributedSampler(_rows(), num_replicas=WORLD, rank=rank, shuffle=shuffle, seed=0)
        with RankRecorder(rank, WORLD) as recorder:
            loader = DataLoader(_rows(), batch_size=2, sampler=sampler)
            events = _epochs(loader, plan)
        digests.append(recorder.digest(events, None))
    return rank_data(SUBJECT, trace_of(digests))


@pytest.mark.parametrize("shuffle, plan, status", [
    (True, [(0, None), (1, None)], "pass"),  # set_epoch each epoch
    (True, [(None, None), (None, 2)], "warn"),  # no set_epoch: the second epoch replays the first
    (True, [(0, None), (0, None)], "warn"),  # set_epoch with the same value
    (True, [(0, None)], "pass"),  # one epoch seen: nothing to compare
    (True, [(0, 1), (0, None)], "pass"),  # a peek at the first batch, then the epoch: no completed epoch before
    (False, [(None, None), (None, None)], "pass"),  # no shuffle: the same order by design
])
def test_sampler_replays_are_judged_only_after_a_completed_shuffled_epoch(shuffle, plan, status):
    found = _sampler_verdict(shuffle, plan)
    assert found.status.value == status, found.message


def test_recorder_leaves_hooks_and_patches_as_it_found_them():
    import torch.nn.modules.module as module_mod
    import torch.optim.optimizer as optimizer_mod

    class LateSampler(DistributedSampler):  # defined after nothing is patched; patched at its first instance
        def __iter__(self):
            yield from super().__iter__()

    def state():
        return (dict(optimizer_mod._global_optimizer_pre_hooks), dict(optimizer_mod._global_optimizer_post_hooks),
                dict(module_mod._global_forward_pre_hooks), DistributedSampler.__iter__, DistributedSampler.__init__,
                DistributedSampler.set_epoch, LateSampler.__iter__, DataLoader.__init__, DataLoader.__iter__)

    before = state()
    with pytest.raises(RuntimeError, match="the script's own error"):
        with RankRecorder(0, WORLD) as recorder:
            sampler = LateSampler(_rows(), num_replicas=WORLD, rank=0, seed=0)
            assert LateSampler.__iter__ is not before[6]
            assert list(sampler) == list(DistributedSampler(_rows(), num_replicas=WORLD, rank=0, seed=0))
            raise RuntimeError("the script's own error")
    assert state() == before
    # the subclass's own __iter__ calling super().__iter__() is one iteration, not two
    assert [len(s.iterations) for s in recorder.samplers.values()] == [1, 1]


def test_an_optimizer_stepped_inside_another_is_left_to_the_outer_one():
    """ZeroRedundancyOptimizer steps this rank's shard through an inner optimizer: the outer one holds
    every parameter, and only it is checksummed (the inner one differs across ranks by design)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))

    class ShardStepping(torch.optim.SGD):
        def __init__(self, params, inner):
            super().__init__(params, lr=0.1)
            self.optim = inner

        def step(self, closure=None):
            return self.optim.step(closure)

    optimizer = ShardStepping(model.parameters(), torch.optim.SGD(model[0].parameters(), lr=0.1))
    with RankRecorder(0, WORLD) as recorder:
        for _ in range(2):
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    found = recorder.digest([], model)["params"]
    assert [(o["class"], len(o["names"]), len(o["states"])) for o in found] == [("ShardStepping", 4, 3)]
    assert found[0]["names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert found[0]["states"][0] != found[0]["states"][1]  # the inner step moved the first layer
    assert recorder.steps == 2
