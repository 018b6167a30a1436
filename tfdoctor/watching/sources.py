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
  calls at one site is cut at the one place where the share of trained rows changes most, when that
  change is far beyond chance (SPLIT_Z): the higher part is the training-split estimate, the lower
  the held-out evaluation. The share itself may be small: nanoGPT on shakespeare_char (1M tokens)
  draws ~320k random windows over its 5000 iterations, so ~27% of the train split's windows repeat
  one it trained on by the run's end (3% after 500 iterations), against 0 of the val split's; over
  eval_iters=200 batches of 64 rows that is thousands of rows against none. A stream too long for
  the run to repeat any window (OpenWebText in a short run) leaves the two splits looking alike:
  they stay one source, their losses averaged, as before.

A lone pass whose rows were mostly trained on is not cut (nothing changes along it) and stays the
held-out evaluation: the script evaluates on rows it trained on, which eval-gap calls a leak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from tfdoctor.watching.series import HELD_OUT, TRAINING_SPLIT, UNKNOWN, EvalPoint

# A pass is cut where the trained-row share of the calls before and after differs by this many standard
# errors (two-proportion z, at the best of its cuts). Chance alone, measured: a 128-row validation set
# with 113 rows (88%) copied from training, shuffled into 4 batches of 32 (fixtures/watch/val_copied.py),
# reaches z 2.7 at the 99th percentile of 10,000 shuffles and 5.9 at most; nanoGPT's two splits
# (fixtures/watch/nanogpt_splits.py, 20 batches of 16 rows each) z 23, and nanoGPT's own config on
# shakespeare_char (200 batches of 64) about 13 after only 200 iterations. A false cut of a leaked set
# leaves its lower part held out and still mostly trained on: the leak is found all the same.
SPLIT_Z = 6.0

WEIGHTINGS = ("calls", "rows", "tokens")


@dataclass
class EvalCall:
    """One evaluation loss computation, as numbers."""

    loss: float  # the per-token mean of the call (nan when not finite)
    site: str  # "train.py:52"
    loader: Optional[int]  # the id of the DataLoader its batch came from; None: rows the script sliced
    rows: int = 0  # rows fed to the model for it, fingerprinted (0: not seen)
    tokens: int = 0  # target tokens counted, ignore_index left out (0: not counted)
    trained: int = 0  # of `rows`, rows the loop trained on (resolved against the trained rows)


def eval_points(step: int, calls: list[EvalCall], training_loaders: set, weighting: str = "calls") -> list[EvalPoint]:
    """The EvalPoints of one evaluation between two steps: one per source, in the order they ran."""
    points, passes_at = [], {}
    for part, from_training_split in _passes(calls, training_loaders):
        site = part[0].site
        passes_at[site] = passes_at.get(site, 0) + 1
        rows = sum(c.rows for c in part)
        split = TRAINING_SPLIT if from_training_split else HELD_OUT if rows else UNKNOWN
        points.append(_point(step, part, f"{site}#{passes_at[site]}", split, weighting))
    return points


def _passes(calls: list[EvalCall], training_loaders: set) -> list[tuple[list[EvalCall], bool]]:
    """The calls cut into passes, each with whether it is a training-split estimate: runs of calls at
    one site from one DataLoader (or from none), a loader-less run cut once more by provenance."""
    runs: list[list[EvalCall]] = []
    for call in calls:
        if runs and (runs[-1][-1].site, runs[-1][-1].loader) == (call.site, call.loader):
            runs[-1].append(call)
        else:
            runs.append([call])
    out = []
    for run in runs:
        if run[0].loader is not None:
            out.append((run, run[0].loader in training_loaders))
            continue
        cut = provenance_cut(run)
        if cut is None:
            out.append((run, False))
        else:
            before, after = run[:cut], run[cut:]
            higher = _share(before) > _share(after)
            out += [(before, higher), (after, not higher)]
    return out


def provenance_cut(calls: list[EvalCall]) -> Optional[int]:
    """Where the share of trained rows changes most along `calls` (the index the second part starts
    at), when that change is at least SPLIT_Z standard errors; else None."""
    if len(calls) < 2 or any(c.rows == 0 for c in calls):
        return None
    best, best_z = None, SPLIT_Z
    total_rows, total_trained = sum(c.rows for c in calls), sum(c.trained for c in calls)
    rows = trained = 0
    for i, call in enumerate(calls[:-1], start=1):
        rows, trained = rows + call.rows, trained + call.trained
        z = _two_proportion_z(trained, rows, total_trained - trained, total_rows - rows)
        if z >= best_z:
            best, best_z = i, z
    return best


def _two_proportion_z(t1: int, n1: int, t2: int, n2: int) -> float:
    pooled = (t1 + t2) / (n1 + n2)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return abs(t1 / n1 - t2 / n2) / spread if spread > 0 else 0.0


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
