"""What is examined: the `Subject` contract, and the adapters that turn any supported model into
"token ids in, logits out": [B, T, V] for a language model, [B, C] / [B, T, C] for a classifier
(tfdoctor/tasks.py tells which).

`Subject` itself needs no torch, so `import tfdoctor` stays cheap; the adapters import it lazily.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tfdoctor.errors import OutputShapeError, SubjectError, UsageError
from tfdoctor.modes import evaluation
from tfdoctor.registry import KINDS, TASKS
from tfdoctor.tolerances import RELATIVE_TOLERANCE

DEFAULT_SEQ_LEN = 32
DEFAULT_BATCH_SIZE = 4
PADDING_SIDES = ("right", "left")
# Subject.packing for the Hugging Face convention: documents told apart by position ids restarting at 0.
PACKING_POSITION_IDS = "position_ids"

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
    pad_id:     padding token id, when the model is trained on padded batches; default
                model.config.pad_token_id, else the tokenizer's pad_token_id.
    eos_id:     end-of-sequence token id, for eos-trained (and the rows --train feeds the loop end
                with it); default the tokenizer's eos_token_id, else model.config.eos_token_id.
    kind:       "causal" (decoder LM), "encoder" (bidirectional) or "seq2seq" (encoder-decoder);
                None: what the model announces (Hugging Face ancestry, x-transformers layers),
                else causal. A declared kind always wins over detection.
    forward:    causal/encoder: forward(model, input_ids) -> logits [B, T, V];
                seq2seq: forward(model, src_ids, tgt_ids) -> logits [B, T_tgt, V].
    train:      train(model, batches): the user's own training loop (used by the loop audits).
    padding_side: "right" or "left": where the pads sit in the batches the model is trained on
                (and the side the training loop is fed); None: unknown, default the tokenizer's.
    tokenizer:  a Hugging Face tokenizer (anything with padding_side / pad_token_id); only those
                two attributes are read, as defaults for padding_side and pad_id.
    batch_first: False for a sequence-first model (nn.TransformerEncoder / nn.MultiheadAttention
                with batch_first=False) called with ids [T, B] and returning [T, B, V]; tfdoctor then
                feeds it [T, B] and transposes the output back. None: detected by a probe.
    packing:    how the model is trained on packed rows (several documents in one row), for
                packing-isolation: packing(model, input_ids [B, T], doc_ids [B, T], position_ids [B, T])
                -> logits, or "position_ids" for the Hugging Face convention
                (model(input_ids=..., position_ids=...), positions restarting at each document, as
                DataCollatorWithFlattening builds them). None: the model is not trained packed.
    incremental: incremental(model, input_ids [B, t], state) -> (logits [B, t, V], state), the model's
                cached decoding (state None on the first call), for cache-consistency. Hugging Face
                causal LMs need none: their use_cache / past_key_values path is used.
    task:       what the model predicts: "lm" (logits [B, T, V] over the vocabulary: next-token, masked
                or seq2seq, as `kind` says), "sequence-classification" (class scores [B, C] from a
                pooled state), "token-classification" ([B, T, C], labels unrelated to the vocabulary),
                "regression" ([B, K] real values per row), "question-answering" (a span's start and
                end scores [B, T] each: start_logits / end_logits, or the pair) or "multiple-choice"
                (ids [B, C, T] in, scores [B, C] out; tfdoctor feeds [B, 1, T], one choice per row,
                and a given `forward` gets those ids too). None: a Hugging Face head's class, else
                the output's structure and shape (tfdoctor/tasks.py). A declared task always wins.
    num_labels: C, the classes (or regression outputs) a classifier scores; filled in from the output
                (V for a language model).
    states:     states(model, input_ids [B, T]) -> [B, T, H], a pooled classifier's per-position
                backbone states, for the mask checks (future-leak, mask-direction,
                bidirectional-encoder). Hugging Face classifiers need none: their hidden states are read.
    """

    model: Any
    vocab_size: Optional[int] = None
    seq_len: Optional[int] = None
    batch_size: Optional[int] = None
    pad_id: Optional[int] = None
    kind: Optional[str] = None
    forward: Optional[Callable] = None
    train: Optional[Callable] = None
    padding_side: Optional[str] = None
    tokenizer: Any = None
    batch_first: Optional[bool] = None
    packing: Any = None
    incremental: Optional[Callable] = None
    eos_id: Optional[int] = None
    task: Optional[str] = None
    num_labels: Optional[int] = None
    states: Optional[Callable] = None


# ----------------------------------------------------------------------------------------------
# Reading facts off a model


def _config(model) -> Any:
    return getattr(model, "config", None)


def vocab_size_of(model) -> Optional[int]:
    """config.vocab_size; a composite (multimodal) config's text part; the input embedding's rows;
    else the first nn.Embedding (which, in a multimodal model, may be an audio or vision table)."""
    import torch.nn as nn

    config = _config(model)
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    for read in (lambda: config.get_text_config().vocab_size, lambda: model.get_input_embeddings().num_embeddings):
        try:
            size = read()
        except Exception:  # no text config / no input embedding, or one that does not say
            continue
        if isinstance(size, int) and size > 0:
            return size
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
    return _position_table_size(model)


def _position_table_size(model) -> Optional[int]:
    """A hand-written GPT often says its context length only through its learned position table
    (nanoGPT's `wpe`, `pos_emb`, `position_embedding`): the rows of the first such nn.Embedding."""
    import torch.nn as nn

    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and (leaf == "wpe" or "pos" in leaf):
            return module.num_embeddings
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

    Hugging Face: the config's own switches first (is_encoder_decoder, XLM/FlauBERT's `causal`,
    is_causal, is_decoder=True), then the task the library registers the class or its library
    ancestor for (causal-LM or masked-LM auto mapping), then a measurement where only an ambiguous
    "LMHead" name is left (tfdoctor/kinds.py). A user's subclass keeps its parent's kind.
    x-transformers: TransformerWrapper's attention layers carry `causal`.
    """
    if is_hugging_face(model):
        from tfdoctor.kinds import hugging_face_kind

        return hugging_face_kind(model)
    layers = getattr(model, "attn_layers", None)
    if isinstance(getattr(layers, "causal", None), bool):
        return "causal" if layers.causal else "encoder"
    return None


def config_pad_id(model) -> Optional[int]:
    value = getattr(_config(model), "pad_token_id", None)
    return value if isinstance(value, int) and value >= 0 else None


def tokenizer_pad_id(tokenizer) -> Optional[int]:
    """A Hugging Face tokenizer's pad_token_id (GPT-2's is None until the user sets pad_token)."""
    value = getattr(tokenizer, "pad_token_id", None)
    return value if isinstance(value, int) and value >= 0 else None


def default_eos_id(subject: Subject) -> Optional[int]:
    """The tokenizer's eos_token_id, else the model config's (the first of a list, as Llama 3's
    config lists several), else None. Not validated against the vocabulary."""
    for holder in (subject.tokenizer, _config(subject.model)):
        value = getattr(holder, "eos_token_id", None)
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def tokenizer_padding_side(tokenizer) -> Optional[str]:
    value = getattr(tokenizer, "padding_side", None)
    return value if value in PADDING_SIDES else None


# ----------------------------------------------------------------------------------------------
# Calling a model


def extract_logits(output, length: Optional[int] = None) -> Any:
    """Logits from what a forward returned: a tensor, an object with .logits, a dict, or a tuple; a
    question-answering head's start and end scores (an object or dict with start_logits / end_logits, or
    a pair of [B, `length`] tensors) stacked [B, T, 2] (tfdoctor/tasks.py)."""
    import torch

    from tfdoctor.tasks import span_scores

    if isinstance(output, torch.Tensor):
        return output
    spans = span_scores(output, length)
    if spans is not None:
        return spans
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise OutputShapeError(
        f"the model returned {type(output).__name__}, not logits",
        "return a tensor [B, T, V], an object with .logits, or a tuple whose first item is the logits (a "
        "question-answering head: start_logits and end_logits, or the pair (start, end))",
    )


def call(subject: Subject, *ids):
    """Logits [B, T, V] for token ids [B, T]: (input_ids,) for causal/encoder, (src_ids, tgt_ids)
    for seq2seq. A sequence-first model (batch_first=False) is fed every id tensor as [T, B] and its
    [T, B, V] output comes back as [B, T, V], so that every probe reads one layout."""
    if subject.batch_first is False:
        time_major = (ids_.transpose(0, 1).contiguous() for ids_ in ids)  # as batchify(...).t() feeds it
        return _logits(subject, *time_major).transpose(0, 1).contiguous()
    return _logits(subject, *ids)


def _logits(subject: Subject, *ids):
    # Probes slice their ids (ids[:, :-1]); a user's forward may call .view on them, which needs
    # contiguous memory, as the batches of a real data loader always are.
    ids = tuple(t.contiguous() if hasattr(t, "contiguous") else t for t in ids)
    length = ids[-1].shape[-1] if ids and hasattr(ids[-1], "shape") else None
    choices = subject.task == "multiple-choice"
    if choices:  # each row one question with one choice: [B, 1, T] in, [B, 1] out (tfdoctor/tasks.py)
        ids = tuple(t.unsqueeze(1) for t in ids)
    logits = extract_logits(_output(subject, *ids), length)
    if choices and logits.dim() == 1:  # a head that squeezed its one choice away
        logits = logits.unsqueeze(-1)
    return logits


def _output(subject: Subject, *ids):
    """What the model (or the Subject's forward) returns for `ids`, before the logits are read off it."""
    if subject.forward is not None:
        return subject.forward(subject.model, *ids)
    if is_hugging_face(subject.model):
        return _call_hugging_face(subject, *ids)
    return subject.model(*ids)  # (input_ids) or (src_ids, tgt_ids)


def _returns_spans(subject: Subject, ids: tuple) -> bool:
    """Whether the model answers `ids` with a span's start and end scores (tfdoctor/tasks.span_scores)."""
    from tfdoctor.tasks import span_scores

    return span_scores(_output(subject, *(t.contiguous() for t in ids)), ids[-1].shape[-1]) is not None


def _call_hugging_face(subject: Subject, *ids):
    """As their users call them: with an attention_mask built from the pad id (a BERT called without
    one attends to its pads by design). The decoder gets no padding mask: its start token may be
    the pad id (T5), and its own causal mask hides trailing pads."""
    model, pad = subject.model, subject.pad_id
    if subject.kind == "seq2seq" and subject.task in ("sequence-classification", "regression"):
        # BART's and T5's classifiers pool the decoder's state at each row's end-of-text, the decoder fed
        # the source shifted right, as the library builds it: one id tensor, ending its rows with EOS
        src = _ended_rows(subject, ids[0])
        return model(input_ids=src, attention_mask=None if pad is None else (src != pad).long())
    if subject.kind == "seq2seq":
        src, tgt = ids
        mask = None if pad is None else (src != pad).long()
        return model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt)
    (input_ids,) = ids
    mask = None if pad is None else (input_ids != pad).long()
    return model(input_ids=input_ids, attention_mask=mask)


def _ended_rows(subject: Subject, ids):
    """`ids` with each row's last real token (the last that is not pad_id) made the end-of-text id and
    every other EOS in it swapped for the next id, as a tokenizer ends every text once; unchanged without
    an eos id."""
    import torch

    eos = subject.eos_id
    if eos is None:
        return ids
    other = (eos + 1) % subject.vocab_size
    other = (other + 1) % subject.vocab_size if other == subject.pad_id else other
    ids = ids.masked_fill(ids == eos, other)
    real = ids != subject.pad_id if subject.pad_id is not None else torch.ones_like(ids, dtype=torch.bool)
    positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    last = torch.where(real, positions, -1).amax(-1, keepdim=True).clamp(min=0)
    return ids.scatter(-1, last, eos)


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


def _check_declared(subject: Subject) -> None:
    """What the user declared on the Subject (or by flags) is of a kind tfdoctor knows: else UsageError
    (SubjectError for a factory that returned no model)."""
    import torch.nn as nn

    if not isinstance(subject.model, nn.Module):
        raise SubjectError(f"expected an nn.Module, got {type(subject.model).__name__}",
                           "return the model (or a tfdoctor.Subject) from the factory")
    if subject.kind is not None and subject.kind not in KINDS:
        raise UsageError(f"unknown kind {subject.kind!r}", f"use one of {', '.join(KINDS)}")
    if subject.task is not None and subject.task not in TASKS:
        raise UsageError(f"unknown task {subject.task!r}", f"use one of {', '.join(TASKS)}")
    if subject.padding_side is not None and subject.padding_side not in PADDING_SIDES:
        raise UsageError(f"unknown padding side {subject.padding_side!r}", f"use one of {', '.join(PADDING_SIDES)}")
    if subject.batch_first not in (None, True, False):
        raise UsageError(f"batch_first must be True, False or None (detect), got {subject.batch_first!r}")
    if subject.packing is not None and not (callable(subject.packing) or subject.packing == PACKING_POSITION_IDS):
        raise UsageError(f"unknown packing {subject.packing!r}",
                         "give packing(model, input_ids, doc_ids, position_ids) -> logits, or "
                         f"{PACKING_POSITION_IDS!r}")


def resolve(subject: Subject) -> Subject:
    """A copy of `subject` with every default filled in, after one small forward that proves the
    model can be called and returns logits of the right shape. Raises SubjectError or UsageError.

    What the user declares wins over what is detected: a kind given on the Subject (or by --kind,
    which overrides the Subject before this runs) is never replaced by the model's announced kind.
    """
    _check_declared(subject)
    kind = subject.kind
    if kind is None:
        # A Subject with its own forward decides how the model is called, so the model's class says
        # nothing about what that forward computes: it stays a causal LM unless it declares otherwise.
        kind = (inferred_kind(subject.model) if subject.forward is None else None) or "causal"
    announced = subject.kind is not None or (subject.forward is None and inferred_kind(subject.model) is not None)
    task = subject.task
    if task is None and subject.forward is None and is_hugging_face(subject.model):
        from tfdoctor.tasks import named_task

        task = named_task(subject.model)  # None: told by the output's shape in the preflight
    pad_id = subject.pad_id
    for default in (tokenizer_pad_id(subject.tokenizer), config_pad_id(subject.model)):
        pad_id = default if pad_id is None else pad_id
    padding_side = subject.padding_side or tokenizer_padding_side(subject.tokenizer)

    for name in ("vocab_size", "seq_len", "batch_size"):  # 0 is a value given, not "use the default"
        value = getattr(subject, name)
        if value is not None and value < 1:
            raise UsageError(f"{name} must be positive, got {value}")
    vocab = subject.vocab_size or vocab_size_of(subject.model)
    if not vocab:
        raise SubjectError("cannot tell the vocabulary size: no config.vocab_size and no nn.Embedding",
                           "pass --vocab N or Subject(vocab_size=N)")
    if vocab < 2:
        raise UsageError(f"a vocabulary of {vocab} token leaves nothing to predict and no token to swap",
                         "pass the model's real --vocab (at least 2)")
    max_positions = max_positions_of(subject.model)
    seq_len = subject.seq_len or DEFAULT_SEQ_LEN
    if subject.seq_len is None and max_positions:
        seq_len = min(seq_len, max_positions)
    elif max_positions and seq_len > max_positions:
        raise UsageError(f"seq_len {seq_len} (--seq-len) is longer than the model's {max_positions} positions",
                         f"pass --seq-len {max_positions} or less")
    batch = subject.batch_size or DEFAULT_BATCH_SIZE
    for name, value in (("vocab_size", vocab), ("seq_len", seq_len), ("batch_size", batch)):
        if value < 1:
            raise UsageError(f"{name} must be positive, got {value}")
    if seq_len < 2:
        raise UsageError(f"seq_len must be at least 2 to tell past from future, got {seq_len}")
    if pad_id is not None and not 0 <= pad_id < vocab:
        raise UsageError(f"pad_id {pad_id} is outside the vocabulary [0, {vocab})")
    if subject.eos_id is not None and not 0 <= subject.eos_id < vocab:
        raise UsageError(f"eos_id {subject.eos_id} is outside the vocabulary [0, {vocab})")
    eos_id = subject.eos_id if subject.eos_id is not None else default_eos_id(subject)
    if eos_id is not None and not 0 <= eos_id < vocab:
        eos_id = None  # a config's eos beyond a shrunk vocabulary (a tiny test config): no EOS to judge

    resolved = dataclasses.replace(subject, vocab_size=vocab, seq_len=seq_len, batch_size=batch, kind=kind,
                                   pad_id=pad_id, padding_side=padding_side, eos_id=eos_id, task=task)
    if subject.batch_first is not None:
        resolved = _preflight(resolved)[0]
    else:
        resolved = dataclasses.replace(resolved, batch_first=True)
        try:
            resolved, ids, logits = _preflight(resolved)
        except SubjectError:
            resolved, ids, logits = _at_decoded_length(resolved, subject.seq_len, max_positions)
        if _behaves_sequence_first(resolved, ids, logits):
            resolved = _preflight(dataclasses.replace(resolved, batch_first=False))[0]
    if not announced and resolved.task in ("token-classification", "question-answering") and _reads_later(resolved):
        # A tagger or a span head is not asked to predict its next token: one that reads later tokens is
        # a bidirectional encoder, as most are, not a causal LM leaking its future (the kind's default).
        resolved = dataclasses.replace(resolved, kind="encoder")
    return resolved


def _reads_later(subject: Subject) -> bool:
    """Whether the first position's output moves when the last token of the row changes (one forward of
    two rows in eval mode)."""
    import torch

    (ids,) = _twin_ids(subject)[:1]
    ids = ids.clone()
    ids[1, -1] = ids[0, -1] + 1 if ids[0, -1] + 1 < subject.vocab_size else 0
    if subject.pad_id is not None and int(ids[1, -1]) == subject.pad_id:
        ids[1, -1] = (subject.pad_id + 1) % subject.vocab_size
    with torch.no_grad(), evaluation(subject.model):
        out = call(subject, ids).float()
    scale = max(float(out.abs().max()), 1e-30)
    return float((out[1, 0] - out[0, 0]).abs().max()) > RELATIVE_TOLERANCE * scale


def _at_decoded_length(resolved: Subject, given_seq_len: Optional[int], max_positions: Optional[int]) -> tuple:
    """A model that decodes a fixed number of outputs, its maximum positions, whatever the input
    length (Perceiver's decoder queries) fails the preflight at the default length: it is probed at
    its maximum positions, where inputs and outputs line up. Re-raises the preflight's error when the
    length was given, or the model fails there too. Returns (subject, ids, logits)."""
    import sys

    import torch

    error = sys.exc_info()[1]
    if given_seq_len is not None or not max_positions or max_positions <= resolved.seq_len:
        raise error
    try:  # one row at the default length: is the output as long as the maximum positions?
        with torch.no_grad(), evaluation(resolved.model):
            length = call(resolved, _twin_ids(resolved)[0][:1]).shape[1]
    except Exception:
        raise error from None
    if length != max_positions:
        raise error
    refit = dataclasses.replace(resolved, seq_len=max_positions)
    try:
        return _preflight(refit)
    except SubjectError:
        raise error from None


def _twin_ids(subject: Subject) -> tuple:
    """Inputs of two identical rows [2, T] (seq2seq: source and target), ids that never hold pad_id."""
    import torch

    generator = torch.Generator().manual_seed(0)
    count = 2 if subject.kind == "seq2seq" else 1
    return tuple(random_tokens(subject, 1, subject.seq_len, generator).repeat(2, 1) for _ in range(count))


def _preflight(subject: Subject) -> tuple:
    """Call the model once on two identical rows and check the logits' shape against the task (the
    shape tells the task when none is known yet). Returns (the subject with its task and num_labels,
    ids, logits)."""
    import torch

    import tfdoctor.tasks as tasks  # the module, not the package: `from tfdoctor import` would close a circle

    ids = _twin_ids(subject)
    B, T = ids[0].shape
    with torch.no_grad(), evaluation(subject.model):
        try:
            logits = call(subject, *ids)
        except SubjectError:
            raise
        except Exception as exc:  # the user's forward: anything can come out of it
            raise SubjectError(f"calling the model on ids [{B}, {T}] raised {type(exc).__name__}: {exc}",
                               "check --kind, --vocab and --seq-len, or give Subject(forward=...)") from exc
    shape, V = tuple(logits.shape), subject.vocab_size
    task = subject.task
    if task is None and shape == (B, T, tasks.SPAN_ENDS) and subject.batch_first is not False:
        with torch.no_grad(), evaluation(subject.model):  # two labels per token, or a span's two ends?
            task = tasks.QA if _returns_spans(subject, ids) else None
    task = task or tasks.shaped_task(shape, B, T, V)
    if task is None or not tasks.fits(task, shape, B, T, V):
        expected = (f"[B, T, V] = [{B}, {T}, {V}]" if task in (None, tasks.LM)
                    else f"{tasks.SHAPES[task]} with B = {B}"
                         + (f", T = {T}" if task in (tasks.TOKEN, tasks.QA) else ""))
        told = "" if subject.task is None else f" for --task {task}"
        raise OutputShapeError(
            f"output shape {expected} expected{told} but got {list(shape)}",
            "return logits over the vocabulary for every position, or pass the right --vocab; a classifier "
            "takes --task sequence-classification / token-classification / regression / question-answering / "
            "multiple-choice",
        )
    subject = dataclasses.replace(subject, task=task, num_labels=tasks.outputs_of(task, shape, V))
    _refuse_unusable_logits(logits, subject)
    return subject, ids, logits


class NonFiniteLogits(SubjectError):
    """The logits are NaN or Inf on valid random tokens: finite-logits judges that, and `subject`
    (resolved up to that call) is what it judges; no model check can judge such logits."""

    def __init__(self, message: str, hint: str, subject: Subject):
        super().__init__(message, hint)
        self.subject = subject


def _refuse_unusable_logits(logits, subject: Subject) -> None:
    """Logits every check would misjudge: named here once, instead of a crash panel (or a verdict
    about dropout) in each check."""
    import torch

    dtype = str(logits.dtype).replace("torch.", "")
    if logits.is_complex():
        raise SubjectError(f"the model returns {dtype} logits, and cross-entropy needs real ones",
                           "return the real-valued scores over the vocabulary (e.g. logits.real, or fix the head)")
    if not logits.is_floating_point():
        raise SubjectError(f"the model returns {dtype} logits (ids or a decision, not scores over the vocabulary)",
                           "return the floating-point logits the loss is computed on, before any argmax")
    # -inf on some entries is a legitimate "never this token"; NaN, +inf or a row of -inf is not.
    unusable = torch.isnan(logits) | torch.isposinf(logits) | torch.isneginf(logits).all(-1, keepdim=True)
    if bool(unusable.any()):
        bad = int(unusable.expand_as(logits).sum())
        raise NonFiniteLogits(f"the model's logits are NaN or Inf on random tokens ({bad} of {logits.numel()} "
                           "values), so no check can judge them",
                           "find the first non-finite activation with torch.autograd.set_detect_anomaly(True) "
                           "or forward hooks; a float('-inf') mask over a whole row is a common cause", subject)


def _agree(a, b) -> bool:
    """Equal within the probes' relative tolerance (NaN where both are NaN counts as equal)."""
    import torch

    scale = max((float(t[torch.isfinite(t)].abs().max()) if bool(torch.isfinite(t).any()) else 0.0)
                for t in (a.float(), b.float()))
    diff = torch.nan_to_num((a.float() - b.float()).abs(), nan=0.0, posinf=float("inf"))
    return float(diff.max()) <= RELATIVE_TOLERANCE * max(scale, 1e-30)


def _behaves_sequence_first(subject: Subject, ids: tuple, logits) -> bool:
    """Whether the model reads dim 0 of its input as time and dim 1 as batch, told by behaviour.

    Fed two identical rows, a batch-first model gives two identical outputs. A sequence-first one
    reads the two rows as time steps 0 and 1 of T sequences, so its positional encoding and causal
    mask make them differ. A model that is random in eval mode also makes them differ, so the same
    call is repeated: only a deterministic model whose identical rows differ is tried the other way,
    fed the rows as two identical columns [T, 2], and it is sequence-first when those agree. Anything
    else keeps the batch-first contract (the dependency map then reports what it sees).
    """
    import torch

    if _agree(logits[0], logits[1]):
        return False
    with torch.no_grad(), evaluation(subject.model):
        if not _agree(logits, call(subject, *ids)):
            return False  # random at inference, not a layout
        try:
            columns = call(subject, *(t.transpose(0, 1).contiguous() for t in ids))
        except Exception:  # the model cannot even be called time-major: not sequence-first
            return False
    T = ids[0].shape[1]
    if tuple(columns.shape) != (T, 2, logits.shape[-1]):
        return False
    return _agree(columns[:, 0], columns[:, 1])
