"""Decoding checks: the model's cached, token-by-token decoding (as its own generate() or the
Subject's incremental function runs it) gives the logits of one full forward."""

from __future__ import annotations

from tfdoctor.checks.verdicts import judged_per_implementation
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.tasks import for_classifiers

CAUSAL_ONLY = "written for causal LMs"


def _judged(subject, judge) -> Result:
    """judge under each attention implementation, the model judged by the one it runs."""
    from tfdoctor.probes.configured_implementation import judged_as_run

    return judged_per_implementation(subject, judged_as_run(subject.model, judge))


@check("cache-consistency", title="Decoding with the cache gives the full forward's logits",
       kinds=("causal",), skip_reasons={"encoder": CAUSAL_ONLY, "seq2seq": CAUSAL_ONLY,
                                        **for_classifiers("it predicts no next token to decode")}, tasks=("lm",))
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
    sequence again at every step keeps no cache: skipped, saying so; so is a library whose own cached
    decoding crashes (its exception and line named as the library's). Other models are run when given
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
    return _judged(subject, lambda implementation: _judge_cache(subject, hugging_face))


def _cache_arms(subject, hugging_face: bool) -> list:
    import torch

    from tfdoctor.context import current
    from tfdoctor.errors import first_line
    from tfdoctor.modes import evaluation
    from tfdoctor.probes.decoding import MODEL_ERRORS, compare_cache, crash_reason, library_crash, raised_by_model
    from tfdoctor.probes.generation import accepts

    sides = [False, True] if hugging_face and accepts(subject.model, "attention_mask") else [False]
    arms, raised = [], []
    with evaluation(subject.model):
        generator = torch.Generator().manual_seed(current().seed + 13)
        for left_padded in sides:
            try:
                arms.append(compare_cache(subject, generator, left_padded=left_padded))
            except MODEL_ERRORS as exc:  # the model cannot run this variant: named, not an error
                if not raised_by_model(exc):
                    raise
                raised.append(("left-padded prompts with their attention mask" if left_padded else
                               "a prompt then one token at a time", first_line(exc),
                               crash_reason(subject.model, exc) if library_crash(exc) else None))
    return arms, raised


def _judge_cache(subject, hugging_face: bool) -> Result:
    from tfdoctor.probes.decoding import NotComparable

    try:
        arms, raised = _cache_arms(subject, hugging_face)
    except NotComparable as exc:
        return Result.skipped(f"no cached decoding to compare: {exc}")
    if raised and not arms and all(library for _, _, library in raised):
        # the library's own decoding breaks on every variant (transformers 5.25's BLT): its failure, named
        return Result.skipped(f"no cached decoding to compare: {raised[0][2]}",
                              {"raised": {variant: error for variant, error, _ in raised}, "library_crash": True})
    verdict = _judged_arms(subject, hugging_face, arms) if arms else None
    if raised and (verdict is None or verdict.status.value in ("pass", "skip")):
        variant, error, _ = raised[0]
        agreed = f"; {verdict.message}" if verdict is not None else ""
        return Result.warned(f"the model raises when decoding {variant} ({error}), the way "
                             f"{'generate()' if hugging_face else 'Subject.incremental'} runs it{agreed}",
                             "make the model run this variant (batched generation pads prompts on the left and "
                             "passes their attention mask)", {"raised": {v: e for v, e, _ in raised}})
    return verdict


def _judged_arms(subject, hugging_face: bool, arms: list) -> Result:
    """The verdict on the measured arms. In bfloat16 or float16 a difference over the float32
    tolerance but within the precision's rounding reach is a close call: measured and judged again
    in float32 (the parameters upcast in place and restored), or a note where that cannot be done."""
    from tfdoctor.probes.precision import close_call, in_float32
    from tfdoctor.tolerances import EQUIVALENCE_TOLERANCE

    defect = next((arm for arm in arms if arm.shape_defect), None)
    if defect is not None:
        return _shape_result(subject, defect)
    how, precision = close_call(subject.model, max(arm.relative for arm in arms), EQUIVALENCE_TOLERANCE)
    if how == "close":
        return Result.passed(f"cached decoding agrees with the full forward within rounding; "
                             f"{precision['close_call']}", precision)
    if how == "float32":
        with in_float32(subject.model):
            arms, _ = _cache_arms(subject, hugging_face)
            return _arms_verdict(subject, hugging_face, arms, precision)
    return _arms_verdict(subject, hugging_face, arms, precision)


def _arms_verdict(subject, hugging_face: bool, arms: list, precision: dict) -> Result:
    import torch

    from tfdoctor.modes import evaluation
    from tfdoctor.probes.invariance import eval_noise

    details = {"prefill": arms[0].prefill, "positions": int(arms[0].diff.numel()),
               "path": "generate" if hugging_face else "incremental", "arms": {}, **precision}
    note = f"; {precision['close_call']}" if "close_call" in precision else ""
    for arm in arms:
        details["arms"][arm.label] = {"largest_difference": float(arm.diff.max()), "output_scale": arm.scale,
                                      "tolerance": arm.tolerance, "first_divergence": arm.first_divergence(),
                                      "difference_by_position": [float(f"{d:.3g}") for d in arm.diff.tolist()],
                                      **arm.details}
    broken = [arm for arm in arms if arm.first_divergence() is not None]
    if not broken:
        summary = "; ".join(f"{arm.label}: largest difference {float(arm.diff.max()):.2g}" for arm in arms)
        return Result.passed(f"prefill of {arms[0].prefill} tokens then {arms[0].diff.numel() - arms[0].prefill} "
                             f"cached steps give the full forward's logits at every position ({summary}){note}",
                             details)
    arm = broken[0]
    with torch.no_grad(), evaluation(subject.model):
        noise = eval_noise(arm.full, arm.rerun_full(), arm.tolerance)
        what = "full forwards"
        if noise is None:  # the cached decoding itself may be random (LSH buckets hashed at each step)
            compared = arm.compared.to(arm.steps.device)[..., None]
            noise = eval_noise(arm.steps * compared, arm.rerun_steps() * compared, arm.tolerance)
            what = "cached decodings"
        uncached = arm.uncached_gap(arm.first_divergence()) if noise is None else None
    if noise is not None:
        return Result.skipped(f"two identical {what} gave logits {noise:.3g} apart in eval mode (the model is random "
                              "at inference, e.g. hashing or sampling with no seed), so the cache cannot be compared",
                              {"noise": noise, "random": what})
    return _divergence_result(arm, details, note, uncached)


def _divergence_result(arm, details: dict, note: str, uncached: float) -> Result:
    at = arm.first_divergence()
    gap = float(arm.diff[at])
    details.update(arm=arm.label, first_divergence=at, difference_at_first=gap)
    where = (f"position {at}, inside the {arm.prefill}-token prefill" if at < arm.prefill
             else f"position {at}, the {'first' if at == arm.prefill else f'{at - arm.prefill + 1}th'} token "
                  "decoded with the cache")
    details["difference_from_uncached_forward"] = uncached
    if uncached <= arm.tolerance:
        return _length_dependent_result(arm, details, where, gap, note)
    if at < arm.prefill:
        cause = ("the cached call of several tokens differs from the full forward: the cache path drops the "
                 "causal mask (the prompt reads its own future)")
        hint = ("keep the causal mask whenever more than one token is given with a cache: query i may see "
                "keys <= past_length + i (is_causal=True is wrong for a chunk after a cache; build the mask "
                "with the offset)")
    else:
        cause = ("the tokens decoded one at a time differ from the full forward, and from a forward without cache "
                 "of the tokens so far, while the prefill agrees; the candidates: the new token's position is "
                 "not offset by the cache length, its keys/values are stored or read wrongly, or the cached "
                 "path attends to another set of keys than the full forward (an approximate or windowed cache)")
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
    """The cached logits differ from the full forward's, yet equal a forward without cache of the
    tokens generation had at that step (what generate() computes with use_cache=False): the cache is
    consistent; the full forward gives a position other logits when more tokens follow it, which is
    future-leak's (and padding-equivalence's) to judge, not the cache's."""
    batch = "" if arm.label == "unpadded" else " with left-padded prompts"
    details["length_dependent_full_forward"] = True
    return Result.passed(
        f"cached decoding{batch} gives, at every step, the logits of a forward without cache of the tokens so far "
        f"(difference {details['difference_from_uncached_forward']:.2g} at the first divergence); "
        f"the full forward of the whole sequence differs from them first at {where}, by {gap:.3g}: it gives a "
        f"position other logits when more tokens follow it "
        f"(see future-leak{' and padding-equivalence' if batch else ''})"
        f"{note}", details)


# --- generation's arm through the model's own generate() method (checks/learning.py generation) ------
