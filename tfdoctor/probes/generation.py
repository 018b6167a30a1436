"""Decode a Hugging Face model exactly as its own generate() does, with tokens chosen in advance.

Models differ in how they decode: a key/value cache passed back as `cache` (GPT-2, Llama), a state
object generate() creates and hands in (Mamba's `cache_params`, RecurrentGemma), buckets
(Reformer's `past_buckets_states`), an attention mask given on the first call only (Mamba), or no
cache at all (OpenAI-GPT and XLM are fed the whole sequence again at every step). Each model's
prepare_inputs_for_generation and _update_model_kwargs_for_generation encode its convention, so
instead of imitating them this probe calls model.generate() itself: a logits processor forces the
next token to be the one drawn in advance (the raw logits are untouched), and a forward hook records
what each call was given and returned. The recorded logits are then compared by the caller with one
full forward of the same tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from tfdoctor.subject import extract_logits


@dataclass
class GenerateCall:
    fed: int  # tokens in the input_ids of the call
    logits_shape: list[int]
    arguments: list[str]  # the keyword arguments generate() passed


@dataclass
class Decoded:
    ids: torch.Tensor  # [B, T] the tokens decoded (prompt, then the forced ones)
    calls: list[GenerateCall] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per call, float32 on the CPU

    def refeeds(self) -> Optional[GenerateCall]:
        """The first decoding call that was given more than the one new token (no cache kept)."""
        return next((c for c in self.calls[1:] if c.fed > 1), None)


def why_not_generate(model: torch.nn.Module) -> Optional[str]:
    """Why the model's own generate() cannot drive the comparison, or None when it can."""
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not callable(getattr(model, "generate", None)):
        return "the model has no generate()"
    if not can_generate():
        return "model.can_generate() is False: the model does not decode with generate()"
    return None


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether forward names the argument (as generate() decides for attention_mask, position_ids)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _stop_tokens(model: torch.nn.Module) -> set[int]:
    config = getattr(model, "generation_config", None)
    stops = getattr(config, "eos_token_id", None)
    stops = [] if stops is None else ([stops] if isinstance(stops, int) else list(stops))
    return {int(t) for t in stops if t is not None}


def without_stop_tokens(model: torch.nn.Module, ids: torch.Tensor, prefill: int, vocab: int) -> torch.Tensor:
    """ids with every end-of-sequence token after the prompt replaced (generate() would stop there and
    pad the rest, so the decoded tokens would no longer be the drawn ones)."""
    stops = _stop_tokens(model)
    if not stops:
        return ids
    allowed = next((t for t in range(vocab) if t not in stops), None)
    if allowed is None:
        return ids
    ids = ids.clone()
    tail = ids[:, prefill:]
    tail[torch.isin(tail, torch.tensor(sorted(stops), device=ids.device))] = allowed
    return ids


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """generate() logs its choices (pad token, flags of the model's generation config), and some
    models print from prepare_inputs_for_generation (Reformer): not ours to show."""
    try:
        from transformers.utils import logging
    except ImportError:  # pragma: no cover - a PreTrainedModel without transformers cannot exist
        yield
        return
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)


def decode_as_generate(model: torch.nn.Module, ids: torch.Tensor, real: torch.Tensor, prefill: int,
                       pad_id: int) -> Decoded:
    """generate() on the prompt ids[:, :prefill] (attention mask `real` when forward takes one, as a
    tokenizer gives it), forced to continue with ids[:, prefill:]: one call per decoded token, each
    recorded. Greedy, one beam, use_cache=True, all prompt logits kept where the model can drop them,
    no auto-compilation (a static cache on a GPU would compile the same forward first)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    total = ids.shape[1]

    class Forced(LogitsProcessor):
        """Every score but the drawn token's set to -inf; output_logits would still be the raw ones."""

        def __call__(self, input_ids, scores):
            t = input_ids.shape[1]
            if t >= total:  # the last call's choice is never fed back
                return scores
            forced = torch.full_like(scores, float("-inf"))
            return forced.scatter_(1, ids[:, t:t + 1].to(scores.device), 0.0)

    decoded = Decoded(ids)

    def record(module, args, kwargs, output):
        fed = kwargs.get("input_ids", args[0] if args else None)
        logits = extract_logits(output)
        decoded.calls.append(GenerateCall(int(fed.shape[1]) if isinstance(fed, torch.Tensor) else 0,
                                          list(logits.shape), sorted(k for k, v in kwargs.items() if v is not None)))
        decoded.logits.append(logits.detach().float().cpu())

    arguments = dict(input_ids=ids[:, :prefill], max_new_tokens=total - prefill + 1, do_sample=False, num_beams=1,
                     num_return_sequences=1, logits_processor=LogitsProcessorList([Forced()]), pad_token_id=pad_id,
                     use_cache=True, disable_compile=True)  # the same forward, without minutes of compiling
    if accepts(model, "attention_mask"):
        arguments["attention_mask"] = real[:, :prefill].long()
    supports_keep = getattr(model, "_supports_logits_to_keep", None)
    if callable(supports_keep) and supports_keep():
        arguments["logits_to_keep"] = 0  # every prompt position, not only the last
    handle = model.register_forward_hook(record, with_kwargs=True)
    try:
        with torch.no_grad(), _quiet():
            model.generate(**arguments)
    finally:
        handle.remove()
    return decoded
