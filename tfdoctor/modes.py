"""A model's train/eval flags for the length of a block, put back per module afterwards.

Below the Subject (which runs its preflight forward in eval mode) and needing no torch import, so
that `import tfdoctor` stays cheap; the probes' process-wide state lives in tfdoctor/probes/process_state.py.
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


def outermost_mode_calls(original, hear):
    """A stand-in for `nn.Module.train` that calls `hear(module, mode)` for the outermost call only
    (`model.eval()` calls train(False), which calls it again on every child), then `original`. The
    recorder (recording/patched_calls.py) and the watch monitor (watching/hooks.py) both patch with it."""
    depth = [0]

    def train(module, mode=True):
        if depth[0] == 0:
            hear(module, mode)
        depth[0] += 1
        try:
            return original(module, mode)
        finally:
            depth[0] -= 1

    train.__wrapped__ = original
    return train
