"""Padded batches, and what the model does with the pad positions in them.

Pads go on the side the model is trained with (Subject.padding_side). Where that side is unknown:
a causal model is probed on both sides (on the right the causal mask itself hides the pads, on the
left it does not), an encoder or a seq2seq source on the right.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from tfdoctor.probes.dependency import finite_scale
from tfdoctor.subject import Subject, call, is_hugging_face, random_tokens

# How far the pad positions' embeddings are pushed, in units of the embedding output's std: far
# enough that any real use of them shows, well inside what float32 represents.
PERTURBATION_STDS = 3.0
# The largest share of a real query's attention on pad keys: below the first, the pads are masked
# (a finfo.min or -1e4 fill leaves exactly 0 in float32); above the second, they are attended (an
# unmasked pad among T keys takes ~1/T); in between neither is claimed.
PAD_ATTENTION_SHARE = (1e-6, 1e-3)


def how_pads_are_read(share: float | None) -> tuple[str, str]:
    """(verb, note): how pads whose content moves real outputs reach them, as the largest share of a real
    query's attention on pad keys shows (None: no softmax weights over those keys were seen)."""
    if share is not None and share > PAD_ATTENTION_SHARE[1]:
        return "attend to", ""
    if share is not None and share < PAD_ATTENTION_SHARE[0]:
        return "read", " (no attention weight reaches them: a convolution, recurrence or mean over positions)"
    return "read", " (by attention, or a convolution or recurrence over positions: the weights were not seen)"


@dataclass
class PaddedBatch:
    inputs: tuple  # for call(subject, *inputs)
    padded: torch.Tensor  # [B, T] True at pad positions of the padded sequence (src for seq2seq)
    real_outputs: torch.Tensor  # [B, T_out] True where the output belongs to a real position
    side: str  # "left" or "right"


def pad_counts(batch: int, length: int) -> list[int]:
    """Pads per row, from one to most of the row, so short and long padding are both seen."""
    return [max(1, min(length - 1, (r + 1) * length // (batch + 1))) for r in range(batch)]


def probed_sides(subject: Subject) -> list[str]:
    """The sides padding-mask probes: the declared one; unknown: right then left for a causal
    model (both are common: right in from-scratch training, left in batched generation), right for
    an encoder or a seq2seq source (without a key mask they read pads on either side)."""
    if subject.padding_side is not None:
        return [subject.padding_side]
    return ["right", "left"] if subject.kind == "causal" else ["right"]


def nan_probe_side(subject: Subject) -> str:
    """The side masked-row-nan pads: the declared one; unknown: left for a causal model (its first
    queries then see only pads, the harder case), right otherwise."""
    if subject.padding_side is not None:
        return subject.padding_side
    return "left" if subject.kind == "causal" else "right"


def pad_mask(batch: int, length: int, side: str, device=None) -> torch.Tensor:
    """[B, T] True at pad positions: pad_counts(B, T) pads per row, on `side`."""
    padded = torch.zeros(batch, length, dtype=torch.bool, device=device)
    for row, count in enumerate(pad_counts(batch, length)):
        if side == "left":
            padded[row, :count] = True
        else:
            padded[row, length - count:] = True
    return padded


def padded_batch(subject: Subject, generator: torch.Generator, side: Optional[str] = None,
                 fully_padded_row: bool = False) -> PaddedBatch:
    B, T, pad = subject.batch_size, subject.seq_len, subject.pad_id
    side = side or nan_probe_side(subject)
    ids = random_tokens(subject, B, T, generator)
    padded = pad_mask(B, T, side, ids.device)
    if fully_padded_row:
        padded[0] = True
    ids = ids.masked_fill(padded, pad)
    if subject.kind == "seq2seq":
        target = random_tokens(subject, B, T, generator)
        return PaddedBatch((ids, target), padded, torch.ones(B, T, dtype=torch.bool, device=ids.device), side)
    return PaddedBatch((ids,), padded, ~padded, side)


def input_embedding(subject: Subject) -> torch.nn.Module | None:
    """The module that embeds the (source) token ids: Hugging Face's get_input_embeddings() when it
    is a module (Perceiver's is its latent array, a Parameter; a custom class may not say), else the
    first nn.Embedding over the whole vocabulary. Its output may be a tensor or a tuple led by one
    (I-BERT's (embedding, scale))."""
    model = subject.model
    if is_hugging_face(model):
        holders = [model]
        if subject.kind == "seq2seq" and hasattr(model, "get_encoder"):
            holders.insert(0, model.get_encoder())
        for holder in holders:
            try:
                found = holder.get_input_embeddings() if hasattr(holder, "get_input_embeddings") else None
            except NotImplementedError:  # a custom PreTrainedModel that does not say
                found = None
            if isinstance(found, torch.nn.Module):
                return found
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.num_embeddings >= subject.vocab_size:
            return module
    return None


def pad_row_pinned(subject: Subject) -> bool:
    """Whether the pad token's embedding can never change: the input embedding is an nn.Embedding with
    padding_idx = the pad id, whose row gets no gradient (Hugging Face's BERT family builds it so and
    zeroes it). The pads' token content is then one fixed vector in training; a leak of that content
    alone (MobileBERT's trigram input reads the next position's token embedding) changes nothing, which
    padded rows matching the rows alone then show."""
    embedding = input_embedding(subject)
    return (isinstance(embedding, torch.nn.Embedding) and subject.pad_id is not None
            and embedding.padding_idx == subject.pad_id)


def _embedded(output, ids: torch.Tensor) -> torch.Tensor | None:
    """The [*ids.shape, d] float embedding in what an embedding module returned (a tensor, or a
    tuple led by it); None when it is not there."""
    tensor = output[0] if isinstance(output, (tuple, list)) and output else output
    if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.shape[:-1] == ids.shape:
        return tensor
    return None


@contextlib.contextmanager
def perturbed_pads(embedding: torch.nn.Module, ids: torch.Tensor, padded: torch.Tensor,
                   generator: torch.Generator) -> Iterator[list[int]]:
    """While active, the embedding's output at pad positions of `ids` is pushed far off, ids intact
    (so the model builds its mask exactly as in training). Only calls that embed `ids` itself are
    touched: a decoder sharing the embedding keeps its own inputs. Yields a list that counts calls."""
    calls: list[int] = []
    # A sequence-first model embeds the ids as [T, B]: the pads then sit at padded.T.
    layouts = [(ids, padded), (ids.transpose(0, 1), padded.transpose(0, 1))]

    def hook(module, args, output):
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        where = next((mask for layout, mask in layouts
                      if args[0].shape == layout.shape and torch.equal(args[0], layout)), None)
        if where is None:
            return None
        embedded = _embedded(output, args[0])
        if embedded is None:
            return None
        calls.append(1)
        noise = torch.randn(embedded.shape, generator=generator).to(embedded.device, embedded.dtype)
        scale = PERTURBATION_STDS * float(embedded.detach().float().std().clamp_min(1e-3))
        moved = embedded + noise * scale * where.unsqueeze(-1).to(embedded.dtype)
        return moved if embedded is output else type(output)([moved, *output[1:]])

    handle = embedding.register_forward_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


@dataclass
class PadSensitivity:
    change: torch.Tensor  # [B, T_out] largest logit change at each output position
    finite: torch.Tensor  # [B, T_out] the unperturbed output is finite there
    scale: float
    embedding_calls: int
    batch: PaddedBatch


def pad_sensitivity(subject: Subject, seed: int, side: str) -> PadSensitivity | None:
    """How much each output moves when only the pad positions' embeddings change, with the batch
    padded on `side`. None when the input embedding cannot be found."""
    embedding = input_embedding(subject)
    if embedding is None:
        return None
    generator = torch.Generator().manual_seed(seed)
    batch = padded_batch(subject, generator, side)
    with torch.no_grad():
        base = call(subject, *batch.inputs).float()
        with perturbed_pads(embedding, batch.inputs[0], batch.padded, generator) as calls:
            moved = call(subject, *batch.inputs).float()
    change = torch.nan_to_num((moved - base).abs().amax(dim=-1), nan=float("inf"))
    finite = torch.isfinite(base).all(dim=-1)
    return PadSensitivity(change.cpu(), finite.cpu(), finite_scale(base), len(calls), batch)


def fixed_output_length(subject: Subject, generator: torch.Generator) -> str | None:
    """Why outputs cannot be matched to inputs position by position, or None when they can: a model
    that decodes a fixed number of outputs whatever the input length (Perceiver's decoder queries)
    answers a shorter row with as many outputs as a full one; a model whose rows are not sequences of
    their own (MusicGen's are the codebooks of a sample, read together) refuses a lone row."""
    T = subject.seq_len
    short = max(1, T // 2)
    ids = random_tokens(subject, 1, short, generator)
    with torch.no_grad():
        try:
            got = call(subject, ids).shape[1]
        except Exception as exc:  # noqa: BLE001 - judged below: refused only a lone row, or broken
            refused = _lone_row_refused(subject, generator, exc)
            if refused is None:
                raise
            return refused
    if got == short:
        return None
    return (f"the model returns {got} outputs for {short} input tokens (a fixed number of decoded outputs, "
            "not one per token), so a sequence alone and padded cannot be compared position by position")


def _lone_row_refused(subject: Subject, generator: torch.Generator, exc: Exception) -> str | None:
    """The skip reason when a model that raised `exc` on one row runs a batch of the probe's rows,
    else None (it is broken for any batch)."""
    from tfdoctor.errors import first_line

    rows = max(2, subject.batch_size)
    try:
        call(subject, random_tokens(subject, rows, subject.seq_len, generator))
    except Exception:  # noqa: BLE001 - broken for any batch: the caller re-raises the first exception
        return None
    return (f"the model refuses a batch of one row ({first_line(exc)}) but runs {rows} rows "
            "together: its rows are not sequences of their own (MusicGen's are the codebooks of a sample), so a "
            "row alone and padded cannot be compared")


# Keywords under which a model is handed a key-padding mask (Hugging Face, nn.Transformer,
# x-transformers, hand-written models).
KEY_MASK_NAMES = ("attention_mask", "key_padding_mask", "src_key_padding_mask", "padding_mask", "pad_mask", "mask")


def _code_names(function) -> set:
    """Identifiers and string constants of a function's code (nested functions included): what a
    Subject's forward passes is read from there, since it is never called with a mask by tfdoctor."""
    code = getattr(function, "__code__", None) or getattr(getattr(function, "__call__", None), "__code__", None)
    names: set = set(getattr(function, "keywords", None) or ())  # functools.partial(..., attention_mask=)
    stack = [code] if code is not None else []
    while stack:
        code = stack.pop()
        names.update(code.co_names, code.co_varnames)
        for const in code.co_consts:
            if isinstance(const, str):
                names.add(const)
            elif isinstance(const, tuple):  # keyword names of a call
                names.update(c for c in const if isinstance(c, str))
            elif hasattr(const, "co_names"):
                stack.append(const)
    return names


def key_mask_given(subject: Subject) -> str | None:
    """How the model is handed a key-padding mask, or None when it is not: a Hugging Face model is
    called with attention_mask (as its users call it); a Subject's own forward that passes a mask."""
    import inspect

    if subject.forward is None:
        try:
            takes = "attention_mask" in inspect.signature(subject.model.forward).parameters
        except (TypeError, ValueError):
            takes = False
        if not (is_hugging_face(subject.model) and takes and _mask_is_read(subject)):
            return None  # RWKV takes attention_mask and ignores it: no key mask at all
        return "a Hugging Face model called with attention_mask"
    named = _code_names(subject.forward)
    given = next((name for name in KEY_MASK_NAMES if name in named), None)
    return f"its forward passes {given}=" if given else None


def _mask_is_read(subject: Subject) -> bool:
    """Whether a Hugging Face model's last output moves when attention_mask hides the first half of
    its row (one forward of two rows, the ids the same): a mask that is taken but never read is none."""
    from tfdoctor.modes import evaluation
    from tfdoctor.probes.dependency import finite_scale
    from tfdoctor.tolerances import RELATIVE_TOLERANCE

    T = subject.seq_len
    ids = random_tokens(subject, 1, T, torch.Generator().manual_seed(0)).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, : T // 2] = 0
    try:
        with torch.no_grad(), evaluation(subject.model):
            logits = subject.model(input_ids=ids, attention_mask=mask).logits[:, -1].float()
    except Exception:  # cannot be called so: say nothing about a mask
        return False
    return float((logits[0] - logits[1]).abs().max()) > RELATIVE_TOLERANCE * max(finite_scale(logits), 1e-30)


def left_padding_evidenced(subject: Subject) -> str | None:
    """Why a model whose padding side is not declared is taken to be left-padded, or None when
    nothing says so. A declared side (--padding-side, the tokenizer's, the side the loop's own
    batches were seen padded on) is Subject.padding_side and decides before this is asked; what is
    left is the library's own batched generation: a Hugging Face model whose generate() runs and
    whose forward reads the attention mask it is given takes batched prompts padded on the left
    (transformers warns on right-padded prompts of a decoder-only model). A key mask alone is no
    evidence: a hand-written model that masks its pads may only ever be padded on the right, where
    the same code is correct (learned positions from the row's start, for one)."""
    from tfdoctor.probes.generation import why_not_generate

    if not is_hugging_face(subject.model) or why_not_generate(subject.model) is not None:
        return None
    # the library's generate() calls the model's own forward, not a Subject's forward around it
    given = key_mask_given(dataclasses.replace(subject, forward=None))
    if given is None:
        return None  # RWKV takes attention_mask and ignores it: its generate() cannot pad a batch
    return (f"the library's batched generation pads on the left ({type(subject.model).__name__}.generate() takes "
            "left-padded prompts and their attention_mask)")
