"""The same sequences arranged differently: alone, padded among rows of other lengths, or packed
with other documents in one row (token by token with the model's cache: decoding.py). A model must
give each sequence the same logits in every arrangement.

Every arrangement is one batched forward (the cheap path of the dependency map): a causal model's
sequence "alone" is the first L positions of a row that holds it and then unrelated filler, since
position i of a causal model reads only tokens <= i (future-leak checks that part separately).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from tfdoctor.probes.dependency import finite_scale
from tfdoctor.subject import PACKING_POSITION_IDS, Subject, call, extract_logits, is_hugging_face, random_tokens
from tfdoctor.tolerances import EQUIVALENCE_TOLERANCE

# packing-isolation: the shortest document packed (one token predicts nothing worth comparing) and
# the most documents per row (enough to see a boundary leak, few enough to name each one).
MIN_DOCUMENT = 2
MAX_DOCUMENTS = 4


# ----------------------------------------------------------------------------------------------
# Calling a Hugging Face model with the arguments generation and packed training use


def _accepts(model, name: str) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters


def _takes(model, name: str) -> bool:
    """Whether an argument reaches the model: forward names it, or the model is a Hugging Face model
    whose forward takes **kwargs (a subclass's forward(input_ids, **kwargs); GraniteMoe's use_cache).
    Another library's **kwargs may refuse an argument it does not know, so it is not sent there."""
    if _accepts(model, name):
        return True
    if not is_hugging_face(model):
        return False
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _takes_use_cache(model) -> bool:
    """use_cache reaches the model: a cache created because the flag did not arrive turns off
    transformers' detection of packed sequences (GraniteMoe takes it through **kwargs)."""
    return _takes(model, "use_cache") and (_accepts(model, "use_cache") or
                                          hasattr(getattr(model, "config", None), "use_cache"))


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counted from each row's first real token, as generation builds them from the
    attention mask (pads get 1, a harmless in-range id)."""
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(mask == 0, 1)


def hf_forward(model, ids, mask=None, positions=None, use_cache=False):
    """Logits and the returned cache of a Hugging Face causal LM. use_cache None leaves it to the
    model's config (as a hand-written loop that does not pass it does)."""
    kwargs = {"input_ids": ids}
    if mask is not None:
        kwargs["attention_mask"] = mask.long()
    if positions is not None and _takes(model, "position_ids"):
        kwargs["position_ids"] = positions
    if use_cache is not None and _takes_use_cache(model):
        kwargs["use_cache"] = bool(use_cache)
    out = model(**kwargs)
    # transformers 5 names the returned cache `cache` and warns on every read of its old name, a field
    # only outputs of older versions have; reading the old name only there keeps that warning away.
    returned = out.cache if hasattr(out, "cache") else getattr(out, "past_key_values", None)
    return extract_logits(out), returned


def hf_causal(subject: Subject) -> bool:
    """A Hugging Face causal LM called the way tfdoctor calls it (no Subject forward of its own)."""
    return subject.forward is None and subject.kind == "causal" and is_hugging_face(subject.model)


def _filler(subject: Subject, ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return random_tokens(subject, *ids.shape, generator=generator)


# ----------------------------------------------------------------------------------------------
# padding-equivalence


def real_lengths(batch: int, length: int) -> list[int]:
    """Real tokens per row: one full row (a batch is padded to its longest sequence), the others
    shorter and all different, so that rows of several pad counts are compared."""
    if batch == 1:
        return [max(1, length // 2)]
    return [length] + [max(1, length - (r + 1) * length // batch) for r in range(batch - 1)]


@dataclass
class PaddedArrangement:
    side: str
    lengths: list[int]
    diff: torch.Tensor  # [B, T] largest logit difference at each real position (0 elsewhere), inf at NaN
    real: torch.Tensor  # [B, T] True at the real positions of the padded batch
    scale: float
    ids: torch.Tensor  # the padded batch
    logits: torch.Tensor  # its logits [B, T, V]

    @property
    def tolerance(self) -> float:
        return EQUIVALENCE_TOLERANCE * max(self.scale, 1e-30)

    @property
    def differs(self) -> torch.Tensor:
        return (self.diff > self.tolerance) & self.real

    def row_differences(self) -> list[float]:
        return [float(self.diff[r][self.real[r]].max()) if bool(self.real[r].any()) else 0.0
                for r in range(self.diff.shape[0])]


# What each Hugging Face model's generate() hands its forward, recorded once per model.
_GENERATE_ARGUMENTS: weakref.WeakKeyDictionary[torch.nn.Module, frozenset] = weakref.WeakKeyDictionary()


def generate_arguments(subject: Subject) -> frozenset:
    """The keyword arguments a Hugging Face causal LM's own generate() gives its forward for a
    left-padded batch of prompts, recorded from one generate() call of one new token. transformers
    builds position ids from the attention mask only for a forward that names position_ids
    (GenerationMixin.generate; a model's prepare_inputs_for_generation may add them), so a model
    that takes them only through **kwargs (WhisperForCausalLM) numbers a left-padded prompt from
    the row's start, and a probe that hands it position ids would hide that. Where generate()
    cannot run, generate's own rule: position ids when forward names them."""
    from tfdoctor.probes.generation import accepts, decode_as_generate, why_not_generate

    model = subject.model
    known = _GENERATE_ARGUMENTS.get(model)
    if known is not None:
        return known
    by_signature = frozenset(name for name in ("attention_mask", "position_ids") if accepts(model, name))
    recorded = by_signature
    if why_not_generate(model) is None:
        T = min(subject.seq_len, 8)
        ids = random_tokens(subject, 2, T, torch.Generator().manual_seed(0))
        real = torch.ones_like(ids, dtype=torch.bool)
        real[1, : T // 2] = False  # the second prompt left-padded, as batched generation pads it
        ids = ids.masked_fill(~real, subject.pad_id if subject.pad_id is not None else 0)
        try:
            run = decode_as_generate(model, ids, real, T, subject.pad_id if subject.pad_id is not None else 0)
            if run.calls:
                recorded = frozenset(run.calls[0].arguments)
        except Exception:  # noqa: BLE001 - generate() does not run on this model: its signature rule stands
            recorded = by_signature
    _GENERATE_ARGUMENTS[model] = recorded
    return recorded


def padded_call(subject: Subject, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Logits of a padded batch, called as in training: the Subject's forward, or a Hugging Face
    model with attention_mask from the pads (causal LMs also with position ids from that mask where
    the model's own generate() passes them, as it builds them; where the user's own forward builds
    them, it decides)."""
    if hf_causal(subject):
        positions = mask_positions(real) if "position_ids" in generate_arguments(subject) else None
        return hf_forward(subject.model, ids, mask=real, positions=positions)[0]
    return call(subject, ids)


@dataclass
class PaddingProbe:
    sequences: torch.Tensor  # [B, T] each row's real tokens at its start (then filler)
    lengths: list[int]
    reference: torch.Tensor  # [B, T, V] each sequence alone at positions [0, L)


def alone(subject: Subject, generator: torch.Generator) -> PaddingProbe:
    """The probe sequences and their logits alone: for a causal model one forward of unpadded rows
    (real tokens then filler); an encoder reads its filler, so each length is run by itself."""
    B, T = subject.batch_size, subject.seq_len
    lengths = real_lengths(B, T)
    ids = random_tokens(subject, B, T, generator)
    with torch.no_grad():
        if subject.kind == "causal":
            full = torch.ones_like(ids, dtype=torch.bool)
            reference = padded_call(subject, ids, full).float()
        else:
            reference = torch.zeros(B, T, subject.num_labels or subject.vocab_size, device=ids.device)  # V, or C
            for r, L in enumerate(lengths):
                row = ids[r:r + 1, :L]
                reference[r, :L] = padded_call(subject, row, torch.ones_like(row, dtype=torch.bool)).float()[0]
    return PaddingProbe(ids, lengths, reference)


def arrange_padded(subject: Subject, probe: PaddingProbe, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's sequences as one batch padded on `side` with pad_id: (ids, real [B, T])."""
    B, T = probe.sequences.shape
    ids = torch.full_like(probe.sequences, subject.pad_id)
    real = torch.zeros(B, T, dtype=torch.bool, device=ids.device)
    for r, L in enumerate(probe.lengths):
        start = T - L if side == "left" else 0
        ids[r, start:start + L] = probe.sequences[r, :L]
        real[r, start:start + L] = True
    return ids, real


def compare_padded(subject: Subject, probe: PaddingProbe, side: str) -> PaddedArrangement:
    """One forward of the sequences padded on `side`, compared position by position with alone."""
    ids, real = arrange_padded(subject, probe, side)
    with torch.no_grad():
        logits = padded_call(subject, ids, real).float()
    B, T = ids.shape
    diff = torch.zeros(B, T)
    compared = []
    for r, L in enumerate(probe.lengths):
        start = T - L if side == "left" else 0
        here, there = logits[r, start:start + L], probe.reference[r, :L]
        gap = (here - there).abs().amax(-1)
        gap = torch.where(torch.isfinite(here).all(-1), gap, torch.full_like(gap, float("inf")))
        diff[r, start:start + L] = torch.nan_to_num(gap, nan=float("inf"), posinf=float("inf")).cpu()
        compared.append(there)
    scale = finite_scale(torch.cat(compared))
    return PaddedArrangement(side, probe.lengths, diff, real.cpu(), scale, ids, logits)


def row_alone_padded(subject: Subject, arrangement: PaddedArrangement, row: int) -> torch.Tensor:
    """Row `row` of the padded batch run as a batch of one (same pads): [T, V]."""
    ids = arrangement.ids[row:row + 1]
    real = arrangement.real[row:row + 1].to(ids.device)
    with torch.no_grad():
        return padded_call(subject, ids, real).float()[0]


# ----------------------------------------------------------------------------------------------
# packing-isolation


@dataclass
class PackedRows:
    ids: torch.Tensor  # [B, T]
    doc_ids: torch.Tensor  # [B, T] 0, 0, 0, 1, 1, 2, ... within each row
    positions: torch.Tensor  # [B, T] restarting at 0 at each document
    documents: list[list[tuple[int, int]]]  # per row: (start, length) of each document


def pack_rows(subject: Subject, generator: torch.Generator) -> PackedRows:
    """B rows of T tokens, each holding 2..MAX_DOCUMENTS documents of random lengths. The Hugging
    Face convention packs one row (transformers reads documents off the position ids of a batch of
    one, the batch DataCollatorWithFlattening builds)."""
    B, T = subject.batch_size, subject.seq_len
    if subject.packing == PACKING_POSITION_IDS:
        B = 1
    ids = random_tokens(subject, B, T, generator)
    doc_ids = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    documents = []
    most = max(1, min(MAX_DOCUMENTS, T // MIN_DOCUMENT))
    for r in range(B):
        count = min(most, MAX_DOCUMENTS - r % (MAX_DOCUMENTS - 1)) if most >= 2 else 1
        # cut points: count - 1 distinct places, each document at least MIN_DOCUMENT long
        slack = T - count * MIN_DOCUMENT
        cuts = sorted(torch.randint(0, slack + 1, (count - 1,), generator=generator).tolist())
        lengths = [MIN_DOCUMENT + b - a for a, b in zip([0] + cuts, cuts + [slack])]
        row, start = [], 0
        for d, L in enumerate(lengths):
            doc_ids[r, start:start + L] = d
            positions[r, start:start + L] = torch.arange(L)
            row.append((start, L))
            start += L
        documents.append(row)
    device = ids.device
    return PackedRows(ids, doc_ids.to(device), positions.to(device), documents)


def packed_call(subject: Subject, rows: PackedRows, ids: Optional[torch.Tensor] = None,
                use_cache: Optional[bool] = False, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits of packed rows (or of copies of them, stacked: copy c of row r at c * B + r), with
    the rows' restarting positions unless other `positions` [B, T] are given."""
    ids = rows.ids if ids is None else ids
    copies = ids.shape[0] // rows.ids.shape[0]
    positions = rows.positions if positions is None else positions
    doc_ids, positions = rows.doc_ids.repeat(copies, 1), positions.repeat(copies, 1)
    if subject.packing == PACKING_POSITION_IDS:
        # No attention mask and no cache: only then does transformers tell the documents apart by the
        # restarting position ids. The Trainer trains with config.use_cache = False.
        try:
            return hf_forward(subject.model, ids, positions=positions, use_cache=use_cache)[0]
        except TypeError as exc:  # a forward(ids) without keyword arguments: the convention cannot apply
            if "unexpected keyword argument" not in str(exc):
                raise
            from tfdoctor.errors import SubjectError

            raise SubjectError(f"packing='position_ids' calls model(input_ids=..., position_ids=...), and this "
                               f"model's forward refuses it ({exc})",
                               "give Subject(packing=fn) with fn(model, input_ids, doc_ids, position_ids) -> "
                               "logits") from exc
    return extract_logits(subject.packing(subject.model, ids.contiguous(), doc_ids.contiguous(),
                                          positions.contiguous()))


@dataclass
class PackingComparison:
    rows: PackedRows
    diff: torch.Tensor  # [B, T] largest logit difference from the document alone
    scale: float
    logits: torch.Tensor  # the packed rows' logits [B, T, V]
    alone_ids: torch.Tensor  # [n, width] every document alone at the start of its own row, filler after
    reference: torch.Tensor  # [n, width, V] their logits

    @property
    def tolerance(self) -> float:
        return EQUIVALENCE_TOLERANCE * max(self.scale, 1e-30)

    def documents(self) -> list[tuple[int, int, int]]:
        """(row, start, length) of every packed document, in the order of alone_ids."""
        return [(r, s, L) for r, row in enumerate(self.rows.documents) for s, L in row]

    def against(self, reference: torch.Tensor) -> PackingComparison:
        """The same packed logits compared with another reference for the documents alone."""
        B, T = self.rows.ids.shape
        diff = torch.zeros(B, T)
        for n, (r, s, L) in enumerate(self.documents()):
            gap = (self.logits[r, s:s + L] - reference[n, :L]).abs().amax(-1)
            diff[r, s:s + L] = torch.nan_to_num(gap, nan=float("inf"), posinf=float("inf")).cpu()
        return PackingComparison(self.rows, diff, finite_scale(reference), self.logits, self.alone_ids, reference)


def alone_call(subject: Subject, ids: torch.Tensor) -> torch.Tensor:
    """Logits of one document per row, called as the model is called on an unpacked row, so that it
    numbers the positions itself: a Hugging Face model with no position ids (and no cache), a
    Subject packed by a function through its usual forward. Packed training must give each document
    the positions the model gives it alone: RoBERTa counts from padding_idx + 1, so position ids
    from 0 (DataCollatorWithFlattening's) put every packed document where it never is unpacked."""
    if subject.packing == PACKING_POSITION_IDS:
        return hf_forward(subject.model, ids, use_cache=False)[0]
    return call(subject, ids)


def numbered_call(subject: Subject, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Logits of one document per row, called the way the packed rows are (the packing fn with one
    document id, or position ids), numbered start, start + 1, ...: the packing convention alone."""
    n, width = ids.shape
    positions = (torch.arange(width, device=ids.device) + start).expand(n, -1).contiguous()
    if subject.packing == PACKING_POSITION_IDS:
        return hf_forward(subject.model, ids, positions=positions, use_cache=False)[0]
    return extract_logits(subject.packing(subject.model, ids.contiguous(), torch.zeros_like(positions), positions))


def compare_packed(subject: Subject, rows: PackedRows, generator: torch.Generator) -> PackingComparison:
    """The packed rows in one forward against every document alone as the model numbers it by
    itself, all documents in one forward (each at the start of its own row, filler after it: a
    causal model never reads the filler)."""
    docs = [(r, s, L) for r, row in enumerate(rows.documents) for s, L in row]
    width = max(L for _, _, L in docs)
    alone_ids = random_tokens(subject, len(docs), width, generator)
    for n, (r, s, L) in enumerate(docs):
        alone_ids[n, :L] = rows.ids[r, s:s + L]
    with torch.no_grad():
        packed = packed_call(subject, rows).float()
        reference = alone_call(subject, alone_ids).float()
    placeholder = PackingComparison(rows, torch.zeros(0), 0.0, packed, alone_ids, reference)
    return placeholder.against(reference)


# The largest start of a document's positions looked for when the model numbers a document alone
# otherwise than the packed rows do: RoBERTa-style learned positions start at padding_idx + 1 (2
# with RoBERTa's padding_idx 1); a few more cover other pad ids near the start of the vocabulary.
MAX_NUMBERING_START = 8


@dataclass
class Numbering:
    gap: float  # largest difference between a document alone as the model numbers it and numbered from 0
    start: Optional[int]  # the start that reproduces the model's own numbering (None: none up to the max)
    collated: PackingComparison  # the packed rows against the documents alone numbered from 0


def own_numbering(subject: Subject, comparison: PackingComparison) -> Numbering:
    """How the model numbers a document alone, against the packing convention's 0, 1, 2, ...: the
    documents alone both ways (one forward), and where they differ, the start k (1..MAX) for which
    k, k + 1, ... reproduces the model's own numbering (a forward per start tried)."""
    ids, own = comparison.alone_ids, comparison.reference
    lengths = [L for _, _, L in comparison.documents()]
    real = torch.zeros(ids.shape, dtype=torch.bool)
    for n, L in enumerate(lengths):
        real[n, :L] = True

    def gap(logits: torch.Tensor) -> float:
        differences = torch.nan_to_num((logits - own).abs().amax(-1), nan=float("inf")).cpu()
        return float(differences[real].max())

    with torch.no_grad():
        from_zero = numbered_call(subject, ids).float()
    collated = comparison.against(from_zero)
    gap_from_zero = gap(from_zero)
    if gap_from_zero <= comparison.tolerance:
        return Numbering(gap_from_zero, 0, collated)
    with torch.no_grad():
        for start in range(1, MAX_NUMBERING_START + 1):
            if gap(numbered_call(subject, ids, start).float()) <= comparison.tolerance:
                return Numbering(gap_from_zero, start, collated)
    return Numbering(gap_from_zero, None, collated)


def document_map(subject: Subject, comparison: PackingComparison, generator: torch.Generator) -> list[list[list[bool]]]:
    """Per row, M[i][j]: do document i's logits move when only document j's tokens change? One
    forward with a copy of the packed batch per (row, document) swapped."""
    rows = comparison.rows
    B, T = rows.ids.shape
    count = max(len(row) for row in rows.documents)
    copies = rows.ids.repeat(count, 1)  # copy c of row r at c * B + r: document c swapped
    swapped = random_tokens(subject, *copies.shape, generator=generator)
    for c in range(count):
        for r, row in enumerate(rows.documents):
            if c < len(row):
                s, L = row[c]
                copies[c * B + r, s:s + L] = swapped[c * B + r, s:s + L]
    with torch.no_grad():
        moved = packed_call(subject, rows, copies).float()
    base = comparison.logits.repeat(count, 1, 1)
    change = torch.nan_to_num((moved - base).abs().amax(-1), nan=float("inf"),
                              posinf=float("inf")).cpu()  # [count * B, T]
    maps = []
    for r, row in enumerate(rows.documents):
        grid = []
        for i, (s, L) in enumerate(row):
            grid.append([bool(change[j * B + r, s:s + L].max() > comparison.tolerance) for j in range(len(row))])
        maps.append(grid)
    return maps


def change_with_config_cache(subject: Subject, rows: PackedRows, comparison: PackingComparison) -> Optional[float]:
    """How far the packed logits move when use_cache is left to a Hugging Face config that turns it
    on (None when the Subject does not pack by position ids or the config has no cache on)."""
    if (subject.packing != PACKING_POSITION_IDS
            or not getattr(getattr(subject.model, "config", None), "use_cache", False)):
        return None
    with torch.no_grad():
        default = packed_call(subject, rows, use_cache=None).float()
    return float((default - comparison.logits).abs().max())


def change_with_running_positions(subject: Subject, rows: PackedRows, comparison: PackingComparison) -> float:
    """How far the packed logits move when the position ids run on across each row instead of
    restarting at each document: 0 when the positions given never reach the model."""
    B, T = rows.ids.shape
    running_on = torch.arange(T, device=rows.ids.device).expand(B, -1).contiguous()
    with torch.no_grad():
        moved = packed_call(subject, rows, positions=running_on).float()
    return float(torch.nan_to_num((moved - comparison.logits).abs(), nan=float("inf")).max())


def eval_noise(first: torch.Tensor, again: torch.Tensor, tolerance: float) -> Optional[float]:
    """The gap between two identical forwards, when it is over the tolerance (else None)."""
    same_nan = torch.isnan(first) & torch.isnan(again)  # NaN in both is the same NaN (masked-row-nan's)
    gap = (first - again).abs().masked_fill(same_nan, 0.0)
    gap = float(torch.nan_to_num(gap, nan=float("inf"), posinf=float("inf")).max()) if first.numel() else 0.0
    return gap if gap > tolerance else None
