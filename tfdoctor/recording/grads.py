"""What the recorder reads off tensors and autograd graphs: the global gradient norm, a few sampled
elements of every tensor (to see weights or gradients change), the integer tensors of a call (token
ids, targets), short walks back through the autograd graph, and the parameters an optimizer holds.
"""

from __future__ import annotations

import collections
import math

import torch

# How far back from a backward's root to look for the GradScaler's multiply (it is the root itself
# or a few nodes away: `scaler.scale(loss / k)`, `scaler.scale(loss) / k`), and from a scored
# tensor for one already watched (`logits.float().view(-1, V)` is two nodes from the logits).
SCALE_SEARCH_NODES = 64
# Manual updates: elements sampled per parameter tensor to see the weights change between backward
# calls (every tensor with a gradient moves, so a few per tensor are plenty).
SAMPLE_PER_TENSOR = 32


def grad_norm(params) -> tuple[float, bool]:
    """Global L2 norm of the gradients present, and whether all of them are finite."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return 0.0, True
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    total = float(torch.linalg.vector_norm(norms))
    if math.isfinite(total):  # a NaN or inf element makes the norm NaN or inf: no per-tensor scan needed
        return total, True
    # Not finite: either a non-finite element or finite ones whose squares overflow; tell them apart.
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    return total, finite


def int_tensors(args, kwargs) -> list[tuple[str, torch.Tensor]]:
    found = [(str(i), a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_floating_point()
             and a.dim() == 2]
    found += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()
              and v.dim() == 2]
    return [(k, v.detach()) for k, v in found]


def nodes_near(root, limit: int = SCALE_SEARCH_NODES) -> set[int]:
    """ids of the first `limit` autograd nodes met walking breadth-first back from `root`."""
    seen: set[int] = set()
    if root is None:
        return seen
    queue = collections.deque([root])
    while queue and len(seen) < limit:
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        queue.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return seen


def reaches(root, targets: list, limit: int = SCALE_SEARCH_NODES) -> bool:
    """Whether any of the autograd nodes `targets` lies within `limit` nodes of `root`."""
    wanted = {id(t) for t in targets if t is not None}
    if root is None or not wanted:
        return False
    queue, seen = collections.deque([root]), set()
    while queue and len(seen) < limit:
        node = queue.popleft()
        if node is None or id(node) in seen:
            continue
        if id(node) in wanted:
            return True
        seen.add(id(node))
        queue.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return False


def sample(tensors) -> torch.Tensor:
    """A few elements of every tensor, flattened: enough to see any of them change."""
    parts = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        parts.append(flat[::max(1, flat.numel() // SAMPLE_PER_TENSOR)][:SAMPLE_PER_TENSOR].float())
    return torch.cat(parts).cpu() if parts else torch.zeros(0)


def params_of(optimizer) -> list:
    return [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
