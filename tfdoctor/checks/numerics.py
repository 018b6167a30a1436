"""Numerics checks: are the attention weights a proper distribution, and does the mask survive
reduced precision?"""

from __future__ import annotations

from tfdoctor.checks.verdicts import judged_per_implementation
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.tasks import pooled_scores

# Probe batch for both checks: one forward pass each (per dtype), so small.
PROBE_ROWS = 2

# softmax-mask-order: a row of weights counts as "off" when its sum is further than this from 1.
# Float32 softmax rows sum to 1 within ~1e-6 at probe lengths; the bug leaves row i of a causal
# mask with (i + 1) / T of the mass at initialisation, so even the last-but-one row is ~1/T (0.03 at
# T = 32) short. 1e-3 sits well between. Half-precision weights round each entry, so the tolerance
# is never tighter than ROUNDING_EPS_MULTIPLE machine epsilons of the weights' dtype (0.016 for
# float16, 0.125 for bfloat16).
ROW_SUM_TOLERANCE = 1e-3
ROUNDING_EPS_MULTIPLE = 16
# Sites named in the message; the details list them all.
SITES_SHOWN = 3
# finite-logits: positions listed per row in the details.
FINITE_POSITIONS_LISTED = 32

MASK_ORDER_HINT = (
    "mask the scores before the softmax and never the probabilities after it: "
    "att = scores.masked_fill(~allowed, float('-inf')).softmax(dim=-1) (allowed = "
    "torch.tril(torch.ones(T, T, dtype=torch.bool))), or F.scaled_dot_product_attention(q, k, v, "
    "is_causal=True); if you must mask afterwards, renormalise: att = att / att.sum(-1, keepdim=True)"
)

HALF_MASK_HINT = (
    "fill masked scores with a value that fits the dtype they are in: "
    "scores.masked_fill(blocked, torch.finfo(scores.dtype).min) (or float('-inf') where no row is "
    "fully masked) instead of a literal such as -1e9"
)


def _probe_ids(subject, seed_offset: int):
    """Random ids for one forward: (ids,) or, for seq2seq, (src, tgt)."""
    import torch

    from tfdoctor.context import current
    from tfdoctor.subject import random_tokens

    generator = torch.Generator().manual_seed(current().seed + seed_offset)
    count = 2 if subject.kind == "seq2seq" else 1
    return tuple(random_tokens(subject, PROBE_ROWS, subject.seq_len, generator) for _ in range(count))


def row_sum_tolerance(dtype_name: str) -> float:
    import torch

    dtype = getattr(torch, dtype_name.removeprefix("torch."), torch.float32)
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(ROW_SUM_TOLERANCE, ROUNDING_EPS_MULTIPLE * eps)


@check("finite-logits", title="The logits are finite on valid random tokens")
def finite_logits(subject) -> Result:
    """Catches a model whose logits are NaN or Inf on ordinary input (random tokens, no padding): a
    causal mask that leaves some query row with no key (softmax over all -inf), a root or a division
    at zero, an overflow. Every other check would misjudge such logits, so when the first call
    tfdoctor makes already gives NaN this check fails and the model checks are skipped.

    One forward in eval mode under no_grad on random tokens (the row of tfdoctor's first call and
    two more); fails naming the rows and positions that are NaN or Inf (or -inf over the whole
    vocabulary), the positions NaN in every row (a mask row that blocks every key), and the op and
    module where the first NaN appears.

    Fix: build masks that leave every query at least one key (its own position); fill with
    `torch.finfo(scores.dtype).min`; keep epsilons inside roots and denominators.
    """
    import torch

    from tfdoctor.modes import evaluation
    from tfdoctor.probes.nonfinite import explained, first_nonfinite
    from tfdoctor.subject import call

    ids = _finite_probe_ids(subject)
    with torch.no_grad(), evaluation(subject.model):
        logits = call(subject, *ids)
        bad = (torch.isnan(logits) | torch.isposinf(logits)).any(-1) | torch.isneginf(logits).all(-1)  # (B, T)
        bad = bad.reshape(logits.shape[0], -1)  # a pooled classifier's one prediction per row: (B, 1)
        origin = first_nonfinite(subject.model, lambda: call(subject, *ids)) if bool(bad.any()) else None
    B, T = bad.shape
    details = {"probe_shape": [B, T], "nonfinite_positions": int(bad.sum()), "positions": B * T}
    if not bool(bad.any()):
        if T == 1 and logits.dim() == 2:  # a pooled classifier: one prediction per row, no positions
            return Result.passed(f"all {B} random rows give finite {pooled_scores(subject.task)}", details)
        return Result.passed(f"all {B * T} positions of {B} random rows give finite logits", details)
    rows = {r: [int(t) for t in bad[r].nonzero().flatten().tolist()] for r in range(B) if bool(bad[r].any())}
    everywhere = [int(t) for t in bad.all(0).nonzero().flatten().tolist()]
    details.update({"rows": {str(r): ps[:FINITE_POSITIONS_LISTED] for r, ps in rows.items()},
                    "nan_in_every_row": everywhere, "first_nonfinite": origin.to_dict() if origin else None})
    shown = "; ".join(f"row {r}: positions {_spans(ps)}" for r, ps in list(rows.items())[:SITES_SHOWN])
    cause, hint = explained(origin)
    if everywhere and len(everywhere) < T:
        which = f"positions {_spans(everywhere)} are" if len(everywhere) > 1 else f"position {everywhere[0]} is"
        cause += (f"; {which} NaN in every row, so the likely cause is the mask row of that query, which blocks "
                  "every key")
        hint = ("leave every query at least one key, its own position (torch.triu(ones, diagonal=1) as the "
                "blocked mask, torch.tril(ones) as the allowed one); " + hint)
    return Result.failed(f"the logits are NaN/Inf at {int(bad.sum())} of {B * T} positions on valid random tokens "
                         f"({shown}): {cause}", hint, details)


def _finite_probe_ids(subject):
    """tfdoctor's first call's row (seed 0, as subject resolution draws it) and random ones, as many
    rows in all as the probe batch: some models take only batches of a certain size (MusicGen's rows
    are the codebooks of its samples)."""
    import torch

    from tfdoctor.context import current
    from tfdoctor.subject import random_tokens

    first = torch.Generator().manual_seed(0)
    others = torch.Generator().manual_seed(current().seed + 13)
    count = 2 if subject.kind == "seq2seq" else 1
    heads = [random_tokens(subject, 1, subject.seq_len, first) for _ in range(count)]
    rest = [random_tokens(subject, max(1, subject.batch_size - 1), subject.seq_len, others) for _ in range(count)]
    return tuple(torch.cat([head, more]) for head, more in zip(heads, rest))


def _spans(positions: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            spans.append(f"{start}" if start == p else f"{start}-{p}")
            start = None
    return ", ".join(spans)


@check("softmax-mask-order", title="Attention weights are masked before the softmax and sum to one",
       located=("attention",))
def softmax_mask_order(subject) -> Result:
    """Catches a mask applied to the attention probabilities after the softmax (zeroed or multiplied
    out) instead of to the scores before it: the rows stop summing to one, so every token's output
    is shrunk by an arbitrary, position-dependent factor, and the future still moves the softmax's
    normaliser.

    Runs one forward in eval mode under no_grad on random tokens and watches every softmax (any
    spelling: torch.softmax, F.softmax, Tensor.softmax) through masking, dropout, casts and
    reshapes until it is multiplied with V (matmul, @, bmm, einsum) over the softmax's own axis.
    Each row of weights that reaches V must sum to one within 1e-3. Rows that are all zero or
    non-finite (fully masked rows in padded batches) are left to masked-row-nan. Models whose
    attention runs inside fused F.scaled_dot_product_attention pass with a note: the kernel masks
    before its softmax. A model where no softmax reaches a product is skipped.

    Fix: mask before the softmax: `scores.masked_fill(~allowed, float('-inf')).softmax(-1)`, or
    `is_causal=True` with SDPA.
    """
    return judged_per_implementation(subject, lambda implementation: _softmax_mask_order(subject))


def _softmax_mask_order(subject) -> Result:
    import torch

    from tfdoctor.modes import evaluation
    from tfdoctor.probes.attention import capture_attention
    from tfdoctor.subject import call

    ids = _probe_ids(subject, seed_offset=11)
    with torch.no_grad(), evaluation(subject.model):
        capture = capture_attention(subject.model, lambda: call(subject, *ids))

    fused = sum(capture.fused_calls.values())
    fused_note = (f"; {fused} fused attention call(s) ({', '.join(sorted(capture.fused_calls))}) mask "
                  "inside the call" if fused else "")
    sites = []
    for use in capture.uses:
        tolerance = row_sum_tolerance(use.dtype)
        sums = use.row_sums
        sites.append({
            "module": use.site, "product": use.product, "shape": use.shape, "dtype": use.dtype,
            "rows": use.rows, "rows_off": use.off_rows(tolerance), "tolerance": tolerance,
            "rows_off_in_magnitude": use.off_rows_in_magnitude(tolerance),
            "min_row_sum": float(sums.min()) if sums.numel() else None,
            "max_row_sum": float(sums.max()) if sums.numel() else None,
            "zero_rows": use.zero_rows, "nonfinite_rows": use.nonfinite_rows,
        })
    details = {"softmax_calls": capture.softmaxes, "weights_reaching_v": len(sites),
               "fused_attention_calls": dict(capture.fused_calls), "sites": sites,
               "probe_shape": [PROBE_ROWS, subject.seq_len]}

    if not sites:
        if fused:
            return Result.passed(f"attention runs only inside fused or library calls ({fused} call(s) to "
                                 f"{', '.join(sorted(capture.fused_calls))}), which mask before their "
                                 "softmax: no weights to inspect", details)
        return Result.skipped(f"no softmax output reached a product with V in one forward "
                              f"({capture.softmaxes} softmax call(s) seen): attention is computed in a way "
                              "this check cannot follow", details)

    signed = [site for site in sites if site["rows_off"] and not site["rows_off_in_magnitude"]]
    bad = [site for site in sites if site["rows_off"] and site["rows_off_in_magnitude"]]
    rows = sum(site["rows"] for site in sites)
    signed_note = (f"; {len(signed)} site(s) ({signed[0]['module']}{' ...' if len(signed) > 1 else ''}) carry "
                   "signed weights whose magnitudes sum to 1 (signed or Cog attention: the sign of each score "
                   "put back after the softmax), which is not a mask" if signed else "")
    if not bad:
        deviation = max((max(abs(site["min_row_sum"] - 1), abs(site["max_row_sum"] - 1))
                         for site in sites if site["min_row_sum"] is not None and site not in signed),
                        default=0.0)
        return Result.passed(f"{len(sites)} attention softmax(es), {rows} rows of weights: every row "
                             f"reaching V sums to 1 (largest deviation {deviation:.1e}){signed_note}{fused_note}",
                             details)

    worst = min(bad, key=lambda site: site["min_row_sum"])
    rows_off = sum(site["rows_off"] for site in bad)
    rows_bad = sum(site["rows"] for site in bad)
    names = ", ".join(site["module"] for site in bad[:SITES_SHOWN]) + (
        f" and {len(bad) - SITES_SHOWN} more" if len(bad) > SITES_SHOWN else "")
    return Result.failed(
        f"attention weights that multiply V do not sum to one in {len(bad)} of {len(sites)} softmax "
        f"site(s) ({names}): {rows_off} of {rows_bad} rows are off by more than {worst['tolerance']:g}, "
        f"row sums go down to {worst['min_row_sum']:.3f} in {worst['module']}; the probabilities are "
        "masked after the softmax, so each position's output is shrunk by the mass the mask removed",
        MASK_ORDER_HINT, details)


@check("half-precision-mask", title="The attention mask survives float16 and bfloat16 autocast")
def half_precision_mask(subject) -> Result:
    """Catches mask constants that do not fit reduced precision: masked_fill(mask, -1e9) raises
    "value cannot be converted to type c10::Half without overflow" as soon as the model runs under
    float16 autocast, and a constant that silently saturates to -inf (torch.where, arithmetic) turns
    fully masked rows into NaN.

    Runs the forward in eval mode under no_grad on random tokens, once in the model's own precision
    and once under torch.autocast on the model's device for each of float16 and bfloat16 (CPU
    autocast supports both and computes the attention scores in float16 as CUDA does), watching
    every constant that goes into a float16 or bfloat16 tensor. An overflow error, or outputs that
    turn NaN/Inf where the model's own precision gives finite ones, fail, naming the constant, the
    module and the dtype. A constant that silently becomes +-inf while the outputs stay finite warns.

    Fix: fill with the dtype's own minimum: `scores.masked_fill(blocked,
    torch.finfo(scores.dtype).min)`.
    """
    return judged_per_implementation(subject, lambda implementation: _half_precision_mask(subject))


def _half_precision_mask(subject) -> Result:
    import torch

    from tfdoctor.modes import evaluation
    from tfdoctor.probes.autocast import autocast_run
    from tfdoctor.subject import call, device_of

    device = device_of(subject.model).type
    if not torch.amp.is_autocast_available(device):
        return Result.skipped(f"autocast is not available on {device}")
    dtypes = [torch.float16, torch.bfloat16]
    unsupported = []
    if device == "cuda" and not torch.cuda.is_bf16_supported():
        dtypes.remove(torch.bfloat16)
        unsupported.append("bfloat16")

    ids = _probe_ids(subject, seed_offset=12)
    with torch.no_grad(), evaluation(subject.model):
        reference = call(subject, *ids)
        own = str(reference.dtype).removeprefix("torch.")
        reference = reference.float()
        if not bool(torch.isfinite(reference).all()):
            return Result.skipped(f"the outputs are already NaN/Inf in the model's own precision ({own}), "
                                  "so reduced precision cannot be judged (see masked-row-nan)")
        runs = {str(dtype).removeprefix("torch."): autocast_run(subject, device, dtype, ids, reference)
                for dtype in dtypes}
    details = {"device": device, "own_dtype": own, "runs": runs, "unsupported_dtypes": unsupported,
               "probe_shape": [PROBE_ROWS, subject.seq_len]}
    failures = {name: run for name, run in runs.items() if run["outcome"] in ("overflow error", "non-finite")}
    if failures:
        return Result.failed("; ".join(_failure(name, run, own) for name, run in failures.items()),
                             HALF_MASK_HINT, details)
    saturated = [(name, run) for name, run in runs.items() if run["constants"]]
    if saturated:
        padded = _padded_runs(subject, device, [name for name, _ in saturated])
        details["padded_runs"] = padded
        broken = {name: run for name, run in (padded or {}).items()
                  if run["outcome"] in ("overflow error", "non-finite")}
        if broken:
            name, run = next(iter(broken.items()))
            constant = run["constants"][0] if run["constants"] else saturated[0][1]["constants"][0]
            return Result.failed(
                f"with a fully padded row, under {name} autocast {run.get('nonfinite_outputs', 0)} of "
                f"{run.get('outputs', 0)} outputs are NaN/Inf (finite in {own}): the constant {constant['value']:g} "
                f"in {constant['op']} (module {constant['module']}) does not fit {name} and becomes "
                f"{'-' if constant['value'] < 0 else '+'}inf", HALF_MASK_HINT, details)
    raised = {name: run for name, run in runs.items() if run["outcome"] == "raised"}
    if raised:
        return Result.warned(
            "; ".join(f"the forward cannot run under {name} autocast: {run['error']} (raised at {run['at']})"
                      for name, run in raised.items())
            + ", so the mask could not be judged there", "run the model under the autocast dtype you train with, "
            "and keep in-place writes out of autocast regions (or write into a buffer of the autocast dtype)",
            details)
    note = ""
    if saturated:
        name, run = saturated[0]
        constant = run["constants"][0]
        why = ("even with a fully padded row in the batch" if padded is not None else
               "without padding no row is fully masked (pass --pad-id to probe a padded batch)")
        note = (f"; note: the constant {constant['value']:g} in {constant['op']} (module {constant['module']}) "
                f"saturates to {'-' if constant['value'] < 0 else '+'}inf under {name} ({run['constants_seen']} "
                f"use(s)), and the outputs stay finite {why}")
    spread = ", ".join(f"{name} {run['max_abs_difference']:.2g}" for name, run in runs.items())
    return Result.passed(f"finite outputs under {' and '.join(runs)} autocast on {device}; largest "
                         f"difference from {own}: {spread}{note}", details)


def _failure(name: str, run: dict, own: str) -> str:
    import torch

    constant = run["constants"][0] if run["constants"] else None
    raised = run["outcome"] == "overflow error"
    if constant:
        where = (f"the constant {constant['value']:g} in {constant['op']} (module {constant['module']}) "
                 f"does not fit {name} (largest {torch.finfo(getattr(torch, name)).max:g})")
    elif raised:
        where = "the value that overflowed was not a constant passed to a torch call"
    else:
        where = "no out-of-range constant was seen, so activations overflow the dtype's range"
    if raised:
        return f"under {name} autocast the forward raises \"{run['error']}\": {where}"
    return (f"under {name} autocast {run['nonfinite_outputs']} of {run['outputs']} outputs are NaN/Inf "
            f"(finite in {own}): {where}")


def _padded_runs(subject, device: str, names: list[str]):
    """The autocast runs of `names` on a batch with a fully padded row (where a saturated -inf mask
    constant can matter); None without a pad id (no row is ever fully masked then)."""
    import torch

    from tfdoctor.context import current
    from tfdoctor.modes import evaluation
    from tfdoctor.probes.autocast import autocast_run
    from tfdoctor.probes.padding import padded_batch
    from tfdoctor.subject import call

    if subject.pad_id is None:
        return None
    batch = padded_batch(subject, torch.Generator().manual_seed(current().seed + 14), fully_padded_row=True)
    with torch.no_grad(), evaluation(subject.model):
        reference = call(subject, *batch.inputs).float()
        return {name: autocast_run(subject, device, getattr(torch, name), batch.inputs, reference) for name in names}
