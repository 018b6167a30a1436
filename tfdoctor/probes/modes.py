"""Leave the user's model as it was found: train/eval flags per module, and process-wide state."""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import torch


@contextlib.contextmanager
def evaluation(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """model.eval() for the block, then every submodule's own flag back (they may differ)."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


@contextlib.contextmanager
def preserved_process_state() -> Iterator[None]:
    """Restore the RNG streams (Python, torch CPU and CUDA), thread count and grad mode."""
    python_state = random.getstate()
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    threads = torch.get_num_threads()
    grad_enabled = torch.is_grad_enabled()
    try:
        yield
    finally:
        random.setstate(python_state)
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_grad_enabled(grad_enabled)


def training_flags(model: torch.nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]
