"""Logits recovered from a model whose forward does not return them as [B, T, V].

Two shapes real scripts train:
- flattened: Lightning's Transformer demo (lightning.pytorch.demos.Transformer) ends its forward
  with `output.view(-1, vocab_size)`, log-probabilities [B*T, V] ready for `nll_loss(output,
  target.view(-1))`. The rows are the tokens in order, so when the recorded forward's first
  dimension is the token count of the ids it was given (the decoder's ids for an encoder-decoder),
  every later output is read back in the shape of that call's ids.
- held deeper: x-transformers' XTransformer returns its loss; the logits come out of a module two
  calls down (decoder -> net), which needs the encoder's output as its context, so it cannot be
  called alone. The whole model is called as the script called it, and the logits that module
  returns inside are taken, when they are [B, T, V] for the ids given.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from tfdoctor.subject import extract_logits


def flattened(shape: Optional[list[int]], ids: Optional[torch.Tensor]) -> bool:
    """Whether logits of `shape` are the tokens of `ids` [B, T] flattened to [B*T, V]."""
    return (shape is not None and ids is not None and len(shape) == 2 and ids.dim() == 2
            and ids.shape[0] > 1 and shape[0] == ids.numel())


def _called(forward: Optional[Callable], model, ids):
    return forward(model, *ids) if forward is not None else model(*ids)


def unflattening(forward: Optional[Callable]) -> Callable:
    """forward(model, *ids) whose [B*T, V] output comes back as [B, T, V] in the shape of the last
    ids given (the decoder's, for an encoder-decoder); `forward` None: the plain call model(*ids)."""

    def unflattened(model, *ids):
        output = _called(forward, model, ids)
        rows = ids[-1]
        if isinstance(output, torch.Tensor) and output.dim() == 2 and output.shape[0] == rows.numel():
            return output.view(*rows.shape, output.shape[-1])  # (B, T, V)
        return output

    return unflattened


def capturing(forward: Optional[Callable], path: str) -> Callable:
    """forward(model, *ids) that calls the whole model and returns the logits its submodule `path`
    returned inside that call (its last call, the one nearest the loss), as [B, T, V] for the ids;
    the model's own output when that submodule gave none of that shape."""

    def captured(model, *ids):
        inner = model.get_submodule(path)
        seen: list[torch.Tensor] = []

        def keep(module, args, output):
            try:
                logits = extract_logits(output)
            except Exception:  # noqa: BLE001 - an output with no logits in it: nothing to keep
                return
            if isinstance(logits, torch.Tensor):
                seen.append(logits)

        handle = inner.register_forward_hook(keep)
        try:
            output = _called(forward, model, ids)
        finally:
            handle.remove()
        rows = ids[-1]
        fits = [t for t in seen if t.dim() == 3 and tuple(t.shape[:2]) == tuple(rows.shape)]
        return fits[-1] if fits else output

    return captured
