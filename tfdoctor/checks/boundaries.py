"""Document-boundary judges: is the end-of-sequence token ever a graded target (eos-trained), and
does a packed row grade the last token of one document on the first token of the next
(packing-labels)? Both read, from the gradient the loop's backward sent to the model's scores, which
token each position was graded on and with what weight (tfdoctor/recording/windows.py, as objective
and ignore-index do); the counts come from tfdoctor/recording/targets_at_boundaries.py.
"""

from __future__ import annotations

from tfdoctor.recording.windows import ALIGN_MIN_SHARE, no_scores
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.tasks import for_classifiers

# packing-labels: the share of document boundaries that may be graded. A target left out of the loss
# (-100, ignore_index, a zero weight) sends its position exactly no gradient, so any graded boundary
# is the bug itself, not noise: none is tolerated.
MAX_GRADED_BOUNDARY_SHARE = 0.0


@check("eos-trained", title="The end-of-sequence token is a graded target", kinds=("causal", "seq2seq"),
       needs=("eos_id",),
       skip_reasons={"encoder": "an encoder is graded on its own (masked) positions; it is never asked to "
                                "end a sequence", **for_classifiers("it is never asked to end a sequence")},
       located=("loss", "backward"), tasks=("lm",))
def eos_trained(subject, trace) -> Result:
    """Catches a loop that never grades the end-of-sequence token, so the model never learns to stop
    and generates until max_new_tokens. The classic cause: pad == eos (GPT-2 and Llama tokenizers
    have no pad token, so `tokenizer.pad_token = tokenizer.eos_token`) and labels masked wherever the
    input is a pad, which masks every real EOS too (trl #1623, DeepSeek-Coder #163, unsloth #416).

    Runs the loop (under `check --train` every row's real tokens end with EOS; with pad == eos a
    padded row's first pad is its EOS) and reads, from the gradient each scored position really
    received (whatever the loss), which positions were graded on EOS. EOS offered among the targets
    but never graded fails; any graded EOS passes; data that never holds an EOS is skipped, saying
    so, and so is an encoder-decoder given only `labels=` whose -100 targets hide what they were.
    The EOS id is --eos-id, else the tokenizer the script holds (eos_token_id), else
    model.config.eos_token_id.

    Fix: mask the padding by the attention mask, not by the id:
    `labels = input_ids.masked_fill(attention_mask == 0, -100)` (or keep each row's first pad as its
    end-of-text target); better, give the tokenizer a pad token of its own.
    """
    entries = [e for e in trace.scores if e.get("backward") is not None and bool(e["readable"].any())]
    if not entries:
        return Result.skipped(no_scores(trace, subject))
    from tfdoctor.recording.targets_at_boundaries import eos_targets

    eos, pad = subject.eos_id, subject.pad_id
    found = eos_targets(trace, subject, ALIGN_MIN_SHARE)
    details = {"eos_id": eos, "pad_id": pad, "pad_is_eos": pad == eos, "eos_targets": found["offered"],
               "graded_eos_targets": found["graded"], "graded_targets": found["graded_targets"],
               "rows_with_eos": found["rows"], "rows_with_eos_graded": found["rows_graded"],
               "read_off_inputs": found["traced"], "unreadable_targets": found["hidden"]}
    if not found["offered"]:
        where = "the targets traced back to the input ids" if found["traced"] else "the loss's targets"
        if found["hidden"]:
            return Result.skipped(f"no end-of-sequence token (eos_id={eos}) among {where}, but {found['hidden']} "
                                  "targets are -100 in the labels the model builds its decoder input from, so what "
                                  "they were (an EOS masked, or padding) cannot be read", details)
        return Result.skipped(f"no end-of-sequence token (eos_id={eos}) among {where}: the data never ends a "
                              f"document with EOS, so whether the loop grades it cannot be seen", details)
    rows = f" in {found['rows']} rows" if found["rows"] else ""
    if found["graded"]:
        shown = (f"{found['rows_graded']} of {found['rows']} rows" if found["rows"]
                 else f"{found['graded']} of {found['offered']} EOS targets")
        return Result.passed(f"the end-of-sequence token (eos_id={eos}) is graded: {shown} train it "
                             f"({found['graded']} graded EOS targets)", details)
    if pad == eos:
        counted = (f"{found['rows']} rows end with EOS (or its pads) and not one of their "
                   f"{found['offered']} EOS targets"
                   if found["rows"] else f"none of the {found['offered']} EOS targets")
        return Result.failed(
            f"the end-of-sequence token is never graded: {counted} is graded. pad_id == eos_id == {eos} and the "
            "labels are masked wherever the input is a pad, so every real EOS is masked with the padding and "
            "the model never learns to stop",
            "mask the padding by the attention mask, not by the id: labels = input_ids.masked_fill("
            "attention_mask == 0, -100) (or keep each row's first pad as its end-of-text target); better, "
            "give the tokenizer its own pad token (tokenizer.add_special_tokens({'pad_token': '<pad>'}))",
            details)
    return Result.failed(
        f"none of the {found['offered']} end-of-sequence targets{rows} (eos_id={eos}) is graded: the loss "
        "masks EOS, so the model never learns to stop",
        f"keep the EOS label: do not set targets equal to {eos} to -100 (ignore_index={eos} or a "
        "collate that masks it); only padding and prompt tokens should be ignored", details)


@check("packing-labels", title="Packed documents are not graded across their boundaries", kinds=("causal",),
       skip_reasons={"encoder": "an encoder is graded on its own positions; no target crosses into the next "
                                "document",
                     "seq2seq": "an encoder-decoder is fed one target sequence per row",
                     **for_classifiers("its targets are labels, not the next document's tokens")},
       located=("loss", "backward"), tasks=("lm",))
def packing_labels(subject, trace) -> Result:
    """Catches packed training that grades the last token of each document on the first token of the
    next one: the labels are the packed row shifted by one, so every boundary teaches the model to
    predict an unrelated document's start from the end of another (BioNeMo #1449, transformers
    #46634, axolotl #1375); with document masking the model cannot even see what it is asked for.

    Judged on packed rows only: position ids that restart inside a row, or a document-id argument
    (doc_ids, seq_idx, ...) in the recorded forwards; otherwise skipped. For every position whose
    target lies in another document, it reads from the gradient the position received whether the
    loss graded it (whatever the loss). Any graded boundary fails, with the count and share.

    Fix: set the label of each document's first token to -100 before the shift (what
    DataCollatorWithFlattening does), i.e. `targets[:, t] = -100` wherever `doc_ids[:, t + 1] !=
    doc_ids[:, t]` (or position_ids[:, t + 1] == 0).
    """
    entries = [e for e in trace.scores if e.get("backward") is not None and bool(e["readable"].any())]
    if not entries:
        return Result.skipped(no_scores(trace, subject))
    from tfdoctor.recording.targets_at_boundaries import boundary_targets

    found = boundary_targets(trace, subject, ALIGN_MIN_SHARE)
    details = {k: found[k] for k in ("packed_by", "offset", "rows", "documents", "boundaries", "graded",
                                     "graded_targets", "examples")}
    if found["packed_by"] is None:
        return Result.skipped("the rows are not packed: no recorded forward had position ids restarting inside "
                              "a row or a document-id argument (doc_ids, seq_idx, ...)", details)
    if found["offset"] is None:
        return Result.skipped("the graded targets do not line up with the input ids at any offset (see "
                              "objective), so the document boundaries cannot be placed", details)
    if not found["boundaries"]:
        return Result.skipped(f"packed rows ({found['packed_by']}), but no target lies in another document "
                              f"than its position: each of the {found['rows']} rows holds one document, or its "
                              "boundaries fall past the input ids", details)
    share = found["graded"] / found["boundaries"]
    details["graded_share"] = share
    if share <= MAX_GRADED_BOUNDARY_SHARE:
        return Result.passed(f"all {found['boundaries']} document boundaries of the packed rows are left out of "
                             f"the loss ({found['packed_by']})", details)
    return Result.failed(
        f"{found['graded']} of {found['boundaries']} document boundaries ({share:.0%}) are graded: the last token "
        f"of a document is trained to predict the first token of the next one ({found['packed_by']})",
        "set the label of each document's first token to -100 before the shift, as DataCollatorWithFlattening "
        "does: targets = targets.masked_fill(doc_ids[:, 1:] != doc_ids[:, :-1], -100) for targets = ids[:, 1:] "
        "(or where position_ids[:, 1:] == 0)", details)
