"""Greedy decoding of a memorised batch from each row's first token (the generation check's measure).

A causal model that has memorised a batch predicts each of its tokens from the tokens before it, so
greedy decoding from the first token must write the batch again, one token at a time. `decode_memorised`
measures three things on the model that overfit-batch trained (probes/memorise.py), dropout off:
- `teacher`: the argmax of one full forward of the batch (what training graded), per position;
- `uncached`: free-running greedy decoding, the whole prefix fed again at every step (no cache);
- `cached`: the prediction at every position through the model's cache, fed the uncached decode's
  tokens (Subject.incremental, or a Hugging Face model's own generate() forced to those tokens, as
  cache-consistency drives it), so its first departure from `uncached` is where cached greedy
  decoding would part from it;
- `own`: the tokens the model's own generate() method decodes greedily from each row's first token
  (nanoGPT's generate(idx, max_new_tokens, ...), probes/own_decoder.py), with or without its cache.
Predictions only; the check (checks/learning.py generation) judges them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from tfdoctor.modes import evaluation
from tfdoctor.probes.decoding import MODEL_ERRORS, crash_reason, raised_by_model
from tfdoctor.probes.generation import decode_as_generate, why_not_generate, without_stop_tokens
from tfdoctor.probes.invariance import hf_causal
from tfdoctor.probes.loss import LMBatch
from tfdoctor.probes.own_decoder import OwnDecode
from tfdoctor.subject import Subject, call, extract_logits


@dataclass
class GreedyRun:
    rows: torch.Tensor  # [B, L] the memorised rows: first token, then the targets
    teacher: torch.Tensor  # [B, L] argmax of the full forward predicting each position (column 0: the row's)
    uncached: torch.Tensor  # [B, L] greedy decoding without cache (column 0: the first token)
    cached: Optional[torch.Tensor] = None  # [B, L] predictions through the cache along `uncached`
    cached_upto: int = 0  # positions < this are covered by `cached`
    cache_driver: Optional[str] = None  # "incremental" or "generate"
    no_cache: Optional[str] = None  # why there is no cached arm
    details: dict = field(default_factory=dict)
    # [B, L] the full forward's log-probability margin of its top token over the next (column 0: inf)
    margin: Optional[torch.Tensor] = None
    own: Optional[OwnDecode] = None  # the model's own generate() method, greedy from each row's first token
    own_missing: Optional[str] = None  # why that method was not run (none, not drivable, it raised)


def _argmax(logits) -> torch.Tensor:
    return extract_logits(logits).float().argmax(-1).cpu()


def _free_running(clone: Subject, first: torch.Tensor, length: int) -> torch.Tensor:
    """Greedy decoding with the whole prefix fed at every step: one forward per token."""
    decoded = first
    for _ in range(length - 1):
        logits = call(clone, decoded)
        if logits.shape[:2] != decoded.shape:  # its last row would not be the next token's prediction
            raise MisshapedDecode(f"the model returns logits {list(logits.shape)} for input_ids "
                                  f"{list(decoded.shape)}")
        nxt = logits[:, -1].float().argmax(-1, keepdim=True)
        decoded = torch.cat([decoded, nxt.to(decoded.device)], dim=1)
    return decoded.cpu()


class MisshapedDecode(Exception):
    """A decoding call returned other than one row of logits per token given (HF RWKV in
    transformers 5.24 answers input_ids [4, 1] with [4, 4, V])."""


def _through_incremental(clone: Subject, ids: torch.Tensor) -> torch.Tensor:
    """Predictions for positions 1..L-1 through Subject.incremental, fed `ids` one token at a time."""
    out, state = clone.incremental(clone.model, ids[:, :1].contiguous(), None)
    preds = [_argmax(out)[:, -1:]]
    for t in range(1, ids.shape[1] - 1):
        out, state = clone.incremental(clone.model, ids[:, t:t + 1].contiguous(), state)
        preds.append(_argmax(out)[:, -1:])
    return torch.cat(preds, dim=1)


def _through_generate(clone: Subject, ids: torch.Tensor) -> tuple[Optional[torch.Tensor], int, Optional[str]]:
    """(predictions for positions 1..n through generate()'s cache, n + 1 positions covered, or why none)."""
    model = clone.model
    forced = without_stop_tokens(model, ids, 1, clone.vocab_size)
    altered = (forced != ids).any(0).nonzero()
    upto = int(altered[0]) + 1 if altered.numel() else ids.shape[1]  # generate() would stop after an end-of-sequence
    real = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    run = decode_as_generate(model, forced, real, 1, clone.pad_id if clone.pad_id is not None else 0)
    refed = run.refeeds()
    if refed is not None or not run.logits:
        return None, 0, f"{type(model).__name__}.generate() keeps no cache (it feeds the whole sequence again)"
    preds = torch.stack([logits[:, -1].argmax(-1) for logits in run.logits[:ids.shape[1] - 1]], dim=1)
    return preds, min(upto, preds.shape[1] + 1), None


def decode_memorised(subject: Subject, model: torch.nn.Module, batch: LMBatch) -> GreedyRun:
    """Greedy decoding of `batch` (causal: inputs ids[:, :-1], targets ids[:, 1:]) by `model`, the
    memorised copy, without and with the cache (see the module doc)."""
    clone = dataclasses.replace(subject, model=model)
    ids = batch.inputs[0]
    rows = torch.cat([ids, batch.targets[:, -1:].to(ids.device)], dim=1)
    with torch.no_grad(), evaluation(model):
        scores = extract_logits(call(clone, ids)).float().log_softmax(-1).cpu()
        teacher = torch.cat([rows[:, :1].cpu(), scores.argmax(-1)], dim=1)
        top2 = scores.topk(2, dim=-1).values if scores.shape[-1] > 1 else scores.expand(*scores.shape[:-1], 2)
        margin = torch.cat([torch.full_like(top2[:, :1, 0], float("inf")), top2[..., 0] - top2[..., 1]], dim=1)
        uncached = _free_running(clone, rows[:, :1], rows.shape[1])
        run = GreedyRun(rows.cpu(), teacher, uncached, margin=margin)
        along = uncached.to(ids.device)
        if subject.incremental is not None:
            run.cached = torch.cat([uncached[:, :1], _through_incremental(clone, along)], dim=1)
            run.cached_upto, run.cache_driver = rows.shape[1], "incremental"
        elif hf_causal(subject) and why_not_generate(model) is None:
            try:
                preds, upto, run.no_cache = _through_generate(clone, along)
            except MODEL_ERRORS as exc:  # its generate() cannot decode: said, and the loop's arm still judged
                if not raised_by_model(exc):
                    raise
                preds, run.no_cache = None, f"no cached decoding: {crash_reason(model, exc)}"
            if preds is not None:
                run.cached = torch.cat([uncached[:, :1], preds.cpu()], dim=1)
                run.cached_upto, run.cache_driver = upto, "generate"
        else:
            run.no_cache = "no cached decoding: pass Subject(incremental=fn) (Hugging Face causal LMs need none)"
        run.own, run.own_missing = _through_own_generate(model, rows[:, :1], rows.shape[1] - 1, uncached)
    return run


def _through_own_generate(model: torch.nn.Module, first: torch.Tensor, new: int, uncached: torch.Tensor):
    """(the model's own generate() from `first`, or None and why not). A model without such a method
    has None and None; an exception its generate() raises is the reason, tfdoctor's own propagates.
    Where its tokens part from `uncached`, it is called again with another seed: a decoder that still
    samples (a draw its switches did not turn off) is then marked not repeatable."""
    from tfdoctor.context import current
    from tfdoctor.errors import first_line
    from tfdoctor.probes.own_decoder import NotDrivable, decode_with_own_generate, describe, own_generate

    method = own_generate(model)
    if method is None:
        return None, None
    name = describe(method)[0]
    seed = current().seed
    try:
        own = decode_with_own_generate(model, first, new, seed)
        n = min(own.tokens.shape[1], uncached.shape[1])
        if not torch.equal(own.tokens[:, :n], uncached[:, :n]):
            again = decode_with_own_generate(model, first, new, seed + 1)
            own.repeatable = again.tokens.shape == own.tokens.shape and torch.equal(again.tokens, own.tokens)
        return own, None
    except NotDrivable as exc:
        return None, f"{name}() cannot be called here: {exc}"
    except MODEL_ERRORS as exc:
        if not raised_by_model(exc):
            raise
        return None, f"{name}() raised {first_line(exc)} decoding from a one-token prompt"
