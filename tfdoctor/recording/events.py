"""What each recorded event carries: one TypedDict per `Event.kind`, the keys the recorder writes into
`Event.data` and the loop judges read back, with what each means and its unit. `PAYLOADS` maps a kind to
its TypedDict. tests/test_events.py holds the keys of recorded traces, the keys the judges read off them
and the keys the source names against these declarations, so that a key renamed on one side only fails
there instead of reading as a silent None; `Trace.of("kind")` hands a type checker the kind's TypedDict.

A key declared in a `total=False` class is written only sometimes (the condition is in its comment);
the other keys are always there. Ids are `id()` of the live object, which the recording compares and
never dereferences. Payloads stay plain dicts at run time (the Trace pickles across ranks and
processes); the TypedDicts are for the reader and a type checker only.

No torch here: the check modules import this through trace.py, and `tfdoctor checks` lists them
without loading torch (tensor-valued keys are annotated as "torch.Tensor" strings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional, TypedDict, Union

if TYPE_CHECKING:
    import torch

EventKind = Literal["batch", "forward", "loss", "backward", "scale", "unscale", "scaler_step", "scaler_update",
                    "clip", "opt_step", "zero_grad", "sched_step", "autocast", "mode"]


class _Located(TypedDict):
    # The user's "path:line" of the call (usercode/call_sites.py), which a loop finding names; None when
    # no frame of the user's own code is on the stack (a call made inside a library with no user code above).
    where: Optional[str]


class BatchData(TypedDict):
    """`check --train` handed the loop one of its batches (recording/loop.py); `run` has no such events."""

    index: int  # the batch's position in the list fed to train(model, batches)


class _ForwardAlways(TypedDict):
    index: int  # the forward's number in the recording, 0 first: what LossData.forward and scores name
    inputs: list[tuple[str, torch.Tensor]]  # the 2-D integer tensors passed: (keyword, or position as "0"), ids
    kwargs: list[str]  # the keyword names of the call, sorted
    amp: Optional[str]  # dtype the innermost autocast region requests ("bfloat16", "float16"); None: none


class ForwardData(_ForwardAlways, total=False):
    """The recorded model's outermost forward."""

    # A training forward (grad mode on, not nested in another forward) only:
    training: bool  # the model's own .training flag
    mode_dependent: int  # dropout (p > 0) and batch-norm modules in the trained part
    mode_off: list[str]  # the names of those left in eval mode
    mode_off_kinds: list[str]  # "dropout" / "batch norm": what mode_off holds; only when mode_off is not empty
    # The output carries per-token log_probs and no logits (TRL's fused LM head): the output's class name.
    fused_head: str
    # `run` only (script_recorder.ScriptRecorder watches every candidate model until one is settled):
    module: int  # id() of the module called
    grad: bool  # grad mode at the outermost call; False: an evaluation forward, not a micro-batch


class _LossAlways(_Located):
    function: Literal["cross_entropy", "nll_loss"]  # the functional the loss called (nn losses call these)
    forward: int  # ForwardData.index of the latest forward before the call; -1: none yet
    amp: Optional[str]  # as ForwardData.amp, at the loss call
    requires_grad: bool  # the loss output carries a graph (a training loss, not an evaluation one)
    reduction: str  # "mean" | "sum" | "none", as passed (the default filled in)
    ignore_index: int  # as passed, -100 by default
    label_smoothing: float  # as passed, 0.0 by default (nll_loss has none)
    value: float  # the loss output summed over its elements
    input_shape: list[int]  # the scores' shape: [N, C], a classifier's [B, C], or [B, C, T]
    # Filled in by a hook on the output when the loop's backward reaches it; None until then (never
    # reached: an evaluation loss, or a loss the loop did not backpropagate):
    grad: Optional[torch.Tensor]  # the gradient it received, flat, float32 on the CPU
    backward: Optional[int]  # the index in Trace.events of the backward that sent it


class LossData(_LossAlways, total=False):
    """A cross-entropy or NLL call, wherever it was made (in the loop, or inside a library's forward)."""

    targets: torch.Tensor  # the integer class targets, flat, on the CPU; absent for soft (float) targets


class _BackwardAlways(_Located):
    value: float  # the root tensor summed (the loss as backpropagated, times any GradScaler scale)
    grads_clear: bool  # every optimized parameter's .grad was None or all zero before this backward
    scaled: bool  # the root was computed from a GradScaler.scale() output
    scale: Optional[float]  # that scale (65536.0 at the start); None: not scaled, or the scaler is disabled
    amp: Optional[str]  # as ForwardData.amp, at the backward call


class BackwardData(_BackwardAlways, total=False):
    """`Tensor.backward` on the loop's loss (autograd.grad is not followed)."""

    grads_after: bool  # some gradient was non-zero on a sample just after it; set when the backward returns
    # `run`, until the model is settled or while several are trained: ids of the parameters its graph
    # reaches, removed from the payload when the script's own model is known (script_recorder.keep_own_events).
    reaches: frozenset[int]


class ScaleData(_Located):
    """`GradScaler.scale(loss)`."""

    scaler: int  # id() of the GradScaler
    enabled: bool  # enabled on this machine (a CUDA scaler disables itself without CUDA)
    requested: bool  # what the loop asked for (GradScaler(enabled=...)), whatever this machine allows
    device: str  # the scaler's device ("cuda", "cpu")
    scale: float  # the scale it multiplied by; 1.0 when disabled
    init_scale: float  # the scaler's init_scale (65536.0 by default)


class UnscaleData(_Located):
    """`GradScaler.unscale_(optimizer)`."""

    scaler: int  # id() of the GradScaler
    optimizer: int  # id() of the optimizer whose gradients it unscales (OptimizerRecord.id)
    internal: bool  # made by scaler.step() itself (the loop did not unscale first), not by the loop


class _ScalerStepAlways(_Located):
    scaler: int  # id() of the GradScaler
    optimizer: int  # id() of the optimizer it steps


class ScalerStepData(_ScalerStepAlways, total=False):
    """`GradScaler.step(optimizer)`."""

    skipped: bool  # no optimizer step happened inside it (inf/NaN gradients); set when the call returns


class ScalerUpdateData(TypedDict):
    """`GradScaler.update()`."""

    scaler: int  # id() of the GradScaler


class _ClipAlways(_Located):
    how: Literal["norm", "value"]  # clip_grad_norm_ / clip_grads_with_norm_, or clip_grad_value_
    params: int  # parameter tensors handed to it (0: an exhausted iterator)
    covers_all: bool  # every model parameter holding a gradient was handed to it
    model_params_with_grad: int  # the model's parameter tensors holding a gradient at the call
    limit: float  # max_norm, or clip_value for clip_grad_value_
    pre_norm: float  # L2 norm of the handed gradients before clipping


class ClipData(_ClipAlways, total=False):
    """A gradient clip (torch.nn.utils.clip_grad_*)."""

    # The window's first clip only: the whole model's gradient norm before clipping, and whether finite.
    global_pre_norm: float
    finite: bool


class _OptStepAlways(_Located):
    optimizer: Optional[int]  # id() of the optimizer (OptimizerRecord.id); None: a manual update
    lrs: list[float]  # each param group's learning rate at the step; a manual update: estimated, or [] unknown
    grad_norm: float  # L2 norm of the gradients the step reads, as they reach it (after any clip)
    finite: bool  # all of those gradients are finite
    in_scaler: bool  # the step ran inside GradScaler.step()


class OptStepData(_OptStepAlways, total=False):
    """An optimizer step, or a manual update of the weights (a loop with no optimizer object)."""

    manual: bool  # True: the weights changed between two backward calls with no optimizer step
    # An optimizer's step (not a manual update) only:
    joins: bool  # no backward since the previous step: it joins that step's window (Muon + AdamW)
    params: int  # parameter tensors the optimizer holds
    frozen: int  # of those, the ones with requires_grad False
    # The first step (and the steps that join it): per param group, the median RMS of its weight
    # matrices before the update; None for a group with none.
    matrix_rms: list[Optional[float]]


class ZeroGradData(_Located):
    """`Optimizer.zero_grad` or the recorded model's `Module.zero_grad`."""

    owner: Literal["optimizer", "model"]


class SchedStepData(_Located):
    """A learning-rate scheduler's `step()` made by the loop (a scheduler's own nested steps are not)."""

    scheduler: int  # id() of the scheduler
    name: str  # its class: LambdaLR, OneCycleLR, ...


class AutocastData(_Located):
    """Entering a torch.autocast region."""

    device: str  # the region's device type ("cuda", "cpu")
    dtype: Optional[str]  # the dtype it asks for ("float16", "bfloat16")
    requested: bool  # what the loop asked for (enabled=...), whatever this machine allows
    enabled: bool  # enabled on this machine (a CUDA region disables itself without CUDA)


class _ModeAlways(_Located):
    training: bool  # train(True) / train(False), which eval() calls
    module: str  # the class name of the module it was called on
    by_library: bool  # made by a library (from_pretrained's eval(), Lightning's loops), not the user's code


class ModeData(_ModeAlways, total=False):
    """The outermost `Module.train(mode)` or `eval()` call."""

    on_model: bool  # the module is, or holds, or is part of the recorded model; set when the recording ends


EventData = Union[BatchData, ForwardData, LossData, BackwardData, ScaleData, UnscaleData, ScalerStepData,
                  ScalerUpdateData, ClipData, OptStepData, ZeroGradData, SchedStepData, AutocastData, ModeData]

# kind -> its TypedDict class (whose __required_keys__ and __optional_keys__ the test reads)
PAYLOADS: dict[str, Any] = {
    "batch": BatchData, "forward": ForwardData, "loss": LossData, "backward": BackwardData, "scale": ScaleData,
    "unscale": UnscaleData, "scaler_step": ScalerStepData, "scaler_update": ScalerUpdateData, "clip": ClipData,
    "opt_step": OptStepData, "zero_grad": ZeroGradData, "sched_step": SchedStepData, "autocast": AutocastData,
    "mode": ModeData,
}


def holds_only_frozen(step: OptStepData) -> bool:
    """An optimizer step whose optimizer holds parameters, every one of them with requires_grad False:
    the step changes nothing, whatever the gradients (optimizer-coverage's finding, not zero-grad's)."""
    return bool(step.get("params")) and step.get("frozen") == step["params"]


def declared_keys(kind: str) -> frozenset[str]:
    """Every key an event of `kind` may carry, always or sometimes."""
    payload = PAYLOADS[kind]
    return frozenset(payload.__required_keys__ | payload.__optional_keys__)


# Events that carry the user's file:line of the call (`where`), which the loop checks name in their
# findings. Forwards and batches are many and judged by content only.
LOCATED_EVENTS = frozenset(kind for kind, payload in PAYLOADS.items() if "where" in payload.__required_keys__)
