"""Padding seen through a pooled prediction: a sequence classifier's class scores [B, C] (or a
regression head's values) must not depend on the pads around a row, neither on their content nor on
their count or side. What the measurements say, and which pooling explains a difference.

- `padded_rows`: B random rows of distinct real lengths (1 to T/2 pads), padded on one side.
- `alone_scores`: each row's scores run alone, unpadded, at its own length: the reference.
- `pad_content_change`: each row's largest score change when the embeddings at some of its pad
  positions are pushed far off (probes/padding.perturbed_pads), the ids intact so that every mask
  is built as in training.
- `pooling_cause`: which reading of the pads explains a difference (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tfdoctor.probes.dependency import finite_scale
from tfdoctor.probes.padding import PAD_ATTENTION_SHARE, input_embedding, perturbed_pads
from tfdoctor.subject import Subject, call, random_tokens
from tfdoctor.tolerances import EQUIVALENCE_TOLERANCE


@dataclass
class PaddedRows:
    ids: torch.Tensor  # (B, T) padded rows
    pads: torch.Tensor  # (B, T) bool, True at pad positions
    lengths: list[int]  # real tokens per row
    side: str


def padded_rows(subject: Subject, side: str, generator: torch.Generator) -> PaddedRows:
    """B rows of random tokens, row r with 1 + r * (T/2 - 1) / (B - 1) pads (so the pad counts differ
    from row to row, up to half the row), padded on `side`."""
    B, T, pad = max(2, subject.batch_size), subject.seq_len, subject.pad_id
    ids = random_tokens(subject, B, T, generator)
    counts = [1 + (r * max(0, T // 2 - 1)) // max(1, B - 1) for r in range(B)]
    positions = torch.arange(T, device=ids.device)
    pads = torch.stack([positions >= T - n if side == "right" else positions < n for n in counts])
    return PaddedRows(ids.masked_fill(pads, pad), pads, [T - n for n in counts], side)


def real_tokens(rows: PaddedRows, r: int) -> torch.Tensor:
    """Row r's real tokens, [1, L]."""
    return rows.ids[r][~rows.pads[r]].unsqueeze(0)


def alone_scores(subject: Subject, rows: PaddedRows) -> torch.Tensor:
    """(B, C): each row's scores run alone at its own length, no pad anywhere."""
    with torch.no_grad():
        return torch.cat([call(subject, real_tokens(rows, r)).float() for r in range(len(rows.lengths))])


def scores(subject: Subject, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return call(subject, ids).float()


def tolerance(*outputs: torch.Tensor, terms: float = 0.0) -> float:
    """Two score sets agree within this: EQUIVALENCE_TOLERANCE of their scale, or of `terms` (the size of
    the terms a linear head sums into a score, head_terms) when larger."""
    return EQUIVALENCE_TOLERANCE * max(max(finite_scale(o) for o in outputs), terms, 1e-30)


def head_terms(subject: Subject, ids: torch.Tensor) -> float:
    """The largest sum of |terms| a linear head adds into one class score, max over rows and classes of
    |h| @ |W|^T, 0.0 when the scores do not come from an nn.Linear. Rounding in a dot product scales with
    its terms, not with its result: a head initialised small (std 0.02) sums states of RMS ~1 into scores
    of ~0.01, so float32 reordering noise of 1.6e-7..2.7e-7 in ConvBERT's scores was 1.8e-5 of their
    scale but ~1e-6 of their terms."""
    found: list[float] = []

    def hook(module, args, output):
        if isinstance(output, torch.Tensor) and output.dim() == 2 and output.shape[0] == ids.shape[0] and args:
            h = args[0].detach().float()
            found.append(float((h.abs() @ module.weight.detach().float().abs().T).max()))

    handles = [m.register_forward_hook(hook) for m in subject.model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            call(subject, ids)
    finally:
        for handle in handles:
            handle.remove()
    return found[-1] if found else 0.0


def row_gaps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B,): each row's largest score difference (inf where one side is NaN/Inf and the other is not)."""
    return torch.nan_to_num((a - b).abs(), nan=float("inf")).amax(-1).cpu()


def pad_content_change(subject: Subject, rows: PaddedRows, where: torch.Tensor,
                       generator: torch.Generator) -> Optional[torch.Tensor]:
    """(B,): each row's largest score change when the embeddings at `where` ((B, T) bool, pad positions)
    are pushed off; None when the input embedding cannot be found or is not called on the ids."""
    embedding = input_embedding(subject)
    if embedding is None:
        return None
    base = scores(subject, rows.ids)
    with torch.no_grad(), perturbed_pads(embedding, rows.ids, where, generator) as calls:
        moved = call(subject, rows.ids).float()
    return row_gaps(moved, base) if calls else None


def real_state_change(subject: Subject, rows: PaddedRows, generator: torch.Generator) -> Optional[float]:
    """The largest change of the last block's output (the backbone's states, before any pooling) at
    real positions when the pads' embeddings are pushed off; None when no repeated block returning
    [B, T, D] is found. Moved: the blocks read the pads (attention); still: only the pooling does."""
    from tfdoctor.probes.depth import find_stack

    embedding, stack = input_embedding(subject), find_stack(subject.model)
    if embedding is None or stack is None:
        return None
    seen: list[torch.Tensor] = []

    def keep(module, args, output):
        state = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(state, torch.Tensor) and state.shape[:2] == rows.ids.shape:
            seen.append(state.detach().float())

    handle = stack.blocks[-1][1].register_forward_hook(keep)
    try:
        with torch.no_grad():
            call(subject, rows.ids)
            with perturbed_pads(embedding, rows.ids, rows.pads, generator):
                call(subject, rows.ids)
    finally:
        handle.remove()
    if len(seen) != 2:
        return None
    real = (~rows.pads).to(seen[0].device)
    return float(torch.nan_to_num((seen[1] - seen[0]).abs(), nan=float("inf")).amax(-1)[real].max())


# Causes pooling_cause names, each with what it means and the fix.
EDGE, ATTENDED, POOLED_OVER_PADS, READ, COUNT = "edge-position", "attends-pads", "pools-pads", "reads-pads", "pad-count"
MIXED = "mixes-pads"


def pooling_cause(subject: Subject, rows: PaddedRows, generator: torch.Generator) -> tuple[str, dict]:
    """Why the pooled scores of these padded rows differ from the rows alone, as measured:

    - "edge-position": only the pad at the row's edge (the last position of a right-padded row, the
      first of a left-padded one) moves the scores: the head reads that one position, a pad here;
    - "attends-pads": the pads' content moves the scores and real queries give the pad keys a share of
      their attention (softmax weights seen), or the last block's states at real positions move with it
      (a fused kernel): the encoder attends to the pads;
    - "mixes-pads": the pads' content moves the scores and the states at real positions, while real
      queries give the pad keys no attention (or the model computes none): a layer mixing positions
      without the mask does it (FNet's Fourier transform, MobileBERT's trigram input, Nystromformer's
      landmarks, a convolution over positions);
    - "pools-pads": the pads' content moves the scores, no attention on them and the states at real
      positions stay still: the pooling (a mean or max over every position) takes the pads in;
    - "reads-pads": the pads' content moves the scores, the attention weights not seen (a fused kernel);
    - "pad-count": the pads' content changes nothing, yet their number does: a mean divided by the
      padded length, or positions counted from the row's start.
    """
    from tfdoctor.probes.attention import pad_attention

    evidence: dict = {}
    base = scores(subject, rows.ids)
    tol = tolerance(base, terms=head_terms(subject, rows.ids))
    everywhere = pad_content_change(subject, rows, rows.pads, generator)
    if everywhere is None or not bool((everywhere > tol).any()):
        if everywhere is not None:
            evidence["largest_change_from_pad_content"] = float(everywhere.max())
        return COUNT, evidence
    evidence["largest_change_from_pad_content"] = float(everywhere.max())
    edge = -1 if rows.side == "right" else 0
    at_edge = torch.zeros_like(rows.pads)
    at_edge[:, edge] = rows.pads[:, edge]
    inner = rows.pads & ~at_edge
    edge_change = pad_content_change(subject, rows, at_edge, generator)
    inner_change = pad_content_change(subject, rows, inner, generator) if bool(inner.any()) else None
    if edge_change is not None and inner_change is not None:
        evidence.update(change_from_edge_pad=float(edge_change.max()), change_from_other_pads=float(inner_change.max()))
        if bool((edge_change > tol).any()) and not bool((inner_change > tol).any()):
            return EDGE, evidence
    with torch.no_grad():
        share = pad_attention(subject.model, lambda: call(subject, rows.ids), rows.pads)
    evidence["largest_attention_on_pads"] = share
    if share is not None and share > PAD_ATTENTION_SHARE[1]:
        return ATTENDED, evidence
    # no attention to the pads (or the weights not seen, a fused kernel): do the real states move?
    moved = real_state_change(subject, rows, generator)
    if moved is not None:
        evidence["largest_real_state_change_from_pad_content"] = moved
        states_tol = EQUIVALENCE_TOLERANCE * max(evidence["largest_change_from_pad_content"], 1.0)
        if moved <= states_tol:
            return POOLED_OVER_PADS, evidence
        # not attention: real queries give the pads none, or the model computes no attention at all (FNet)
        unattended = share < PAD_ATTENTION_SHARE[0] if share is not None else not _attends(subject)
        return (MIXED if unattended else ATTENDED), evidence
    if share is not None and share < PAD_ATTENTION_SHARE[0]:
        return POOLED_OVER_PADS, evidence
    return READ, evidence  # the weights not seen (a fused kernel), or a share too small to claim either


def _attends(subject: Subject) -> bool:
    """Whether a forward computes attention (softmax weights meeting values, or a fused kernel)."""
    from tfdoctor.probes.attention import attention_calls

    capture = attention_calls(subject)
    return bool(capture.uses or capture.fused_calls)


def head_site(subject: Subject, ids: torch.Tensor) -> Optional[str]:
    """The user's "path:line" where the module returning the class scores (the head, fed the pooled
    state) is called, or None (no such submodule, or it is called from library code only)."""
    from tfdoctor.usercode.call_sites import call_site

    found: list[tuple[torch.Tensor, Optional[str]]] = []

    def hook(module, args, output):
        if isinstance(output, torch.Tensor) and output.dim() == 2 and output.shape[0] == ids.shape[0]:
            found.append((output, call_site(2)))

    handles = [m.register_forward_hook(hook) for name, m in subject.model.named_modules() if name]
    try:
        with torch.no_grad():
            out = call(subject, ids)
    finally:
        for handle in handles:
            handle.remove()
    return next((where for tensor, where in reversed(found) if tensor is out or torch.equal(tensor, out)), None)
