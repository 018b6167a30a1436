"""Causal-mask checks, judged on the measured dependency map rather than on how the mask is spelt."""

from __future__ import annotations

from tfdoctor.checks.verdicts import judged_per_implementation
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.tasks import for_classifiers

ENCODER_SKIP = "encoder models attend both ways by design (see bidirectional-encoder)"

# mask-direction: a map counts as "sees everything" when at least this share of both the strictly
# lower and the strictly upper triangle is present. A correct causal model fills its lower triangle
# completely; a few missing pairs come from tokens that happen to barely move an output.
FULL_SHARE = 0.9
# Future dependencies confined to a band no wider than this share of T read as an off-by-one (the
# band widens by one per layer when each layer sees one token ahead), not as a missing mask.
OFF_BY_ONE_MAX_SHARE = 0.25
# bidirectional-encoder: a pair depends when its change is this many times the noise measured in the
# same forward, and at least this share of the logit scale (float32 rounding of the largest logit).
NOISE_MARGIN = 10.0
FLOAT32_FLOOR = 1e-7

CAUSAL_MASK_HINT = (
    "mask before the softmax with the allowed mask torch.tril(torch.ones(T, T, dtype=torch.bool)) "
    "(scores.masked_fill(~allowed, float('-inf'))), or equivalently the blocked mask "
    "torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1) (scores.masked_fill(blocked, "
    "float('-inf'))); with SDPA pass is_causal=True"
)
# F.scaled_dot_product_attention reads a boolean attn_mask the other way round from masked_fill: True
# where a query MAY attend. A blocked mask (torch.triu(ones, diagonal=1)) handed to it lets each position
# see only later tokens; when the model calls SDPA, its fix says so.
SDPA_MASK_HINT = (
    "the model calls F.scaled_dot_product_attention, whose boolean attn_mask is True where a query MAY "
    "attend (the opposite of masked_fill's): a blocked mask such as torch.triu(ones, diagonal=1) given "
    "to it lets each position see only later tokens. Pass is_causal=True (and no attn_mask), or "
    "attn_mask=torch.tril(torch.ones(T, T, dtype=torch.bool)) (= ~blocked)"
)


def _on_dependency_map(subject, judge):
    """judge(map) as a judge(implementation): measures (or reuses) the map for that implementation.
    A model that is random in eval mode gets a warning instead: no change can be pinned on a token."""

    def judge_implementation(implementation):
        from tfdoctor.probes.dependency import token_dependency_map

        dmap = token_dependency_map(subject, implementation)
        if dmap.rows == "grouped":
            return Result.skipped(
                f"two identical rows of one batch gave logits {dmap.noise:.3g} apart, the same batch run twice "
                "agreed, and a batch of one row is refused: the model reads its batch rows together as parts of "
                "one sample (like MusicGen's codebooks), so what each output depends on cannot be measured row "
                "by row", {"noise": dmap.noise, "tolerance": dmap.tolerance})
        if dmap.rows == "repeatable":
            return Result.warned(
                f"two identical rows of one batch gave logits {dmap.noise:.3g} apart in eval mode, yet the same "
                "batch run twice agreed: the rows are read together, so what each output depends on cannot be "
                "measured",
                "if each row is its own sequence, look for an operation across the batch dimension: a view or "
                "reshape that mixes batch and time (x.view(T, B, d) on a [B, T, d] tensor instead of "
                "x.transpose(0, 1)), or a norm or attention over the batch axis",
                {"noise": dmap.noise, "tolerance": dmap.tolerance})
        if dmap.random_in_eval:
            return Result.warned(
                f"two identical inputs gave outputs {dmap.noise:.3g} apart in eval mode, so what each "
                "output depends on cannot be measured: the model is random at inference",
                "look for dropout that ignores eval mode (F.dropout(x, p) defaults to training=True; pass "
                "training=self.training) or noise sampled in forward", {"noise": dmap.noise,
                                                                        "tolerance": dmap.tolerance})
        return judge(dmap)

    return judge_implementation


def _map_details(dmap) -> dict:
    drawn, step = dmap.drawn()
    details = {
        "seq_len": dmap.seq_len,
        "forwards": dmap.forwards,
        "tolerance": dmap.tolerance,
        "output_scale": dmap.scale,
        "dependency_map": drawn,
        "map_cell_positions": step,
    }
    if dmap.opened is not None:
        details["zero_init_probe"] = dmap.opened
    return details


def _opened_note(dmap) -> str:
    """Said in the message when the verdict rests on the map with zero-initialised paths opened."""
    if dmap.opened is None or dmap.opened["judged"] != "opened":
        return ""
    return (f"; the fresh model's outputs depend on {dmap.opened['fresh_past_share']:.0%} of the earlier tokens "
            "(zero-initialised output projections or gates), so this was measured with its "
            f"{dmap.opened['jittered_tensors']} zero or constant weight tensor(s) jittered, then restored")


@check("future-leak", title="No output position depends on a later input token",
       kinds=("causal", "seq2seq"), skip_reasons={"encoder": ENCODER_SKIP}, located=("attention",), per_position=True)
def future_leak(subject) -> Result:
    """Catches any path from a later token to an earlier prediction: a missing, inverted or
    off-by-one causal mask, or probabilities zeroed after the softmax.

    Measures the dependency map D[i, j] (does output i change when input token j is swapped?) for
    all i, j at once: one batch row per perturbed position, in eval mode under no_grad, with a
    tolerance relative to the output's scale. Any D[i, j] with j > i fails; the details give the
    first leaking pair and the map, drawn as a heat map in the report. For seq2seq models the map is
    over the decoder's positions with the source held fixed.

    The map is of the architecture, not of the init: a model whose outputs barely mix positions at
    initialisation (attention and MLP output projections or residual gates set to zero, as nanochat,
    modded-nanoGPT and ReZero do) hides any leak until its first step, so it is measured again with
    its trainable zero or constant tensors jittered (then written back) and the details say so.

    Fix: mask the scores before the softmax with the allowed mask `torch.tril(torch.ones(T, T,
    dtype=torch.bool))` (or the blocked mask `torch.triu(..., diagonal=1)`); with SDPA pass
    `is_causal=True`.
    """
    return judged_per_implementation(
        subject, _on_dependency_map(subject, lambda dmap: _judge_future_leak(dmap, subject)))


def _judge_future_leak(dmap, subject) -> Result:
    leaks = dmap.future_pairs()
    details = _map_details(dmap)
    details["leaking_pairs"] = len(leaks)
    if not leaks:
        return Result.passed(f"no position depends on a later token (T={dmap.seq_len}, "
                             f"{dmap.forwards} batched forward(s)){_opened_note(dmap)}", details)
    i, j = leaks[0]
    details["first_leak"] = {"output_position": i, "input_position": j, "change": float(dmap.delta[i, j]),
                             "relative_change": float(dmap.delta[i, j] / dmap.scale)}
    T = dmap.seq_len
    return Result.failed(
        f"output position {i} changes when token {j} (a later one) changes: {len(leaks)} of "
        f"{T * (T - 1) // 2} future pairs leak, so the model can read the tokens it is asked to predict"
        + _opened_note(dmap), SDPA_MASK_HINT if _calls_sdpa(subject) else CAUSAL_MASK_HINT, details)


def classify(depends) -> tuple[str, int]:
    """Name the pattern of a boolean T x T map (list of lists or tensor): causal, upper, none,
    off-by-one or other; with the widest look-ahead seen (0 when nothing in the future is seen)."""
    rows = depends.tolist() if hasattr(depends, "tolist") else depends
    T = len(rows)
    lower = [rows[i][j] for i in range(T) for j in range(i)]
    upper = [rows[i][j] for i in range(T) for j in range(i + 1, T)]
    diagonal = [rows[i][i] for i in range(T)]
    ahead = max((j - i for i in range(T) for j in range(i + 1, T) if rows[i][j]), default=0)
    lower_share = sum(lower) / max(1, len(lower))
    upper_share = sum(upper) / max(1, len(upper))
    diagonal_share = sum(diagonal) / T
    if not any(upper):
        # A partly filled lower triangle is still causal (sliding-window attention); a missing
        # diagonal or an empty past is not a mask shape, it is a model that ignores tokens.
        return ("causal" if diagonal_share >= FULL_SHARE and lower_share > 0 else "other"), 0
    if not any(lower):
        return "upper", ahead
    if lower_share >= FULL_SHARE and upper_share >= FULL_SHARE:
        return "none", ahead
    if lower_share >= FULL_SHARE and ahead <= max(1, int(OFF_BY_ONE_MAX_SHARE * T)):
        return "off-by-one", ahead
    return "other", ahead


@check("mask-direction", title="The attention mask is causal: each position sees itself and the past",
       kinds=("causal", "seq2seq"), skip_reasons={"encoder": ENCODER_SKIP}, located=("attention",), per_position=True)
def mask_direction(subject) -> Result:
    """Names the shape of the mask the model behaves as if it had: "causal" (past and self),
    "upper" (self and future but not the past: torch.triu used where torch.tril was meant), "none"
    (no mask), "off-by-one" (also sees the next token or few) or "other".

    Judged on the same measured dependency map as future-leak, never on the source, so the correct
    idiom torch.triu(ones, diagonal=1) used as a blocked mask passes.

    Fix: the one-liner for the pattern found: `torch.tril` where `torch.triu` was written,
    `diagonal=0` where a position saw its next token, or the missing mask itself.
    """
    return judged_per_implementation(
        subject, _on_dependency_map(subject, lambda dmap: _judge_mask_direction(dmap, subject)))


def _runs_attention(subject) -> bool:
    """Whether one eval forward calls a softmax or a fused attention kernel at all."""
    from tfdoctor.probes.attention import attention_calls

    capture = attention_calls(subject)
    return bool(capture.softmaxes or capture.fused_calls)


def _calls_sdpa(subject) -> bool:
    """Whether one eval forward calls F.scaled_dot_product_attention (asked only of a failing model)."""
    from tfdoctor.probes.attention import attention_calls

    return "scaled_dot_product_attention" in attention_calls(subject).fused_calls


def _judge_mask_direction(dmap, subject) -> Result:
    pattern, ahead = classify(dmap.depends)
    details = _map_details(dmap)
    details.update(pattern=pattern, look_ahead=ahead)
    only_itself = bool(dmap.depends.diagonal().all()) and not bool(dmap.depends.tril(-1).any())
    if ahead == 0 and only_itself and not _runs_attention(subject):
        # A bigram drafter or a per-token classifier mixes no positions and calls no attention:
        # there is no mask to name. The same map from a model that does attend is a mask bug.
        return Result.skipped("each output reads only its own token and the forward calls no softmax or "
                              "attention kernel: the model mixes no positions, so it has no attention mask "
                              "to judge (future-leak still checks that nothing later is read)", details)
    T = dmap.seq_len
    note = _opened_note(dmap)
    if pattern == "causal":
        return Result.passed(f"causal: every position sees itself and the past, nothing later (T={T}){note}",
                             details)
    if pattern == "upper":
        sdpa = _calls_sdpa(subject)
        return Result.failed(
            "upper-triangular: each position sees itself and every later token but none of the earlier "
            "ones; the allowed mask was built with torch.triu where torch.tril was meant"
            + (" (or a blocked mask was given to SDPA, which takes True as allowed)" if sdpa else "") + note,
            SDPA_MASK_HINT if sdpa else
            "use torch.tril(torch.ones(T, T, dtype=torch.bool)) as the allowed mask (or keep triu but "
            "with diagonal=1 and use it as the blocked mask: scores.masked_fill(blocked, float('-inf')))",
            details)
    if pattern == "none":
        return Result.failed(
            "no causal mask: every position depends on every token, later ones included" + note,
            "apply the causal mask in every self-attention layer before the softmax: "
            "scores.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float('-inf')), "
            "or F.scaled_dot_product_attention(q, k, v, is_causal=True)", details)
    if pattern == "off-by-one":
        return Result.failed(
            f"off-by-one mask: positions see up to {ahead} token(s) ahead (the next token is the answer "
            "they are trained to predict; the window widens by one per layer)" + note,
            "the mask's diagonal is shifted: use torch.tril(ones) with diagonal=0 as the allowed mask, or "
            "torch.triu(ones, diagonal=1) (not diagonal=2) as the blocked mask", details)
    if ahead == 0:
        blind = not bool(dmap.depends.any())
        message = ("no output depends on any input token: the forward ignores its input ids" if blind else
                   "outputs depend on the past only partly, or not on their own token")
        return Result.failed(message + note, "check that the token embedding reaches the attention blocks "
                             "and that each position attends to itself", details)
    return Result.failed(f"irregular mask: positions see up to {ahead} token(s) ahead in an irregular "
                         "pattern (see the map)" + note, CAUSAL_MASK_HINT, details)


@check("bidirectional-encoder", title="An encoder lets every position see both directions",
       kinds=("encoder",), skip_reasons={"causal": "causal models must not see later tokens (see future-leak)",
                                         "seq2seq": "the decoder is causal by design; the encoder is "
                                                    "examined through cross-attention-mask"}, located=("attention",),
       per_position=True)
def bidirectional_encoder(subject) -> Result:
    """Catches a causal (or other one-way) mask left in a model that is declared or recognised as an
    encoder: BERT-style models must read the tokens on both sides of each position.

    Measures the same dependency map as future-leak, over the encoder's positions, and names its
    pattern; "none" (every position sees every token) is what an encoder should show.

    Fix: drop the causal mask from the encoder's self-attention and keep only the key-padding mask.
    """
    return judged_per_implementation(subject, _on_dependency_map(subject, _judge_bidirectional))


def _encoder_floor(dmap) -> float:
    """The smallest change that counts as a dependency in an encoder's map: a decade above the
    noise measured in the same forward (two identical rows; a row's outputs are otherwise computed
    bit for bit apart from the others', so a pair that does not depend moves by exactly 0), never
    below float32 rounding of the logit scale, never above the usual tolerance. A fresh model can
    mix weakly but really (Reformer: ~1e-5 of the logit scale), right at the usual tolerance, and a
    verdict must not turn on which side of it a pair lands."""
    return min(dmap.tolerance, max(NOISE_MARGIN * dmap.noise, FLOAT32_FLOOR * max(dmap.scale, 1e-30)))


def _judge_bidirectional(dmap) -> Result:
    import torch

    floor = _encoder_floor(dmap)
    depends = dmap.delta > floor
    pattern, ahead = classify(depends)
    details = _map_details(dmap)
    weak = depends & ~dmap.depends
    details.update(pattern=pattern, dependency_floor=floor, weak_pairs=int(weak.sum()))
    if pattern == "none":
        note = ""
        if bool(weak.any()):
            largest = float(dmap.delta[weak].max())
            note = (f"; {int(weak.sum())} pairs depend only weakly (up to {largest / max(dmap.scale, 1e-30):.2g} of "
                    f"the logit scale, under the usual {dmap.tolerance / max(dmap.scale, 1e-30):.0e}, yet "
                    f"{'far' if dmap.noise == 0 else f'{largest / max(dmap.noise, 1e-30):.0f}x'} above the measured "
                    "noise): weak but real mixing, as a fresh init can have")
        return Result.passed(f"every position depends on earlier and later tokens (T={dmap.seq_len}){note}", details)
    if pattern in ("causal", "off-by-one"):
        return Result.failed(
            "the encoder is one-way: " + ("no position sees the tokens after it" if pattern == "causal" else
                                          f"positions see at most {ahead} token(s) ahead")
            + ", so a bidirectional model is trained with half its context",
            "drop the causal mask from the encoder's self-attention (keep only the key-padding mask), or "
            "declare the model kind='causal' if it is a decoder", details)
    if pattern == "upper":
        return Result.failed("the encoder sees only itself and later tokens, never earlier ones",
                             "drop the triangular mask from the encoder's self-attention", details)
    reach = _two_sided_reach(depends)
    if reach is not None:
        details.update(look_ahead=reach[0], look_behind=reach[1])
        return Result.passed(f"every position depends on tokens on both sides, within a window (up to {reach[0]} "
                             f"ahead and {reach[1]} behind, T={dmap.seq_len}): local attention, bidirectional", details)
    if not bool((depends & ~torch.eye(dmap.seq_len, dtype=torch.bool)).any()):
        return Result.warned("no position depends on any other token at this length: the encoder does not mix "
                             "positions (see the map)", "check that attention reaches across positions (a sparse or "
                             "approximate attention may drop every pair at short lengths: try a longer --seq-len)",
                             details)
    return Result.warned("some positions do not depend on tokens on one side (see the map)",
                         "check for local or windowed masks in the encoder's self-attention", details)


def _two_sided_reach(depends) -> tuple[int, int] | None:
    """(widest look-ahead, widest look-behind) when every position reads at least one later token
    (if any) and one earlier token (if any), as local/windowed attention does; else None."""
    T = depends.shape[0]
    ahead = [[j - i for j in range(i + 1, T) if depends[i, j]] for i in range(T)]
    behind = [[i - j for j in range(i) if depends[i, j]] for i in range(T)]
    if all(ahead[i] for i in range(T - 1)) and all(behind[i] for i in range(1, T)):
        return max(max(a) for a in ahead[:-1]), max(max(b) for b in behind[1:])
    return None


@check("cross-attention-mask", title="Every decoder position can read the whole source",
       kinds=("seq2seq",), skip_reasons={"causal": "no cross-attention in a decoder-only model",
                                         "encoder": "no cross-attention in an encoder-only model",
                                         **for_classifiers("its decoder's per-position outputs are not read")},
       located=("attention",), tasks=("lm",))
def cross_attention_mask(subject) -> Result:
    """Catches a causal mask pasted into cross-attention: decoder position i may then read only
    source positions <= i, which quietly caps a translation model's quality.

    Perturbs the encoder's output one source position per batch row (a forward hook on the
    encoder; changing source tokens would not show it, as the encoder mixes every token into every
    position) and records which decoder outputs move. Every decoder position must read every
    source position.

    Fix: `memory_mask=None`; mask only source padding (`memory_key_padding_mask=(src == pad_id)`).
    """
    import torch

    from tfdoctor.context import current
    from tfdoctor.modes import evaluation
    from tfdoctor.probes.cross_attention import cross_map

    def judge(implementation) -> Result:
        with evaluation(subject.model):
            cmap = cross_map(subject, torch.Generator().manual_seed(current().seed + 5))
        if cmap is None:
            return Result.skipped("cannot find the encoder module whose output the decoder reads "
                                  "(name it `encoder`, or use a Hugging Face encoder-decoder)")
        reads = cmap.reads
        T, S = reads.shape
        unread = (~reads).nonzero().tolist()
        cells = [[int(reads[i, j]) for j in range(S)] for i in range(T)]
        details = {"encoder_module": cmap.hooked, "tolerance": cmap.tolerance, "unread_pairs": len(unread),
                   "reads_map": cells}
        if not unread:
            return Result.passed(f"each of {T} decoder positions reads all {S} source positions", details)
        i, j = unread[0]
        if all(j > i for i, j in unread):
            return Result.failed(
                f"cross-attention is causal: decoder position {i} cannot read source position {j} "
                f"({len(unread)} of {T * S} pairs unread, all with source position > decoder position)",
                "pass no causal mask to cross-attention: memory_mask=None (nn.Transformer), or only the "
                "source key-padding mask (memory_key_padding_mask=(src == pad_id))", details)
        return Result.failed(f"decoder position {i} cannot read source position {j} ({len(unread)} of "
                             f"{T * S} pairs unread)",
                             "cross-attention should mask only source padding; check memory_mask", details)

    return judged_per_implementation(subject, judge)
