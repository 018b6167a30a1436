"""The one door to torch's private names: every private torch module, function, attribute and aten op
name tfdoctor relies on, and every probe of what the installed torch has, each behind one small
function or constant here. Nothing else in tfdoctor names a private torch name (tests/test_torch_compat.py
holds the package to that with the layout tool's pattern).

Each entry says which torch versions it was verified on and what happens when the name is missing:
a fallback, or `MissingTorchFeature` (an ImportError with the version that has it) raised only when
the feature is used, never an AttributeError at import. "Ran on 2.13" means tests/test_torch_compat.py
exercises it on the installed torch (2.13 when this was written); "since X (pytorch#N)" means the
pull request that added the name, found in torch's history, merged before release X was cut; nothing
was run on an older torch (no older wheel is reachable here).

The floor in pyproject.toml is torch>=2.4, not 2.1: tfdoctor calls, unguarded and in every command,
public names that 2.1 lacks: torch.amp.is_autocast_available (pytorch#124938, Apr 2024),
torch.get_autocast_dtype(device) and torch.is_autocast_enabled(device) (pytorch#124359, Apr 2024),
all three first in 2.4, and torch.amp.GradScaler (2.3; not re-read). Between 2.4 and 2.13 the names
below that moved have a fallback each.

Left outside on purpose: nn.Module's `_parameters` / `_buffers` / `_modules` dicts and Tensor's
`_version` counter, read where a module is copied or a batch fingerprinted. They are the storage
nn.Module and autograd have had since torch 0.4 and that torch's own public helpers
(torch.func.functional_call, state_dict) read; wrapping them would hide plain attribute access.
The aten op names that only recognise ops in a dispatch mode (memory/counter.py's autocast lists,
memory/fsdp_measured.py's collectives) stay beside their lists, except the attention ones, which are also called.

Lazy: importing this module does not import torch (the CLI's --help and the analytic `memory` command
must stay torch-free, whatever imports this); each function imports what it reads when called.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable, Iterator, Optional

# The oldest torch tfdoctor supports; pyproject.toml says the same (see the module docstring).
TORCH_FLOOR = (2, 4)


class MissingTorchFeature(ImportError):
    """A torch feature tfdoctor needs is absent from the installed torch."""

    def __init__(self, feature: str, since: str) -> None:
        super().__init__(f"{feature} needs torch {since} or newer; this is torch {torch_version_text()}. "
                         f"Upgrade torch (pip install -U torch).")
        self.feature, self.since = feature, since


def torch_version_text() -> str:
    import torch

    return str(torch.__version__)


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch, from "2.13.0+cpu", "2.6.0a0+git..." and the like."""
    head = torch_version_text().split("+")[0].split(".")
    try:
        return int(head[0]), int("".join(c for c in head[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


# -- dispatch and function modes -------------------------------------------------------------------

def dispatch_mode_base() -> type:
    """torch.utils._python_dispatch.TorchDispatchMode, the base of the memory counters.
    Since 2.0; ran on 2.13. Missing: MissingTorchFeature (the traced memory mode cannot work without it)."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as exc:
        raise MissingTorchFeature("tracing a step op by op (TorchDispatchMode)", "2.0") from exc
    return TorchDispatchMode


def outside_function_mode(mode: Any):
    """A context in which `mode`, when it is the innermost torch function mode, is off: the recorder's
    own tensor work then skips its __torch_function__ (~2 us a call). torch.overrides'
    _get_current_function_mode and _pop_mode_temporarily: since 2.0; ran on 2.13. Missing: the mode
    stays on (slower, same results)."""
    import torch.overrides as overrides

    current = getattr(overrides, "_get_current_function_mode", None)
    pop = getattr(overrides, "_pop_mode_temporarily", None)
    if current is not None and pop is not None and current() is mode:
        return pop()
    return contextlib.nullcontext()


def is_compiling_function() -> Callable[[], bool]:
    """torch.compiler.is_compiling (public since 2.3; ran on 2.13), resolved once for hot paths.
    Missing: a function that answers False (the hooks then also run inside compiled regions)."""
    import torch

    found = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return found if callable(found) else (lambda: False)


# -- pytrees ---------------------------------------------------------------------------------------

def tree_flatten(tree: Any) -> tuple[list, Any]:
    """torch.utils._pytree.tree_flatten: (leaves, spec). Since 1.x; ran on 2.13."""
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: Any) -> Any:
    """torch.utils._pytree.tree_unflatten. Since 1.x; ran on 2.13."""
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)


def tree_leaves(tree: Any) -> list:
    """torch.utils._pytree.tree_leaves (in 2.2 at the latest: pytorch#120155 of Feb 2024 builds on it);
    ran on 2.13. Missing: the leaves of tree_flatten."""
    from torch.utils import _pytree

    leaves = getattr(_pytree, "tree_leaves", None)
    return leaves(tree) if leaves is not None else _pytree.tree_flatten(tree)[0]


# -- autograd graph --------------------------------------------------------------------------------

def current_autograd_node() -> Optional[Any]:
    """The autograd node backward is running now, or None: torch._C._current_autograd_node, since 2.0
    (pytorch#90867, Dec 2022); ran on 2.13. Missing: None, so backward's allocations go unnamed
    (blamed on no module) rather than wrong."""
    import torch

    reader = getattr(torch._C, "_current_autograd_node", None)
    return reader() if reader is not None else None


def autograd_node_number(node: Any) -> int:
    """An autograd node's sequence number (Node._sequence_nr(): the order forward made the nodes).
    Ran on 2.13; older releases not checked. Missing: MissingTorchFeature."""
    number = getattr(node, "_sequence_nr", None)
    if number is None:
        raise MissingTorchFeature("autograd node sequence numbers (Node._sequence_nr)", "2.13")
    return number()


def tensor_storage_id(tensor: Any) -> int:
    """storage_id of the storage under `tensor`."""
    return tensor.untyped_storage()._cdata


def storage_id(storage: Any) -> int:
    """A key that names one storage while it lives (UntypedStorage._cdata, the C++ object's address;
    the same for every view of it). Tensor.untyped_storage is 2.0's; ran on 2.13."""
    return storage._cdata


# -- fake tensors ----------------------------------------------------------------------------------

# The logger the fake-tensor dispatcher writes a failing op's traceback to.
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


def fake_tensor_mode(allow_non_fake_inputs: bool = True) -> Any:
    """A new torch._subclasses.fake_tensor.FakeTensorMode. Since 2.0 (allow_non_fake_inputs too); ran
    on 2.13. Missing: MissingTorchFeature (the traced memory mode and seq-limit need it)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as exc:
        raise MissingTorchFeature("fake tensors (FakeTensorMode)", "2.0") from exc
    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def is_fake_tensor(tensor: Any) -> bool:
    """Whether `tensor` is a FakeTensor (whose .fake_mode is the mode that made it). Since 2.0; ran on
    2.13. Missing: False."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return False
    return isinstance(tensor, FakeTensor)


@contextlib.contextmanager
def fake_tensor_errors_quiet() -> Iterator[None]:
    """The fake-tensor dispatcher logs every failing op with its traceback; where a failure is the
    answer asked for, that logger is quiet (and as it was after). A logger that no longer exists is
    a new, silent one: nothing to undo."""
    noisy = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = noisy.level
    noisy.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        noisy.setLevel(level)


# -- foreach kernels -------------------------------------------------------------------------------

def foreach_norms(tensors: list) -> list:
    """The L2 norm of each tensor in one pass (torch._foreach_norm: since 1.10; ran on 2.13).
    Missing: one vector_norm per tensor."""
    import torch

    norms = getattr(torch, "_foreach_norm", None)
    if norms is not None:
        return list(norms(tensors))
    return [torch.linalg.vector_norm(t) for t in tensors]


def adam_update(params: list, grads: list, means: list, squares: list, lr: float, betas: tuple[float, float],
                eps: float, step: int) -> None:
    """One Adam update (no weight decay) of `params` in place, with bias correction at `step` (1-based):
    the arithmetic of torch.optim.Adam's single-tensor path. With torch's foreach kernels
    (_foreach_lerp_, _mul_, _addcmul_, _sqrt, _div_, _add_, _addcdiv_: all in 2.0, what torch.optim's
    own foreach Adam calls; ran on 2.13) in seven launches; without them, the same per tensor."""
    import torch

    beta1, beta2 = betas
    correction = math.sqrt(1 - beta2 ** step)
    step_size = -lr / (1 - beta1 ** step)
    if all(hasattr(torch, "_foreach_" + op) for op in ("lerp_", "mul_", "addcmul_", "sqrt", "div_", "add_",
                                                        "addcdiv_")):
        torch._foreach_lerp_(means, grads, 1 - beta1)
        torch._foreach_mul_(squares, beta2)
        torch._foreach_addcmul_(squares, grads, grads, 1 - beta2)
        denominators = torch._foreach_sqrt(squares)
        torch._foreach_div_(denominators, correction)
        torch._foreach_add_(denominators, eps)
        torch._foreach_addcdiv_(params, means, denominators, step_size)
        return
    adam_update_per_tensor(params, grads, means, squares, lr, betas, eps, step)


def adam_update_per_tensor(params: list, grads: list, means: list, squares: list, lr: float,
                           betas: tuple[float, float], eps: float, step: int) -> None:
    """adam_update without foreach kernels (public ops only); the tests hold the two to each other."""
    beta1, beta2 = betas
    correction = math.sqrt(1 - beta2 ** step)
    step_size = -lr / (1 - beta1 ** step)
    for p, g, m, s in zip(params, grads, means, squares):
        m.lerp_(g, 1 - beta1)
        s.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        p.addcdiv_(m, (s.sqrt() / correction).add_(eps), value=step_size)


# -- data loading, mixed precision, torch.compile --------------------------------------------------

def dataloader_iterator_base() -> Optional[type]:
    """torch.utils.data.dataloader._BaseDataLoaderIter, whose __next__ every DataLoader iterator
    (single- and multi-process) inherits. Since 1.x; ran on 2.13. Missing: None (the batch wait is not
    timed)."""
    from torch.utils.data import dataloader

    found = getattr(dataloader, "_BaseDataLoaderIter", None)
    return found if isinstance(found, type) else None


def dataloader_iterator_setting(iterator: Any, name: str, default: Any = None) -> Any:
    """A DataLoader setting (num_workers, pin_memory, batch_size...) as a DataLoader iterator keeps it:
    `_<name>` on _BaseDataLoaderIter (since 1.x; ran on 2.13). Missing: `default`."""
    return getattr(iterator, "_" + name, default)


def index_sampler(loader: Any) -> Optional[Any]:
    """The sampler a DataLoader (or its iterator) draws indices or batches of indices from: its
    `_index_sampler` (since 1.x; ran on 2.13). Missing: None."""
    return getattr(loader, "_index_sampler", None)


def scaler_enabled(scaler: Any) -> bool:
    """Whether a GradScaler scales (its _enabled: False when disabled by the user, or by itself for
    CUDA on a machine without CUDA). Since 1.6; ran on 2.13. Missing: False."""
    return bool(getattr(scaler, "_enabled", False))


def scaler_device(scaler: Any) -> str:
    """The device type a GradScaler was made for (torch.amp.GradScaler's _device, since 2.3; ran on
    2.13). Missing: "cuda", the only device torch.cuda.amp.GradScaler knew."""
    return str(getattr(scaler, "_device", "cuda"))


def scaler_init_scale(scaler: Any) -> float:
    """The scale a GradScaler started from (_init_scale; ran on 2.13). Missing: torch's default, 2 ** 16."""
    return float(getattr(scaler, "_init_scale", 2.0 ** 16) or 2.0 ** 16)


def scaler_scale_tensor(scaler: Any) -> Optional[Any]:
    """The tensor holding a GradScaler's current scale (_scale, None before the first scale(); ran on
    2.13): copying it does not wait for the GPU as get_scale() does. Missing: None."""
    return getattr(scaler, "_scale", None)


def autocast_enabled(region: Any) -> bool:
    """Whether a torch.autocast region casts (its _enabled: False when disabled or when the device has
    no autocast). Since 1.10; ran on 2.13. Missing: False."""
    return bool(getattr(region, "_enabled", False))


def scheduler_is_initial(scheduler: Any) -> bool:
    """Whether an LRScheduler's step() is the one its own __init__ makes (_is_initial, set around that
    call; ran on 2.13). Missing: False (that first step then counts as the loop's)."""
    return bool(getattr(scheduler, "_is_initial", False))


def chained_schedulers(scheduler: Any) -> tuple:
    """The schedulers a SequentialLR or ChainedScheduler steps (their _schedulers; ran on 2.13), or ()."""
    return tuple(getattr(scheduler, "_schedulers", None) or ())


def compiled_inner(module: Any) -> Optional[Any]:
    """The module torch.compile wrapped (OptimizedModule._orig_mod, since 2.0; ran on 2.13), or None."""
    return getattr(module, "_orig_mod", None)


# -- scaled dot-product attention kernels ----------------------------------------------------------
# The aten ops F.scaled_dot_product_attention dispatches to (each with a "<name>_backward"). Names only:
# an op missing from the installed torch is never seen in dispatch, so it never matches.
SDPA_OP_PREFIX = "_scaled_dot_product"
# Each schema was read on 2.13 (torch.ops.aten.<name>.default._schema); the CPU one is also run there.
SDPA_FLASH = "_scaled_dot_product_flash_attention"  # CUDA flash attention
SDPA_EFFICIENT = "_scaled_dot_product_efficient_attention"  # CUDA memory-efficient attention
SDPA_FLASH_CPU = "_scaled_dot_product_flash_attention_for_cpu"  # the CPU's fused kernel
SDPA_CUDNN = "_scaled_dot_product_cudnn_attention"  # cuDNN (H100-class GPUs)
SDPA_OVERRIDEABLE = "_scaled_dot_product_fused_attention_overrideable"  # other devices' fused kernels
SDPA_FUSED = (SDPA_FLASH_CPU, SDPA_FLASH, SDPA_EFFICIENT, SDPA_CUDNN, SDPA_OVERRIDEABLE)
SDPA_MATH = "_scaled_dot_product_attention_math"  # the math path, called directly by sdpa_math


def sdpa_flash(q, k, v, dropout: float, causal: bool, scale: float):
    """The output of aten._scaled_dot_product_flash_attention (head size padded by the caller).
    Schema (q, k, v, dropout_p, is_causal, return_debug_mask, *, scale) read on 2.13; ran there on
    fake CPU tensors (its meta function)."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)[0]


def sdpa_efficient(q, k, v, bias, logsumexp: bool, dropout: float, causal: bool, scale: Optional[float]):
    """The output of aten._scaled_dot_product_efficient_attention. Schema (q, k, v, attn_bias,
    compute_log_sumexp, dropout_p, is_causal, *, scale) read on 2.13 and run there on fake CPU
    tensors; older releases not checked."""
    import torch

    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, logsumexp, dropout, causal,
                                                                  scale=scale)[0]


def sdpa_math(q, k, v, mask, dropout: float, causal: bool, scale: Optional[float], enable_gqa: bool):
    """The output of aten._scaled_dot_product_attention_math (q, k, v, attn_mask, dropout_p, is_causal,
    dropout_mask, *, scale, enable_gqa); ran on 2.13. enable_gqa came in 2.5 (pytorch#132689): it is
    passed only when asked for, and on 2.4 grouped heads are repeated here (not run: no 2.4 here)."""
    import torch

    aten = torch.ops.aten
    if enable_gqa and torch_version() >= (2, 5):
        return aten._scaled_dot_product_attention_math(q, k, v, mask, dropout, causal, None, scale=scale,
                                                       enable_gqa=True)[0]
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = (t.repeat_interleave(groups, dim=-3) for t in (k, v))
    return aten._scaled_dot_product_attention_math(q, k, v, mask, dropout, causal, None, scale=scale)[0]


# -- FSDP2 and DTensor -----------------------------------------------------------------------------

def dtensor_class() -> Optional[type]:
    """DTensor: torch.distributed.tensor (public since 2.5, pytorch#133881), else
    torch.distributed._tensor (2.4). Ran on 2.13. Missing (no distributed build): None."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def local_tensor(tensor: Any) -> Any:
    """This rank's shard of a DTensor (DTensor._local_tensor, the tensor itself with no autograd in
    between, unlike to_local()); any other tensor as it is. Ran on 2.13."""
    dtensor = dtensor_class()
    return tensor._local_tensor if dtensor is not None and isinstance(tensor, dtensor) else tensor


def fsdp2_module_class() -> Optional[type]:
    """FSDPModule, the class fully_shard mixes into a sharded module: torch.distributed.fsdp (public
    since 2.6, pytorch#141868), else torch.distributed._composable.fsdp (2.4, 2.5). Ran on 2.13.
    Missing: None (no module is FSDP2-sharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def fully_shard_function() -> Callable:
    """fully_shard, from where fsdp2_module_class finds FSDPModule. Ran on 2.13. Missing:
    MissingTorchFeature."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError as exc:
            raise MissingTorchFeature("FSDP2 (fully_shard)", "2.4") from exc
    return fully_shard


# What fully_shard and nn.Module keep on a module besides its parameters, buffers and submodules; a
# plain copy of a sharded module leaves these out (recording/unshard.py). Read on 2.13's
# torch/nn/modules/module.py and torch/distributed/fsdp/_fully_shard.
MODULE_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
                      "_backward_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                      "_load_state_dict_post_hooks")
_FSDP2_MARKS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")  # set for Dynamo on each managed module
_COMPOSABLE_STATE_PREFIX = "__composable_api_state_key"  # fully_shard's state: `<prefix>_<uuid>`


def is_fsdp2_bookkeeping(attribute: str) -> bool:
    """Whether a module attribute is fully_shard's state or mark rather than the user's."""
    return attribute in _FSDP2_MARKS or attribute.startswith(_COMPOSABLE_STATE_PREFIX)


def fsdp2_params(model: Any) -> list:
    """Every FSDPParam of every fully_shard group in `model`: FSDPModule._get_fsdp_state() (2.4 on),
    whose state holds its groups as `_fsdp_param_groups` (a list, 2.13) or `_fsdp_param_group` (one or
    None, earlier releases); each group's `fsdp_params`. Ran on 2.13."""
    fsdp_module = fsdp2_module_class()
    if fsdp_module is None:
        return []
    found = []
    for module in model.modules():
        if not isinstance(module, fsdp_module):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [single] if single is not None else []
        found.extend(p for group in groups for p in group.fsdp_params)
    return found


def fsdp2_param_tensors(fsdp_param: Any) -> tuple[list, list]:
    """(the tensors holding a parameter, those holding its gradient) that one FSDPParam keeps now: its
    shard (_sharded_param_data), its unsharded parameter and all-gather outputs when it has them, and
    the gradients of both. Ran on 2.13; an attribute a release lacks is skipped."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    held = [getattr(fsdp_param, "_sharded_param_data", None), unsharded,
            *getattr(fsdp_param, "all_gather_outputs", [])]
    sharded = getattr(fsdp_param, "sharded_param", None)
    grads = [getattr(sharded, "grad", None), getattr(unsharded, "grad", None)]
    return [t for t in held if t is not None], [g for g in grads if g is not None]


def fsdp2_memory_tracker_class() -> type:
    """torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker (pytorch#125323, merged mid-2024:
    2.5 at the latest). Ran on 2.13. Missing: MissingTorchFeature (bench and tests only)."""
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    except ImportError as exc:
        raise MissingTorchFeature("FSDPMemTracker", "2.5") from exc
    return FSDPMemTracker
