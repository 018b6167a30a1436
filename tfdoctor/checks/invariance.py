"""Invariance checks: the same sequence gets the same logits however it is batched (alone or
padded, packed with other documents, computed at once or token by token with a cache)."""

from __future__ import annotations

from tfdoctor.checks.verdicts import judged_per_implementation
from tfdoctor.registry import check
from tfdoctor.result import Result

MAX_LISTED = 6
SEQ2SEQ_SKIP = "written for decoder-only and encoder models (a seq2seq source's padding is padding-mask's)"
CAUSAL_ONLY = "written for causal LMs"

POSITIONS_HINT = (
    "count positions from each row's first real token, not from the row's start: positions = "
    "(mask.cumsum(-1) - 1).clamp(min=0) with mask = (ids != pad_id), and index the position table "
    "(or the rotary angles) with them; Hugging Face models take position_ids=positions"
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

UNKNOWN_SIDE_HINT = ("if you only ever pad on the right, say so: --padding-side right or "
                     "Subject(padding_side='right'); otherwise ")


def _random_in_eval(first, again, tolerance: float) -> float | None:
    """The gap between two identical forwards, when it is over the tolerance (else None)."""
    import torch

    same_nan = torch.isnan(first) & torch.isnan(again)  # NaN in both is the same NaN (masked-row-nan's)
    gap = (first - again).abs().masked_fill(same_nan, 0.0)
    gap = float(torch.nan_to_num(gap, nan=float("inf"), posinf=float("inf")).max()) if first.numel() else 0.0
    return gap if gap > tolerance else None


def _random_result(gap: float, what: str) -> Result:
    return Result.warned(f"two identical forwards of the {what} gave logits {gap:.3g} apart in eval mode, so "
                         "arrangements cannot be compared: the model is random at inference", RANDOM_HINT,
                         {"noise": gap})


# ----------------------------------------------------------------------------------------------
# padding-equivalence


def _padding_cause(subject, arrangement) -> tuple[str, dict]:
    """Why a padded arrangement differs from the sequences alone: "nonfinite", "batch" (the row that
    differs most gives other logits run alone with the same pads), "pads" (real positions move with
    the pads' content), "positions" (none of those, and pads sit before the real tokens) or "other"."""
    import torch

    from tfdoctor.probes.invariance import padded_call, row_alone_padded
    from tfdoctor.probes.padding import input_embedding, perturbed_pads

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
    if embedding is not None:
        generator = torch.Generator().manual_seed(0)
        ids, pads = arrangement.ids, ~arrangement.real.to(arrangement.ids.device)
        with torch.no_grad(), perturbed_pads(embedding, ids, pads, generator) as calls:
            moved = padded_call(subject, ids, ~pads).float()
        if calls:
            change = (moved - arrangement.logits).abs().amax(-1).cpu()
            evidence["largest_change_from_pad_content"] = float(change[arrangement.real].max())
            if bool((change[arrangement.real] > arrangement.tolerance).any()):
                return "pads", evidence
    return ("positions" if arrangement.side == "left" else "other"), evidence


def _padding_message(subject, arrangement, cause: str) -> tuple[str, str]:
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
        return (f"{seen}: the pads are not attended, yet the real tokens move with the number of pads before "
                f"them ({per_pad}), so positions are counted from the row's start: learned positions shift "
                "by the pad count", POSITIONS_HINT)
    if cause == "pads":
        return f"{seen}: real positions attend to the pads (their logits move with the pads' content)", PADS_HINT
    if cause == "batch":
        return (f"{seen}: a row's logits depend on the other rows of its batch (the same padded row run alone "
                "gives other logits): a batch-dependent operation", BATCH_HINT)
    if cause == "nonfinite":
        return f"{seen}: real positions turn NaN/Inf when padded", NONFINITE_HINT
    return (f"{seen}: the pads are not attended and the row alone agrees with the batch, so the trailing pads "
            "change earlier positions some other way (a mean over positions that includes the pads, or later "
            "positions read: see future-leak)", BATCH_HINT)


@check("padding-equivalence", title="Each sequence gets the same logits alone as inside a padded batch",
       kinds=("causal", "encoder"), needs=("pad_id",), skip_reasons={"seq2seq": SEQ2SEQ_SKIP})
def padding_equivalence(subject) -> Result:
    """Catches models that predict differently for the same sequence depending on how it is padded:
    learned (or rotary) positions counted from the row's start, so that left padding shifts every
    real token's position by the pad count; pads that are attended; operations that mix the rows of a
    batch. The loss still falls, but what the model learns depends on the batch it was in.

    Runs the probe sequences (one full row, the others shorter, all different lengths) alone and
    padded into one batch on the side the model is trained with (--padding-side, the tokenizer's;
    unknown: both for a causal model, right for an encoder), each arrangement in one batched forward,
    with the model called as in training (its own forward; Hugging Face models with attention_mask,
    causal LMs also with position ids from the mask, as generation builds them), and compares every
    real position's logits within a tolerance relative to their scale. The report gives the largest
    difference, the positions affected and the likely cause, told apart by behaviour: real outputs
    that move with the pads' content (pads attended), a row that differs run alone with the same pads
    (batch-dependent), or neither (positions from the row's start). Where the side is unknown, a
    difference under left padding only warns: it matters for left-padded training and batched
    generation.

    Fix: build positions from the mask, positions = (mask.cumsum(-1) - 1).clamp(min=0) (Hugging Face:
    position_ids=positions), and mask the pad keys.
    """
    import torch

    from tfdoctor.context import current
    from tfdoctor.probes.invariance import alone, compare_padded
    from tfdoctor.probes.modes import evaluation
    from tfdoctor.probes.padding import probed_sides

    declared = subject.padding_side
    sides = probed_sides(subject)

    def judge(implementation) -> Result:
        with evaluation(subject.model):
            generator = torch.Generator().manual_seed(current().seed + 11)
            probe = alone(subject, generator)
            arrangements = [compare_padded(subject, probe, side) for side in sides]
            alone_forwards = 1 if subject.kind == "causal" else len(probe.lengths)
            details = {"declared_side": declared, "real_lengths": probe.lengths, "seq_len": subject.seq_len,
                       "forwards": alone_forwards + len(arrangements), "sides": {}}
            failing = []
            for arrangement in arrangements:
                side_details = {"largest_difference": float(arrangement.diff[arrangement.real].max()),
                                "output_scale": arrangement.scale, "tolerance": arrangement.tolerance,
                                "row_differences": arrangement.row_differences(),
                                "pads_per_row": [subject.seq_len - L for L in arrangement.lengths]}
                details["sides"][arrangement.side] = side_details
                if bool(arrangement.differs.any()):
                    noise = _random_in_eval(arrangement.logits, _again(subject, arrangement), arrangement.tolerance)
                    if noise is not None:
                        return _random_result(noise, f"{arrangement.side}-padded batch")
                    cause, evidence = _padding_cause(subject, arrangement)
                    positions = arrangement.differs.nonzero().tolist()
                    side_details.update(cause=cause, differing_count=len(positions),
                                        differing_positions=[{"row": r, "position": p}
                                                             for r, p in positions[:MAX_LISTED]], **evidence)
                    failing.append((arrangement, cause))
        if not failing:
            summary = " and ".join(f"{a.side} padding (largest difference {details['sides'][a.side]['largest_difference']:.2g}"
                                   f", tolerance {a.tolerance:.2g})" for a in arrangements)
            return Result.passed(f"every sequence ({', '.join(map(str, probe.lengths))} real tokens) gets the same "
                                 f"logits alone as in a batch: {summary}", details)
        arrangement, cause = failing[0]
        details.update(pad_side=arrangement.side, **details["sides"][arrangement.side])
        message, hint = _padding_message(subject, arrangement, cause)
        if declared is None and subject.kind == "causal" and all(a.side == "left" for a, _ in failing):
            return Result.warned(f"{message}; right padding is equivalent, so this matters only for left-padded "
                                 "training and batched generation", UNKNOWN_SIDE_HINT + hint, details)
        if declared is not None:
            message += f" ({declared} padding, as declared)"
        return Result.failed(message, hint, details)

    return judged_per_implementation(subject, judge)


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
    import torch

    from tfdoctor.probes.invariance import packed_call

    if subject.packing != "position_ids" or not getattr(getattr(subject.model, "config", None), "use_cache", False):
        return ""
    with torch.no_grad():
        default = packed_call(subject, rows, use_cache=None).float()
    gap = float((default - comparison.logits).abs().max())
    details["difference_with_config_use_cache"] = gap
    if gap <= comparison.tolerance:
        return ""
    return ("; called without use_cache=False (config.use_cache is True) the documents read each other "
            f"(difference {gap:.2g}): this release reads packing off the position ids only without a cache, so "
            "pass use_cache=False in a hand-written loop (the Trainer does)")


@check("packing-isolation", title="Packed documents do not see each other and restart their positions",
       kinds=("causal",), skip_reasons={"encoder": CAUSAL_ONLY, "seq2seq": CAUSAL_ONLY})
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
    alone (one batched forward each) and compares each document's logits. On a difference it draws
    the document map (does document i move when only document j's tokens change?) and names what
    leaks: attention across the boundary, or positions that do not restart (a document that no
    other one moves, yet differs).

    Fix: mask attention to the same document, allowed = causal & (doc_ids[:, :, None] ==
    doc_ids[:, None, :]), and restart position ids at every document.
    """
    import torch

    from tfdoctor.context import current
    from tfdoctor.probes.invariance import compare_packed, document_map, pack_rows, packed_call
    from tfdoctor.probes.modes import evaluation

    if subject.packing is None:
        return Result.skipped("the Subject does not say how it packs documents: pass Subject(packing=fn) with "
                              "fn(model, input_ids, doc_ids, position_ids) -> logits, or packing='position_ids'")

    def judge(implementation) -> Result:
        with evaluation(subject.model):
            generator = torch.Generator().manual_seed(current().seed + 12)
            rows = pack_rows(subject, generator)
            comparison = compare_packed(subject, rows, generator)
            tolerance = comparison.tolerance
            documents = sum(len(row) for row in rows.documents)
            details = {"documents_per_row": [len(row) for row in rows.documents],
                       "document_lengths": [[L for _, L in row] for row in rows.documents],
                       "largest_difference": float(comparison.diff.max()), "output_scale": comparison.scale,
                       "tolerance": tolerance, "packing": "position_ids" if isinstance(subject.packing, str)
                       else getattr(subject.packing, "__name__", "fn"), "forwards": 2}
            differing = [(r, d) for r, row in enumerate(rows.documents) for d, (s, L) in enumerate(row)
                         if float(comparison.diff[r, s:s + L].max()) > tolerance]
            if not differing:
                note = _cache_note(subject, comparison, rows, details)
                return Result.passed(f"each of {documents} documents packed {max(details['documents_per_row'])} to a "
                                     f"row gets the same logits as alone (largest difference "
                                     f"{details['largest_difference']:.2g}, tolerance {tolerance:.2g}){note}", details)
            with torch.no_grad():
                noise = _random_in_eval(comparison.logits, packed_call(subject, rows).float(), tolerance)
            if noise is not None:
                return _random_result(noise, "packed batch")
            maps = document_map(subject, comparison, generator)
        leaks = [(r, i, j) for r, grid in enumerate(maps) for i, row in enumerate(grid) for j, seen in enumerate(row)
                 if seen and i != j]
        leaked_into = {(r, i) for r, i, _ in leaks}
        unmoved = [(r, d) for r, d in differing if (r, d) not in leaked_into]
        details.update(differing_documents=[{"row": r, "document": d} for r, d in differing[:MAX_LISTED]],
                       differing_count=len(differing), cross_document_pairs=len(leaks),
                       document_map={str(r): _drawn_documents(grid) for r, grid in enumerate(maps)})
        found = []
        if leaks:
            r, i, j = leaks[0]
            listed = ", ".join(f"row {r} doc {i} reads doc {j}" for r, i, j in leaks[:4])
            found.append(f"attention crosses the document boundary ({len(leaks)} pairs: {listed}"
                         f"{', ...' if len(leaks) > 4 else ''})")
            details["cause"] = "attention"
        if unmoved:
            listed = ", ".join(f"row {r} doc {d}" for r, d in unmoved[:4])
            found.append(f"positions do not restart at each document ({listed} differ from alone though no other "
                         "document moves them)")
            details["cause"] = "positions" if not leaks else "attention and positions"
        rows_listed = f"{len(differing)} of {documents} packed documents get other logits than alone " \
                      f"(largest difference {details['largest_difference']:.3g})"
        hints = []
        if leaks:
            hints.append("mask attention to each document: allowed = causal & (doc_ids[:, :, None] == "
                         "doc_ids[:, None, :]) (flex_attention / varlen kernels: cu_seqlens from doc_ids)")
        if unmoved:
            hints.append("restart the positions at every document (position_ids from the collator, "
                         "pos = arange within each document) and pass them to the model")
        return Result.failed(f"{rows_listed}: " + "; ".join(found), "; ".join(hints), details)

    return judged_per_implementation(subject, judge)


# ----------------------------------------------------------------------------------------------
# cache-consistency


@check("cache-consistency", title="Decoding with the cache gives the full forward's logits",
       kinds=("causal",), skip_reasons={"encoder": CAUSAL_ONLY, "seq2seq": CAUSAL_ONLY})
def cache_consistency(subject) -> Result:
    """Catches a key/value cache that changes the model: a cached path that drops the causal mask
    (a prompt of several tokens then reads its own future), positions not offset by the cache length
    (every decoded token is placed at position 0), a cache that is appended twice or sliced wrongly,
    a one-token call that returns logits of another shape. Training never runs the cache, so only
    generation is wrong.

    Prefills half the probe sequence, then decodes up to 8 tokens one at a time through the model's
    cache, and compares the logits at every position with one full forward (tolerance relative to
    their scale). Hugging Face causal LMs are driven by their own generate() (greedy, forced to the
    drawn tokens), so each model's convention is followed: its cache or state object, the arguments
    its prepare_inputs_for_generation passes; under each attention implementation, also with a
    left-padded prompt batch and its attention mask. A model whose generate() feeds the whole
    sequence again at every step keeps no cache: skipped, saying so. Other models are run when given
    Subject(incremental=fn) with fn(model, input_ids [B, t], state) -> (logits, state), state None on
    the first call. In bfloat16 or float16 a difference within that precision's rounding is measured
    again in float32 before it is judged. Reports the first position that diverges and by how much.

    Fix: keep the causal mask for multi-token calls with a cache (query i sees keys <= past + i) and
    start the new tokens' positions at the cache length.
    """
    from tfdoctor.probes.generation import why_not_generate
    from tfdoctor.probes.invariance import hf_causal

    hugging_face = subject.incremental is None and hf_causal(subject)  # a given incremental fn wins
    if not hugging_face and subject.incremental is None:
        return Result.skipped("no cached decoding to compare: pass Subject(incremental=fn) with "
                              "fn(model, input_ids, state) -> (logits, state) (Hugging Face causal LMs need none)")
    reason = why_not_generate(subject.model) if hugging_face else None
    if reason is not None:
        return Result.skipped(f"no cached decoding to compare: {reason}")
    return judged_per_implementation(subject, lambda implementation: _judge_cache(subject, hugging_face))


def _cache_arms(subject, hugging_face: bool) -> list:
    import torch

    from tfdoctor.context import current
    from tfdoctor.probes.decoding import compare_cache
    from tfdoctor.probes.generation import accepts
    from tfdoctor.probes.modes import evaluation

    with evaluation(subject.model):
        generator = torch.Generator().manual_seed(current().seed + 13)
        arms = [compare_cache(subject, generator)]
        if hugging_face and accepts(subject.model, "attention_mask"):
            arms.append(compare_cache(subject, generator, left_padded=True))
    return arms


def _precision_arms(subject, hugging_face: bool, arms: list) -> tuple[list, dict]:
    """In bfloat16 or float16, arms whose difference is over the float32 tolerance but within the
    precision's rounding reach are a close call: measured again in float32 (the parameters upcast in
    place and restored), judged there. Evidence of the close call in the returned details."""
    from tfdoctor.probes.precision import can_upcast, compute_dtype, in_float32, rounding_reach

    dtype = compute_dtype(subject.model)
    reach = rounding_reach(dtype)
    worst = max(arm.relative for arm in arms)
    if not reach or any(arm.shape_defect for arm in arms) or not any(arm.first_divergence() is not None
                                                                     for arm in arms) or worst > reach:
        return arms, {"compute_dtype": str(dtype).replace("torch.", "")} if reach else {}
    name = str(dtype).replace("torch.", "")
    evidence = {"compute_dtype": name, "relative_difference_in_compute_dtype": worst, "rounding_reach": reach}
    if not can_upcast(subject.model):
        evidence["close_call"] = (f"in {name} the cached and full logits differ by {worst:.2g} of their scale, within "
                                  f"{name} rounding's reach ({reach:.2g}); not measured again in float32 (model too "
                                  "large to upcast): not judged")
        return [], evidence
    with in_float32(subject.model):
        arms = _cache_arms(subject, hugging_face)
    evidence["close_call"] = (f"in {name} the cached and full logits differ by {worst:.2g} of their scale, within "
                              f"{name} rounding's reach ({reach:.2g}): measured again in float32")
    return arms, evidence


def _judge_cache(subject, hugging_face: bool) -> Result:
    from tfdoctor.probes.decoding import NotComparable

    try:
        arms = _cache_arms(subject, hugging_face)
    except NotComparable as exc:
        return Result.skipped(f"no cached decoding to compare: {exc}")
    defect = next((arm for arm in arms if arm.shape_defect), None)
    if defect is not None:
        return _shape_result(subject, defect)
    first_arms = arms
    arms, precision = _precision_arms(subject, hugging_face, arms)
    details = {"prefill": first_arms[0].prefill, "positions": int(first_arms[0].diff.numel()),
               "path": "generate" if hugging_face else "incremental", "arms": {}, **precision}
    note = f"; {precision['close_call']}" if "close_call" in precision else ""
    if not arms:  # a close call that could not be measured again
        return Result.passed(f"cached decoding agrees with the full forward within rounding{note}", details)
    for arm in arms:
        details["arms"][arm.label] = {"largest_difference": float(arm.diff.max()), "output_scale": arm.scale,
                                      "tolerance": arm.tolerance, "first_divergence": arm.first_divergence(),
                                      "difference_by_position": [float(f"{d:.3g}") for d in arm.diff.tolist()],
                                      **arm.details}
    broken = [arm for arm in arms if arm.first_divergence() is not None]
    if not broken:
        summary = "; ".join(f"{arm.label}: largest difference {float(arm.diff.max()):.2g}" for arm in arms)
        return Result.passed(f"prefill of {arms[0].prefill} tokens then {arms[0].diff.numel() - arms[0].prefill} "
                             f"cached steps give the full forward's logits at every position ({summary}){note}", details)
    arm = broken[0]
    if arm.rerun_full is not None:
        import torch

        from tfdoctor.probes.modes import evaluation

        with torch.no_grad(), evaluation(subject.model):
            noise = _random_in_eval(arm.full, arm.rerun_full(), arm.tolerance)
        if noise is not None:
            return Result.skipped(f"two identical full forwards gave logits {noise:.3g} apart in eval mode (the model "
                                  "is random at inference, e.g. hashing or sampling with no seed): cached decoding "
                                  "cannot be compared with it", {"noise": noise})
    return _divergence_result(arm, details, note)


def _divergence_result(arm, details: dict, note: str) -> Result:
    at = arm.first_divergence()
    gap = float(arm.diff[at])
    details.update(arm=arm.label, first_divergence=at, difference_at_first=gap)
    where = (f"position {at}, inside the {arm.prefill}-token prefill" if at < arm.prefill
             else f"position {at}, the {'first' if at == arm.prefill else f'{at - arm.prefill + 1}th'} token "
                  "decoded with the cache")
    details["prompt_alone_difference"] = arm.prompt_alone_gap
    if at < arm.prefill and arm.prompt_alone_gap <= arm.tolerance:
        return _length_dependent_result(arm, details, where, gap, note)
    if at < arm.prefill:
        cause = ("the cached call of several tokens differs from the full forward: the cache path drops the "
                 "causal mask (the prompt reads its own future)")
        hint = ("keep the causal mask whenever more than one token is given with a cache: query i may see "
                "keys <= past_length + i (is_causal=True is wrong for a chunk after a cache; build the mask "
                "with the offset)")
    else:
        cause = ("the tokens decoded one at a time differ from the full forward while the prefill agrees: "
                 "the new token's position is not offset by the cache length, or its keys/values are "
                 "stored or read wrongly")
        hint = ("start the new tokens' positions at the cache length (positions = arange(past, past + t)) and "
                "append their keys and values once")
    batch = ("" if arm.label == "unpadded" else
             "with left-padded prompts (and their attention mask, as batched generation runs them), ")
    return Result.failed(f"{batch}logits diverge first at {where}, by {gap:.3g} "
                         f"({gap / max(arm.scale, 1e-30):.2g} of their scale): {cause}{note}", hint, details)


def _shape_result(subject, arm) -> Result:
    """A call of the model's own decoding that returned logits of the wrong shape: the model's."""
    from tfdoctor.probes.implementations import library_release

    defect = arm.shape_defect
    fed = "one-token" if defect["input_ids"][1] == 1 else f"{defect['input_ids'][1]}-token"
    details = {"path": "generate", "arm": arm.label, "shape_defect": defect, **arm.details}
    where = " with left-padded prompts" if arm.label != "unpadded" else ""
    return Result.failed(
        f"the model's cached forward, called by its own generate(){where}, returned logits {defect['logits']} for a "
        f"{fed} call (input_ids {defect['input_ids']}, arguments {', '.join(defect['arguments'])}); a decoding step "
        f"must return {defect['expected']}: generate() reads logits[:, -1] and decodes from the wrong numbers "
        f"({type(subject.model).__name__}, {library_release(subject.model)})",
        "return logits [batch, new tokens, vocab] from a call with a cache: look for a tensor of the step that "
        "broadcasts [B, 1, ...] against [B, ...] (a squeeze() or a missing unsqueeze on the decoded position)",
        details)


def _length_dependent_result(arm, details: dict, where: str, gap: float, note: str) -> Result:
    """The prompt's logits move with the tokens after it in a full forward, while the cached prefill
    agrees with a forward of the prompt alone: the full forward's fault, not the cache's."""
    batch = "" if arm.label == "unpadded" else " with left-padded prompts"
    return Result.warned(
        f"logits diverge first at {where}, by {gap:.3g}{batch}; the cached prefill agrees with a full forward of the "
        f"prompt alone (difference {arm.prompt_alone_gap:.2g}), so the cache is not at fault: the full forward gives "
        f"the prompt's positions other logits when more tokens follow them (a mask that lets positions read later "
        f"tokens or depends on the sequence length{', e.g. with left padding' if batch else ''}; see future-leak and "
        f"padding-equivalence){note}",
        "build the attention mask so that position i reads only real keys <= i whatever the sequence length; "
        "run tfdoctor check --only future-leak,padding-equivalence to see which positions read ahead", details)
