"""What is examined: the `Subject` contract, and the adapters that turn any supported model into
"token ids in, logits [B, T, V] out".

`Subject` itself needs no torch, so `import tfdoctor` stays cheap; the adapters import it lazily.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tfdoctor.errors import SubjectError, UsageError
from tfdoctor.registry import KINDS

DEFAULT_SEQ_LEN = 32
DEFAULT_BATCH_SIZE = 4

# Where models keep their context length, in the order we trust them.
_MAX_POSITION_ATTRS = ("n_positions", "max_position_embeddings", "n_ctx", "block_size",
                       "max_seq_len", "max_len", "max_length")


@dataclass
class Subject:
    """The model under examination and how to drive it.

    model:      the nn.Module.
    vocab_size: number of token ids; default from model.config.vocab_size or the first nn.Embedding.
    seq_len:    probe length T; default 32, capped by the model's maximum positions.
    batch_size: probe batch B; default 4.
    pad_id:     padding token id, when the model is trained on padded batches.
    kind:       "causal" (decoder LM), "encoder" (bidirectional) or "seq2seq" (encoder-decoder).
    forward:    causal/encoder: forward(model, input_ids) -> logits [B, T, V];
                seq2seq: forward(model, src_ids, tgt_ids) -> logits [B, T_tgt, V].
    train:      train(model, batches): the user's own training loop (used by the loop audits).
    """

    model: Any
    vocab_size: Optional[int] = None
    seq_len: Optional[int] = None
    batch_size: Optional[int] = None
    pad_id: Optional[int] = None
    kind: str = "causal"
    forward: Optional[Callable] = None
    train: Optional[Callable] = None


# ----------------------------------------------------------------------------------------------
# Reading facts off a model


def _config(model) -> Any:
    return getattr(model, "config", None)


def vocab_size_of(model) -> Optional[int]:
    config = _config(model)
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    import torch.nn as nn

    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    return None


def max_positions_of(model) -> Optional[int]:
    for holder in (_config(model), model):
        for attr in _MAX_POSITION_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def device_of(model):
    import torch

    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def is_encoder_decoder(model) -> bool:
    return bool(getattr(_config(model), "is_encoder_decoder", False))


def is_hugging_face(model) -> bool:
    """A transformers PreTrainedModel (recognised without importing transformers)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def inferred_kind(model) -> Optional[str]:
    """The kind a model announces itself as, or None when it does not say.

    Hugging Face: `config.is_encoder_decoder` (T5, BART) is seq2seq; a class descended from a
    *ForCausalLM / *LMHeadModel (or a config marked is_decoder) is causal; one descended from a
    *ForMaskedLM (BERT-like) is an encoder. The class's ancestry is read, not its own name, so a
    user's subclass keeps its parent's kind.
    x-transformers: TransformerWrapper's attention layers carry `causal`.
    """
    if is_hugging_face(model):
        if is_encoder_decoder(model):
            return "seq2seq"
        lineage = [cls.__name__ for cls in type(model).__mro__]
        if getattr(_config(model), "is_decoder", False) or any(
                name.endswith("ForCausalLM") or "LMHead" in name for name in lineage):
            return "causal"
        if any(name.endswith("ForMaskedLM") for name in lineage):
            return "encoder"
        return None
    layers = getattr(model, "attn_layers", None)
    if isinstance(getattr(layers, "causal", None), bool):
        return "causal" if layers.causal else "encoder"
    return None


def config_pad_id(model) -> Optional[int]:
    value = getattr(_config(model), "pad_token_id", None)
    return value if isinstance(value, int) and value >= 0 else None


# ----------------------------------------------------------------------------------------------
# Calling a model


def extract_logits(output) -> Any:
    """Logits from what a forward returned: a tensor, an object with .logits, a dict, or a tuple."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise SubjectError(
        f"the model returned {type(output).__name__}, not logits",
        "return a tensor [B, T, V], an object with .logits, or a tuple whose first item is the logits",
    )


def call(subject: Subject, *ids):
    """Logits for token ids: (input_ids,) for causal/encoder, (src_ids, tgt_ids) for seq2seq."""
    model = subject.model
    if subject.forward is not None:
        return extract_logits(subject.forward(model, *ids))
    if is_hugging_face(model):
        return extract_logits(_call_hugging_face(subject, *ids))
    return extract_logits(model(*ids))  # (input_ids) or (src_ids, tgt_ids)


def _call_hugging_face(subject: Subject, *ids):
    """As their users call them: with an attention_mask built from the pad id (a BERT called without
    one attends to its pads by design). The decoder gets no padding mask: its start token may be
    the pad id (T5), and its own causal mask hides trailing pads."""
    model, pad = subject.model, subject.pad_id
    if subject.kind == "seq2seq":
        src, tgt = ids
        mask = None if pad is None else (src != pad).long()
        return model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt)
    (input_ids,) = ids
    mask = None if pad is None else (input_ids != pad).long()
    return model(input_ids=input_ids, attention_mask=mask)


def random_tokens(subject: Subject, batch: int, length: int, generator=None):
    """Uniform random ids that never include pad_id: a pad may legitimately behave differently."""
    import torch

    vocab = subject.vocab_size
    excluded = subject.pad_id is not None and 0 <= subject.pad_id < vocab
    high = vocab - 1 if excluded else vocab
    ids = torch.randint(0, high, (batch, length), generator=generator)
    if excluded:
        ids = ids + (ids >= subject.pad_id).long()
    return ids.to(device_of(subject.model))


# ----------------------------------------------------------------------------------------------
# Filling in defaults and validating


def resolve(subject: Subject) -> Subject:
    """A copy of `subject` with every default filled in, after one small forward that proves the
    model can be called and returns logits of the right shape. Raises SubjectError or UsageError.
    """
    import torch.nn as nn

    if not isinstance(subject.model, nn.Module):
        raise SubjectError(f"expected an nn.Module, got {type(subject.model).__name__}",
                           "return the model (or a tfdoctor.Subject) from the factory")
    if subject.kind not in KINDS:
        raise UsageError(f"unknown kind {subject.kind!r}", f"use one of {', '.join(KINDS)}")
    # "causal" is the default: a model that announces another kind (a BERT, a T5) is taken at its word.
    kind = subject.kind
    if kind == "causal" and subject.forward is None:
        kind = inferred_kind(subject.model) or kind
    pad_id = subject.pad_id if subject.pad_id is not None else config_pad_id(subject.model)

    vocab = subject.vocab_size or vocab_size_of(subject.model)
    if not vocab:
        raise SubjectError("cannot tell the vocabulary size: no config.vocab_size and no nn.Embedding",
                           "pass --vocab N or Subject(vocab_size=N)")
    max_positions = max_positions_of(subject.model)
    seq_len = subject.seq_len or DEFAULT_SEQ_LEN
    if subject.seq_len is None and max_positions:
        seq_len = min(seq_len, max_positions)
    batch = subject.batch_size or DEFAULT_BATCH_SIZE
    for name, value in (("vocab_size", vocab), ("seq_len", seq_len), ("batch_size", batch)):
        if value < 1:
            raise UsageError(f"{name} must be positive, got {value}")
    if seq_len < 2:
        raise UsageError(f"seq_len must be at least 2 to tell past from future, got {seq_len}")
    if pad_id is not None and not 0 <= pad_id < vocab:
        raise UsageError(f"pad_id {pad_id} is outside the vocabulary [0, {vocab})")

    resolved = dataclasses.replace(subject, vocab_size=vocab, seq_len=seq_len, batch_size=batch, kind=kind,
                                   pad_id=pad_id)
    _preflight(resolved)
    return resolved


def _preflight(subject: Subject) -> None:
    import torch

    from tfdoctor.probes.modes import evaluation

    B, T = 2, subject.seq_len
    with torch.no_grad(), evaluation(subject.model):
        ids = random_tokens(subject, B, T, torch.Generator().manual_seed(0))
        try:
            logits = call(subject, ids, ids) if subject.kind == "seq2seq" else call(subject, ids)
        except SubjectError:
            raise
        except Exception as exc:  # the user's forward: anything can come out of it
            raise SubjectError(f"calling the model on ids [{B}, {T}] raised {type(exc).__name__}: {exc}",
                               "check --kind, --vocab and --seq-len, or give Subject(forward=...)") from exc
    shape = tuple(logits.shape)
    if shape != (B, T, subject.vocab_size):
        raise SubjectError(
            f"output shape [B, T, V] = [{B}, {T}, {subject.vocab_size}] expected but got {list(shape)}",
            "return logits over the vocabulary for every position, or pass the right --vocab",
        )
