"""ignore-index on a token classifier: its targets are labels from the data ([B, T] over C classes
unrelated to the vocabulary), not the padded token ids the language-model judge reads, so a graded pad
is told by the input at its position: a pad id there, and weight from the loss.

Users mark what the loss must skip with -100 (F.cross_entropy's ignore_index): the pads and, in the
Hugging Face recipe, every sub-word after a word's first. A collate that pads the labels with 0 (a real
class, usually "O") instead grades every pad as that class. Registered as ignore-index's judge for the
token-classification task (registry.judges): same id, same problem, seen in the labels.
"""

from __future__ import annotations

from tfdoctor.registry import judges
from tfdoctor.result import Result

# As ignore-index: pad positions must get no weight at all; anything above rounding is padding graded.
PAD_WEIGHT_TOLERANCE = 1e-6


def graded_positions(trace, subject) -> dict:
    """Over every scored grid that reached a backward: the pad positions and the real ones, how many of
    each the loss graded, their weight, and the labels the graded pads were given."""
    import torch

    from tfdoctor.recording.windows import scored_grids

    counts = {"pads": 0, "graded_pads": 0, "real": 0, "graded_real": 0, "pad_weight": 0.0, "weight": 0.0}
    pad_labels: list[torch.Tensor] = []
    for grid in scored_grids(trace, subject):
        pads = grid["ids"] == subject.pad_id
        graded = grid["weights"] > 0
        counts["pads"] += int(pads.sum())
        counts["real"] += int((~pads).sum())
        counts["graded_pads"] += int((pads & graded).sum())
        counts["graded_real"] += int((~pads & graded).sum())
        counts["pad_weight"] += float(grid["weights"][pads & graded].sum())
        counts["weight"] += float(grid["weights"][graded].sum())
        pad_labels.append(grid["targets"][pads & graded & grid["hard"]])
    labels = torch.cat(pad_labels) if pad_labels else torch.empty(0, dtype=torch.long)
    counts["pad_labels"] = {int(k): int(v) for k, v in zip(*torch.unique(labels, return_counts=True))}
    return counts


@judges("ignore-index", tasks=("token-classification",))
def token_ignore_index(subject, trace) -> Result:
    """ignore-index on a token classifier: no pad position may be graded, whatever label it carries."""
    from tfdoctor.recording.windows import no_scores

    if not any(e.get("backward") is not None and bool(e["readable"].any()) for e in trace.scores):
        return Result.skipped(no_scores(trace, subject).replace("the vocabulary", f"the {subject.num_labels} labels"))
    seen = graded_positions(trace, subject)
    if not seen["pads"] and not seen["real"]:
        return Result.skipped("the scored labels could not be traced back to the model's input ids")
    share = seen["pad_weight"] / seen["weight"] if seen["weight"] else 0.0
    ignored_real = seen["real"] - seen["graded_real"]
    details = {"pad_id": subject.pad_id, "labels": subject.num_labels, "pad_positions": seen["pads"],
               "graded_pad_positions": seen["graded_pads"], "real_positions": seen["real"],
               "graded_real_positions": seen["graded_real"], "pad_weight_share": share,
               "labels_on_graded_pads": seen["pad_labels"]}
    ignored = (f"; {ignored_real} of the {seen['real']} real positions are ignored too (sub-words after a word's "
               "first, as the recipe labels them)" if ignored_real else "")
    if share <= PAD_WEIGHT_TOLERANCE:
        return Result.passed(f"none of the {seen['pads']} pad positions is graded (their labels are ignored){ignored}",
                             details)
    common = max(seen["pad_labels"], key=seen["pad_labels"].get) if seen["pad_labels"] else None
    as_label = f" as label {common}" if common is not None else ""
    return Result.failed(
        f"the loss grades padding: {seen['graded_pads']} of {seen['pads']} pad positions (pad_id={subject.pad_id}) "
        f"are graded{as_label}, {share:.0%} of the label weight: the model is trained to tag pads{as_label}",
        "pad the labels with -100, the ignore_index of F.cross_entropy (pad_sequence(labels, batch_first=True, "
        "padding_value=-100); DataCollatorForTokenClassification's label_pad_token_id=-100), or "
        f"labels = labels.masked_fill(input_ids == {subject.pad_id}, -100)", details)
