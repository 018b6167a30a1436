"""Invariance checks: the same sequence gets the same logits however it is batched (alone or
padded, packed with other documents; token by token with a cache: decoding.py)."""

from __future__ import annotations

from tfdoctor.checks.verdicts import judged_per_implementation
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.tasks import for_classifiers

MAX_LISTED = 6
SEQ2SEQ_SKIP = "written for decoder-only and encoder models (a seq2seq source's padding is padding-mask's)"
CAUSAL_ONLY = "written for causal LMs"

POSITIONS_HINT = (
    "count positions from each row's first real token, not from the row's start: positions = "
    "(mask.cumsum(-1) - 1).clamp(min=0) with mask = (ids != pad_id), and index the position table "
    "(or the rotary angles) with them; Hugging Face models take position_ids=positions"
)
GENERATE_POSITIONS_HINT = (
    "name position_ids in the model's forward and hand it on to the layer that embeds positions, so "
    "that generate() builds them from the attention mask (it does so only for a forward that names "
    "them), or pass position_ids=(mask.cumsum(-1) - 1).clamp(min=0) yourself on every call"
)
PADS_HINT = (
    "mask the pad keys in every attention layer: keep = (ids != pad_id)[:, None, None, :], "
    "scores.masked_fill(~keep, torch.finfo(scores.dtype).min); Hugging Face models take "
    "attention_mask=(ids != pad_id)"
)
BATCH_HINT = ("compute every statistic per row (LayerNorm/RMSNorm over features, not BatchNorm or a mean "
              "over the batch dimension) and mask pads out of any mean over positions")
NONFINITE_HINT = ("fill masked scores with torch.finfo(scores.dtype).min instead of float('-inf') "
                  "(see masked-row-nan)")
RANDOM_HINT = ("look for dropout that ignores eval mode (F.dropout(x, p) defaults to training=True; pass "
               "training=self.training) or noise sampled in forward")

UNKNOWN_SIDE_HINT = ("say which side you pad: --padding-side right (or Subject(padding_side='right')) if you "
                     "only ever pad on the right; otherwise (--padding-side left) ")


def _judged(subject, judge) -> Result:
    """judge under each attention implementation, the model judged by the one it runs: under
    another, a failure is a warning not to switch, and an exception is named, not an error."""
    from tfdoctor.probes.configured_implementation import judged_as_run

    return judged_per_implementation(subject, judged_as_run(subject.model, judge))


def _random_result(gap: float, what: str) -> Result:
    return Result.warned(f"two identical forwards of the {what} gave logits {gap:.3g} apart in eval mode, so "
                         "arrangements cannot be compared: the model is random at inference", RANDOM_HINT,
                         {"noise": gap})


# ----------------------------------------------------------------------------------------------
# padding-equivalence


def _padding_cause(subject, arrangement) -> tuple[str, dict]:
    """Why a padded arrangement differs from the sequences alone, as measured: "nonfinite", "batch"
    (the row that differs most gives other logits run alone with the same pads), "pads" (real
    positions move with the pads' content), "pads-attended" (the pads' content changes nothing, but
    the softmax weights give real queries' attention to pad keys: the model attends to pads whose
    content it overwrites), "positions" (left pads, no attention on them in the weights seen),
    "positions-or-pads" (left pads, the weights not seen: a fused kernel), "unexplained" (left pads,
    neither read nor attended, and some padded rows agree: not positions, which shift every padded
    row) or "other" (right pads)."""
    import torch

    from tfdoctor.probes.attention import pad_attention
    from tfdoctor.probes.invariance import padded_call, row_alone_padded
    from tfdoctor.probes.padding import PAD_ATTENTION_SHARE, input_embedding, perturbed_pads

    differs = arrangement.differs
    evidence: dict = {}
    if not bool(torch.isfinite(arrangement.diff[differs]).all()):
        return "nonfinite", evidence
    # The other rows first: a statistic over the batch also moves with the other rows' pads.
    row = max(range(len(arrangement.lengths)), key=lambda r: float(arrangement.diff[r].max()))
    single = row_alone_padded(subject, arrangement, row)
    batch_gap = float((single - arrangement.logits[row]).abs().amax(-1).cpu()[arrangement.real[row]].max())
    evidence["row_alone_vs_in_batch"] = batch_gap
    if batch_gap > arrangement.tolerance:
        return "batch", evidence
    embedding = input_embedding(subject)
    ids, pads = arrangement.ids, ~arrangement.real.to(arrangement.ids.device)
    if embedding is not None:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad(), perturbed_pads(embedding, ids, pads, generator) as calls:
            moved = padded_call(subject, ids, ~pads).float()
        if calls:
            change = (moved - arrangement.logits).abs().amax(-1).cpu()
            evidence["largest_change_from_pad_content"] = float(change[arrangement.real].max())
    with torch.no_grad():
        share = pad_attention(subject.model, lambda: padded_call(subject, ids, ~pads), pads)
    evidence["largest_attention_on_pads"] = share
    if evidence.get("largest_change_from_pad_content", 0.0) > arrangement.tolerance:
        return "pads", evidence  # how they are read: the attention share says (probes/padding.how_pads_are_read)
    if share is not None and share > PAD_ATTENTION_SHARE[1]:
        return "pads-attended", evidence
    if arrangement.side != "left":
        return "other", evidence
    padded = [d for L, d in zip(arrangement.lengths, arrangement.row_differences()) if L < arrangement.diff.shape[1]]
    if any(d <= arrangement.tolerance for d in padded):
        return "unexplained", evidence  # positions from the row's start would shift every padded row
    if share is None or share >= PAD_ATTENTION_SHARE[0]:
        return "positions-or-pads", evidence
    return "positions", evidence


def _padding_message(subject, arrangement, cause: str, arrangement_share: float | None = None) -> tuple[str, str]:
    """The finding's message and hint; `arrangement_share`: the largest attention share on pad keys seen."""
    T = arrangement.diff.shape[1]
    rows = arrangement.row_differences()
    worst = max(range(len(rows)), key=lambda r: rows[r])
    pads = T - arrangement.lengths[worst]
    count, total = int(arrangement.differs.sum()), int(arrangement.real.sum())
    seen = (f"with {arrangement.side} padding, {count} of {total} real positions get other logits than the same "
            f"sequence alone (largest difference {rows[worst]:.3g}, {rows[worst] / max(arrangement.scale, 1e-30):.2g} "
            f"of the logits' scale, in the row with {pads} pads)")
    if cause == "positions":
        per_pad = ", ".join(f"{T - L} pads: {d:.3g}" for L, d in zip(arrangement.lengths, rows) if L < T)
        said = (f"{seen}: the pads are not attended, yet the real tokens move with the number of pads before "
                f"them ({per_pad}), so positions are counted from the row's start: learned positions shift "
                "by the pad count")
        note, hint = _generate_positions(subject)
        return said + note, hint or POSITIONS_HINT
    if cause == "pads":
        from tfdoctor.probes.padding import how_pads_are_read

        verb, how = how_pads_are_read(arrangement_share)
        return f"{seen}: real positions {verb} the pads{how}, their logits moving with the pads' content", PADS_HINT
    if cause == "pads-attended":
        return (f"{seen}: real positions attend to the pads (the softmax weights give pad keys a share of real "
                "queries' attention), whose content the model overwrites, so only their number shows", PADS_HINT)
    if cause == "unexplained":
        per_pad = ", ".join(f"{T - L} pads: {d:.3g}" for L, d in zip(arrangement.lengths, rows) if L < T)
        return (f"{seen}: the pads are neither read nor attended and the row alone agrees, yet only some padded "
                f"rows differ ({per_pad}), which positions counted from the row's start would not do (they shift "
                "every padded row); not measured further, the candidates are a selection over key positions that "
                "the pads take part in (top-k or sparse attention, an indexer, routing) or an op that sees the "
                "row's length", "apply the attention mask before any top-k or sparse selection over keys, so "
                "that pads are never selected; " + POSITIONS_HINT)
    if cause == "positions-or-pads":
        note, hint = _generate_positions(subject)
        return (f"{seen}: the pads' content changes nothing, yet the real tokens move with the number of pads "
                "before them, and the attention weights are inside a fused kernel, so the cause is one of: "
                "positions counted from the row's start, or attention to pads whose content the model "
                f"overwrites{note}", f"{hint or POSITIONS_HINT}; and {PADS_HINT}")
    if cause == "batch":
        return (f"{seen}: a row's logits depend on the other rows of its batch (the same padded row run alone "
                "gives other logits): a batch-dependent operation", BATCH_HINT)
    if cause == "nonfinite":
        return f"{seen}: real positions turn NaN/Inf when padded", NONFINITE_HINT
    return (f"{seen}: the pads are not attended and the row alone agrees with the batch, so the trailing pads "
            "change earlier positions some other way (a mean over positions that includes the pads, or later "
            "positions read: see future-leak)", BATCH_HINT)


def _generate_positions(subject) -> tuple[str, str]:
    """(note, hint) for a Hugging Face causal LM whose own generate() hands its forward no position
    ids, as the probe then calls it: the model numbers a left-padded prompt by itself. ("", "") else."""
    from tfdoctor.probes.generation import accepts
    from tfdoctor.probes.invariance import generate_arguments, hf_causal

    if not hf_causal(subject) or "position_ids" in generate_arguments(subject):
        return "", ""
    name = type(subject.model).__name__
    if not accepts(subject.model, "position_ids"):
        return f" ({name}.generate() passes no position_ids: its forward does not name them)", GENERATE_POSITIONS_HINT
    return (f" ({name}.generate() passes no position_ids: its prepare_inputs_for_generation drops them)",
            "do not batch left-padded prompts through this model's generate() (it drops the position ids), or "
            "call the model yourself with position_ids=(mask.cumsum(-1) - 1).clamp(min=0)")


@check("padding-equivalence", title="Each sequence gets the same logits alone as inside a padded batch",
       kinds=("causal", "encoder"), needs=("pad_id",), skip_reasons={"seq2seq": SEQ2SEQ_SKIP}, located=("attention",))
def padding_equivalence(subject) -> Result:
    """Catches models that predict differently for the same sequence depending on how it is padded:
    learned (or rotary) positions counted from the row's start, so that left padding shifts every
    real token's position by the pad count; pads that are attended; operations that mix the rows of a
    batch. The loss still falls, but what the model learns depends on the batch it was in.

    Runs the probe sequences (one full row, the others shorter, all different lengths) alone and
    padded into one batch on the side the model is trained with (--padding-side, the tokenizer's;
    unknown: both for a causal model, right for an encoder), each arrangement in one batched forward,
    with the model called as in training (its own forward; Hugging Face models with attention_mask,
    causal LMs also with position ids from the mask where their own generate() passes them, as it
    builds them: it passes none to a forward that does not name position_ids, WhisperForCausalLM's),
    and compares every real position's logits within a tolerance relative to their scale. The report
    gives the largest difference, the positions affected and the likely cause, told apart by
    behaviour: real outputs that move with the pads' content (pads attended), a row that differs run
    alone with the same pads (batch-dependent), or neither (positions from the row's start). Where
    the side is unknown (no --padding-side, tokenizer or loop batches to read it from), a difference
    under left padding only fails where left padding is evidenced: a Hugging Face causal LM whose
    generate() pads batched prompts on the left and reads their mask. Otherwise it warns, naming
    --padding-side: a hand-written model with a key mask and positions from the row's start is
    correct when only ever padded on the right.

    Fix: build positions from the mask, positions = (mask.cumsum(-1) - 1).clamp(min=0) (Hugging Face:
    position_ids=positions), and mask the pad keys.
    """
    import torch

    from tfdoctor.context import current
    from tfdoctor.modes import evaluation
    from tfdoctor.probes.invariance import alone, compare_padded, generate_arguments, hf_causal
    from tfdoctor.probes.padding import fixed_output_length, left_padding_evidenced, probed_sides

    declared = subject.padding_side
    sides = probed_sides(subject)
    with evaluation(subject.model):
        unmatched = fixed_output_length(subject, torch.Generator().manual_seed(current().seed + 11))
    if unmatched is not None:
        return Result.skipped(unmatched)

    def judge(implementation) -> Result:
        with evaluation(subject.model):
            generator = torch.Generator().manual_seed(current().seed + 11)
            probe = alone(subject, generator)
            arrangements = [compare_padded(subject, probe, side) for side in sides]
            alone_forwards = 1 if subject.kind == "causal" else len(probe.lengths)
            details = {"declared_side": declared, "real_lengths": probe.lengths, "seq_len": subject.seq_len,
                       "forwards": alone_forwards + len(arrangements), "sides": {}}
            if hf_causal(subject):  # how the probe called it: as the model's own generate() does
                details["generate_arguments"] = sorted(generate_arguments(subject))
            failing = []
            for arrangement in arrangements:
                side_details = {"largest_difference": float(arrangement.diff[arrangement.real].max()),
                                "output_scale": arrangement.scale, "tolerance": arrangement.tolerance,
                                "row_differences": arrangement.row_differences(),
                                "pads_per_row": [subject.seq_len - L for L in arrangement.lengths]}
                details["sides"][arrangement.side] = side_details
                if bool(arrangement.differs.any()):
                    from tfdoctor.probes.invariance import eval_noise

                    noise = eval_noise(arrangement.logits, _again(subject, arrangement), arrangement.tolerance)
                    if noise is not None:
                        return _random_result(noise, f"{arrangement.side}-padded batch")
                    tied = _tie_order_only(subject, arrangement.side, current().seed + 11)
                    if tied is not None:  # a top-k selection's tie order, not the pads (probes/ties.py)
                        side_details["largest_difference_with_ties_by_position"] = tied
                        continue
                    cause, evidence = _padding_cause(subject, arrangement)
                    positions = arrangement.differs.nonzero().tolist()
                    side_details.update(cause=cause, differing_count=len(positions),
                                        differing_positions=[{"row": r, "position": p}
                                                             for r, p in positions[:MAX_LISTED]], **evidence)
                    failing.append((arrangement, cause))
        if not failing:
            summary = " and ".join(f"{a.side} padding (largest difference "
                                   f"{details['sides'][a.side]['largest_difference']:.2g}"
                                   f", tolerance {a.tolerance:.2g})" for a in arrangements)
            tied = [a.side for a in arrangements
                    if "largest_difference_with_ties_by_position" in details["sides"][a.side]]
            ties = (f"; with {' and '.join(tied)} padding only through the order of tied scores in the model's top-k "
                    "selection, which moves with a row's length: with ties broken by position they match"
                    if tied else "")
            return Result.passed(f"every sequence ({', '.join(map(str, probe.lengths))} real tokens) gets the same "
                                 f"logits alone as in a batch: {summary}{ties}", details)
        arrangement, cause = failing[0]
        details.update(pad_side=arrangement.side, **details["sides"][arrangement.side])
        message, hint = _padding_message(subject, arrangement, cause, details.get("largest_attention_on_pads"))
        # Side unknown and only left padding differs: a failure where left padding is evidenced, else
        # a warning (the same code is correct when only ever padded on the right). An unexplained
        # difference in some rows only (a top-k near tie can flip) is not escalated.
        left_only = declared is None and subject.kind == "causal" and all(a.side == "left" for a, _ in failing)
        evidence = left_only and cause != "unexplained" and left_padding_evidenced(subject)
        details["left_padding_evidence"] = evidence or None
        if evidence:
            message += f"; {evidence}"
        elif left_only:
            return Result.warned(f"{message}; right padding is equivalent and no side is declared (--padding-side, "
                                 "the tokenizer's, the loop's batches), so this matters only if you train "
                                 "left-padded or generate in batches", UNKNOWN_SIDE_HINT + hint, details)
        if declared is not None:
            message += f" ({declared} padding, as declared)"
        return Result.failed(message, hint, details)

    return _judged(subject, judge)


def _tie_order_only(subject, side: str, seed: int):
    """The largest difference left on `side` once torch.topk breaks ties by position, when every
    position then agrees (the difference came from a selection's tie order); None when it still differs."""
    import torch

    from tfdoctor.probes.invariance import alone, compare_padded
    from tfdoctor.probes.ties import ties_broken_by_position

    with ties_broken_by_position():
        again = compare_padded(subject, alone(subject, torch.Generator().manual_seed(seed)), side)
    return None if bool(again.differs.any()) else float(again.diff[again.real].max())


def _again(subject, arrangement):
    import torch

    from tfdoctor.probes.invariance import padded_call

    with torch.no_grad():
        return padded_call(subject, arrangement.ids, arrangement.real.to(arrangement.ids.device)).float()


# ----------------------------------------------------------------------------------------------
# packing-isolation


def _drawn_documents(grid: list[list[bool]]) -> list[str]:
    """A document map row by row: '#' own document, 'X' reads another document, '.' does not."""
    return ["".join(("#" if i == j else "X") if seen else "." for j, seen in enumerate(row))
            for i, row in enumerate(grid)]


def _cache_note(subject, comparison, rows, details: dict) -> str:
    """Hugging Face packing holds only without a cache: a loop that leaves config.use_cache on (and
    does not pass use_cache=False) trains with documents reading each other. Said, not judged: the
    Trainer switches the cache off, and how a hand-written loop calls the model is not known here."""
    from tfdoctor.probes.invariance import change_with_config_cache

    gap = change_with_config_cache(subject, rows, comparison)
    if gap is None:
        return ""
    details["difference_with_config_use_cache"] = gap
    if gap <= comparison.tolerance:
        return ""
    return ("; called without use_cache=False (config.use_cache is True) the documents read each other "
            f"(difference {gap:.2g}): this release reads packing off the position ids only without a cache, so "
            "pass use_cache=False in a hand-written loop (the Trainer does)")


@check("packing-isolation", title="Packed documents do not see each other and restart their positions",
       kinds=("causal",), skip_reasons={"encoder": CAUSAL_ONLY, "seq2seq": CAUSAL_ONLY,
                                        **for_classifiers(CAUSAL_ONLY)}, tasks=("lm",))
def packing_isolation(subject) -> Result:
    """Catches packed training whose documents leak into each other: several documents packed into
    one row attend across the boundary (a causal mask with no document mask, under eager or SDPA),
    or their positions do not restart at each document. Each document is then trained on the ends
    of unrelated ones, and the loss still falls.

    Runs when the Subject says how the model is trained packed: Subject(packing=fn) with
    fn(model, input_ids [B, T], doc_ids [B, T], position_ids [B, T]) -> logits, or
    packing="position_ids" for the Hugging Face convention (model(input_ids=..., position_ids=...),
    positions restarting at each document, no attention mask, as DataCollatorWithFlattening does).
    Packs 2-4 documents of random lengths into each row, runs the packed batch and every document
    alone as the model numbers it by itself (one batched forward each: no position ids for the
    Hugging Face convention, the Subject's usual forward for a packing fn) and compares each
    document's logits. On a difference it names what differs: positions numbered otherwise than the
    model numbers a document alone (RoBERTa counts from padding_idx + 1, DataCollatorWithFlattening
    from 0), with the start that reproduces the model's own numbering; then, against the documents
    numbered as packed, it draws the document map (does document i move when only document j's
    tokens change?) and names attention across the boundary, or positions that do not restart (a
    document that no other one moves, yet differs).

    Fix: mask attention to the same document, allowed = causal & (doc_ids[:, :, None] ==
    doc_ids[:, None, :]), and restart position ids at every document where the model starts them
    alone (RoBERTa: at padding_idx + 1).
    """
    if subject.packing is None:
        return Result.skipped("the Subject does not say how it packs documents: pass Subject(packing=fn) with "
                              "fn(model, input_ids, doc_ids, position_ids) -> logits, or packing='position_ids'")
    return _judged(subject, lambda implementation: _judge_packing(subject))


def _measured_packing(subject):
    """(rows, comparison, generator): the packed rows against every document alone."""
    import torch

    from tfdoctor.context import current
    from tfdoctor.probes.invariance import compare_packed, pack_rows

    generator = torch.Generator().manual_seed(current().seed + 12)
    rows = pack_rows(subject, generator)
    return rows, compare_packed(subject, rows, generator), generator


def _judge_packing(subject) -> Result:
    from tfdoctor.errors import first_line
    from tfdoctor.modes import evaluation
    from tfdoctor.probes.decoding import MODEL_ERRORS, raised_by_model
    from tfdoctor.probes.precision import close_call, in_float32
    from tfdoctor.tolerances import EQUIVALENCE_TOLERANCE

    with evaluation(subject.model):
        try:
            rows, comparison, generator = _measured_packing(subject)
        except MODEL_ERRORS as exc:
            if not raised_by_model(exc):
                raise
            return Result.warned(f"the model raises when run packed ({first_line(exc)}), so packed training "
                                 "cannot run on it as called", "pack with a document mask the model accepts, or "
                                 "train unpacked", {"raised": first_line(exc)})
        relative = float(comparison.diff.max()) / max(comparison.scale, 1e-30)
        how, precision = close_call(subject.model, relative, EQUIVALENCE_TOLERANCE)
        if how == "close":
            return Result.passed(f"packed documents agree with alone within rounding; {precision['close_call']}",
                                 precision)
        if how == "float32":
            with in_float32(subject.model):
                return _packing_verdict(subject, *_measured_packing(subject), precision)
        return _packing_verdict(subject, rows, comparison, generator, precision)


def _differing(rows, comparison) -> list[tuple[int, int]]:
    """(row, document) of every packed document whose logits differ from the comparison's alone."""
    return [(r, d) for r, row in enumerate(rows.documents) for d, (s, L) in enumerate(row)
            if float(comparison.diff[r, s:s + L].max()) > comparison.tolerance]


def _numbering_said(subject, numbering, comparison, isolated: bool) -> tuple[str, str]:
    """What the model's own numbering of a document alone against the packed rows' 0, 1, 2, ... says
    (message part, hint)."""
    from tfdoctor.probes.invariance import MAX_NUMBERING_START
    from tfdoctor.subject import PACKING_POSITION_IDS

    share = numbering.gap / max(comparison.scale, 1e-30)
    given = ("the position ids given restart at 0 at each document" if subject.packing == PACKING_POSITION_IDS
             else "the packing function numbers each document 0, 1, 2, ...")
    if numbering.start is not None:
        pad = getattr(getattr(subject.model, "config", None), "pad_token_id", None)
        why = " (padding_idx + 1, as RoBERTa counts)" if isinstance(pad, int) and numbering.start == pad + 1 else ""
        own = f"the model numbers a document alone from {numbering.start}{why}"
        fix = (f"number each packed document as the model numbers it alone: position_ids = arange(L) + "
               f"{numbering.start} within each document (add {numbering.start} to the collator's position_ids)")
    else:
        own = (f"the model numbers a document alone otherwise (no start from 0 to {MAX_NUMBERING_START} "
               "reproduces its own numbering)")
        fix = "give each packed document the position ids the model builds for it alone"
    lead = "documents are isolated, but " if isolated else ""
    return (f"{lead}{given}, while {own}: every packed "
            f"document is trained at positions it never has unpacked (difference {numbering.gap:.3g}, "
            f"{share:.2g} of the logits' scale, between a document alone numbered from 0 and as the model "
            "numbers it)", fix)


def _packing_verdict(subject, rows, comparison, generator, precision: dict) -> Result:
    import torch

    from tfdoctor.probes.invariance import document_map, eval_noise, own_numbering, packed_call

    tolerance = comparison.tolerance
    documents = sum(len(row) for row in rows.documents)
    details = {"documents_per_row": [len(row) for row in rows.documents],
               "document_lengths": [[L for _, L in row] for row in rows.documents],
               "largest_difference": float(comparison.diff.max()), "output_scale": comparison.scale,
               "tolerance": tolerance, "packing": "position_ids" if isinstance(subject.packing, str)
               else getattr(subject.packing, "__name__", "fn"), "forwards": 2, **precision}
    note = f"; {precision['close_call']}" if "close_call" in precision else ""
    differing = _differing(rows, comparison)
    if not differing:
        note = _cache_note(subject, comparison, rows, details) + note
        return Result.passed(f"each of {documents} documents packed {max(details['documents_per_row'])} to a "
                             f"row gets the same logits as alone (largest difference "
                             f"{details['largest_difference']:.2g}, tolerance {tolerance:.2g}){note}", details)
    with torch.no_grad():
        noise = eval_noise(comparison.logits, packed_call(subject, rows).float(), tolerance)
    if noise is not None:
        return _random_result(noise, "packed batch")
    found, hints, causes = [], [], []
    # The model's own numbering first: where it differs from the packed rows' 0, 1, 2, ..., every
    # document differs from alone by that alone, and what else leaks is judged against the
    # documents alone numbered as the packed rows number them.
    numbering = own_numbering(subject, comparison)
    details.update(numbering_difference=numbering.gap, own_numbering_start=numbering.start)
    rest = comparison
    if numbering.gap > tolerance:
        rest = numbering.collated
        isolated = not _differing(rows, rest)
        said, hint = _numbering_said(subject, numbering, comparison, isolated)
        found.append(said)
        hints.append(hint)
        causes.append("numbering")
    details.update(differing_documents=[{"row": r, "document": d} for r, d in differing[:MAX_LISTED]],
                   differing_count=len(differing))
    leftover = _differing(rows, rest)
    if leftover:
        maps = document_map(subject, rest, generator)
        leaks = [(r, i, j) for r, grid in enumerate(maps) for i, row in enumerate(grid)
                 for j, seen in enumerate(row) if seen and i != j]
        leaked_into = {(r, i) for r, i, _ in leaks}
        unmoved = [(r, d) for r, d in leftover if (r, d) not in leaked_into]
        details.update(cross_document_pairs=len(leaks),
                       document_map={str(r): _drawn_documents(grid) for r, grid in enumerate(maps)})
        if leaks:
            listed = ", ".join(f"row {r} doc {i} reads doc {j}" for r, i, j in leaks[:4])
            found.append(f"attention crosses the document boundary ({len(leaks)} pairs: {listed}"
                         f"{', ...' if len(leaks) > 4 else ''})")
            hints.append("mask attention to each document: allowed = causal & (doc_ids[:, :, None] == "
                         "doc_ids[:, None, :]) (flex_attention / varlen kernels: cu_seqlens from doc_ids)")
            causes.append("attention")
        if unmoved:
            cause, said, hint = _unmoved_cause(subject, rows, rest, unmoved, details)
            found.append(said)
            hints.append(hint)
            causes.append(cause)
    else:
        details["cross_document_pairs"] = 0
    details["cause"] = " and ".join(causes)
    rows_listed = f"{len(differing)} of {documents} packed documents get other logits than alone " \
                  f"(largest difference {details['largest_difference']:.3g})"
    return Result.failed(f"{rows_listed}: " + "; ".join(found) + note, "; ".join(hints), details)


def _unmoved_cause(subject, rows, comparison, unmoved, details: dict) -> tuple[str, str, str]:
    """Documents that differ from alone although no other document's tokens move them. Measured
    apart: the packed rows again with position ids that run on across the row. Unchanged logits
    mean the positions given never reach the model, so every document sits at its offset in the
    row: positions do not restart. Otherwise (or for a document that starts its row, whose positions
    are those alone) the cause was not told apart, and the candidates are listed."""
    from tfdoctor.probes.invariance import change_with_running_positions

    reach = change_with_running_positions(subject, rows, comparison)
    details["change_with_running_positions"] = reach
    offset = [(r, d) for r, d in unmoved if rows.documents[r][d][0] > 0]
    listed = ", ".join(f"row {r} doc {d}" for r, d in unmoved[:4])
    if reach <= comparison.tolerance and offset:
        return ("positions", f"positions do not restart at each document: the position ids given do not reach the "
                f"model (the packed logits do not change when they run on across the row, difference {reach:.2g}), "
                f"so {listed} sit at their offset in the row and differ from alone though no other document's "
                "tokens move them", "restart the positions at every document (position_ids from the collator, "
                "pos = arange within each document) and pass them to the model")
    measured = (f"the position ids given do reach the model (its logits change by {reach:.2g} when they run on "
                "across the row)" if reach > comparison.tolerance else
                "the documents start their rows, so their positions are those alone")
    return ("unexplained", f"{listed} differ from alone though no other document's tokens move them, and {measured}; "
            "the cause was not told apart: attention to the other documents that their content does not change "
            "(keys that only dilute the softmax, an attention sink), a statistic over the whole row (a norm or "
            "mean over positions), or positions that do not restart",
            "hook each layer's output to see where a document packed and alone part; mask attention to each "
            "document and restart the positions at each one")
