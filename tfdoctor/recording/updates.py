"""Whether an optimizer step moved the weights it had gradients for (stale-update's measure).

A weight held in bfloat16 or float16 changes only when the update is at least half the spacing
between representable numbers around it (half an ulp, eps/2 of the weight's size: 3.9e-3 in
bfloat16). Smaller updates round back to the old value: the optimizer steps, the gradient is
non-zero, and nothing moves. `UpdateProbe` sees it directly: at the first few optimizer steps of the
loop it keeps a copy of (a strided sample of) every low-precision trained tensor before the step and
compares it after, counting the elements that had a non-zero gradient and the ones of those the step
left unchanged, with the rate, the typical weight and the typical gradient size. The judge
(checks/step.py stale-update) reads these numbers off the Trace.

float32 (and float64) weights are counted, not copied: their resolution (6e-8 relative) is far
below any update a training loop makes.
"""

from __future__ import annotations

import torch

# Optimizer steps watched (those with a positive rate: a warm-up that starts at lr 0 moves nothing in
# any precision). Three show a weight that never moves while costing one copy per step at the start.
WATCHED_STEPS = 3
# Elements compared per tensor: a strided sample of this many at most, so a large model costs a few
# MB per step (the share of unchanged elements is read as well from 65k elements as from all).
SAMPLE_MAX = 65_536
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _sampled(tensor: torch.Tensor, stride: int) -> torch.Tensor:
    return tensor.detach().reshape(-1)[::stride]


class UpdateProbe:
    """What the first WATCHED_STEPS optimizer steps did to the low-precision weights they hold; `steps`
    is plain data for the Trace (see `after`)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.pending: dict[int, list] = {}  # id(optimizer) -> [(param, lr, stride, weights before)]
        self.other: dict[int, list] = {}  # id(optimizer) -> [(param, lr)] kept in float32 or wider

    def watched(self) -> int:
        """Loop steps watched so far (optimizers stepped together, Muon and AdamW, make one step)."""
        return len({step["window"] for step in self.steps})

    def before(self, optimizer, trained: list[torch.Tensor], window: int) -> None:
        """Copy the sample of every low-precision tensor of `trained` the optimizer holds, before its step."""
        if self.watched() >= WATCHED_STEPS and all(step["window"] != window for step in self.steps):
            return
        trained_ids = {id(p) for p in trained}
        held, other = [], []
        with torch.no_grad():
            for group in optimizer.param_groups:
                lr = group.get("lr", 0.0)
                lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
                for p in group["params"]:
                    if id(p) not in trained_ids or not p.requires_grad or type(p.data) is not torch.Tensor or p.is_meta:
                        continue  # frozen, or a sharded (DTensor) / shape-only parameter: not compared
                    if p.dtype not in LOW_PRECISION:
                        other.append((p, lr))
                        continue
                    stride = max(1, -(-p.numel() // SAMPLE_MAX))
                    held.append((p, lr, stride, _sampled(p, stride).clone()))
        self.pending[id(optimizer)] = held
        self.other[id(optimizer)] = other

    def after(self, optimizer, names: dict[int, str], window: int) -> None:
        """Compare after the step: one entry in `steps` per step that had a positive rate and gradients."""
        held, other = self.pending.pop(id(optimizer), None), self.other.pop(id(optimizer), [])
        if held is None:
            return
        tensors = []
        with torch.no_grad():
            for p, lr, stride, before in held:
                if lr <= 0 or p.grad is None or type(p.grad) is not torch.Tensor:
                    continue
                grad = _sampled(p.grad, stride)
                graded = (grad != 0) & torch.isfinite(grad)
                count = int(graded.sum())
                if count == 0:  # no gradient reached it at this step: frozen in effect, not stale
                    continue
                unchanged = int(((_sampled(p, stride) == before) & graded).sum())
                tensors.append({"name": names.get(id(p), "?"), "dtype": str(p.dtype).replace("torch.", ""),
                                "numel": p.numel(), "graded": count, "unchanged": unchanged, "lr": lr,
                                "weight": float(before[graded].float().abs().median()),
                                "grad": float(grad[graded].float().abs().median())})
        wide = sorted({str(p.dtype).replace("torch.", "") for p, lr in other
                       if lr > 0 and p.grad is not None and type(p.grad) is torch.Tensor})
        if tensors or wide:
            self.steps.append({"window": window, "optimizer": type(optimizer).__name__, "tensors": tensors,
                               "wide_tensors": sum(1 for p, lr in other if lr > 0 and p.grad is not None),
                               "wide_dtypes": wide})
