"""Evaluation sources: the evaluation losses a script computed between two optimizer steps, told apart
into the passes it ran, each averaged the way the script averages it and labelled held-out or
training-split. Pure data in, EvalPoints out (no torch): the monitor records the calls, this module
decides what they were.

A source is one evaluation pass, told apart by
- its call site: the frame that called the model that computed the loss (or that computed the loss,
  without a model), file:line;
- the DataLoader its batches came from: a pass over one DataLoader is one source (the Trainer's eval
  datasets, a val loader then a test loader); the DataLoader the loop trains on makes a training-split
  estimate, by construction;
- without a DataLoader (rows the script slices itself: nanoGPT's get_batch(split)), the rows'
  provenance: nanoGPT's estimate_loss computes `for split in ['train', 'val']` eval_iters losses at one
  line, from two tensors the monitor never sees (get_batch stacks fresh windows: no storage, no id
  links a batch to `train_data` or `val_data`). What does tell them apart is the order (every
  train-split call, then every val-split call) and how many of each call's rows the loop trained on:
  the train split's windows are windows the loop also draws, the val split's never are. So a run of
  calls at one site is cut at the most likely place for one change of the share of trained rows,
  when that change is far beyond chance (SPLIT_Z): the higher part is the training-split estimate,
  the lower the held-out evaluation. A script runs the same evaluation each time, so the cut is found
  on the counts of all its evaluations pooled call by call (and the first evaluation, before any
  training, is cut too: rows count as trained whenever the run trained on them). The share itself may
  be small: nanoGPT's shakespeare_char config draws 64 random windows of a ~1M-token stream an
  iteration, so by the run's end about 27% of the train split's windows repeat one it trained on
  (3% after 500 iterations), against none of the val split's; over eval_iters=200 batches of 64 rows
  that is thousands of rows against none. Measured on Karpathy's train.py over a 400k-token stand-in
  (bench/watch_overhead.py's corpus), 200 iterations, eval_iters=50: 3% of the train split's rows,
  0 of the val split's, both splits found exactly at all three evaluations, the val one equal to the
  printed val loss. A stream too long for the run to repeat any window (OpenWebText in a short run)
  leaves the two splits looking alike: they stay one source, their losses averaged, as before.

A lone pass whose rows were mostly trained on is not cut (nothing changes along it) and stays the
held-out evaluation: the script evaluates on rows it trained on, which eval-gap calls a leak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from tfdoctor.watching.series import HELD_OUT, TRAINING_SPLIT, UNKNOWN, EvalPoint

# A pass is cut where one change of the trained-row share is this many "z" more likely than none (the
# likelihood ratio of two binomial shares over one, at its best cut, reaches SPLIT_Z ** 2). Chance
# alone, measured on 10,000 shuffles: a 128-row validation set with 113 rows (88%) copied from training
# in 4 batches of 32 (fixtures/watch/val_copied.py) reaches 3.1 at the 99th percentile and 5.5 at most;
# with 13 rows (10%) copied, 2.8 and 4.4. nanoGPT's two splits: fixtures/watch/nanogpt_splits.py (20
# batches of 16 rows each, 90% of the train split's windows trained on) ~26 per evaluation; Karpathy's
# train.py on a 400k-token shakespeare_char stand-in (bench/watch_overhead.py's corpus; 200 iterations
# of batch 64, eval_iters=50, 3% of its train windows trained on) 12 per evaluation, 21 pooled over its
# three. A false cut of a leaked set leaves its lower part held out and still mostly trained on: the
# leak is found all the same.
SPLIT_Z = 6.0

WEIGHTINGS = ("calls", "rows", "tokens")


@dataclass(slots=True)  # a run of days keeps hundreds of thousands: ~100 bytes each with slots
class EvalCall:
    """One evaluation loss computation, as numbers."""

    loss: float  # the per-token mean of the call (nan when not finite)
    site: str  # "train.py:52"
    loader: Optional[int]  # the id of the DataLoader its batch came from; None: rows the script sliced
    rows: int = 0  # rows fed to the model for it, fingerprinted (0: not seen)
    tokens: int = 0  # target tokens counted, ignore_index left out (0: not counted)
    trained: int = 0  # of `rows`, rows the loop trained on (resolved against the trained rows)


def eval_points(evaluations: list[tuple[int, list[EvalCall]]], training_loaders: set,
                weighting: str = "calls") -> list[EvalPoint]:
    """The EvalPoints of a run's evaluations (each: the steps done, its calls): one per source and
    evaluation, in the order they ran. A script runs the same evaluation each time, so the loader-less
    passes of one site and length are cut at one place, found on their trained rows pooled call by call."""
    runs = [(step, _runs(calls)) for step, calls in evaluations]
    pooled: dict[tuple[str, int], list[list[int]]] = {}
    for _, parts in runs:
        for run in parts:
            if run[0].loader is None:
                counts = pooled.setdefault((run[0].site, len(run)), [[0, 0] for _ in run])
                for count, call in zip(counts, run):
                    count[0] += call.trained
                    count[1] = count[1] + call.rows if call.rows and count[1] >= 0 else -1  # -1: not fingerprinted
    cuts = {key: provenance_cut(counts) for key, counts in pooled.items()}
    points = []
    for step, parts in runs:
        passes_at: dict[str, int] = {}
        for run in parts:
            for part, from_training_split in _passes(run, training_loaders, cuts.get((run[0].site, len(run)))):
                site = part[0].site
                passes_at[site] = passes_at.get(site, 0) + 1
                rows = sum(c.rows for c in part)
                split = TRAINING_SPLIT if from_training_split else HELD_OUT if rows else UNKNOWN
                points.append(_point(step, part, f"{site}#{passes_at[site]}", split, weighting))
    return points


def _runs(calls: list[EvalCall]) -> list[list[EvalCall]]:
    """Consecutive calls at one site from one DataLoader (or from none)."""
    runs: list[list[EvalCall]] = []
    for call in calls:
        if runs and (runs[-1][-1].site, runs[-1][-1].loader) == (call.site, call.loader):
            runs[-1].append(call)
        else:
            runs.append([call])
    return runs


def _passes(run: list[EvalCall], training_loaders: set, cut: Optional[int]) -> list[tuple[list[EvalCall], bool]]:
    """A run as its passes, each with whether it is a training-split estimate."""
    if run[0].loader is not None:
        return [(run, run[0].loader in training_loaders)]
    if cut is None:
        return [(run, False)]
    before, after = run[:cut], run[cut:]
    higher = _share(before) > _share(after)
    return [(before, higher), (after, not higher)]


def provenance_cut(counts: list[list[int]]) -> Optional[int]:
    """Where the share of trained rows changes along a pass ([trained, rows] per call), as the most
    likely place for one change of a binomial share (the cut that maximises the likelihood of two
    shares over one), when the likelihood ratio reaches SPLIT_Z ** 2 (its z for one cut); else None.
    Likelihood, not the largest z: calls with no trained row at the end of a training split at a small
    share (3%: nanoGPT's bench run below) are as likely on the held-out side, where the z of the two
    shares puts them, which moved the cut 2 calls into the train split."""
    if len(counts) < 2 or any(rows <= 0 for _, rows in counts):
        return None
    total_trained, total_rows = sum(t for t, _ in counts), sum(n for _, n in counts)
    whole = _log_likelihood(total_trained, total_rows)
    best, best_ratio = None, SPLIT_Z ** 2
    trained = rows = 0
    for i, (t, n) in enumerate(counts[:-1], start=1):
        trained, rows = trained + t, rows + n
        ratio = 2 * (_log_likelihood(trained, rows) + _log_likelihood(total_trained - trained, total_rows - rows)
                     - whole)
        if ratio > best_ratio + 1e-9:  # the first of equally likely cuts
            best, best_ratio = i, ratio
    return best


def _log_likelihood(trained: int, rows: int) -> float:
    """Of `trained` successes in `rows` at their own share (0 log 0 = 0)."""
    share = trained / rows
    return sum(k * math.log(p) for k, p in ((trained, share), (rows - trained, 1 - share)) if k)


def _share(calls: list[EvalCall]) -> float:
    rows = sum(c.rows for c in calls)
    return sum(c.trained for c in calls) / rows if rows else 0.0


def _point(step: int, calls: list[EvalCall], source: str, split: str, weighting: str) -> EvalPoint:
    finite = [c for c in calls if math.isfinite(c.loss)]
    means = {"calls": _mean([(c.loss, 1) for c in finite]),
             "rows": _mean([(c.loss, c.rows) for c in finite]) if all(c.rows for c in finite) else math.nan,
             "tokens": _mean([(c.loss, c.tokens) for c in finite]) if all(c.tokens for c in finite) else math.nan}
    used = weighting if math.isfinite(means.get(weighting, math.nan)) else "calls"  # rows / tokens not seen
    return EvalPoint(step=step, loss=means[used], rows=sum(c.rows for c in calls),
                     trained_rows=sum(c.trained for c in calls), calls=len(calls), source=source, split=split,
                     weighting=used, tokens=sum(c.tokens for c in calls), row_weighted=means["rows"],
                     token_weighted=means["tokens"])


def _mean(weighted: list[tuple[float, int]]) -> float:
    total = sum(w for _, w in weighted)
    return sum(v * w for v, w in weighted) / total if total else math.nan
