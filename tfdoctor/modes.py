"""A model's train/eval flags for the length of a block, put back per module afterwards.

Below the Subject (which runs its preflight forward in eval mode) and needing no torch import, so
that `import tfdoctor` stays cheap; the probes' process-wide state lives in tfdoctor/probes/modes.py.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch


@contextlib.contextmanager
def evaluation(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """model.eval() for the block, then every submodule's own flag back (they may differ)."""
    with _mode(model, train=False):
        yield model


@contextlib.contextmanager
def training(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """model.train() for the block, then every submodule's own flag back."""
    with _mode(model, train=True):
        yield model


@contextlib.contextmanager
def _mode(model: torch.nn.Module, train: bool) -> Iterator[None]:
    flags = [(module, module.training) for module in model.modules()]
    if train:
        model.train()
    else:
        model.eval()  # not train(False): a model may override eval()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag
