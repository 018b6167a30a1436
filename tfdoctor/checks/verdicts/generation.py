"""generation's verdicts (checks/learning.py): where greedy decoding, tfdoctor's own loop, the cache and
the model's own generate(), departs from the batch the model memorised."""

from __future__ import annotations

from tfdoctor.result import Result

# generation: tokens of the decoded and the memorised row shown around the first divergence.
SHOWN_TOKENS = 8
# A departure is judged only where the full forward prefers the batch's token by at least this many
# nats over the next: a memorised token sits far above it (the fixtures' mismatches: > 5), while a
# near tie can flip between two correct code paths of one model (HF RWKV's one-token path against its
# sequence path departed in 1 row of 4 at a margin below 1).
GENERATION_MARGIN = 1.0


def first_departure(a, b, upto: int) -> list:
    """Per row, the first position t >= 1 below `upto` where a and b differ, or None."""
    out = []
    for r in range(a.shape[0]):
        diff = (a[r, 1:upto] != b[r, 1:upto]).nonzero()
        out.append(int(diff[0]) + 1 if diff.numel() else None)
    return out


def shown_around(row, t: int) -> list:
    return [int(x) for x in row[max(0, t - SHOWN_TOKENS // 2):t + SHOWN_TOKENS // 2]]


def generation_verdict(run) -> Result:
    B, L = run.rows.shape
    departs = first_departure(run.uncached, run.rows, L)
    # a departure the full forward shares (it misses that token too) was never memorised: not judged there
    def memorised(r: int, t: int) -> bool:
        confident = run.margin is None or float(run.margin[r, t]) >= GENERATION_MARGIN
        return bool(run.teacher[r, t] == run.rows[r, t]) and confident

    mismatched = [(t, r) for r, t in enumerate(departs) if t is not None and memorised(r, t)]
    unmemorised = [(t, r) for r, t in enumerate(departs) if t is not None and not memorised(r, t)]
    details = {"rows": B, "tokens_per_row": L, "reproduced_rows": departs.count(None),
               "cache": run.cache_driver or run.no_cache, "first_departure_per_row": departs}
    hint = ("give each position at training the context it has when decoding: a causal mask torch.tril(ones(T, T)) "
            "(not triu), positions counted from the start of the sequence, nothing that depends on its length")
    if mismatched:
        t, r = min(mismatched)
        decoded, wanted = run.uncached[r], run.rows[r]
        head = decoded[t - 1:t + SHOWN_TOKENS // 2]  # the token before the departure and a few after
        again = "its first token" if int(head[0]) == int(wanted[0]) else f"token {int(head[0])}"
        repeats = f"; it decodes {again} over and over" if len(head) > 2 and bool((head == head[0]).all()) else ""
        if run.margin is not None:
            details["full_forward_margin_nats"] = float(run.margin[r, t])
        details.update(row=r, position=t, expected_token=int(wanted[t]), decoded_token=int(decoded[t]),
                       decoded=shown_around(decoded, t), memorised=shown_around(wanted, t),
                       mismatched_rows=len(mismatched))
        return Result.failed(
            f"train/inference mismatch: greedy decoding from row {r}'s first token departs from the memorised batch "
            f"at position {t}: token {int(decoded[t])} where the batch has {int(wanted[t])}, although the full forward "
            f"of the batch, from the same prefix, predicts {int(wanted[t])}{repeats} ({len(mismatched)} of {B} rows "
            "depart where the full forward is right): what training sees is not what decoding sees", hint, details)
    failed, own_note = own_decoder_verdict(run, departs, memorised, shown_around, details)
    if failed is not None:
        return failed
    if run.cached is not None:
        agreed = [t if t is not None else run.cached_upto for t in departs]
        cache_departs = [first_departure(run.cached[r:r + 1], run.uncached[r:r + 1], min(run.cached_upto, a + 1))[0]
                         for r, a in enumerate(agreed)]
        # where the uncached arm reproduced the batch, the prefix is the batch's: its margin applies
        found = [(t, r) for r, t in enumerate(cache_departs) if t is not None and memorised(r, t)]
        if found and run.cache_driver == "generate":  # a library's cache is cache-consistency's (HF RoBERTa)
            details.update(generate_departs_at=dict(zip(("position", "row"), min(found))), cached_rows=len(found))
            found = []
        if found:
            t, r = min(found)
            details.update(row=r, position=t, uncached_token=int(run.uncached[r, t]),
                           cached_token=int(run.cached[r, t]), cached_rows=len(found))
            return Result.failed(
                f"decoding with the cache ({run.cache_driver}) departs from decoding without it at position {t} of "
                f"row {r}: token {int(run.cached[r, t])} instead of {int(run.uncached[r, t])}, which the model "
                "memorised: the cache path differs from the full forward (see cache-consistency)",
                "keep the causal mask for multi-token calls with a cache and start new tokens' positions at the "
                "cache length", details)
    arms = f"with and without the cache ({run.cache_driver})" if run.cached is not None else \
        f"without the cache ({run.no_cache})"
    note = ""
    if "generate_departs_at" in details:
        at = details["generate_departs_at"]
        arms = (f"without the cache ({run.cache_driver}() departs at position {at['position']} of row {at['row']}: "
                "cache-consistency judges the cache)")
    if unmemorised:
        t, r = min(unmemorised)
        note = (f"; {len(unmemorised)} row(s) depart where the model had not memorised the token (row {r} at "
                f"position {t}: its full forward misses it too), judged up to there")
    return Result.passed(f"greedy decoding from each row's first token writes the memorised batch again ({B} rows of "
                         f"{L} tokens) {arms}{own_note}{note}", details)


def own_decoder_verdict(run, departs: list, memorised, shown, details: dict) -> tuple:
    """(a failure or None, a note for the pass) on the tokens the model's own generate() decoded
    greedily from each row's first token (run.own), against the memorised batch. `departs` holds,
    per row, where tfdoctor's greedy loop (the whole prefix through forward) first left the batch
    (None: never); `memorised(r, t)` whether the full forward predicts the batch's token there with
    confidence. The method is judged at its first departure in a row where the loop still followed
    the batch: the same prefix, so the same prediction is due. Its evidence goes to
    details["own_decoder"]."""
    own = run.own
    if own is None:
        if run.own_missing:
            details["own_decoder"] = {"not_run": run.own_missing}
        return None, (f"; {run.own_missing}" if run.own_missing else "")
    B, L = run.rows.shape
    n = min(own.tokens.shape[1], L)
    firsts = []
    for r in range(B):
        upto = min(n, (departs[r] if departs[r] is not None else L - 1) + 1)
        diff = (own.tokens[r, 1:upto] != run.rows[r, 1:upto]).nonzero()
        firsts.append(int(diff[0]) + 1 if diff.numel() else None)
    evidence = details["own_decoder"] = {
        "method": own.method, "location": own.location, "greedy_by": own.how, "returned": own.returned,
        "arguments": own.arguments, "tokens_compared": n, "first_departure_per_row": firsts}
    found = [(t, r) for r, t in enumerate(firsts) if t is not None and memorised(r, t)]
    call = f"{own.method}() ({own.location}, greedy by {own.how})"
    if found and own.repeatable is False:
        evidence["repeatable"] = False
        return None, (f"; {call} decodes at random even so (two seeds gave different tokens): its tokens are not "
                      "judged")
    if not found:
        short = f", {n} of {L} tokens (it stopped early)" if n < L else ""
        return None, f" and through your {own.method}(){short}"
    t, r = min(found)
    decoded, wanted = own.tokens[r], run.rows[r]
    details.update(row=r, position=t, expected_token=int(wanted[t]), decoded_token=int(decoded[t]),
                   decoded=shown(decoded, t), memorised=shown(wanted, t), departing_rows=len(found))
    argmax = " (its argmax path)" if own.sampled else ""
    return Result.failed(
        f"your decoder {call}{argmax} departs from the memorised batch at position {t} of row {r}: token "
        f"{int(decoded[t])} where the batch has {int(wanted[t])}, which tfdoctor's greedy loop (the whole prefix "
        f"through forward) decodes and the full forward predicts ({len(found)} of {B} rows depart): "
        f"{own.method}() gives the model another context than training does",
        f"make {own.method}() feed the model what training feeds it: the last block_size tokens as they are "
        "(idx[:, -block_size:], nothing filled in front), positions counted from the first token, and with a "
        "cache each new token at position cache length (arange(past, past + t)) with keys/values appended once",
        details), ""
