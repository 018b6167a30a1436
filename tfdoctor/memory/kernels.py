"""The attention kernel a traced step runs: the one F.scaled_dot_product_attention would pick on the
device the model trains on, whatever device its factory built it on.

SDPA picks its kernel at run time from its inputs' device. A fused kernel (flash attention,
memory-efficient attention) keeps the output and a float32 logsumexp row per query, never the
[.., T, T] scores; the math path materialises them. On the meta device every call takes the math
path (torch's `_fused_sdp_choice_meta` answers math unless the tensors are CUDA's), so a model built
on meta to be sized without allocating was traced with scores it will never store: a 4-layer Llama
at 2,048 tokens read 8.2 GiB from meta and 5.7 GiB from the CPU. The trace therefore runs on the
target device (resolve_target):

- cpu: the fake tensors are CPU tensors whatever device the weights were built on, and torch's own
  CPU dispatch picks the kernel (flash attention for CPU, masks included; the math path under dropout).
- cuda, when the weights are not already on a GPU: the step is traced on CPU fake tensors and each SDPA
  call is routed to the kernel CUDA would pick on an sm80+ GPU (A100, H100, H200) with torch's default
  priority, flash, then memory-efficient, then math, through the gates of torch's sdp_utils.cpp that
  shapes and dtypes decide (cuda_choice). The fused ops' own meta functions make their outputs
  (logsumexp included) and autograd their backward. cuDNN attention, first on H100-class GPUs with a
  recent cuDNN, keeps the same output and logsumexp as flash. Grouped key/value heads (enable_gqa) run
  on flash and math only (torch 2.13's documentation of F.scaled_dot_product_attention).
- weights already on the target (a real or fake CUDA model on a GPU machine): torch's own dispatch.

Imports torch; the analytic mode never imports this module.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tfdoctor.errors import UsageError
from tfdoctor.usercode.torch_compat import (
    SDPA_CUDNN,
    SDPA_EFFICIENT,
    SDPA_FLASH,
    SDPA_FLASH_CPU,
    SDPA_OVERRIDEABLE,
    dispatch_mode_base,
    sdpa_efficient,
    sdpa_flash,
    sdpa_math,
)

TARGETS = ("cpu", "cuda")
MATH = "math path (stores the T x T scores)"
# The fused ops by name (aten ops seen in dispatch, or chosen for CUDA), and how the report names them.
FUSED = {
    SDPA_FLASH_CPU: "flash attention for CPU (fused: no T x T scores)",
    SDPA_FLASH: "flash attention (fused: no T x T scores)",
    SDPA_EFFICIENT: "memory-efficient attention (fused: no T x T scores)",
    SDPA_CUDNN: "cuDNN attention (fused: no T x T scores)",
    SDPA_OVERRIDEABLE: "the device's fused attention (no T x T scores)",
}
_HALF = (torch.float16, torch.bfloat16)
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def weights_devices(model) -> set[str]:
    """The device types the model's parameters and buffers are on (accelerate's init_empty_weights leaves
    the buffers on the CPU and the parameters on meta)."""
    return {t.device.type for t in list(model.parameters()) + list(model.buffers())}


def resolve_target(model, requested: Optional[str]) -> tuple[str, str]:
    """(the device type whose kernels are traced, why that one)."""
    if requested:
        try:
            kind = torch.device(requested).type
        except RuntimeError:
            kind = requested
        if kind not in TARGETS:
            raise UsageError(f"--device {requested!r} is not cpu or cuda[:N]", "pass --device cpu or --device cuda")
        return kind, f"set by --device {requested}"
    built = sorted(weights_devices(model))
    if len(built) == 1 and built[0] in TARGETS:
        return built[0], f"the model's weights are on {built[0]}"
    return "cpu", f"the weights are on {' and '.join(built) or 'no device'}, so the CPU's kernels were assumed " \
                  "(--device cuda for a GPU's)"


def onto(device: torch.device, fake_mode, default: Callable) -> Callable:
    """A converter for fake_step: a tensor already on `device` goes through `default`; any other (meta,
    or another device) becomes a fake tensor of the same shape, strides and dtype on `device`."""

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == device.type:
            return default(tensor)
        meta = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")
        return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, device)

    return convert


def attention_kernels(model, requested: Optional[str], fake: bool) -> tuple["AttentionKernels", bool]:
    """The watcher for fake_step, and whether the weights must move to CPU fake tensors: when traced on
    fake tensors and they are not on the target (meta, or CPU weights traced for a GPU)."""
    target, why = resolve_target(model, requested if fake else None)
    return AttentionKernels(target, why), fake and weights_devices(model) - {target} != set()


class _FirstFused(dispatch_mode_base()):
    """Which fused aten op (if any) one SDPA call dispatched to."""

    def __init__(self) -> None:
        super().__init__()
        self.op: Optional[str] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
        if self.op is None and name in FUSED:
            self.op = name
        return func(*args, **(kwargs or {}))


def _arguments(args, kwargs) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs or {})
    defaults = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    return {**defaults, **bound}


def _heads_ok(q, k, v, gqa: bool) -> bool:
    """check_batch_size_and_num_heads_dense: same batch; key/value heads equal to the query's, or (with
    enable_gqa) dividing them."""
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    if q.shape[1] == k.shape[1] == v.shape[1]:
        return True
    return gqa and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0


def cpu_math_reason(a: dict[str, Any]) -> str:
    """Why torch's CPU dispatch (use_flash_attention_cpp) took the math path, as far as the inputs tell."""
    q, k, v = a["query"], a["key"], a["value"]
    if not torch.backends.cuda.flash_sdp_enabled():
        return "flash SDPA is switched off (torch.backends.cuda.enable_flash_sdp(False) or an sdpa_kernel context)"
    if a["dropout_p"] > 0:
        return f"dropout_p={a['dropout_p']:g} in training: the CPU's fused kernel has no dropout"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "query, key and value are not all 4-D [B, heads, T, head size]"
    if not _heads_ok(q, k, v, bool(a["enable_gqa"])):
        return "key/value heads differ from the query's without enable_gqa=True"
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        return "query, key and value head sizes differ"
    if q.dtype not in _CPU_FLASH_DTYPES:
        return f"dtype {q.dtype} has no fused CPU kernel"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "the last dimension of query, key or value is not contiguous"
    return "torch's CPU dispatch chose it for these inputs"


def cuda_choice(a: dict[str, Any]) -> tuple[str, str]:
    """(op name or "math", why not the kernels before it): torch's select_sdp_backend on an sm80+ GPU with
    the default priority, flash > memory-efficient > math, for the gates that shapes and dtypes decide."""
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "math", "query, key and value are not all 4-D"
    if not _heads_ok(q, k, v, bool(a["enable_gqa"])) or 0 in (q.shape[-2], k.shape[-2]):
        return "math", "key/value heads differ from the query's without enable_gqa=True"
    why = []
    if not torch.backends.cuda.flash_sdp_enabled():
        why.append("flash SDPA is switched off")
    elif mask is not None:
        why.append("flash attention takes no explicit attn_mask")
    elif not (q.shape[-1] == k.shape[-1] == v.shape[-1] <= 256):
        why.append("flash attention needs equal head sizes of at most 256")
    elif q.dtype not in _HALF:
        why.append(f"flash attention needs float16 or bfloat16, not {str(q.dtype).replace('torch.', '')}")
    elif a["is_causal"] and q.shape[-2] != k.shape[-2]:
        why.append("flash attention takes is_causal only with as many queries as keys")
    elif any(t.stride(-1) != 1 and t.shape[-1] != 1 for t in (q, k, v)):
        why.append("flash attention needs a contiguous last dimension")
    else:
        return SDPA_FLASH, ""
    align = 8 if q.dtype in _HALF else 4  # minimum_gemm_alignment on sm80+
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        why.append("memory-efficient SDPA is switched off")
    elif q.dtype not in _HALF + (torch.float32,):
        why.append(f"memory-efficient attention has no {q.dtype} kernel")
    elif k.shape[1] != q.shape[1]:  # torch 2.13: "GQA works only for flash attention and math on CUDA"
        why.append("memory-efficient attention takes no grouped key/value heads (enable_gqa)")
    elif q.shape[-1] != k.shape[-1] or q.shape[-1] % align or v.shape[-1] % align:
        why.append(f"memory-efficient attention needs head sizes divisible by {align}")
    elif any(t.stride(-1) != 1 for t in (q, k, v)):
        why.append("memory-efficient attention needs a contiguous last dimension")
    else:
        return SDPA_EFFICIENT, "; ".join(why)
    return "math", "; ".join(why)


def _autocast(a: dict[str, Any]) -> None:
    """CUDA autocast casts SDPA's floating inputs to its 16-bit dtype before the kernel is chosen; the
    CPU autocast of the trace does it below this mode, too late for cuda_choice."""
    device = a["query"].device.type
    if torch.is_autocast_enabled(device):
        low = torch.get_autocast_dtype(device)
        for name in ("query", "key", "value", "attn_mask"):
            t = a[name]
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != low:
                a[name] = t.to(low)


def _additive(mask: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    """convert_boolean_attn_mask: a bool mask becomes 0 / -inf in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), -math.inf)


def run_cuda_kernel(op: str, a: dict[str, Any]) -> torch.Tensor:
    """What attention.cpp does around the chosen CUDA op, on the traced tensors."""
    q, k, v = a["query"], a["key"], a["value"]
    dropout, causal, scale = float(a["dropout_p"]), bool(a["is_causal"]), a["scale"]
    if op == SDPA_FLASH:
        size = q.shape[-1]
        pad = -size % 8  # pad_last_dim<8>: the kernel takes multiples of 8, scaled by the true size
        if pad:
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        scale = scale if scale is not None else 1.0 / math.sqrt(size)
        out = sdpa_flash(q, k, v, dropout, causal, scale)
        return out[..., :size] if pad else out
    mask = _additive(a["attn_mask"], q.dtype)
    if op == SDPA_EFFICIENT:
        if mask is not None:  # preprocess_mask: [B, heads, Tq, Tk], its last dim padded to a multiple of 16
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            if mask.shape[-1] % 16:
                mask = F.pad(mask, (0, 16 - mask.shape[-1] % 16))[..., :k.shape[2]]
            elif any(s % 16 for s in mask.stride()[:3]):
                mask = mask.contiguous()
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return sdpa_efficient(q, k, v, mask, lse, dropout, causal, scale)
    return sdpa_math(q, k, v, mask, dropout, causal, scale, bool(a["enable_gqa"]))


class AttentionKernels(TorchFunctionMode):
    """Watches (or, emulating CUDA, routes) every F.scaled_dot_product_attention call of the step and
    counts the kernel each one ran, with the reason for each math path."""

    def __init__(self, target: str, why: str) -> None:
        super().__init__()
        self.target, self.why, self.emulate = target, why, False
        self.counts: dict[tuple[str, str], int] = {}

    def on(self, device: Optional[torch.device]) -> "AttentionKernels":
        """Enter as the mode for a step traced on `device`: CUDA's choice is emulated off a GPU."""
        self.emulate = self.target == "cuda" and (device is None or device.type != "cuda")
        return self

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        a = _arguments(args, kwargs)
        if self.emulate:
            _autocast(a)
            op, reason = cuda_choice(a)
            out = run_cuda_kernel(op, a)
        else:
            with _FirstFused() as seen:
                out = func(*args, **(kwargs or {}))
            op = seen.op or "math"
            reason = cpu_math_reason(a) if op == "math" and self.target == "cpu" else ""
        self.counts[op, reason] = self.counts.get((op, reason), 0) + 1  # reason: why not a kernel before it
        return out

    def summary(self) -> dict[str, Any]:
        """For the report: the target, why, and each kernel with its calls (none: no SDPA call at all)."""
        kernels = [{"kernel": FUSED.get(op, MATH), "op": op, "fused": op != "math", "calls": n, "reason": reason}
                   for (op, reason), n in sorted(self.counts.items(), key=lambda kv: -kv[1])]
        return {"device": self.target, "why": self.why, "emulated": self.emulate,
                "sdpa_calls": sum(self.counts.values()), "kernels": kernels}


def changes_kernel(summary: Optional[dict[str, Any]]) -> bool:
    """Would bf16 autocast change the kernel? On an emulated GPU, a math path taken for want of 16 bits."""
    return bool(summary) and summary["device"] == "cuda" and any(
        not k["fused"] and "float16 or bfloat16" in k["reason"] for k in summary["kernels"])


def scores_note(summary: Optional[dict[str, Any]], scores_bytes: Optional[int], analytic: str = "") -> str:
    """What the report says of attention scores the trace stored ("" when it stored none): the model's
    own attention ops, or SDPA calls on their math path and why. `analytic`: the analytic command that
    estimates a GPT of the model's shape with fused attention (a TARGET refuses --attention)."""
    if not summary or not scores_bytes:
        return ""
    math_calls = [k for k in summary["kernels"] if not k["fused"]]
    if not summary["sdpa_calls"]:
        estimate = (f"; the analytic mode estimates a GPT of this shape with it: `{analytic}`" if analytic else "")
        return ("the model computes attention with its own ops and stores the [.., T, T] scores; "
                "F.scaled_dot_product_attention (attn_implementation=\"sdpa\" for a Hugging Face model) runs a "
                "fused kernel that does not, a change to the model's code" + estimate)
    if not math_calls:
        return ""
    calls = sum(k["calls"] for k in math_calls)
    reasons = "; ".join(sorted({k["reason"] for k in math_calls if k["reason"]}))
    note = (f"{calls} of {summary['sdpa_calls']} F.scaled_dot_product_attention calls take the math path on "
            f"{summary['device']} and store the [.., T, T] scores" + (f" ({reasons})" if reasons else ""))
    if changes_kernel(summary):
        note += "; under bf16 autocast (--dtype bf16) they could take flash attention"
    return note
