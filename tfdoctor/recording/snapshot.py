"""The copy of the script's model that the model checks judge (`snapshot_model`: the model as it was
when the script first called it; a model sharded with FSDP2 is gathered whole first, see
unshard.py), why there is none (`why_uncopied`), and the stand-in used then (`TraceOnly`).
"""

from __future__ import annotations

import torch

from tfdoctor.errors import first_line
from tfdoctor.probes.isolation import isolated_copy
from tfdoctor.recording.unshard import TooLarge, sharded_bytes, unsharded_copy
from tfdoctor.recording.wrappers import is_shard
from tfdoctor.usercode.torch_compat import fsdp2_module_class


class TraceOnly(torch.nn.Module):
    """Stands in for a model that could not be copied (FSDP-sharded: it runs only with every rank):
    the loop and rank checks judge the recorded trace and never need the model's outputs, and no
    model check runs on it. Uniform scores over the vocabulary, of the shape the script's model gave."""

    def __init__(self, vocab: int, like: torch.nn.Module):
        super().__init__()
        self.vocab = vocab
        self.like = type(like).__name__
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, ids, *args, **kwargs):
        return self.anchor + torch.zeros(*ids.shape, self.vocab)  # (B, T, V)


def snapshot_model(model: torch.nn.Module) -> torch.nn.Module:
    """The copy the model checks judge: the model as it was when the script first called it. A model
    sharded with FSDP2 is gathered whole first (on every rank, the same call: see unshard.py)."""
    if _sharded(model):
        fsdp_module = fsdp2_module_class()
        if fsdp_module is None or not any(isinstance(m, fsdp_module) for m in model.modules()):  # FSDP1, TP
            raise _Sharded()
        try:
            model = unsharded_copy(model)
        except TooLarge:
            raise _Sharded(f"{sharded_bytes(model) / 2 ** 30:.1f} GiB whole, more than tfdoctor gathers on "
                           "one rank for the model checks") from None
    copy = isolated_copy(model)[0]
    for p in copy.parameters():
        p.grad = None
    return copy


class _Sharded(Exception):
    pass


def _sharded(model: torch.nn.Module) -> bool:
    """FSDP (fully_shard's DTensor parameters, FSDP1's flat parameters): each rank holds a shard, and
    the model runs only with every rank taking part in its all-gathers."""
    return any(is_shard(p) for p in model.parameters())


def why_uncopied(model: torch.nn.Module, error: Exception) -> str:
    """The skip reason of the model checks when the model could not be copied."""
    if isinstance(error, _Sharded):
        size = f" and {error.args[0]}" if error.args else ""
        return (f"the model is sharded across the ranks (FSDP){size}: its forward needs every rank, so the "
                "model checks cannot run it on rank 0 alone; run `tfdoctor check` on the model's factory for them")
    return f"the model could not be copied to judge it apart from the script ({first_line(error)})"
