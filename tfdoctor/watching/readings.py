"""What the watch monitor reads off the objects of the user's run (watching/monitor.py): a gradient
list's norm, a row's size, a scheduler's optimizer, a loss's token ids, a DataLoader's settings, the
process's CUDA memory, the device and dropout of the trained model, an evaluation's call site. Small
functions, each read the cheap way: the monitor runs at every step of a run of days."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch

from tfdoctor.usercode.torch_compat import (
    dataloader_iterator_setting,
    foreach_norms,
    index_sampler,
    scaler_scale_tensor,
)
from tfdoctor.watching.series import StepRow

# Frames of these packages are the machinery, not the script: torch's, and tfdoctor's own hooks.
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["tfdoctor"]))
_MODULE_CALL = os.path.join("torch", "nn", "modules", "module.py")


def eval_call_site() -> str:
    """Where an evaluation loss comes from, as "file.py:line": the frame that called the outermost module
    on the stack (the model: nanoGPT's `model(X, Y)` in estimate_loss, the Trainer's compute_loss), else
    the innermost frame outside torch and tfdoctor (a loss computed by the script itself). The whole
    stack is walked, once per evaluation call; training calls never pay for it."""
    frame, site = sys._getframe(1), None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(_MODULE_CALL):
            site = None  # the frames so far ran inside a module: the one above this call is the caller
        elif site is None and not name.startswith(_LIBRARY_DIRS):
            site = frame
        frame = frame.f_back
    if site is None:
        return "?"
    return sys.intern(f"{os.path.basename(site.f_code.co_filename)}:{site.f_lineno}")  # one string per site


def norm_of(grads: list) -> torch.Tensor:
    """The L2 norm of all `grads` together: one foreach pass, then the norm of the per-tensor norms."""
    per = foreach_norms(grads)
    try:
        return torch.linalg.vector_norm(torch.stack(per))
    except RuntimeError:  # mixed dtypes or devices (a model split across devices)
        return torch.linalg.vector_norm(torch.stack([n.float().to(per[0].device) for n in per]))


def deep_size(row: StepRow) -> int:
    """A StepRow's bytes with its lists and numbers (sys.getsizeof, one level down: measured within 5%
    of the RSS 100,000 rows take)."""
    import sys

    size = sys.getsizeof(row) + sys.getsizeof(row.__dict__)
    for value in row.__dict__.values():
        size += sys.getsizeof(value) + (sum(sys.getsizeof(v) for v in value) if isinstance(value, list) else 0)
    return size


def driven(scheduler) -> Any:
    """The torch optimizer a scheduler sets the rates of: the one inside an accelerate
    AcceleratedOptimizer (the Hugging Face Trainer's), whose steps the hooks see."""
    optimizer = getattr(scheduler, "optimizer", None)
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def count_params(optimizer) -> int:
    return sum(p.numel() for group in optimizer.param_groups for p in group["params"])


def number(value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.item()
    return float(value)


def scale_of(scaler) -> Any:
    """The scaler's current scale as a copy of its tensor, read later (float(get_scale()) would make a
    GPU run wait for its queue at every micro-batch)."""
    scale = scaler_scale_tensor(scaler)
    return scale.detach().clone().reshape(()) if isinstance(scale, torch.Tensor) else float(scaler.get_scale())


def token_ids(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The model's token ids: `input_ids=`, else the first integer tensor argument."""
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dtype != torch.bool \
                and value.dim() >= 1:
            return value
    return None


def loader_facts(loader) -> dict:
    """num_workers, pin_memory and batch_size of a DataLoader, or of its iterator when the iterator was
    made before the hooks (Lightning makes it before on_train_start): the iterator keeps them private."""
    def read(name: str, default=None):
        value = getattr(loader, name, None)
        return dataloader_iterator_setting(loader, name, default) if value is None else value

    sampler = index_sampler(loader)
    batch_size = read("batch_size")
    try:  # batches per epoch, for the planned length and a scheduler stepped per epoch
        length = len(loader)
    except TypeError:  # an IterableDataset without __len__
        length = None
    return {"num_workers": int(read("num_workers", 0) or 0), "pin_memory": bool(read("pin_memory", False)),
            "batch_size": batch_size if batch_size is not None else getattr(sampler, "batch_size", None),
            "name": type(loader).__name__, "batches_per_epoch": length}


def cuda_memory() -> tuple[Optional[int], Optional[int]]:
    if not torch.cuda.is_initialized():  # a flag: is_available() would ask the driver every step
        return None, None
    return int(torch.cuda.memory_allocated()), int(torch.cuda.memory_reserved())


def device_of(optimizer) -> str:
    if optimizer is None:
        return "cpu"
    for group in optimizer.param_groups:
        for p in group["params"]:
            return str(p.device)
    return "cpu"


def has_dropout(model) -> bool:
    if model is None:
        return False
    return any("Dropout" in type(m).__name__ and float(getattr(m, "p", 0) or 0) > 0 for m in model.modules())
