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


def _numpy_random():
    """numpy's global RandomState when numpy is already imported (tfdoctor never imports it)."""
    import sys

    numpy = sys.modules.get("numpy")
    return getattr(numpy, "random", None) if numpy is not None else None


# Process-wide switches a user's factory or loop (or a check) may flip, with how to read and set each.
# A check that leaves one changed would change every later check and the user's own process.
_SWITCHES = (
    ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("deterministic algorithms", lambda: (torch.are_deterministic_algorithms_enabled(),
                                          torch.is_deterministic_algorithms_warn_only_enabled()),
     lambda state: torch.use_deterministic_algorithms(state[0], warn_only=state[1])),
    ("anomaly mode", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
     lambda state: torch.set_anomaly_enabled(state[0], state[1])),
    ("mkldnn", lambda: torch.backends.mkldnn.enabled, lambda v: setattr(torch.backends.mkldnn, "enabled", v)),
    ("cudnn", lambda: (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                       torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32),
     lambda v: [setattr(torch.backends.cudnn, name, value)
                for name, value in zip(("enabled", "benchmark", "deterministic", "allow_tf32"), v)]),
    # The legacy tf32 flag before the precision: torch refuses to read the precision while the two
    # APIs disagree, and setting the precision last makes them agree again.
    ("cuda matmul tf32", lambda: torch.backends.cuda.matmul.allow_tf32,
     lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    ("matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
)
_UNREADABLE = object()


def _read(getter):
    try:
        return getter()
    except RuntimeError:  # e.g. the matmul precision while the user has mixed its two APIs: left alone
        return _UNREADABLE


@contextlib.contextmanager
def preserved_process_state() -> Iterator[None]:
    """Restore the RNG streams (Python, numpy, torch CPU and CUDA), thread count, grad mode, and the
    process-wide switches in _SWITCHES (default dtype, deterministic mode, anomaly mode, matmul
    precision, mkldnn/cudnn/tf32 flags)."""
    python_state = random.getstate()
    numpy_random = _numpy_random()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    threads = torch.get_num_threads()
    grad_enabled = torch.is_grad_enabled()
    switches = [(getter, setter, _read(getter)) for _, getter, setter in _SWITCHES]
    try:
        yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy_random.set_state(numpy_state)
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_grad_enabled(grad_enabled)
        for getter, setter, value in switches:
            # Set only what changed: use_deterministic_algorithms imports torch._dynamo (seconds).
            if value is not _UNREADABLE and _read(getter) != value:
                setter(value)


def training_flags(model: torch.nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]
