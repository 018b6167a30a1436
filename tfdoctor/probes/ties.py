"""torch.topk with its ties broken by position, for a probe to tell a padding effect from a selection's
tie order.

A model that selects with top-k (DeepSeek sparse attention's indexer over ReLU'd scores, an MoE router)
meets ties: many scores exactly 0, say. torch.topk breaks them in an order that depends on the length of
the row it searches, so a row padded to a longer batch may select other keys than the same row alone,
and its output moves although nothing about the pads reached it. Measured on transformers' AXK2
sequence classifier (index_topk 16, 32 positions): 2 of 20 right-padded rows differ from the row alone
by up to 6.6e-3, and by at most 9e-8 once ties are broken by position."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from tfdoctor.usercode.patches import Patches


@contextlib.contextmanager
def ties_broken_by_position() -> Iterator[None]:
    """torch.topk (function and method) choosing, among equal values, the lowest index first: a stable
    sort's order, the same whatever the row's length."""
    original = torch.topk

    def stable_topk(values, k, dim=-1, largest=True, sorted=True, *, out=None):
        if out is not None or values.dim() == 0:
            return original(values, k, dim=dim, largest=largest, sorted=sorted, out=out)
        ordered, indices = torch.sort(values, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((ordered.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    with Patches() as patches:
        patches.setattr(torch, "topk", stable_topk)
        patches.setattr(torch.Tensor, "topk", stable_topk)
        yield
