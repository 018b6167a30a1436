"""Which kind a Hugging Face model is (causal LM, bidirectional encoder, encoder-decoder), read from
what the model itself says, most trusted first:

1. its config's own switches: `is_encoder_decoder`; `causal` (XLM and FlauBERT build one class as a
   masked LM or a causal LM from this flag); `is_causal` / `use_bidirectional_attention` (Gemma
   variants run bidirectionally); XLNet's `attn_type` ("bi" or "uni"); `is_decoder=True` (a BERT-like
   stack turned into a decoder);
2. the task the library registers the class (or the library class a user's class derives from)
   for: the causal-LM auto mapping or the masked-LM one, when it is in only one of them;
3. a measurement when only a name is left to go on and the name is ambiguous (`LMHead` heads both
   masked and causal LMs, and XLM's class sits in both mappings): does the first output move when
   the last token changes? Then the model reads both ways, an encoder; else causal.
4. the class names: *ForCausalLM causal, *ForMaskedLM encoder.
5. a task head (*ForSequenceClassification, *ForTokenClassification, *ForQuestionAnswering,
   *ForMultipleChoice) says nothing about its backbone (BERT's and GPT-2's classifiers are named alike):
   the same measurement, on the backbone's last hidden states (output_hidden_states=True), since a pooled
   head has no per-position output (a multiple-choice head is given its ids as one choice, [B, 1, T]).

`is_decoder=False` says nothing: GPT-NeoX's causal LM carries it.
"""

from __future__ import annotations

from typing import Any, Optional

# The part of the class ancestry read: the library's own classes end at PreTrainedModel.
_STOP = ("PreTrainedModel", "Module")


def _lineage(model) -> list[str]:
    names = []
    for cls in type(model).__mro__:
        if cls.__name__ in _STOP:
            break
        names.append(cls.__name__)
    return names


def flagged_kind(config: Any) -> Optional[str]:
    """The kind a config's own switches set, or None when they do not say."""
    if bool(getattr(config, "is_encoder_decoder", False)):
        return "seq2seq"
    causal = getattr(config, "causal", None)  # XLM / FlauBERT: True causal LM, False masked LM
    if isinstance(causal, bool):
        return "causal" if causal else "encoder"
    is_causal = getattr(config, "is_causal", None)
    if isinstance(is_causal, bool):
        return "causal" if is_causal else "encoder"
    if getattr(config, "use_bidirectional_attention", None) in (True, "all"):
        return "encoder"
    attention_type = getattr(config, "attn_type", None)  # XLNet: "bi" reads both ways, "uni" (Transformer-XL) one
    if attention_type in ("bi", "uni"):
        return "encoder" if attention_type == "bi" else "causal"
    if getattr(config, "is_decoder", None) is True:
        return "causal"
    return None


def _registered_names() -> tuple[set, set]:
    """(classes registered for causal LM, classes registered for masked LM) in this transformers."""
    try:
        from transformers.models.auto import modeling_auto as auto
    except Exception:  # an old or trimmed transformers: no registrations to read
        return set(), set()

    def names(mapping) -> set:
        found: set = set()
        for value in mapping.values():
            found.update(value if isinstance(value, (list, tuple)) else [value])
        return found

    return (names(getattr(auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", {})),
            names(getattr(auto, "MODEL_FOR_MASKED_LM_MAPPING_NAMES", {})))


def type_kind(model_type: Optional[str]) -> Optional[str]:
    """causal / encoder from the LM classes the library registers for a model type, when it registers one
    kind only: a head whose backbone's states cannot be measured (Funnel pools its sequence, Perceiver
    decodes latents) has its type's LM kind."""
    try:
        from transformers.models.auto import modeling_auto as auto
    except Exception:  # an old or trimmed transformers: no registrations to read
        return None
    causal = model_type in getattr(auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", {})
    masked = model_type in getattr(auto, "MODEL_FOR_MASKED_LM_MAPPING_NAMES", {})
    return None if causal == masked else "causal" if causal else "encoder"


def registered_kind(model) -> Optional[str]:
    """causal / encoder from the first class in the ancestry the library registers for one task
    only; None when none is registered, or the first registered one serves both (XLM)."""
    causal_lm, masked_lm = _registered_names()
    for name in _lineage(model):
        if name in causal_lm or name in masked_lm:
            if name in causal_lm and name in masked_lm:
                return None
            return "causal" if name in causal_lm else "encoder"
    return None


def named_kind(model) -> Optional[str]:
    """From the names alone: *ForCausalLM causal, *ForMaskedLM encoder; None otherwise ("LMHead"
    names heads of both kinds)."""
    lineage = _lineage(model)
    if any(name.endswith("ForCausalLM") for name in lineage):
        return "causal"
    if any(name.endswith("ForMaskedLM") for name in lineage):
        return "encoder"
    return None


def measured_kind(model, vocab_size: Optional[int], length: int = 8, states: bool = False,
                  choices: bool = False) -> Optional[str]:
    """"encoder" when output 0 moves as the last of `length` tokens changes, "causal" when it does
    not, None when the model cannot be called that way. Two rows, one forward, eval mode. `states`:
    measured on the last hidden states instead of the logits (a classifier's backbone). `choices`: the
    ids given as [2, 1, length], one choice per row (a multiple-choice head)."""
    import torch

    from tfdoctor.modes import evaluation
    from tfdoctor.tolerances import RELATIVE_TOLERANCE

    if not vocab_size or vocab_size < 3:
        return None
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab_size, (1, length), generator=generator).repeat(2, 1)
    # other tokens, never 0 (often the pad): the last one, or for a head's states every one after the
    # first, which an encoder's first position reads somewhere even through local or hashed attention
    # (Reformer's LSH buckets: position 0 read token 2 and not token 1)
    at = 1 if states else -1
    ids[1, at:] = 1 + ids[0, at:] % (vocab_size - 1)
    ids = ids.to(next(model.parameters(), torch.empty(0)).device)
    try:
        with torch.no_grad(), evaluation(model):
            fed = ids.unsqueeze(1) if choices else ids
            output = model(input_ids=fed, attention_mask=torch.ones_like(fed),
                           **({"output_hidden_states": True} if states else {}))
    except Exception:  # a model that wants other inputs: the name-based default stands
        return None
    if states:  # a head's own per-position scores where it has them (a tagger's, a span's start), else states
        hidden = getattr(output, "hidden_states", None)
        start = getattr(output, "start_logits", None)
        logits = getattr(output, "logits", None)
        if isinstance(start, torch.Tensor) and start.shape == ids.shape:
            logits = start.unsqueeze(-1)
        elif not (isinstance(logits, torch.Tensor) and logits.dim() == 3):
            logits = hidden[-1] if isinstance(hidden, (tuple, list)) and hidden else None
    else:
        logits = getattr(output, "logits", output[0] if isinstance(output, (tuple, list)) else output)
    if (not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != ids.shape
            or not bool(torch.isfinite(logits).all())):
        return None
    logits = logits.float()
    moved = float((logits[1, :at] - logits[0, :at]).abs().max())
    return "encoder" if moved > RELATIVE_TOLERANCE * max(float(logits.abs().max()), 1e-30) else "causal"


def _takes_decoder_input(model) -> bool:
    import inspect

    try:
        return "decoder_input_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature to read: as the config says
        return True


def hugging_face_kind(model) -> Optional[str]:
    """The kind of a transformers model, by the order in the module docstring."""
    config = getattr(model, "config", None)
    kind = flagged_kind(config)
    if kind == "seq2seq" and not _takes_decoder_input(model):
        kind = None  # a head on the encoder alone (UMT5ForTokenClassification): its config is the pair's
    kind = kind or registered_kind(model)
    if kind is not None:
        return kind
    lineage = _lineage(model)
    if any("LMHead" in name for name in lineage) and not named_kind(model):
        return measured_kind(model, getattr(config, "vocab_size", None)) or "causal"
    heads = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice")
    if any(name.endswith(heads) for name in lineage):
        choices = any(name.endswith("ForMultipleChoice") for name in lineage)
        return (measured_kind(model, getattr(config, "vocab_size", None), states=True, choices=choices)
                or type_kind(getattr(config, "model_type", None)))
    return named_kind(model)
