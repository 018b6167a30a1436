"""Rank checks: the ranks of a distributed run (torchrun) compared with each other.

Every rank of a `tfdoctor run` under torchrun records its own trace and a digest of what only matters
across ranks (tfdoctor/recording/ranks.py: batch fingerprints, parameter checksums per step, DDP's
sync flag per forward, DistributedSampler iterations, calls per optimizer step); the digests are
gathered to rank 0 into `Trace.ranks`, and the checks here judge that list. In one process it is
empty and every check skips.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Optional

from tfdoctor.registry import check
from tfdoctor.result import Result, counted

# rank-data: two different shuffles of N indices share their first m indices with chance ~1/N^m; an
# iteration whose epoch value changed is called a replay only when at least this many agree (one
# whose epoch stayed the same replays by construction: the order is a function of seed + epoch).
REPEAT_MIN_INDICES = 4

# rank-sync: identical tensors give identical float64 sums on every rank (same kernels, same order);
# this relative tolerance only absorbs a reduction summed in another order (~1e-12 at a million
# elements). A real drift, one float32 rounding (6e-8) in many elements, sits far above it.
SYNC_RTOL = 1e-9
# rank-equivalence. The ranks' graded targets are weighed alike when their mean weights agree this
# closely (token-weighting's tolerance: float32 sums of a few hundred weights sit far below it), and
# their counts differ enough to tell a mean over all tokens from a mean of per-rank means beyond it.
RANK_WEIGHT_TOLERANCE = 0.02
# After an all-reduce every rank holds the same gradient, so every rank's clip measures the same norm
# (to the last bits of a float32 sum); norms this far apart were measured on different gradients.
CLIP_NORM_RTOL = 1e-3
# Parameter names listed in a finding (the rest are counted).
NAMES_SHOWN = 5

# rank-uniform: the calls compared, in the order a step makes them, as the user writes them.
UNIFORM_CALLS = {"backward": "backward()", "clip": "clip_grad_norm_", "unscale": "scaler.unscale_()",
                 "scaler_step": "scaler.step()", "scaler_update": "scaler.update()", "opt_step": "optimizer.step()"}


def _digests(trace) -> tuple[list[dict], str | None]:
    """The ranks' digests, rank 0 first, and why the rank checks cannot judge them (or None)."""
    digests = list(getattr(trace, "ranks", None) or [])
    if len(digests) < 2:
        return digests, ("one process: the rank checks compare the ranks of a distributed run (run the "
                         "script under torchrun, or tfdoctor run --nproc N)")
    return digests, None


def _all(n: int) -> str:
    return "both" if n == 2 else f"all {n}"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


# ------------------------------------------------------------------------------------------------
# rank-data


def _complete(iteration: dict) -> bool:
    """The iteration went through its whole epoch (or the loader took every index it has)."""
    return iteration["finished"] or (iteration["length"] is not None and iteration["consumed"] >= iteration["length"])


def _replay(earlier: dict, later: dict) -> bool:
    """`later` replays the order of `earlier`, a completed epoch, as far as both were recorded."""
    if not (earlier["shuffle"] and later["shuffle"] and _complete(earlier)):
        return False
    if earlier["finished"] and later["finished"]:
        return earlier["order"] == later["order"]
    m = min(len(earlier["head"]), len(later["head"]))
    if m == 0 or earlier["head"][:m] != later["head"][:m]:
        return False
    return earlier["epoch"] == later["epoch"] or m >= REPEAT_MIN_INDICES


def _replays(digest: dict) -> list[dict]:
    """Each sampler iteration of one rank that replays an earlier, completed epoch of the same sampler."""
    found = []
    for sampler in digest.get("samplers", []):
        iterations = sampler["iterations"]
        for j, later in enumerate(iterations):
            earlier = next((it for it in iterations[:j] if _replay(it, later)), None)
            if earlier is not None:
                found.append({"rank": digest["rank"], "sampler": sampler["class"], "epoch": later["epoch"],
                              "first_at_step": earlier["at_step"], "again_at_step": later["at_step"],
                              "where": later["where"], "set_epoch_calls": len(sampler["set_epoch"]),
                              "made_at": sampler["made_at"]})
    return found


# rank-data: the DTensor placements of a model sharded only along the data-parallel ranks (FSDP2's
# fully_shard on a 1-D mesh); any other (Shard(1), Replicate, a 2-D mesh) may be tensor parallel,
# whose ranks within one replica read the same batches by design.
DATA_PARALLEL_LAYOUTS = {"(Shard(dim=0),)"}


def _maybe_tensor_parallel(digests) -> bool:
    return any(set(o.get("layouts", [])) - DATA_PARALLEL_LAYOUTS for d in digests for o in d.get("params", []))


@check("rank-data", title="Each rank trains on its own batches, and each epoch in a new order")
def rank_data(subject, trace) -> Result:
    """Catches ranks that read the same data: a DataLoader with no DistributedSampler (every rank
    draws the same batches, so N ranks do the work of one at N times the cost), and a shuffling
    DistributedSampler that is never told the epoch (every epoch replays the first one's order).

    Compares a fingerprint of the token ids of every training forward across ranks, and, on each
    rank, the index order of each DistributedSampler iteration with the epochs it completed before.
    A sampler with shuffle=False, or a run that saw one epoch, is never judged for repeats.

    Fix: `DataLoader(dataset, sampler=DistributedSampler(dataset))` and `sampler.set_epoch(epoch)` at
    the start of every epoch.
    """
    digests, why = _digests(trace)
    if why:
        return Result.skipped(why)
    sequences = {d["rank"]: tuple(b["fingerprint"] for b in d["batches"]) for d in digests}
    empty = [rank for rank, seq in sequences.items() if not seq]
    if empty:
        return Result.skipped(f"no training forward with token ids was recorded on {_ranks(empty)}")
    groups: dict[tuple, list[int]] = {}
    for rank, seq in sequences.items():
        groups.setdefault(seq, []).append(rank)
    same = [ranks for ranks in groups.values() if len(ranks) > 1]
    seen_by = Counter(fp for seq in sequences.values() for fp in set(seq))
    loaders = {d["rank"]: d.get("loaders", []) for d in digests}
    details = {"ranks": len(digests), "batches_per_rank": {r: len(s) for r, s in sequences.items()},
               "shared_batches": {r: sum(seen_by[fp] > 1 for fp in set(s)) for r, s in sequences.items()},
               "loaders": loaders[digests[0]["rank"]]}
    if same:
        ranks = same[0]
        n = len(sequences[ranks[0]])
        who = f"{_all(len(digests))} ranks" if len(ranks) == len(digests) else _ranks(ranks)
        loader = next(iter(loaders[ranks[0]]), None)
        source = (f"; the DataLoader iterated at {loader['iterated_at']} draws from a {loader['sampler']}"
                  if loader and loader.get("sampler") else "")
        details["same_ranks"] = same
        if loader and loader.get("iterated_at"):
            details["location"], details["call"] = loader["iterated_at"], "the DataLoader"
        message = f"{who} trained on the same {n} batches, token for token{source}"
        hint = ("give the DataLoader a DistributedSampler, which hands each rank its own shard: "
                "DataLoader(dataset, sampler=DistributedSampler(dataset), batch_size=...) (and no shuffle=True "
                "on the loader), with sampler.set_epoch(epoch) before each epoch")
        if getattr(trace, "forward_collectives", None) and len(ranks) == len(digests):
            # measured: the model's forward communicates, so these are the tensor-parallel ranks of one replica
            details["forward_collectives"] = dict(trace.forward_collectives)
            return Result.passed(f"{message}, as the tensor-parallel ranks of one replica must: the model's forward "
                                 f"communicates ({', '.join(trace.forward_collectives)})", details)
        if _maybe_tensor_parallel(digests):  # tensor-parallel ranks of one data-parallel replica share batches
            return Result.warned(f"{message}: expected only for tensor-parallel ranks of one replica", hint, details)
        return Result.failed(f"{message}: {len(digests)} ranks do the work of one", hint, details)
    replays = [r for d in digests for r in _replays(d)]
    details["epochs_seen"] = {d["rank"]: sum(len(s["iterations"]) for s in d.get("samplers", [])) for d in digests}
    if replays:
        first = replays[0]
        ranks = sorted({r["rank"] for r in replays})
        cause = ("set_epoch() is never called" if not first["set_epoch_calls"]
                 else f"set_epoch() left its epoch at {first['epoch']}")
        details.update(replays=replays, location=first["where"], call="the DataLoader")
        return Result.warned(
            f"the {first['sampler']} replays the same order every epoch on {_ranks(ranks)}: the epoch that began "
            f"at step {first['again_at_step'] + 1} repeats the one from step {first['first_at_step'] + 1} index for "
            f"index, because {cause} and the shuffle is seeded with seed + epoch",
            "call sampler.set_epoch(epoch) at the start of every epoch, before iterating the DataLoader", details)
    epochs = max(details["epochs_seen"].values(), default=0)
    shuffled = any(i["shuffle"] for d in digests for sampler in d.get("samplers", []) for i in sampler["iterations"])
    orders = (f", and each of the {epochs} epochs seen in a new order" if epochs > 1
              else "; the epoch order was not judged: one epoch seen (give --steps enough to start a second)"
              if shuffled else "")
    return Result.passed(f"the {len(digests)} ranks trained on different batches "
                         f"({min(details['batches_per_rank'].values())} micro-batches each){orders}", details)


# ------------------------------------------------------------------------------------------------
# rank-sync


def _differs(a, b, numel: int) -> bool:
    """Two [sum, sum of squares] checksums of one tensor differ beyond float64 rounding."""
    (sa, qa), (sb, qb) = a, b
    scale = math.sqrt(max(qa, qb) * max(numel, 1))  # bounds |sum| (Cauchy-Schwarz)
    return abs(qa - qb) > SYNC_RTOL * max(qa, qb) or abs(sa - sb) > SYNC_RTOL * scale


def _drift(a, b) -> float:
    """How far apart two tensors' norms are, relative to the larger (a lower bound on their distance)."""
    na, nb = math.sqrt(max(a[1], 0.0)), math.sqrt(max(b[1], 0.0))
    return abs(na - nb) / max(na, nb) if max(na, nb) > 0 else 0.0


def _step_name(state: int) -> str:
    return "at the start (before the first optimizer step)" if state == 0 else f"after optimizer step {state}"


@check("rank-sync", title="Every rank holds the same weights at the start and after each step")
def rank_sync(subject, trace) -> Result:
    """Catches ranks whose weights differ: ranks that start from different initial weights (no DDP
    broadcast, a seed that depends on the rank) or drift apart after a step (a clip, a GradScaler or
    an optimizer step that not every rank makes, the last micro-batch under no_sync(), a parameter
    DDP does not all-reduce). Data-parallel ranks must stay identical; once apart, they train
    different models and the checkpoint saved from rank 0 is only one of them.

    Compares checksums of every optimizer parameter (float64 sum and sum of squares per tensor) before
    the first optimizer step and after each recorded step, across ranks. Parameters sharded by design
    (FSDP, DTensor) are not compared.

    Fix: wrap the model in DistributedDataParallel (it broadcasts rank 0's weights), and make every
    gradient-changing call (clip, scaler, step) on every rank.
    """
    digests, why = _digests(trace)
    if why:
        return Result.skipped(why)
    missing = [d["rank"] for d in digests if not d.get("params")]
    if missing:
        return Result.skipped(f"no optimizer step was recorded on {_ranks(missing)}")
    base = digests[0]
    compared, sharded, first = 0, set(), None
    # A forward that communicates (tensor parallelism) shards some tensors by hand: those that differ
    # from the start are its shards; the replicated ones must still start and stay equal.
    by_hand = bool(getattr(trace, "forward_collectives", None))
    shards: set = set()
    for o, held in enumerate(base["params"]):
        for other in digests[1:]:
            theirs = other["params"][o] if o < len(other["params"]) else None
            if theirs is None or len(theirs["names"]) != len(held["names"]):
                count = "no" if theirs is None else len(theirs["names"])
                return Result.failed(
                    f"the ranks train different parameters: rank {base['rank']}'s {held['class']} holds "
                    f"{len(held['names'])} tensors, rank {other['rank']}'s {count}",
                    "build the same model and optimizer on every rank", {"optimizer": held["class"]})
            count, state, apart = _compare_pair(held, theirs, by_hand, shards, sharded)
            compared += count if other is digests[1] else 0
            if apart and (first is None or state < first["state"]):
                first = {"state": state, "ranks": (base["rank"], other["rank"]), "apart": apart,
                         "tensors": len(held["names"]), "optimizer": held["class"], "last": _last_drift(held, theirs)}
    steps = min(len(o["states"]) for d in digests for o in d["params"]) - 1
    details = {"ranks": len(digests), "steps_compared": steps, "tensors_compared": compared,
               "sharded_tensors": len(sharded)}
    if not compared and sharded:
        return Result.skipped(f"every parameter is sharded ({len(sharded)} tensors, FSDP / DTensor): each rank "
                              "holds its own shard by design", details)
    if first is None:
        note = (f"; {len(sharded)} tensors not compared: the tensor-parallel shards, which differ from the start "
                "by design (the model's forward communicates)" if shards else
                f"; {len(sharded)} sharded tensors not compared" if sharded else "")
        return Result.passed(f"the weights are identical on {_all(len(digests))} ranks at the start and after each of "
                             f"{steps} optimizer steps ({compared} tensors compared){note}", details)
    if by_hand:  # a shard that started equal (a zero bias) cannot be told from a replicated weight drifting
        parted = sorted({name for name, _, _ in first["apart"]})
        details.update(parted_after_start=parted[:20], first_step=first["state"])
        return Result.passed(
            f"the replicated weights are identical on {_all(len(digests))} ranks at the start ({compared} tensors "
            f"compared; {len(shards)} tensor-parallel shards differ by design); {counted(len(parted), 'tensor')} that "
            f"started equal parted after step {first['state']} ({', '.join(parted[:4])}): zero-initialised shards, or "
            "replicated weights whose gradient is not summed over the ranks; the two are not told apart", details)
    apart = sorted(first["apart"], key=lambda item: -item[1])
    names = [name for name, _, _ in apart]
    drift = apart[0][1]
    details.update(first_step=first["state"], ranks_compared=list(first["ranks"]), differing=names[:20],
                   differing_tensors=len(names), max_relative_norm_drift=drift,
                   max_sum_difference=max(d for _, _, d in apart), drift_at_last_step=first["last"])
    shown = ", ".join(names[:NAMES_SHOWN]) + (", ..." if len(names) > NAMES_SHOWN else "")
    where = _step_name(first["state"])
    if first["state"] == 0:
        hint = ("start every rank from the same weights: wrap the model in DistributedDataParallel (it "
                "broadcasts rank 0's weights), or seed every rank the same before building it")
    else:
        hint = ("make every rank step with the same gradients: call clip_grad_norm_, the GradScaler and "
                "optimizer.step on every rank (not under `if rank == 0:`), keep the last micro-batch of a step "
                "out of no_sync(), and let DDP all-reduce every trained parameter")
        location = next((d["calls_at"].get("opt_step") for d in digests if d.get("calls_at", {}).get("opt_step")), None)
        if location:
            details["location"], details["call"] = location, "optimizer.step()"
    return Result.failed(
        f"the ranks' weights differ {where}: {len(names)} of {first['tensors']} parameter tensors ({shown}) differ "
        f"between rank {first['ranks'][0]} and rank {first['ranks'][1]}, norms up to {drift:.1e} apart (relative)"
        + (f", {first['last']:.1e} by step {steps}" if first["state"] < steps else ""), hint, details)


def _compare_pair(held: dict, theirs: dict, by_hand: bool, shards: set,
                  sharded: set) -> tuple[int, Optional[int], list]:
    """One optimizer's checksums on two ranks: (tensors compared at the start, the first state at which
    some differ or None, those as (name, drift, |sum difference|)). Sharded tensors go to `sharded`;
    under tensor parallelism by hand (`by_hand`), tensors that differ at the start are its shards."""
    compared = 0
    for s in range(min(len(held["states"]), len(theirs["states"]))):
        apart = []
        for i, name in enumerate(held["names"]):
            a, b = held["states"][s][i], theirs["states"][s][i]
            if held["sharded"][i] or theirs["sharded"][i] or name in shards or a is None or b is None:
                sharded.add(name)
                continue
            if by_hand and s == 0 and _differs(a, b, held["numel"][i]):
                shards.add(name)
                sharded.add(name)
                continue
            compared += s == 0
            if _differs(a, b, held["numel"][i]):
                apart.append((name, _drift(a, b), abs(a[0] - b[0])))
        if apart:
            return compared, s, apart
    return compared, None, []


def _last_drift(a: dict, b: dict) -> float:
    """The largest relative norm drift between two ranks' tensors at the last state both recorded."""
    s = min(len(a["states"]), len(b["states"])) - 1
    pairs = [(x, y) for x, y in zip(a["states"][s], b["states"][s]) if x is not None and y is not None]
    return max((_drift(x, y) for x, y in pairs), default=0.0)


# ------------------------------------------------------------------------------------------------
# ddp-accumulation


@check("ddp-accumulation", title="Under DDP, accumulated micro-batches before the last skip the all-reduce")
def ddp_accumulation(subject, trace) -> Result:
    """Catches gradient accumulation under DistributedDataParallel without `no_sync()`: DDP then
    all-reduces the gradients after every micro-batch, though only the sum at the step is used. The
    result is the same, but a step of k micro-batches pays k all-reduces instead of one (on a large
    model, most of the step's communication). Also notes the reverse: a step whose last micro-batch
    runs under no_sync() leaves its gradients un-reduced.

    Reads, at each forward of the DDP module, whether gradient sync was on, per optimizer step.

    Fix: `with model.no_sync():` around the forward and backward of every micro-batch but the last
    of each step.
    """
    digests, why = _digests(trace)
    if why:
        return Result.skipped(why)
    if not any(d.get("ddp") for d in digests):
        return Result.skipped("the model is not wrapped in DistributedDataParallel")
    worst = None
    accumulating = 0
    for d in digests:
        windows: dict[int, list[dict]] = {}
        for forward in d["ddp"]:
            if forward["window"] < d["steps"]:  # a step that was taken: its micro-batches are all there
                windows.setdefault(forward["window"], []).append(forward)
        for window, forwards in sorted(windows.items()):
            if len(forwards) < 2:
                continue
            accumulating += d["rank"] == digests[0]["rank"]
            wasted = sum(f["sync"] for f in forwards[:-1])
            unsynced = not forwards[-1]["sync"]
            if (wasted or unsynced) and worst is None:
                worst = {"rank": d["rank"], "step": window + 1, "micro_batches": len(forwards), "wasted": wasted,
                         "last_unsynced": unsynced, "per_step": [], "location": next(
                             (f["where"] for f in (forwards[:-1] if wasted else forwards[-1:]) if f["where"]), None)}
            if worst is not None and worst["rank"] == d["rank"]:
                worst["per_step"].append(sum(f["sync"] for f in forwards[:-1]))
    if not accumulating:
        return Result.skipped("no accumulation: every optimizer step takes one micro-batch per rank")
    if worst is None:
        return Result.passed(f"each of the {accumulating} accumulating steps all-reduces once: the micro-batches "
                             "before the last run under no_sync()", {"accumulating_steps": accumulating})
    details = {"accumulating_steps": accumulating, "rank": worst["rank"], "first_step": worst["step"],
               "micro_batches_per_step": worst["micro_batches"],
               "wasted_all_reduces_per_step": Counter(worst["per_step"]).most_common(1)[0][0]}
    if worst["location"]:
        details["location"], details["call"] = worst["location"], "the DDP model's forward"
    hint = ("wrap the forward and backward of every micro-batch but the last in `with model.no_sync():` "
            "(e.g. `ctx = model.no_sync() if not last else contextlib.nullcontext()`)")
    if worst["wasted"]:
        k, n = worst["micro_batches"], details["wasted_all_reduces_per_step"]
        after = f"each of the {k}" if n + 1 == k else f"{n + 1} of the {k}"
        return Result.warned(f"DDP all-reduces the gradients after {after} micro-batches of every optimizer "
                             f"step: {n} all-reduce{'s' if n != 1 else ''} per step wasted (the micro-batches "
                             "before the last are not under no_sync())", hint, details)
    return Result.warned(f"the last micro-batch of optimizer step {worst['step']} runs under no_sync(): its gradients "
                         "are never all-reduced, and each rank steps with its own",
                         "leave the step's last micro-batch out of no_sync(), so that DDP all-reduces the summed "
                         "gradients once", details)


# ------------------------------------------------------------------------------------------------
# rank-uniform


def _times(n: int) -> str:
    return {0: "never", 1: "once", 2: "twice"}.get(n, f"{n} times")


@check("rank-uniform", title="Every rank makes the same training calls in each step")
def rank_uniform(subject, trace) -> Result:
    """Catches training calls that only some ranks make: `if rank == 0: clip_grad_norm_(...)`, a
    GradScaler stepped on one rank, a rank that runs more micro-batches than the others. Ranks that
    disagree step with different gradients and drift apart (or hang in a collective only some join).

    Counts backward, clip_grad_norm_, scaler.unscale_ / step / update and optimizer.step per optimizer
    step on every rank and compares the counts.

    Fix: make those calls on every rank; keep rank-0-only code to logging and checkpoints.
    """
    digests, why = _digests(trace)
    if why:
        return Result.skipped(why)
    steps = {d["rank"]: d["steps"] for d in digests}
    details: dict = {"ranks": len(digests), "steps": steps}
    if len(set(steps.values())) > 1:
        return Result.failed("the ranks took different numbers of optimizer steps: "
                             + ", ".join(f"rank {r} {n}" for r, n in steps.items()),
                             "step the optimizer on every rank, the same number of times", details)
    shared = min(steps.values())
    for window in range(shared):
        for kind, name in UNIFORM_CALLS.items():
            counts = {d["rank"]: (d["windows"][window] if window < len(d["windows"]) else {}).get(kind, 0)
                      for d in digests}
            if len(set(counts.values())) == 1:
                continue
            most = max(counts, key=counts.get)
            caller = next(d for d in digests if d["rank"] == most)
            details.update(step=window + 1, counted=name, counts=counts)
            where = caller.get("calls_at", {}).get(kind)
            if where:
                details["location"], details["call"] = where, name
            listed = ", ".join(f"rank {r} {'called it ' if i == 0 else ''}{_times(n)}"
                               for i, (r, n) in enumerate(counts.items()))
            return Result.failed(f"{name} runs on some ranks only: in optimizer step {window + 1}, {listed}",
                                 f"call {name} on every rank, the same number of times per step (not under "
                                 "`if rank == 0:`); keep rank-0-only code to logging and checkpoints", details)
    if not shared:
        return Result.skipped("no optimizer step was recorded")
    per_step = {name: digests[0]["windows"][0].get(kind, 0) for kind, name in UNIFORM_CALLS.items()
                if digests[0]["windows"] and digests[0]["windows"][0].get(kind)}
    details["first_step_calls"] = per_step
    made = ", ".join(f"{n} {name}" for name, n in per_step.items())
    return Result.passed(f"{_all(len(digests))} ranks made the same calls in each of the {shared} steps ({made} in the "
                         "first)", details)


# ------------------------------------------------------------------------------------------------
# rank-equivalence


@check("rank-equivalence", title="A step over N ranks is the single-process step over all their batches")
def rank_equivalence(subject, trace) -> Result:
    """Catches a distributed step that differs from one single-process step over the union of the
    ranks' micro-batches, in the two ways public trainers got wrong (torchtitan #766 and #2206,
    transformers #37474 and #34242):

    - clipping each rank's own gradient: `clip_grad_norm_` called before the gradients are averaged
      (a hand-written all-reduce after the clip) clips every rank by its local norm, not by the global
      one, so the update is not the clipped mean gradient. A failure.
    - a mean of per-rank means: each rank averages its loss over its own tokens and DDP then averages
      the ranks, so when the ranks grade different numbers of tokens (padding, packing, variable
      lengths) a token on a rank with few weighs more than one on a rank with many. It biases, it does
      not break: a warning (a failure with --strict), as token-weighting within a rank.

    Reads, per optimizer step and rank, the gradient norm the first clip measured, and the weight each
    graded target received (from the gradient that reached the scores, whatever the loss). rank-sync
    compares the weights the step leaves on the ranks.

    Fix: clip after the all-reduce (under DDP, after the backward of the step's synced micro-batch; by
    hand, all-reduce the gradients first). Normalise by the global token count: count the graded
    targets, all_reduce the count, and divide the summed loss by it times the world size (DDP
    divides the summed gradients by the world size again).
    """
    digests, why = _digests(trace)
    if why:
        return Result.skipped(why)
    details: dict = {"ranks": len(digests)}
    clipped = _local_clip(digests, details)
    if clipped is not None:
        return clipped
    weighed = _rank_token_weights(digests, details)
    if weighed is not None:
        return weighed
    judged = [details[key] for key in ("clip_said", "tokens_said") if key in details]
    if judged:
        return Result.passed("; ".join(judged + [details[key] for key in ("clip_not_compared", "tokens_not_compared")
                                                 if key in details]), details)
    unjudged = [details[key] for key in ("clip_not_compared", "tokens_not_compared") if key in details]
    return Result.skipped("; ".join(unjudged) if unjudged else
                          "nothing to compare: no clip made on every rank and no scored targets recorded", details)


def _shared_windows(digests: list[dict], key: str, value) -> dict:
    """window -> {rank: value(entry)} for the windows every rank recorded under `key` (first entry)."""
    per_rank = []
    for d in digests:
        found: dict = {}
        for entry in d.get(key) or []:
            found.setdefault(entry["window"], value(entry))
        per_rank.append(found)
    shared = set(per_rank[0]).intersection(*per_rank[1:])
    return {w: {d["rank"]: found[w] for d, found in zip(digests, per_rank)} for w in sorted(shared)}


def _local_clip(digests: list[dict], details: dict) -> Result | None:
    if any(any(opt["sharded"]) for d in digests for opt in d.get("params", [])):
        details["clip_not_compared"] = "sharded parameters: each rank's clip measures its own shard"
        return None
    norms = _shared_windows(digests, "clips", lambda e: e["norm"])
    if not norms:
        details["clip_not_compared"] = "no clip_grad_norm_ made on every rank in the same step"
        return None
    for window, by_rank in norms.items():
        low, high = min(by_rank.values()), max(by_rank.values())
        if high - low > CLIP_NORM_RTOL * max(abs(high), 1e-12):
            where = next((d.get("calls_at", {}).get("clip") for d in digests
                          if d.get("calls_at", {}).get("clip")), None)
            details.update(step=window + 1, clip_norms=by_rank)
            if where:
                details["location"], details["call"] = where, "clip_grad_norm_"
            listed = ", ".join(f"rank {r} {n:.4g}" for r, n in by_rank.items())
            return Result.failed(
                f"clip_grad_norm_ measured a different gradient norm on each rank in optimizer step {window + 1} "
                f"({listed}): it clipped each rank's own gradient before they were averaged, so the step is "
                "not the single-process step clipped by the global norm",
                "clip after the all-reduce: under DDP, after the backward of the step's synced micro-batch; "
                "with a hand-written all-reduce, average the gradients first and clip the averaged ones", details)
    details["steps_clip_compared"] = len(norms)
    details["clip_said"] = f"every rank's clip measured the same gradient norm in {len(norms)} steps"
    return None


def _rank_token_weights(digests: list[dict], details: dict) -> Result | None:
    found = _shared_windows(digests, "tokens", lambda e: (e["graded"], e["weight"]))
    found = {w: by_rank for w, by_rank in found.items() if all(n > 0 for n, _ in by_rank.values())}
    if not found:
        return None

    def spread(values) -> float:
        return max(values) / min(values) if min(values) > 0 else math.inf

    def means(by_rank: dict) -> dict:
        return {r: total / n for r, (n, total) in by_rank.items()}

    counts_differ = [w for w, by_rank in found.items()
                     if spread([n for n, _ in by_rank.values()]) > 1 + RANK_WEIGHT_TOLERANCE]
    if not counts_differ:
        details["tokens_not_compared"] = ("the ranks graded the same number of targets in each step, so a mean "
                                          "over all tokens cannot be told from a mean of per-rank means")
        return None
    worst = max(counts_differ, key=lambda w: spread(list(means(found[w]).values())))
    weights = means(found[worst])
    counts = {r: n for r, (n, _) in found[worst].items()}
    ratio = spread(list(weights.values()))
    details.update(steps_token_compared=len(counts_differ), token_step=worst + 1, graded_per_rank=counts,
                   mean_weight_per_rank=weights, weight_ratio=ratio)
    if ratio <= 1 + RANK_WEIGHT_TOLERANCE:
        details["tokens_said"] = (f"a target weighs the same on every rank although the ranks graded "
                                  f"{min(counts.values())}..{max(counts.values())} targets per step")
        return None
    heavy, light = max(weights, key=weights.get), min(weights, key=weights.get)
    return Result.warned(
        f"in optimizer step {worst + 1}, a target on rank {heavy} ({counts[heavy]} graded) weighs {ratio:.2f}x one "
        f"on rank {light} ({counts[light]} graded): each rank averages its loss over its own tokens and the "
        "ranks are then averaged, which is not the mean over all the step's tokens",
        "normalise by the global token count: n = the graded targets of this step, torch.distributed."
        "all_reduce(n); loss = F.cross_entropy(..., reduction='sum') / n * world_size (DDP averages the "
        "ranks' gradients)", details)
