"""Token weights from a fused LM head: a model whose output holds per-token log-probabilities of its
labels (`log_probs` [B, T], 0 where a label is ignored) and no logits, as TRL's `fused_lm_head`
patches a causal LM. No scores over the vocabulary ever exist, so which class a position was
graded on cannot be read; its weight can: any loss built on them, sum(-w_t * log_probs[t]),
sends -w_t to each graded position. That is what accumulation-scaling and token-weighting need.

Which positions are graded: the output's `label_mask` when it has one (TRL's does); else those whose
log-probability is not exactly 0 (an ignored label's). A graded token the model predicts with
probability 1 in float32 would be missed, which only a trained-to-saturation model reaches.
"""

from __future__ import annotations

from typing import Optional

import torch


def graded_mask(output, log_probs: torch.Tensor) -> torch.Tensor:
    mask = getattr(output, "label_mask", None)
    if isinstance(mask, torch.Tensor) and mask.shape == log_probs.shape:
        return mask.detach().bool()
    return log_probs.detach() != 0


def hook_log_probs(recorder, output, forward: int) -> Optional[str]:
    """Register a hook on `output.log_probs` that appends one entry per backward to
    `recorder.scores`, in the layout read_scores gives (weights and nll per graded position;
    no target class: `readable` and `hard` stay False, so the target checks skip as before).
    Returns the output's class name, or None when it holds no per-token log-probabilities."""
    log_probs = getattr(output, "log_probs", None)
    if not isinstance(log_probs, torch.Tensor) or not log_probs.requires_grad or not log_probs.is_floating_point():
        return None
    graded = graded_mask(output, log_probs).reshape(-1).cpu()
    values = log_probs.detach().reshape(-1).float().cpu()

    def hook(grad):
        if grad is None:  # DDP hands back outputs it did not use with no gradient
            return
        recorder.busy = True
        try:
            with torch.no_grad():
                weights = torch.where(graded, -grad.detach().reshape(-1).float().cpu(), torch.zeros(()))
                off = torch.zeros_like(graded)
                recorder.scores.append({
                    "targets": torch.zeros_like(values, dtype=torch.long), "weights": weights.clamp_min(0),
                    "hard": off, "readable": off, "reached": graded & (weights != 0), "nll": -values,
                    "log_probs": True, "forward": forward, "backward": recorder.current_backward,
                    "source": "log_probs", "rows_shape": list(log_probs.shape), "fused": True})
        finally:
            recorder.busy = False

    log_probs.register_hook(hook)
    return type(output).__name__
