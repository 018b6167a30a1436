"""What the gradient that reached the scores over the vocabulary says about each row: the class it
grades, its weight in the update and the model's loss on it, for any loss that backpropagates into
them (`read_scores`), and where a softmax-family call keeps its class dimension (`class_dim`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# Functions whose input is a row of scores over the classes, and where their class dimension is
# (an int, or the name of the argument that holds it). Their input is watched when the model's own
# output is not the logits (a model that returns only the loss, a loop that applies the output layer
# itself, as the Annotated Transformer's `generator` does).
SCORE_FUNCTIONS = {
    F.cross_entropy: 1, F.nll_loss: 1, F.kl_div: -1,
    F.log_softmax: "dim", torch.log_softmax: "dim", torch.Tensor.log_softmax: "dim",
    F.softmax: "dim", torch.softmax: "dim", torch.Tensor.softmax: "dim",
}
# read_scores. Any loss of log_softmax(z) (cross-entropy, label smoothing, KL to a smoothed target,
# a library's own cross-entropy) sends z a gradient that sums to zero over the classes: this share
# of its L1 norm is left for rounding and small extra terms (a 1e-4 z-loss adds about 1e-3).
SHIFT_TOLERANCE = 2e-2
# Below this relative spread of the softmax over the classes (a zero-initialised output layer) the
# weight cannot be told from a uniform smoothing term and is read as plain cross-entropy's.
P_SPREAD_MIN = 1e-3
# Classes whose residual from the fit is this many times the mean residual are left out of it (the
# pad column a smoothed target zeroes, an extra term on a few classes).
TRIM_FACTOR = 4.0
# A target distribution whose top class holds less than this share is soft (distillation, mixup):
# it has a weight but no single graded token. Label smoothing up to 0.5 stays hard.
HARD_TARGET_SHARE = 0.5
# read_scores works in float64 on this many elements at a time (8 MB per temporary).
READ_CHUNK_ELEMENTS = 1 << 20


def class_dim(func, tensor: torch.Tensor, args, kwargs) -> Optional[int]:
    """The class dimension of a SCORE_FUNCTIONS call's input, or None when it has none to speak of."""
    where = SCORE_FUNCTIONS[func]
    if isinstance(where, int):
        if tensor.dim() < 2:
            return None
        return where % tensor.dim()
    dim = kwargs.get(where, args[1] if len(args) > 1 else None)
    return dim % tensor.dim() if isinstance(dim, int) and tensor.dim() >= 1 else None


def read_scores(values: torch.Tensor, grad: torch.Tensor) -> dict:
    """What the gradient that reached scores [N, V] says about each row (see `_read_rows`), read a
    few rows at a time so that a 50k vocabulary needs tens of MB, not GB."""
    V = values.shape[-1]
    step = max(1, READ_CHUNK_ELEMENTS // max(1, V))
    parts = [_read_rows(values[i:i + step], grad[i:i + step]) for i in range(0, values.shape[0], step)]
    if len(parts) == 1:
        return parts[0]
    merged = {k: torch.cat([part[k] for part in parts]) for k in parts[0] if k != "log_probs"}
    merged["log_probs"] = all(part["log_probs"] for part in parts)
    return merged


def _read_rows(values: torch.Tensor, grad: torch.Tensor) -> dict:
    """What the gradient that reached scores [N, V] says about each row: the class it grades, its
    weight in the update and the model's loss on it, for any loss that backpropagates into them.

    At logits z, every loss of log_softmax(z) against a target distribution y with weight w sends
    g = w * (softmax(z) - y): the gradient sums to zero over the classes. y is mostly one class (the
    graded token) on top of a constant (label smoothing, 0 for plain cross-entropy), so over the other
    classes g is a straight line in p = softmax(z) whose slope is the weight w; then w * y = w * p - g
    and the graded class is its largest entry. At log-probabilities (a model or loss that applies
    log_softmax first, NLL or KL on top) the gradient is -w * y directly: no entry is positive.
    Rows with no gradient were not graded (ignore_index, a masked pad); rows that fit neither form
    (a loss on the logits that is not a softmax loss) are left unread.
    """
    z, g = values.double(), grad.double()
    N, V = g.shape
    rows = torch.arange(N)
    l1 = g.abs().sum(-1)
    reached = l1 > 0
    logit_rows = reached & (g.sum(-1).abs() <= SHIFT_TOLERANCE * l1)
    logprob_rows = reached & ~logit_rows & (g <= 1e-12 * l1[:, None]).all(-1)
    p = z.softmax(-1)
    # Least-squares line g_j = w * p_j + b over the classes other than the most negative, twice: the
    # second fit leaves out the classes the first one could not explain.
    keep = torch.ones_like(g, dtype=torch.bool)
    first = g.argmin(-1)
    keep[rows, first] = False
    for _ in range(2):
        n = keep.sum(-1).clamp_min(2)
        p_mean = (p * keep).sum(-1) / n
        g_mean = (g * keep).sum(-1) / n
        dp = (p - p_mean[:, None]) * keep
        var = (dp * dp).sum(-1)
        slope = (dp * (g - g_mean[:, None])).sum(-1) / var.clamp_min(1e-300)
        resid = (g - slope[:, None] * p - (g_mean - slope * p_mean)[:, None]).abs()
        limit = TRIM_FACTOR * (resid * keep).sum(-1) / n + 1e-9 * g.abs().amax(-1)
        keep &= resid <= limit[:, None]
    spread = (var / n).sqrt() / p_mean.clamp_min(1e-300)
    plain = -g[rows, first] / (1 - p[rows, first]).clamp_min(1e-12)  # the plain cross-entropy reading
    w = torch.where(spread >= P_SPREAD_MIN, slope, plain)
    mass = torch.where(logit_rows[:, None], w[:, None] * p - g, -g)  # w * y: the weighted target
    weight = torch.where(logit_rows | logprob_rows, mass.sum(-1), torch.zeros_like(l1))
    target = mass.argmax(-1)
    share = mass[rows, target] / weight.clamp_min(1e-300)
    readable = (logit_rows | logprob_rows) & (weight > 0)
    nll = torch.where(logit_rows, -z.log_softmax(-1)[rows, target], -z[rows, target])
    return {"targets": target, "weights": torch.where(readable, weight, torch.zeros_like(weight)).float(),
            "hard": readable & (share >= HARD_TARGET_SHARE), "readable": readable, "reached": reached,
            "nll": nll.float(), "log_probs": bool(logprob_rows.any() and not logit_rows.any()),
            "logit_rows": logit_rows, "logprob_rows": logprob_rows}
