"""The padding checks on a pooled prediction: a sequence classifier's class scores [B, C] (or a
regression head's values [B, K]) judged by padding-mask and padding-equivalence, whose own
implementations read one output per position. Registered as those checks' judges for the pooled
tasks (registry.judges): same ids, same problem, seen in the class scores.

The bugs: a mean over every position, pads included; the last position pooled from right-padded rows
(a pad, not the last token); an encoder that attends to its pads; a mean divided by the padded
length. Each moves a row's class scores with the pads around it, which a correctly masked model never
does.
"""

from __future__ import annotations

from tfdoctor.registry import POOLED_TASKS, judges
from tfdoctor.result import Result, counted
from tfdoctor.tasks import pooled_scores

MAX_LISTED = 6

HINTS = {
    "edge-position": ("pool the last real token of each row, not position -1: last = mask.sum(1) - 1 with "
                      "mask = (ids != pad_id); pooled = states[torch.arange(B), last] (or pad on the left)"),
    "attends-pads": ("mask the pad keys in every attention layer: src_key_padding_mask=(ids == pad_id) for "
                     "nn.TransformerEncoder, or scores.masked_fill((ids == pad_id)[:, None, None, :], "
                     "torch.finfo(scores.dtype).min); Hugging Face models take attention_mask=(ids != pad_id)"),
    "mixes-pads": ("mask the pads in every layer that mixes positions, or zero the pads' states before it "
                   "(states * (ids != pad_id).unsqueeze(-1)); a library model whose mixing takes no mask (FNet, "
                   "Nystromformer) must get every batch padded to one fixed length, as it was pretrained "
                   "(tokenizer(..., padding='max_length'))"),
    "pools-pads": ("average over the real tokens only: keep = (ids != pad_id).unsqueeze(-1); pooled = "
                   "(states * keep).sum(1) / keep.sum(1).clamp(min=1)"),
    "reads-pads": ("mask the pads out of the attention (attention_mask / src_key_padding_mask) and out of the "
                   "pooling (a mean over the real tokens only, or the last real token)"),
    "pad-count": ("divide a masked sum by each row's real token count (mask.sum(1)), not by the padded length "
                  "T; with left padding, count positions from each row's first real token"),
}
CAUSES = {
    "edge-position": "only the pad at the row's {edge} position moves them: the head pools that position, "
                     "which is a pad in a {side}-padded row, not the row's {token} token",
    "attends-pads": "the pads' content moves them and reaches the encoder's states at real positions{share}: "
                    "the encoder attends to its pads",
    "mixes-pads": "the pads' content moves them and reaches the encoder's states at real positions, though not "
                  "through attention to the pad keys{share}: a layer that mixes positions without the pad mask "
                  "takes them in (FNet's Fourier transform, MobileBERT's trigram input, Nystromformer's landmarks, "
                  "a convolution over positions)",
    "pools-pads": "the pads' content moves them, although the encoder's states at real positions ignore it: "
                  "the pooling (a mean or max over every position) takes the pads in",
    "reads-pads": "the pads' content moves them: the pads reach the pooled state (attention to the pads, or a "
                  "pooling over every position)",
    "pad-count": "the pads' content changes nothing, yet their number does: a mean divided by the padded length, "
                 "or positions counted from the row's start",
}


def _side(subject) -> tuple[str, str]:
    """The side judged and why: the declared (or tokenizer's) side, else right, the side classifier
    tokenizers pad on by default (BERT, RoBERTa, GPT-2's)."""
    if subject.padding_side:
        return subject.padding_side, ""
    return "right", " (right padding, the classifier tokenizers' default; pass --padding-side left if you pad left)"


def _cause_text(cause: str, evidence: dict, side: str) -> str:
    edge, token = ("last", "last real") if side == "right" else ("first", "first real")
    share = evidence.get("largest_attention_on_pads")
    if cause == "mixes-pads":
        share = "" if share is None else f" (real tokens give them {share:.2g} of their attention)"
    else:
        share = f" (real tokens give the pad keys up to {share:.2g} of their attention)" if share else ""
    return CAUSES[cause].format(edge=edge, side=side, token=token, share=share)


def _blamed(subject, rows, generator, side: str, details: dict, seen: str) -> Result:
    """The finding once rows moved: `seen`, then the pooling's cause as measured, located where it is.
    A failure, or a warning for a pooled edge position on a side nobody declared: a head that pools the
    last position (XLNet's summary, a hand-written x[:, -1]) is right on left-padded rows, and XLNet's
    own tokenizer pads on the left."""
    from tfdoctor.probes.pooled import pooling_cause

    cause, evidence = pooling_cause(subject, rows, generator)
    details.update(evidence, cause=cause)
    _located(subject, rows, cause, details)
    message = f"{seen}: {_cause_text(cause, evidence, side)}"
    if cause == "edge-position" and not subject.padding_side:
        return Result.warned(message + " (no padding side declared, so right, the common default, was judged: "
                             "pooling that position is correct on left-padded rows; pass --padding-side left if "
                             "you pad on the left)", HINTS[cause], details)
    return Result.failed(message, HINTS[cause], details)


def _judged(subject, judge) -> Result:
    """judge(implementation) in eval mode, under each attention implementation (as padding-equivalence)."""
    from tfdoctor.checks.verdicts import judged_per_implementation
    from tfdoctor.modes import evaluation
    from tfdoctor.probes.configured_implementation import judged_as_run

    def in_eval(implementation) -> Result:
        with evaluation(subject.model):
            return judge(implementation)

    return judged_per_implementation(subject, judged_as_run(subject.model, in_eval))


POOLING_CAUSES = ("edge-position", "pools-pads", "pad-count")


def _located(subject, rows, cause: str, details: dict) -> None:
    """A pooling bug is found where the pooled state meets the head: the user's line calling it (the
    runner would name the attention line, right only when the encoder attends to its pads)."""
    from tfdoctor.probes.pooled import head_site

    if cause in POOLING_CAUSES:
        where = head_site(subject, rows.ids)
        if where:
            details.update(location=where, call="the classification head, fed the pooled state")


def _pinned_and_equivalent(subject, rows, padded, tolerance: float):
    """When the pad token's embedding row can never change (probes/padding.pad_row_pinned), the largest
    difference between the padded rows' scores and the rows alone, if within `tolerance`; else None."""
    from tfdoctor.probes.padding import pad_row_pinned
    from tfdoctor.probes.pooled import alone_scores, row_gaps

    if not pad_row_pinned(subject):
        return None
    largest = float(row_gaps(padded, alone_scores(subject, rows)).max())
    return largest if largest <= tolerance else None


def _tie_order_only(subject, rows, tolerance: float):
    """The largest row difference between alone and padded once torch.topk breaks ties by position, when
    that brings every row within `tolerance` (the difference came from a selection's tie order, which
    moves with the row's length: probes/ties.py); None when rows still differ."""
    from tfdoctor.probes.pooled import alone_scores, row_gaps, scores
    from tfdoctor.probes.ties import ties_broken_by_position

    with ties_broken_by_position():
        gaps = row_gaps(scores(subject, rows.ids), alone_scores(subject, rows))
    largest = float(gaps.max())
    return largest if largest <= tolerance else None


def _noise(subject, rows) -> float:
    """How far two identical forwards of the padded rows are apart (0 for a deterministic model)."""
    from tfdoctor.probes.pooled import row_gaps, scores

    return float(row_gaps(scores(subject, rows.ids), scores(subject, rows.ids)).max())


@judges("padding-mask", tasks=POOLED_TASKS)
def pooled_padding_mask(subject) -> Result:
    """padding-mask on a pooled prediction: each row's class scores must not move when the content of
    its pads changes (the pad embeddings pushed far off, the ids and so every mask intact)."""
    import torch

    from tfdoctor.context import current
    from tfdoctor.probes.pooled import head_terms, pad_content_change, padded_rows, scores, tolerance

    side, why_side = _side(subject)
    named = pooled_scores(subject.task)

    def judge(implementation) -> Result:
        generator = torch.Generator().manual_seed(current().seed + 3)
        rows = padded_rows(subject, side, generator)
        base = scores(subject, rows.ids)
        tol = tolerance(base, terms=head_terms(subject, rows.ids))
        noise = _noise(subject, rows)
        if noise > tol:
            return Result.warned(f"two identical eval forwards gave {named} {noise:.3g} apart: the model is "
                                 "random at inference, so the pads' effect cannot be measured",
                                 "look for dropout that ignores eval mode (F.dropout(x, p) without training=)",
                                 {"noise": noise})
        change = pad_content_change(subject, rows, rows.pads, generator)
        if change is None:
            return Result.skipped("the input embedding was not found (or not called on the ids), so the pads' "
                                  "content cannot be changed")
        moved = [r for r in range(len(rows.lengths)) if float(change[r]) > tol]
        details = {"pad_side": side, "pads_per_row": rows.pads.sum(1).tolist(), "task": subject.task,
                   "largest_change": float(change.max()), "tolerance": tol,
                   "rows_moved": moved[:MAX_LISTED]}
        inert = _pinned_and_equivalent(subject, rows, base, tol) if moved else None
        if inert is not None:
            details["padded_vs_alone"] = inert
            return Result.passed(f"the {named} of {len(moved)} of {len(rows.lengths)} {side}-padded rows move when "
                                 f"the pads' token embedding is changed (largest change {float(change.max()):.2g}), "
                                 f"but nn.Embedding(padding_idx={subject.pad_id}) keeps that embedding fixed in "
                                 f"training, and the padded rows get the {named} they get alone (largest difference "
                                 f"{inert:.2g}): nothing about the pads reaches them{why_side}", details)
        if not moved:
            return Result.passed(f"the {named} of {len(rows.lengths)} {side}-padded rows do not move with "
                                 f"their pads' content (largest change {float(change.max()):.2g}){why_side}", details)
        return _blamed(subject, rows, generator, side, details,
                       f"the {named} of {len(moved)} of {len(rows.lengths)} {side}-padded rows move with "
                       f"their pads' content (largest change {float(change.max()):.3g})")

    return _judged(subject, judge)


@judges("padding-equivalence", tasks=POOLED_TASKS)
def pooled_padding_equivalence(subject) -> Result:
    """padding-equivalence on a pooled prediction: each row's class scores inside a padded batch must
    equal its scores alone, unpadded; the rows carry different numbers of pads (1 to T/2)."""
    import torch

    from tfdoctor.context import current
    from tfdoctor.probes.pooled import alone_scores, head_terms, padded_rows, row_gaps, scores, tolerance

    side, why_side = _side(subject)
    named = pooled_scores(subject.task)

    def judge(implementation) -> Result:
        generator = torch.Generator().manual_seed(current().seed + 7)
        rows = padded_rows(subject, side, generator)
        alone = alone_scores(subject, rows)
        padded = scores(subject, rows.ids)
        tol = tolerance(alone, padded, terms=head_terms(subject, rows.ids))
        noise = _noise(subject, rows)
        if noise > tol:
            return Result.warned(f"two identical eval forwards gave {named} {noise:.3g} apart: the model is "
                                 "random at inference, so arrangements cannot be compared",
                                 "look for dropout that ignores eval mode (F.dropout(x, p) without training=)",
                                 {"noise": noise})
        gaps = row_gaps(padded, alone)
        pads = rows.pads.sum(1).tolist()
        differs = [r for r in range(len(pads)) if float(gaps[r]) > tol]
        details = {"pad_side": side, "pads_per_row": pads, "task": subject.task,
                   "row_differences": [float(g) for g in gaps], "tolerance": tol,
                   "differing_rows": differs[:MAX_LISTED]}
        if not differs:
            return Result.passed(f"{len(pads)} rows get the same {named} alone as {side}-padded in a batch "
                                 f"({min(pads)} to {max(pads)} pads; largest difference {float(gaps.max()):.2g})"
                                 f"{why_side}", details)
        tied = _tie_order_only(subject, rows, tol)
        if tied is not None:
            details["largest_difference_with_ties_by_position"] = tied
            return Result.passed(f"{len(pads)} rows get the same {named} alone as {side}-padded in a batch once "
                                 f"torch.topk breaks ties by position (largest difference {tied:.2g}; "
                                 f"{counted(len(differs), 'row')} differed by up to {float(gaps.max()):.2g} through "
                                 "the order of tied scores in the model's top-k selection, not through the pads)"
                                 f"{why_side}", details)
        worst = max(differs, key=lambda r: float(gaps[r]))
        per_row = ", ".join(f"{pads[r]} pads: {float(gaps[r]):.3g}" for r in differs[:MAX_LISTED])
        if not bool(torch.isfinite(padded).all()):
            return Result.failed(f"with {side} padding the {named} of {len(differs)} of {len(pads)} rows are "
                                 "NaN/Inf, which they are not alone", HINTS["attends-pads"].replace(
                                     "torch.finfo(scores.dtype).min", "torch.finfo(scores.dtype).min (not -inf)"),
                                 details)
        return _blamed(subject, rows, generator, side, details,
                       f"with {side} padding, {len(differs)} of {len(pads)} rows get other {named} than the "
                       f"same sequence alone ({per_row}; largest in the row with {pads[worst]} pads)")

    return _judged(subject, judge)
