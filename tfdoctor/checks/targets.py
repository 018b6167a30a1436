"""Target judges: is each position graded on the right token (objective), and is padding left out of
the loss (ignore-index)? Both read, from the gradient the loop's backward sent to the model's scores,
which token each position was graded on and with what weight (tfdoctor/recording/windows.py), so the
verdicts do not depend on variable names or code layout, only on what the loop really computed.
"""

from __future__ import annotations

from tfdoctor.recording.windows import ALIGN_MIN_SHARE, OFFSETS, alignment, no_scores
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.tasks import for_classifiers

# ignore-index: pad targets must get no weight at all; anything above rounding is padding graded.
PAD_WEIGHT_TOLERANCE = 1e-6

_LAYOUTS = {1: "batch-first [B, T]", 0: "sequence-first [T, B]"}


@check("objective", title="Targets are the next input token (no identity, no double shift)",
       kinds=("causal", "seq2seq"),
       skip_reasons={"encoder": "an encoder is graded on its own positions; the next-token alignment "
                                "does not apply",
                     **for_classifiers("graded on labels from the data, not on the next input token")},
       located=("loss", "backward"), tasks=("lm",))
def objective(subject, trace) -> Result:
    """Catches a loss graded on the wrong targets: the input itself (input == target, the loss
    collapses to near zero in the first epoch and means nothing) or labels shifted twice (a library
    model given `labels=` shifts them itself, so pre-shifted labels ask for the token after next).

    Runs the loop and reads, from the gradient that reaches the model's scores over the vocabulary,
    which token each position was graded on (the class the loss pulls up), whatever the loss:
    cross-entropy, label smoothing, KL divergence to a smoothed target, a library's own loss, or one
    computed inside the model's forward. It compares that token with the input tokens around the
    position, batch-first [B, T] or sequence-first [T, B]. The target for position t must be input
    token t+1; the offset found is reported. Ignored targets (-100, padding) are left out.

    Fix: `logits = model(ids[:, :-1])`, `targets = ids[:, 1:]`; flatten logits and targets in the
    same order; give Hugging Face models `labels=input_ids` unshifted.
    """
    found = alignment(trace, subject)
    rows, shares = found["rows"], found["shares"]
    if not rows or not shares:
        return Result.skipped(no_scores(trace, subject))
    best = found["best"]
    layout = _LAYOUTS[found["axis"]]
    details = {"offset": best if shares[best] >= ALIGN_MIN_SHARE else None, "graded_positions": rows,
               "share_by_offset": {f"{k:+d}": round(v, 4) for k, v in shares.items()}, "layout": layout}
    seen = f"the target matched input token t{best:+d} at {shares[best]:.0%} of {rows} graded positions"
    if shares[best] < ALIGN_MIN_SHARE:
        return Result.warned(
            f"the loss targets do not line up with the model's inputs at any offset from {OFFSETS[0]:+d} "
            f"to {OFFSETS[-1]:+d}, batch-first or sequence-first (best: t{best:+d} at {shares[best]:.0%} of "
            f"{rows} positions)",
            "for language modelling the targets are the inputs shifted by one: "
            "logits = model(ids[:, :-1]); loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()); "
            "flatten logits and targets in the same order", details)
    where = "" if found["axis"] == 1 else f" ({layout})"
    if best == 1:
        return Result.passed(f"targets are the next input token (offset +1) at {shares[best]:.0%} of "
                             f"{rows} graded positions{where}", details)
    if best == 0:
        return Result.failed(
            f"each position is graded on the token it was given ({seen}{where}): the model only learns to "
            "copy its input, and a loss near zero means nothing",
            "shift by one: logits = model(ids[:, :-1]); targets = ids[:, 1:]", details)
    if best >= 2:
        return Result.failed(
            f"targets are shifted {best} positions ({seen}{where}): position t is graded on token t{best:+d}, "
            "so the labels were shifted twice (a model given labels= shifts them itself)",
            "shift once: give a Hugging Face model labels=input_ids unshifted (it shifts them), or "
            "shift yourself and compute the loss on the returned logits", details)
    return Result.failed(
        f"each position is graded on the token before it ({seen}{where}): targets run the wrong way",
        "targets are the inputs shifted left by one: targets = ids[:, 1:], inputs = ids[:, :-1]", details)


def _end_of_text_pads(found: dict, pad_id: int) -> dict | None:
    """Whether every graded pad target is the first pad of its sequence, once per sequence: the
    GPT-2 convention (pad id == eos id; the collate keeps each row's first pad as its end-of-text
    target and masks the rest). Counts, or None when the graded pads cannot all be placed."""
    import torch

    best = found["best"]
    if best is None or found["shares"].get(best, 0.0) < ALIGN_MIN_SHARE:
        return None
    placed = at_end = sequences = 0
    for grid in found["grids"]:
        ids, targets, graded = grid["ids"], grid["targets"], grid["weights"] > 0
        if found["axis"] == 0:
            ids, targets, graded = ids.T, targets.T, graded.T
        pads = graded & (targets == pad_id)
        S, T = ids.shape
        is_pad = ids == pad_id
        # first pad after the real tokens: the first pad that follows a real token
        # A row with no pad in the model's input (fed ids[:, :-1]) may have its first pad just past it.
        first = torch.where(is_pad.any(-1), is_pad.float().argmax(-1), torch.full((S,), T))
        for s, t in zip(*torch.nonzero(pads, as_tuple=True)):
            placed += 1
            if int(t) + best - grid["correction"] == int(first[s]) and int(first[s]) > 0:
                at_end += 1
        sequences += int((pads.sum(-1) > 1).sum())
    return {"graded_pads": placed, "first_pad_of_row": at_end, "rows_with_more_than_one": sequences}


@check("ignore-index", title="Padding targets are left out of the loss", needs=("pad_id",),
       located=("loss", "backward"), tasks=("lm",),
       skip_reasons=for_classifiers("its targets are labels, not the padded token ids this check reads"))
def ignore_index(subject, trace) -> Result:
    """Catches a loss that grades padding: pad targets that are neither given `ignore_index=pad_id`
    nor replaced by the ignore value (-100), so part of every update teaches the model to predict
    padding.

    Runs the loop on batches padded with pad_id and measures, from the gradient each scored position
    really received (whatever the loss), the share of the trained weight that goes to pad targets.
    Exactly one graded pad per row, right after its real tokens, is the GPT-2 convention (pad id ==
    eos id, the first pad kept as the end-of-text target): it passes with a note.

    Fix: `ignore_index=pad_id`, `targets.masked_fill(targets == pad_id, -100)`, or weight a
    hand-written loss by `targets != pad_id`.
    """
    entries = [e for e in trace.scores if e.get("backward") is not None and bool(e["readable"].any())]
    if not entries:
        return Result.skipped(no_scores(trace, subject))
    pad_weight = total_weight = pad_loss = total_loss = 0.0
    graded = graded_pads = 0
    for entry in entries:
        weights = entry["weights"]
        pad = (entry["targets"] == subject.pad_id) & (weights > 0)
        contribution = weights * entry["nll"].abs()
        pad_weight += float(weights[pad].sum())
        total_weight += float(weights.sum())
        pad_loss += float(contribution[pad].sum())
        total_loss += float(contribution.sum())
        graded += int((weights > 0).sum())
        graded_pads += int(pad.sum())
    token_share = pad_weight / total_weight if total_weight else 0.0
    loss_share = pad_loss / total_loss if total_loss else 0.0
    found = alignment(trace, subject)
    # Pad targets offered to the loss, graded or not: read off the inputs once the alignment is known
    # (a target replaced by -100 no longer says it was a pad), else counted in cross-entropy's targets.
    losses = [e.data for e in trace.training_losses() if "targets" in e.data]
    aligned = found["best"] is not None and found["shares"].get(found["best"], 0.0) >= ALIGN_MIN_SHARE
    offered = (_pad_targets(found, subject.pad_id) if aligned
               else sum(int((loss["targets"] == subject.pad_id).sum()) for loss in losses))
    offered = max(offered, graded_pads)  # the last position's target lies past the input ids
    ignore_values = sorted({e.data["ignore_index"] for e in trace.training_losses()})
    details = {"pad_id": subject.pad_id, "ignore_index": ignore_values, "pad_targets": offered,
               "graded_targets": graded, "graded_pad_targets": graded_pads, "pad_weight_share": token_share,
               "pad_loss_share": loss_share}
    said = f" (ignore_index {', '.join(map(str, ignore_values))})" if ignore_values else ""
    if token_share <= PAD_WEIGHT_TOLERANCE:
        if offered:
            return Result.passed(f"all {offered} pad targets are ignored{said}", details)
        return Result.passed(f"no pad target reached the loss ({graded} graded targets, none of them "
                             f"pad_id={subject.pad_id})", details)
    eos = _end_of_text_pads(found, subject.pad_id)
    if eos is not None:
        details["end_of_text"] = eos
    if eos is not None and eos["graded_pads"] == graded_pads == eos["first_pad_of_row"] \
            and not eos["rows_with_more_than_one"]:
        rest = f"; the other {offered - graded_pads} pad targets are ignored" if offered > graded_pads else ""
        return Result.passed(
            f"one pad per padded row is graded, the first one after the real tokens ({graded_pads} rows): "
            f"pad_id={subject.pad_id} doubles as end-of-text, the GPT-2 convention (pad == eos){rest}",
            details, hint=f"a note: if {subject.pad_id} is not your end-of-text token, ignore that pad too")
    ignored = ", ".join(map(str, ignore_values)) if ignore_values else "not set (the loss is not F.cross_entropy)"
    return Result.failed(
        f"the loss grades padding: {graded_pads} pad targets (pad_id={subject.pad_id}) carry {token_share:.0%} "
        f"of the target weight and {loss_share:.0%} of the loss (ignore_index is {ignored})",
        f"pass ignore_index={subject.pad_id} to F.cross_entropy / nn.CrossEntropyLoss, or replace pad "
        f"targets with -100: targets = targets.masked_fill(targets == {subject.pad_id}, -100) (a hand-written "
        "loss: multiply each token's loss by (targets != pad_id) and divide by its sum)", details)


def _pad_targets(found: dict, pad_id: int) -> int:
    """About how many scored positions had a pad as their target (graded or not), from the aligned
    inputs (the target of the last position lies past the input and is not counted)."""
    best = found["best"]
    if best is None:
        return 0
    count = 0
    for grid in found["grids"]:
        ids = grid["ids"] if found["axis"] == 1 else grid["ids"].T
        T = ids.shape[1]
        shift = best - grid["correction"]
        if 0 <= shift < T:
            count += int((ids[:, shift:] == pad_id).sum())
    return count
