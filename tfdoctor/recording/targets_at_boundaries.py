"""What the graded targets of a recorded loop say about where documents end: how often the
end-of-sequence token was offered as a target and how often it was graded (`eos_targets`), and, on
packed rows, how many positions are graded on a token of the next document (`boundary_targets`).

Plain functions of the Trace and the Subject, read through windows.alignment (the same reading of
the gradient at the scores that objective and ignore-index judge), no verdicts: the judges are in
tfdoctor/checks/boundaries.py. Torch is imported inside the functions.
"""

from __future__ import annotations

from tfdoctor.recording.discovery import _DOCUMENT_ARGUMENTS as DOCUMENT_ARGUMENTS
from tfdoctor.recording.windows import alignment

# Examples of graded boundary positions kept in the details: (row, position) pairs.
EXAMPLES_KEPT = 5


def _aligned(found: dict, min_share: float) -> bool:
    best = found["best"]
    return best is not None and found["shares"].get(best, 0.0) >= min_share


def _oriented(grid: dict, axis: int, *tensors):
    """The grid's tensors batch-first [rows, T] (a sequence-first loop's are transposed)."""
    return tuple(t.T if axis == 0 else t for t in tensors)


def eos_targets(trace, subject, min_share: float) -> dict:
    """Counts of the end-of-sequence id (subject.eos_id) among the loop's targets: `graded` targets
    that are EOS (read from the gradient at the scores, weight > 0), `offered` EOS targets graded or
    not (read off the input ids once the targets' offset is known, else off the loss's own targets),
    and per row of the batches, `rows` whose targets hold an EOS and `rows_graded` where one is graded.
    `traced` says whether the offered ones were read off the inputs; `hidden` counts the targets
    that could not be read there (a seq2seq model given only labels=, -100 where they were masked)."""
    eos = subject.eos_id
    graded = graded_eos = 0
    for entry in trace.scores:
        if entry.get("backward") is None or not bool(entry["readable"].any()):
            continue
        weighted = entry["weights"] > 0
        graded += int(weighted.sum())
        graded_eos += int((weighted & (entry["targets"] == eos)).sum())
    found = alignment(trace, subject)
    out = {"graded_targets": graded, "graded": graded_eos, "offered": 0, "rows": 0, "rows_graded": 0,
           "traced": _aligned(found, min_share), "hidden": 0}
    if out["traced"]:
        for grid in found["grids"]:
            ids, weights = _oriented(grid, found["axis"], grid["ids"], grid["weights"])
            T = ids.shape[1]
            shift = found["best"] - grid["correction"]
            lo, hi = max(0, -shift), min(T, T - shift)  # positions t whose target t + shift is an input
            if lo >= hi:
                continue
            is_eos = ids[:, lo + shift:hi + shift] == eos  # the target of each position t in [lo, hi)
            out["offered"] += int(is_eos.sum())
            out["rows"] += int(is_eos.any(-1).sum())
            out["rows_graded"] += int((is_eos & (weights[:, lo:hi] > 0)).any(-1).sum())
            out["hidden"] += int((ids[:, lo + shift:hi + shift] < 0).sum())  # -100 in labels read as the ids
    else:  # the loss's own targets (a target replaced by -100 no longer says it was an EOS)
        out["offered"] = sum(int((e.data["targets"] == eos).sum()) for e in trace.training_losses()
                             if "targets" in e.data)
    out["offered"] = max(out["offered"], graded_eos)  # an EOS past the input ids (nanoGPT's ids[:, 1:])
    return out


def documents(inputs: dict, ids, pad_id) -> tuple:
    """(document index of every token [d0, d1], where it was read) for one recorded forward of the
    ids [d0, d1], or (None, None) when its rows are not packed: a document-id argument (doc_ids,
    seq_idx, ...) of the ids' shape, else position ids that restart inside a row (a new document
    wherever the position does not grow, the Hugging Face flattening collator's convention). Only a
    change between two real tokens starts a document: pads belong to none, so left-padded rows with
    positions counted from the attention mask (all 0, or 1, on the pads) are not packed."""
    import torch

    shape = tuple(ids.shape)
    real = ids != pad_id if pad_id is not None else torch.ones(shape, dtype=torch.bool)
    both_real = real[:, 1:] & real[:, :-1]
    for name in DOCUMENT_ARGUMENTS:
        value = inputs.get(name)
        if value is not None and tuple(value.shape) == shape:
            value = value.cpu()
            starts = torch.zeros(shape, dtype=torch.long)
            starts[:, 1:] = ((value[:, 1:] != value[:, :-1]) & both_real).long()
            return starts.cumsum(-1), f"a document-id argument ({name}=...)"
    positions = inputs.get("position_ids")
    if positions is not None and tuple(positions.shape) == shape and shape[-1] > 1:
        positions = positions.cpu()
        restart = (positions[:, 1:] <= positions[:, :-1]) & both_real
        if bool(restart.any()):
            starts = torch.zeros(shape, dtype=torch.long)
            starts[:, 1:] = restart.long()
            return starts.cumsum(-1), "position_ids restart inside a row"
    return None, None


def boundary_targets(trace, subject, min_share: float) -> dict:
    """On the packed rows the loop trained on: `boundaries`, the positions whose target (the input
    token `offset` positions on) lies in another document than the position itself (the last token
    of a document, graded on the first of the next one), and `graded`, those of them the loss gave a
    weight (a pad position or pad target is padding, not a boundary). `packed_by` says how the
    documents were read (None: no packed row was seen); `offset` is None when the targets could not
    be lined up with the inputs. A boundary whose target lies past
    the input ids (the last position of nanoGPT's ids[:, :-1]) cannot be placed and is not counted."""
    found = alignment(trace, subject)
    out = {"packed_by": None, "offset": found["best"] if _aligned(found, min_share) else None,
           "rows": 0, "documents": 0, "boundaries": 0, "graded": 0, "graded_targets": 0, "examples": []}
    for grid in found["grids"]:
        docs, source = documents(grid["inputs"], grid["ids"], subject.pad_id)
        if docs is None:
            continue
        out["packed_by"] = out["packed_by"] or source
        docs, weights, ids = _oriented(grid, found["axis"], docs, grid["weights"], grid["ids"])
        out["rows"] += docs.shape[0]
        out["documents"] += int((docs[:, -1] + 1).sum())
        if out["offset"] is None:
            continue
        T = docs.shape[1]
        shift = out["offset"] - grid["correction"]
        if not 0 < shift < T:  # targets that do not look ahead cross no boundary
            continue
        crossing = docs[:, shift:] != docs[:, :T - shift]  # position t's target t + shift, another document
        if subject.pad_id is not None:  # a pad, as the position or as its target, is in no document
            crossing &= (ids[:, shift:] != subject.pad_id) & (ids[:, :T - shift] != subject.pad_id)
        weighted = weights[:, :T - shift] > 0
        out["boundaries"] += int(crossing.sum())
        out["graded"] += int((crossing & weighted).sum())
        out["graded_targets"] += int((weights > 0).sum())
        room = EXAMPLES_KEPT - len(out["examples"])
        if room > 0:
            rows, positions = (crossing & weighted).nonzero(as_tuple=True)
            out["examples"] += [[int(r), int(t)] for r, t in zip(rows[:room], positions[:room])]
    return out
