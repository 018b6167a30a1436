"""Padding checks: pads must be invisible to real positions, and must not turn into NaN."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tfdoctor.checks.verdicts import judged_per_implementation
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.tolerances import RELATIVE_TOLERANCE

MAX_LISTED_POSITIONS = 8

KEY_PADDING_HINT = (
    "mask the pad keys in every attention layer: keep = (ids != pad_id)[:, None, None, :] "
    "(B, 1, 1, T), scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min); with "
    "nn.MultiheadAttention/nn.Transformer pass key_padding_mask=(ids == pad_id); Hugging Face "
    "models take attention_mask=(ids != pad_id)"
)


SIDE_HINT = ("if you only ever pad on the right (the causal mask then hides the pads), say so: "
             "--padding-side right or Subject(padding_side='right'); otherwise ")


@dataclass
class _SideVerdict:
    """What padding one side showed: a reason it could not be measured, or the leaked positions."""

    side: str
    details: dict
    skip: Optional[str] = None
    leaked: list = field(default_factory=list)
    real_count: int = 0


def _measure_side(subject, side: str, seed: int) -> _SideVerdict:
    from tfdoctor.probes.padding import pad_sensitivity

    sensitivity = pad_sensitivity(subject, seed, side)
    if sensitivity is None:
        return _SideVerdict(side, {}, skip="cannot find the input embedding to perturb the pads through")
    if sensitivity.embedding_calls == 0:
        return _SideVerdict(side, {}, skip="the input embedding was never called with the probe ids")
    batch = sensitivity.batch
    real = batch.real_outputs.cpu()
    details = {"pad_side": side, "pads_per_row": batch.padded.sum(1).tolist()}
    if not bool(sensitivity.finite[real].all()):
        return _SideVerdict(side, details, skip=f"real positions are already NaN/Inf on a {side}-padded batch, so "
                                                "what they read cannot be measured; see masked-row-nan")
    tolerance = RELATIVE_TOLERANCE * max(sensitivity.scale, 1e-30)
    moved = sensitivity.change > tolerance
    details.update(tolerance=tolerance, largest_change=float(sensitivity.change[real].max()),
                   output_scale=sensitivity.scale)
    if subject.kind != "seq2seq" and not bool((moved & batch.padded.cpu()).any()):
        return _SideVerdict(side, details, skip="perturbing the pad embeddings moved nothing, not even the pads' "
                                                "own outputs")
    leaked = (moved & real).nonzero().tolist()
    if leaked:
        details["moved_positions"] = [{"row": r, "position": p} for r, p in leaked[:MAX_LISTED_POSITIONS]]
        details["moved_count"] = len(leaked)
        if subject.kind != "seq2seq":
            details["largest_attention_on_pads"] = _attention_on_pads(subject, batch)
    return _SideVerdict(side, details, leaked=leaked, real_count=int(real.sum()))


def _attention_on_pads(subject, batch):
    """The largest share of a real query's softmax weights on pad keys in the padded batch (None
    when no weights are seen: a fused kernel, or attention not over the ids' positions)."""
    import torch

    from tfdoctor.probes.attention import pad_attention
    from tfdoctor.subject import call

    with torch.no_grad():
        return pad_attention(subject.model, lambda: call(subject, *batch.inputs), batch.padded)


def _how_read(verdict: _SideVerdict) -> tuple[str, str]:
    """(verb, note): how the pads reach real positions, as the softmax weights on pad keys show."""
    from tfdoctor.probes.padding import how_pads_are_read

    return how_pads_are_read(verdict.details.get("largest_attention_on_pads"))


def _leak_message(subject, verdict: _SideVerdict) -> str:
    listed = ", ".join(f"row {r} pos {p}" for r, p in verdict.leaked[:4])
    more = ", ..." if len(verdict.leaked) > 4 else ""
    if subject.kind == "seq2seq":
        seen = "the decoder reads the source pads"
    elif subject.kind == "causal" and verdict.side == "right":
        seen = "with right padding real positions read the pads after them (later positions)"
    elif subject.kind == "causal":
        verb, how = _how_read(verdict)
        seen = f"with left padding real positions {verb} the pads before them{how}"
    else:
        verb, how = _how_read(verdict)
        seen = f"with {verdict.side} padding real positions {verb} the pads{how}"
    return (f"{seen}: {len(verdict.leaked)} of {verdict.real_count} real outputs change when only the pad "
            f"positions' content changes ({listed}{more}); pad id {subject.pad_id} is not masked")


def _hint(verdict: _SideVerdict) -> str:
    """The key mask; and zeroing the pads where what reads them is not attention."""
    from tfdoctor.probes.padding import PAD_ATTENTION_SHARE

    share = verdict.details.get("largest_attention_on_pads")
    if share is not None and share > PAD_ATTENTION_SHARE[1]:
        return KEY_PADDING_HINT
    return (KEY_PADDING_HINT + "; where a convolution, recurrence or mean runs over positions, zero the pads "
            "first (x = x * (ids != pad_id)[..., None]) or exclude them from the mean")


def _answers_change_padded(subject, details: dict, side: str = "left") -> bool:
    """Whether the probe sequences, padded on `side` with the real pad id, get other logits than alone
    (as padding-equivalence compares them, position ids from the mask for Hugging Face causal LMs).
    A model can read its pads' content and still answer the same when the pad token's own embedding
    changes nothing (RecurrentGemma's recurrence), or can never change (a pinned padding_idx row)."""
    import torch

    from tfdoctor.context import current
    from tfdoctor.modes import evaluation
    from tfdoctor.probes.invariance import alone, compare_padded

    with evaluation(subject.model):  # as padding-equivalence compares them: dropout off
        probe = alone(subject, torch.Generator().manual_seed(current().seed + 11))
        arrangement = compare_padded(subject, probe, side)
    details[f"{side}_padded_vs_alone"] = float(arrangement.diff[arrangement.real].max())
    return bool(arrangement.differs.any())


def _pinned_pad_leak(subject, worst: _SideVerdict, details: dict) -> Optional[Result]:
    """A pass when only the pads' token embedding leaks and it can never change (probes/padding.
    pad_row_pinned): the rows padded on that side get the logits they get alone. None otherwise."""
    from tfdoctor.probes.padding import pad_row_pinned

    side = worst.side
    if subject.kind == "seq2seq" or not pad_row_pinned(subject) or _answers_change_padded(subject, details, side):
        return None
    return Result.passed(
        f"{worst.details['moved_count']} of {worst.real_count} real outputs move when the pads' token "
        f"embedding is changed ({side} padding, largest change {worst.details['largest_change']:.2g}), but "
        f"nn.Embedding(padding_idx={subject.pad_id}) keeps that embedding fixed in training, and {side}-padded "
        f"rows get the logits they get alone (largest difference {details[f'{side}_padded_vs_alone']:.2g}): "
        "nothing about the pads reaches them", details)


@check("padding-mask", title="Real positions ignore what sits at pad positions", needs=("pad_id",),
       located=("attention",))
def padding_mask(subject) -> Result:
    """Catches padding that is attended to: outputs at real positions that change with the content
    of pad positions, so the same sentence predicts differently with more or less padding.

    Pads the probe batch on the side the model is trained with (--padding-side, Subject(padding_side=)
    or the tokenizer's), then pushes the pad positions' embeddings far off through a forward hook
    while keeping the ids, so the model builds its own mask exactly as in training, and compares the
    real positions' outputs. A causal model trained on right-padded batches needs no key-padding
    mask (its causal mask hides the trailing pads) and passes without one. Where the side is unknown
    a causal model is probed on both sides: attending to right pads fails (real positions see later
    ones); attending to left pads fails where left padding is evidenced (a Hugging Face model whose
    generate() pads batched prompts on the left and reads their mask) and otherwise warns, naming
    --padding-side: a model, even one handed a key mask, is sound when only ever right-padded.
    Encoders and seq2seq sources are padded on the right unless declared.

    Fix: a `(B, 1, 1, T)` key mask `(ids != pad_id)[:, None, None, :]` filled with
    `torch.finfo(scores.dtype).min`; `attention_mask=` for Hugging Face models; or declare
    `--padding-side right` when you only pad on the right.
    """
    from tfdoctor.context import current
    from tfdoctor.modes import evaluation
    from tfdoctor.probes.padding import left_padding_evidenced, probed_sides

    declared = subject.padding_side
    sides = probed_sides(subject)

    def judge(implementation) -> Result:
        with evaluation(subject.model):
            verdicts = [_measure_side(subject, side, current().seed + 3) for side in sides]
        measured = [v for v in verdicts if v.skip is None]
        if not measured:
            return Result.skipped(verdicts[0].skip, verdicts[0].details)
        details = {**measured[0].details, "declared_side": declared,
                   "sides": {v.side: v.details if v.skip is None else {"skipped": v.skip} for v in verdicts}}
        leaking = [v for v in measured if v.leaked]
        if not leaking:
            pads = " and ".join(f"{v.side} padding, {sum(v.details['pads_per_row'])} pads" for v in measured)
            where = "source " if subject.kind == "seq2seq" else ""
            unmeasured = "".join(f"; {v.side} padding not measured: {v.skip}" for v in verdicts if v.skip)
            return Result.passed(f"no real position reacts to the {where}pad positions ({pads}){unmeasured}",
                                 details)
        worst = leaking[0]
        details.update(worst.details)
        inert = _pinned_pad_leak(subject, worst, details)
        if inert is not None:
            return inert
        message = _leak_message(subject, worst)
        unknown_left = declared is None and subject.kind == "causal" and worst.side == "left"
        evidence = unknown_left and left_padding_evidenced(subject)
        if evidence and _answers_change_padded(subject, details):
            message += f"; {evidence}"
        elif unknown_left:
            # Unknown side, no evidence of left padding: the right side was clean, so right-padded training is sound.
            right = next(v for v in verdicts if v.side == "right")
            safe = ("right padding is safe (the causal mask hides trailing pads)" if right.skip is None
                    else f"right padding was not measured ({right.skip})")
            if "left_padded_vs_alone" in details:  # left padding evidenced, yet the same answers
                safe += ("; left-padded rows still get the logits they get alone (the pad token's own "
                         "embedding happens to change nothing), but pads with other content are read")
            return Result.warned(
                f"{message}; {safe}, so this matters only for batched generation or training on left-padded "
                "batches", SIDE_HINT + _hint(worst), details)
        if declared is not None:
            message += f" ({declared} padding, as declared)"
        return Result.failed(message, _hint(worst), details)

    return judged_per_implementation(subject, judge)


@check("masked-row-nan", title="Fully masked rows stay finite in outputs and gradients", needs=("pad_id",),
       located=("attention",))
def masked_row_nan(subject) -> Result:
    """Catches -inf masks that turn a query with nothing to attend to into NaN: a fully padded row,
    or the first queries of a left-padded row that see only pads. The loss ignores those positions,
    so it looks fine, but NaN reaches the gradients and then every weight.

    Runs a batch with one fully padded row and rows padded on the declared side (unknown: left for
    causal models, right for encoders and seq2seq sources), takes a cross-entropy that ignores pads,
    and checks the outputs and the gradients (computed with torch.autograd.grad, so the model's .grad
    stays untouched) for NaN and Inf.

    Fix: fill masks with `torch.finfo(scores.dtype).min` instead of `float('-inf')`.
    """
    import torch

    from tfdoctor.context import current
    from tfdoctor.probes.loss import random_targets, task_loss
    from tfdoctor.probes.nonfinite import explained, first_nonfinite
    from tfdoctor.probes.padding import padded_batch
    from tfdoctor.probes.process_state import BackwardRefused, DropoutOff
    from tfdoctor.subject import call
    from tfdoctor.tasks import pooled

    params = [(name, p) for name, p in subject.model.named_parameters() if p.requires_grad]
    if not params:
        return Result.skipped("the model has no trainable parameters")

    def judge(implementation) -> Result:
        generator = torch.Generator().manual_seed(current().seed + 4)
        # A pooled classifier's row always holds its text (or a [CLS]): an empty row is a data bug, and
        # PyTorch's own fused encoder layer (a frozen nn.TransformerEncoder in eval) returns NaN for it.
        empty_row = not pooled(subject.task)
        batch = padded_batch(subject, generator, fully_padded_row=empty_row)
        graded = batch.real_outputs.clone()
        if subject.kind == "seq2seq":
            graded[0] = False  # the target of an all-padding source is not graded either
        targets = random_targets(subject, graded, generator)  # a classifier: its labels, -100 on unread rows

        def forward_backward():
            logits = call(subject, *batch.inputs)
            loss = task_loss(subject, logits, targets)
            return logits, loss, torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)

        # eval() switches dropout off; a backward that refuses eval() (Reformer, RWKV) runs in train()
        # with every dropout at p=0 instead
        try:
            with DropoutOff(subject.model) as dropout_off, torch.enable_grad():
                logits, loss, grads = dropout_off.step(forward_backward)
        except BackwardRefused as refused:
            return Result.skipped(f"no gradient can be taken at these shapes: {refused} (pass the --seq-len "
                                  "the model trains at)")
        bad_outputs = (~torch.isfinite(logits.detach()).all(dim=-1)).cpu().reshape(logits.shape[0], -1)  # (B, T or 1)
        bad_params = [name for (name, _), g in zip(params, grads)
                      if g is not None and not bool(torch.isfinite(g).all())]
        details = {"pad_side": batch.side, "pads_per_row": batch.padded.sum(1).tolist(),
                   "loss": float(loss.detach()), "nonfinite_outputs": int(bad_outputs.sum()),
                   "nonfinite_grad_params": bad_params[:MAX_LISTED_POSITIONS],
                   "nonfinite_grad_param_count": len(bad_params)}
        if not int(bad_outputs.sum()) and not bad_params:
            return Result.passed("outputs and gradients stay finite with " + ("a fully padded row and " if empty_row
                                 else "") + f"{batch.side}-padded rows", details)
        rows = sorted({r for r, _ in bad_outputs.nonzero().tolist()})
        details["nonfinite_rows"] = rows
        seen = []
        if int(bad_outputs.sum()):
            seen.append(f"{int(bad_outputs.sum())} output positions are NaN/Inf (rows {rows[:6]}"
                        + ("; row 0 is fully padded)" if empty_row else ")"))
        if bad_params:
            seen.append(f"{len(bad_params)} parameters get NaN/Inf gradients although the loss ignores the pads "
                        f"(loss {float(loss.detach()):.3g})")
        with DropoutOff(subject.model) as dropout_off, torch.enable_grad():  # which op made it, and where
            origin = dropout_off.step(lambda: first_nonfinite(subject.model, forward_backward))
        details["first_nonfinite"] = origin.to_dict() if origin else None
        cause, hint = explained(origin)
        return Result.failed("; ".join(seen) + ": " + cause, hint, details)

    return judged_per_implementation(subject, judge)
