"""Step judges: what happens to the gradients between the last backward and the optimizer step.
GradScaler gradients unscaled before the clip (unscale-before-clip), the clip by the global norm
(clip-global-norm), float16 autocast with loss scaling (amp-loss-scaling), finite and bounded
gradients (grad-health), every parameter with a gradient in an optimizer (optimizer-coverage). Each
judges the one recorded trace of the loop, handed in by the runner; the measures on it are in
tfdoctor/recording/windows.py.
"""

from __future__ import annotations

from collections import Counter

from tfdoctor.recording.events import holds_only_frozen
from tfdoctor.recording.windows import order, scaled_clips, step_norms, stepped
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.sparkline import sparkline

# grad-health: a pre-clip norm that rose at every step over at least this many steps, to at least
# twice its start, is noted as growing steadily (the sign of a learning rate set too high).
GROWTH_MIN_STEPS = 6
GROWTH_FACTOR = 2.0


def _untrained(trace) -> str | None:
    """What shows that the loop trained nothing at all, or None. Only a loop that took no optimizer
    step, called no backward() and left every weight as it was (an empty DataLoader, a loop that
    returns before its first batch) is certain: one that called backward() may accumulate over more
    micro-batches than it was fed, and the script driver refuses a script that never stepped."""
    if trace.steps or trace.of("scaler_step") or trace.of("backward"):
        return None
    if trace.isolation.get("weights_changed", True):  # unknown (another driver), or trained unseen
        return None
    if trace.batches_fed == 0:
        return ("the loop returned without iterating over the batches it was given: no optimizer step was "
                "taken, so nothing trains")
    return (f"the loop iterated over the {trace.batches_fed} batches it was given but no optimizer step was "
            "taken: no backward(), no optimizer.step(), every weight left as it was (a DataLoader or filter "
            "that yields nothing?)")


@check("unscale-before-clip", title="GradScaler gradients are unscaled before clipping",
       located=("clip", "unscale"))
def unscale_before_clip(subject, trace) -> Result:
    """Catches `clip_grad_norm_` on gradients a GradScaler has not unscaled: they are still multiplied
    by the loss scale (65536 at the start), so every batch looks like an outlier, the clip cuts every
    update to a sliver and the model barely moves.

    Judged on the order of calls (scale, backward, clip, unscale_), not on whether unscale_ appears:
    calling it after the clip is as wrong as never calling it. A GradScaler('cuda') disables itself on
    a machine without CUDA, but the order is the same, so the bug is caught there too.

    Fix: `scaler.unscale_(optimizer)` after the last backward, before the clip.
    """
    scales = trace.of("scale")
    if not scales:
        return Result.skipped("the loop uses no GradScaler")
    clips = trace.of("clip")
    if not clips:
        return Result.skipped("the loop scales its loss but clips no gradients")
    bad = scaled_clips(trace)
    bad_windows = sorted({event.window for event, _ in bad})
    windows = sorted({event.window for event in clips})
    first = scales[0].data
    scale = first["scale"] if first["enabled"] else first["init_scale"]
    details = {"clip_windows": len(windows), "clips_on_scaled_gradients": len(bad_windows),
               "order": order(trace, (bad_windows or windows)[0]), "scaler_device": first["device"],
               "scaler_enabled_here": first["enabled"], "loss_scale": scale}
    if not bad:
        return Result.passed(f"gradients unscaled before every clip ({len(windows)} steps; order: "
                             f"{details['order']})", details)
    where = ("" if first["enabled"] else
             f" (GradScaler('{first['device']}') is disabled on this machine, so this run was unharmed; "
             "the order is wrong wherever it is enabled)")
    return Result.failed(
        f"clip ran on still-scaled gradients at {len(bad_windows)} of {len(windows)} steps (order: "
        f"{details['order']}): with a loss scale of {scale:.0f} the clip sees every batch as an outlier "
        f"and shrinks each update about {scale:.0f}-fold{where}",
        "call scaler.unscale_(optimizer) after the last backward and before "
        "torch.nn.utils.clip_grad_norm_(...); scaler.step(optimizer) then does not unscale again", details)


@check("clip-global-norm", title="Gradients are clipped by their global norm",
       located=("clip", "opt_step"))
def clip_global_norm(subject, trace) -> Result:
    """Catches clipping that changes the update's direction: `clip_grad_norm_` called per parameter
    (or per group), which scales each tensor by its own factor, and `clip_grad_value_`, which cuts
    each element on its own. Clipping by the global norm over all parameters only shortens the update.

    No clipping at all is noted, not faulted.

    Fix: `clip_grad_norm_(model.parameters(), max_norm)` once per step, after unscaling.
    """
    reason = stepped(trace)
    if reason:
        return Result.skipped(reason)
    clips = trace.of("clip")
    if not clips:
        return Result.passed("the loop does not clip gradients (a note, not a fault)", {"clips": 0},
                             hint="torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) before "
                                  "optimizer.step() guards against rare huge batches")
    windows: dict[int, list] = {}
    for event in clips:
        windows.setdefault(event.window, []).append(event.data)
    empty = [window for window, calls in windows.items() if all(c["params"] == 0 for c in calls)]
    if empty:  # the clip the loop asked for did not happen: a fault, not a style
        return Result.failed(
            f"clip_grad_norm_ was handed no parameters at {len(empty)} of {len(windows)} steps: it returned 0 "
            "and clipped nothing, while the loop believes it clips (typically an iterator already consumed: "
            "a `filter(...)` or generator over the parameters, used first to build the optimizer)",
            "keep the parameters in a list: params = [p for p in model.parameters() if p.requires_grad]; "
            "or clip model.parameters() itself",
            {"steps_with_clip": len(windows), "steps_clipping_nothing": len(empty),
             "model_params_with_grad": windows[empty[0]][0]["model_params_with_grad"]})
    kinds = Counter()
    for calls in windows.values():
        if any(c["how"] == "value" for c in calls):
            kinds["value"] += 1
        elif any(c["covers_all"] for c in calls):
            kinds["global"] += 1
        elif len(calls) > 1:
            kinds["per-parameter" if all(c["params"] == 1 for c in calls) else "per-group"] += 1
        else:
            kinds["partial"] += 1
    calls = max(windows.values(), key=len)
    details = {"steps_with_clip": len(windows), "by_kind": dict(kinds), "calls_per_step": len(calls),
               "limit": calls[0]["limit"], "model_params_with_grad": calls[0]["model_params_with_grad"]}
    if set(kinds) == {"global"}:
        return Result.passed(f"clip_grad_norm_ over all {calls[0]['params']} parameter tensors, max_norm "
                             f"{calls[0]['limit']:g}, at {len(windows)} steps", details)
    hint = "clip once over all parameters: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)"
    if "value" in kinds:
        return Result.warned(f"clip_grad_value_({calls[0]['limit']:g}) cuts each gradient element on its "
                             "own, which changes the update's direction", hint, details)
    if "per-parameter" in kinds or "per-group" in kinds:
        unit = "parameter tensor" if "per-parameter" in kinds else "group"
        return Result.warned(f"clip_grad_norm_ called {len(calls)} times per step, once per {unit}: each is "
                             f"cut to norm {calls[0]['limit']:g} on its own, which changes the update's "
                             "direction", hint, details)
    return Result.warned(f"clip_grad_norm_ covers {calls[0]['params']} of the "
                         f"{calls[0]['model_params_with_grad']} parameter tensors with gradients", hint, details)


@check("amp-loss-scaling", title="float16 autocast comes with loss scaling",
       located=("autocast", "backward"))
def amp_loss_scaling(subject, trace) -> Result:
    """Catches float16 autocast without a GradScaler: float16 cannot hold gradients below about 6e-8
    (and loses precision below 6e-5), so many Transformer gradients silently become zero. bfloat16
    has float32's range and needs no scaling.

    Reads the autocast regions the loop requested (also a CUDA autocast that disables itself on a
    CPU-only machine) and whether its backward calls start from a GradScaler-scaled loss.

    Fix: `torch.amp.GradScaler('cuda')` around backward and step, or autocast with
    `dtype=torch.bfloat16`.
    """
    regions = [e.data for e in trace.of("autocast") if e.data["requested"]]
    if not regions:
        return Result.skipped("the loop requests no autocast (mixed precision) region")
    fp16 = [r for r in regions if r["dtype"] == "float16"]
    devices = sorted({r["device"] for r in fp16 or regions})
    scales = trace.of("scale")
    requested = [e.data for e in scales if e.data["requested"]]
    backwards = trace.of("backward")
    scaled = [e for e in backwards if e.data["scaled"]]
    details = {"autocast": sorted({f"{r['device']}:{r['dtype']}" for r in regions}),
               "enabled_here": any(r["enabled"] for r in regions), "grad_scaler": bool(scales),
               "scaler_requested": bool(requested), "backward_calls": len(backwards),
               "scaled_backward_calls": len(scaled)}
    if not fp16:
        return Result.passed(f"{', '.join(details['autocast'])} autocast: bfloat16 keeps float32's range and "
                             "needs no loss scaling", details)
    here = ("" if any(r["enabled"] for r in fp16) else
            f" (autocast('{devices[0]}') disabled itself on this machine, so this run was float32)")
    if requested and len(scaled) == len(backwards):
        return Result.passed(f"float16 autocast ({', '.join(devices)}) with a GradScaler on every backward{here}",
                             details)
    hint = ("scaler = torch.amp.GradScaler('cuda'); scaler.scale(loss).backward(); scaler.step(optimizer); "
            "scaler.update() -- or autocast with dtype=torch.bfloat16, which needs no scaler")
    if scales and not requested:
        return Result.failed(f"float16 autocast ({', '.join(devices)}) with a GradScaler created with "
                             f"enabled=False: small gradients underflow to zero{here}", hint, details)
    unscaled = len(backwards) - len(scaled)
    return Result.failed(f"float16 autocast ({', '.join(devices)}) with no loss scaling on {unscaled} of "
                         f"{len(backwards)} backward calls: gradients below ~6e-8 underflow to zero in "
                         f"float16{here}", hint, details)


@check("grad-health", title="Gradients stay finite and bounded during the loop",
       located=("opt_step", "backward"))
def grad_health(subject, trace) -> Result:
    """Catches NaN or Inf gradients reaching the optimizer (every weight they touch becomes NaN) and
    notes a pre-clip gradient norm that grows at every step (usually a learning rate set too high).

    Records the global gradient norm over all parameters before any clipping at each optimizer step
    and draws it as a sparkline.

    Fix: find the first non-finite gradient with `torch.autograd.set_detect_anomaly(True)`; clip and
    lower the rate.
    """
    reason = stepped(trace)
    if reason:
        return Result.skipped(reason)
    scaled = {id(event): scale for event, scale in scaled_clips(trace)}
    norms, finite = [], []
    pre_clip = {}
    for event in trace.of("clip"):
        if "global_pre_norm" in event.data and event.window not in pre_clip:
            scale = scaled.get(id(event)) or 1.0
            pre_clip[event.window] = (event.data["global_pre_norm"] / scale, event.data["finite"])
    for window, step_norm, step_finite in step_norms(trace):
        norm, ok = pre_clip.get(window, (step_norm, step_finite))
        norms.append(norm)
        finite.append(ok and step_finite)
    skipped = [e for e in trace.of("scaler_step") if e.data.get("skipped")]
    drawn = sparkline(norms)  # the message quotes the curve; the report draws details["pre_clip_norms"]
    details = {"pre_clip_norms": norms, "steps": len(norms),
               "non_finite_steps": [i + 1 for i, ok in enumerate(finite) if not ok],
               "scaler_skipped_steps": len(skipped)}
    bad = details["non_finite_steps"]
    if bad:
        return Result.failed(
            f"gradients were NaN/Inf at {len(bad)} of {len(norms)} optimizer steps (first at step {bad[0]}); "
            f"the optimizer wrote them into the weights. Pre-clip norm {drawn}",
            "find the first non-finite gradient (torch.autograd.set_detect_anomaly(True)); typical causes: "
            "log or sqrt of zero in a custom loss or penalty, -inf masks on fully masked rows, float16 overflow",
            details)
    if skipped and not norms:
        return Result.failed(f"the GradScaler skipped all {len(skipped)} steps: the gradients were never finite",
                             "find the first non-finite gradient with torch.autograd.set_detect_anomaly(True)",
                             details)
    if norms and max(norms) == 0.0:  # finite, but nothing to judge a trend on: no gradient arrived at all
        return Result.warned(
            f"the pre-clip gradient norm was 0 at all {len(norms)} optimizer steps: no gradient reached the "
            "trained parameters when the optimizer stepped",
            "a loss detached from the parameters, or zero_grad() between backward() and step(), leaves "
            "nothing to step with; see the zero-grad and overfit-batch findings", details)
    summary = f"gradients finite at all {len(norms)} steps; pre-clip norm {norms[0]:.3g} -> {norms[-1]:.3g} " \
              f"{drawn}"
    growing = (len(norms) >= GROWTH_MIN_STEPS and all(b >= a for a, b in zip(norms, norms[1:]))
               and norms[-1] >= GROWTH_FACTOR * norms[0])
    if growing:
        details["growing"] = True
        return Result.passed(f"{summary}; note: it grew at every step ({norms[-1] / norms[0]:.1f}x), "
                             "a sign of a learning rate set too high", details,
                             hint="lower the peak learning rate or lengthen the warm-up")
    return Result.passed(summary, details)


@check("optimizer-coverage", title="Every parameter that gets a gradient is updated by an optimizer",
       located=("opt_step",))
def optimizer_coverage(subject, trace) -> Result:
    """Catches parameters that receive gradients but sit in no optimizer: they keep their initial
    values however long you train (an optimizer built before a module was added, a param-group filter
    by name that misses some). nanoGPT's configure_optimizers asserts this for the same reason.

    Compares the parameters that hold a gradient at the loop's optimizer steps with those its
    optimizers hold. Also makes sure the loop left your own model as it found it: the loop trains a
    copy, and function attributes that captured submodules (minGPT's `self.mlpf = lambda x: ...`),
    which copy.deepcopy does not copy, are rebuilt on the copy; anything of yours the loop still
    changed is put back and reported.

    Also fails a loop that took no optimizer step at all: it returned without iterating over its
    batches, or iterated without a backward() or any change to the weights (an empty DataLoader, a
    `range(1, epochs)` that is empty, a filter that keeps nothing), so nothing trains.

    Fix: build the optimizer from every trainable parameter; reach submodules through `self`, not
    through a closure. A loop that never steps: make it iterate over the batches it is given.
    """
    untrained = _untrained(trace)
    if untrained:
        return Result.failed(untrained, "make the loop iterate over the batches it is given and call loss.backward() "
                                        "and optimizer.step() on them (an empty DataLoader: check its dataset, "
                                        "batch_size and drop_last)",
                             {"batches_fed": trace.batches_fed, "optimizer_steps": 0, "backward_calls": 0})
    reason = stepped(trace)
    if reason:
        return Result.skipped(reason)
    coverage, isolation = trace.coverage, trace.isolation
    restored, rebound = isolation.get("restored", []), isolation.get("rebound", [])
    missing = coverage.get("not_optimized", [])
    details = {"parameters_with_grad": coverage.get("with_grad"), "trainable": coverage.get("trainable"),
               "not_optimized": missing[:20], "never_reached": coverage.get("never_reached", [])[:20],
               "optimizers": coverage.get("optimizers"), "rebound": rebound, "restored": restored[:20]}
    frozen_steps = [e for e in trace.of("opt_step") if holds_only_frozen(e.data)]
    if frozen_steps and len(frozen_steps) * 2 >= len(trace.of("opt_step")):
        # every parameter the stepped optimizer holds has requires_grad=False: each step changes nothing
        details.update(optimizer_steps_on_frozen_parameters=len(frozen_steps),
                       frozen_in_optimizer=frozen_steps[0].data["params"])
        outside = (f"; {_tensors(len(missing))} that receive gradients {'is' if len(missing) == 1 else 'are'} in "
                   f"no optimizer: {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}" if missing else "")
        return Result.failed(
            f"the optimizer holds only frozen parameters ({_tensors(frozen_steps[0].data['params'])}, all "
            f"requires_grad=False) at {len(frozen_steps)} of {len(trace.of('opt_step'))} optimizer steps: every "
            f"step changes nothing{outside}",
            "build the optimizer after freezing, from the parameters that train: "
            "torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], ...)",
            {**details, "location": frozen_steps[0].data.get("where"), "call": "optimizer.step()"})
    if missing:
        return Result.failed(
            f"{len(missing)} of the {coverage['with_grad']} parameter tensors that receive gradients are in no "
            f"optimizer and never change: {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}",
            "build the optimizer from every trainable parameter (model.parameters(), or param groups that "
            "together cover all of model.named_parameters()); set requires_grad=False on what you freeze",
            details)
    if restored:
        return Result.warned(
            f"training tfdoctor's copy of your model changed {len(restored)} of your model's own tensors "
            f"({', '.join(restored[:4])}{', ...' if len(restored) > 4 else ''}): the copy still shares them "
            "through something copy.deepcopy cannot follow; tfdoctor put them back, but an EMA or any "
            "copy.deepcopy(model) shares them the same way",
            "reach submodules through self inside forward (self.mlp(x)), not through a closure stored on "
            "the module", details)
    if trace.manual and not coverage.get("optimizers"):
        return Result.skipped("the loop updates the parameters itself (no optimizer object)", details)
    note = ""
    if rebound:
        note = (f"; note: copy.deepcopy(model) shares submodules with the original through "
                f"{', '.join(rebound[:3])}{', ...' if len(rebound) > 3 else ''} (functions are not copied): "
                "tfdoctor rebuilt them on its copy, but an EMA made with deepcopy would run your live weights")
    return Result.passed(f"all {coverage['with_grad']} parameter tensors that receive gradients are in the "
                         f"loop's optimizer{'s' if coverage.get('optimizers', 1) > 1 else ''}{note}", details)


def _tensors(count: int) -> str:
    return f"{count} parameter tensor" + ("" if count == 1 else "s")


# stale-update. A tensor has stalled when at least this share of its elements that had a non-zero
# gradient kept their value at the watched steps. In a float step every such element moves; with an
# update below half an ulp only the elements near zero (|w| < 2 x update / eps) still move: about 10%
# of N(0, 0.02) weights in bfloat16 at lr 1e-5, so a stalled tensor sits far above this line.
STALLED_ELEMENT_SHARE = 0.5
# Fail when the stalled tensors are most of the trained low-precision tensors or of their weights
# (workofart/ml-by-hand #85: 0 of 768 moved); warn from a notable share (the norm gains alone, which
# sit at 1.0 where a bfloat16 ulp is 7.8e-3, are a tenth to a third of a Transformer's tensors).
STALE_FAIL_SHARE = 0.5
STALE_WARN_SHARE = 0.1
# Half an ulp relative to the weight, torch.finfo(dtype).eps / 2: the smallest relative update that
# changes a weight of that dtype (bfloat16 eps 2**-7, float16 eps 2**-10).
HALF_ULP = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# Optimizers whose per-element update is about the learning rate whatever the gradient's size
# (Adam's m / sqrt(v) is ~1 in size); for the others (SGD) it is the rate times the gradient.
ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Adagrad", "Adadelta", "RMSprop",
            "Adafactor", "Lion", "Muon")


def _update_ratio(optimizer: str, tensor: dict) -> float:
    """The update the optimizer asks of this tensor, relative to its typical weight (an estimate)."""
    size = tensor["lr"] if optimizer in ADAPTIVE else tensor["lr"] * tensor["grad"]
    return size / tensor["weight"] if tensor["weight"] > 0 else float("inf")


def _stalled_tensors(trace) -> dict[str, dict]:
    """Per low-precision tensor that had gradients at the watched steps: its counts summed over the
    steps, its dtype, numel, largest rate and the estimated update-to-weight ratio."""
    tensors: dict[str, dict] = {}
    for step in trace.updates:
        for t in step["tensors"]:
            held = tensors.setdefault(t["name"], {"dtype": t["dtype"], "numel": t["numel"], "graded": 0,
                                                   "unchanged": 0, "lr": 0.0, "ratio": 0.0,
                                                   "optimizer": step["optimizer"]})
            held["graded"] += t["graded"]
            held["unchanged"] += t["unchanged"]
            held["lr"] = max(held["lr"], t["lr"])
            held["ratio"] = max(held["ratio"], _update_ratio(step["optimizer"], t))
    for held in tensors.values():
        held["stalled"] = held["unchanged"] >= STALLED_ELEMENT_SHARE * held["graded"]
    return tensors


@check("stale-update", title="Optimizer steps move the weights they have gradients for",
       located=("opt_step",))
def stale_update(subject, trace) -> Result:
    """Catches optimizer steps that leave the weights unchanged although their gradients are non-zero:
    weights held in bfloat16 or float16 (`model.to(torch.bfloat16)`, `torch_dtype=torch.bfloat16`)
    trained with a small rate. A weight of those dtypes changes only by at least half an ulp (0.39% of
    its size in bfloat16): a smaller update, lr 1e-5 on weights of 0.02, rounds back to the old
    value, so the loss barely moves however long you train.

    Compares (a sample of) every low-precision trained tensor before and after each of the loop's
    first optimizer steps, counting the elements with a non-zero gradient that kept their value, and
    estimates the update-to-weight ratio the optimizer asked for (the rate for Adam-like optimizers,
    rate x gradient for SGD) against the dtype's half-ulp, torch.finfo(dtype).eps / 2. Weights kept in
    float32 pass: autocast keeps them there.

    Fix: keep float32 master weights and run the forward under `torch.autocast(dtype=torch.bfloat16)`
    (or mixed precision in your trainer); else Kahan summation or stochastic rounding in the
    optimizer, or a larger learning rate.
    """
    reason = stepped(trace)
    if reason:
        return Result.skipped(reason)
    if trace.manual and not trace.optimizers:
        return Result.skipped("the loop updates the parameters itself (no optimizer object)")
    if not trace.updates:
        return Result.skipped("no optimizer step with a positive learning rate and gradients was recorded")
    tensors = _stalled_tensors(trace)
    wide = sorted({d for step in trace.updates for d in step["wide_dtypes"]})
    watched = len({step.get("window") for step in trace.updates})
    details = {"steps_watched": watched, "low_precision_tensors": len(tensors),
               "wide_tensors": max(step["wide_tensors"] for step in trace.updates), "wide_dtypes": wide}
    if not tensors:
        return Result.passed(f"the trained weights are held in {', '.join(wide) or 'float32'}: every update "
                             "above ~6e-8 of a weight moves it", details)
    stalled = {name: t for name, t in tensors.items() if t["stalled"]}
    numel = sum(t["numel"] for t in tensors.values())
    tensor_share = len(stalled) / len(tensors)
    weight_share = sum(t["numel"] for t in stalled.values()) / numel
    dtypes = sorted({t["dtype"] for t in tensors.values()})
    lrs = sorted({t["lr"] for t in tensors.values()})
    details.update(stalled_tensors=len(stalled), stalled_share=round(tensor_share, 4),
                   stalled_weight_share=round(weight_share, 4), dtypes=dtypes, lrs=lrs,
                   half_ulp={d: HALF_ULP.get(d) for d in dtypes}, stalled=sorted(stalled)[:20],
                   unchanged_elements=sum(t["unchanged"] for t in tensors.values()),
                   graded_elements=sum(t["graded"] for t in tensors.values()))
    what = f"{', '.join(dtypes)} tensors"
    if max(tensor_share, weight_share) < STALE_WARN_SHARE:
        return Result.passed(f"the first {watched} optimizer step(s) moved {len(tensors) - len(stalled)} "
                             f"of the {len(tensors)} trained {what} ({', '.join(wide) or 'no'} wider ones)",
                             details)
    steps = f"{watched} optimizer step{'s' if watched > 1 else ''}"
    below = [t for t in stalled.values() if t["ratio"] < HALF_ULP.get(t["dtype"], 0.0)]
    lr_text = ", ".join(f"{lr:.3g}" for lr in lrs)
    if below:  # the largest update-to-weight ratio that still rounds away
        worst = max(below, key=lambda t: t["ratio"])
        details["largest_update_ratio"] = worst["ratio"]
        why = (f"{worst['optimizer']} at lr {lr_text} asks for updates of at most {worst['ratio']:.2g} of a weight, "
               f"below {worst['dtype']}'s resolution (half an ulp = {HALF_ULP[worst['dtype']]:.2g} of the weight), "
               "so they round away")
    else:
        why = f"at lr {lr_text} their updates were lost to {', '.join(dtypes)} rounding"
    names = f"{', '.join(sorted(stalled)[:3])}{', ...' if len(stalled) > 3 else ''}"
    message = (f"{len(stalled)} of the {len(tensors)} trained {what} ({weight_share:.1%} of their weights) did not "
               f"move at the first {steps} although their gradients were non-zero ({names}): {why}")
    hint = ("keep the weights in float32 and run the forward under torch.autocast(device_type, dtype=torch.bfloat16) "
            "(or your trainer's bf16 mixed precision); else use an optimizer with Kahan summation or stochastic "
            "rounding, or a larger learning rate")
    if max(tensor_share, weight_share) >= STALE_FAIL_SHARE:
        return Result.failed(message, hint, details)
    return Result.warned(message, hint, details)
