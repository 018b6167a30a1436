"""The dependency map D[i, j]: does output position i change when input token j changes?

One batch row per perturbed position (row j = the base sequence with token j swapped for another
random token), plus the unperturbed base in every chunk, so the whole T x T map costs
ceil((T + 1) / rows_per_chunk) forward passes instead of T.

The map is of the architecture, not of the init: when a fresh model's outputs leave most of the
past unmixed (zero-initialised output projections or residual gates), the map is measured again
with those paths opened (probes/perturb.py) and the fuller of the two is the one judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tfdoctor.context import current, memo
from tfdoctor.modes import evaluation
from tfdoctor.probes.perturb import Perturbation, opened_paths
from tfdoctor.subject import Subject, call, random_tokens
from tfdoctor.tolerances import RELATIVE_TOLERANCE

# Logits kept alive per forward: rows * T * V floats. Bounds the probe's memory on big vocabularies.
CHUNK_LOGIT_BYTES = 128 * 2**20
# The map drawn in the report is max-pooled down to at most this many cells a side.
DRAWN_SIZE = 16

# A model whose outputs depend on fewer than this share of the strictly-earlier (i > j) pairs is
# measured again with its zero-initialised paths opened. A causal model or an encoder with its
# paths open fills that triangle completely; below 0.9 something (an init, or the model) holds
# positions apart. Same share as mask-direction's "sees everything".
MIXED_PAST_SHARE = 0.9

# Cell values of the drawn map.
NO_DEPENDENCY, PAST_DEPENDENCY, FUTURE_DEPENDENCY = 0, 1, 2


def finite_scale(tensor: torch.Tensor) -> float:
    """Largest |value| among the finite entries (0 when none is): NaN outputs must not poison the
    tolerance that other positions are judged by."""
    largest = float(tensor.abs().max()) if tensor.numel() else 0.0
    if math.isfinite(largest):  # the common case, without copying the finite entries out
        return largest
    finite = tensor[torch.isfinite(tensor)]
    return float(finite.abs().max()) if finite.numel() else 0.0


@dataclass
class DependencyMap:
    """delta[i][j]: largest change of output position i's logits when token j is swapped."""

    delta: torch.Tensor  # (T, T) float
    scale: float  # largest |logit| of the base output
    tolerance: float
    forwards: int  # forward passes the map cost
    noise: float = 0.0  # largest difference between two identical input rows (0 for a deterministic model)
    # Measured only when two identical rows differed: how the rows relate. "repeatable": the same batch
    # run again gives the same logits, so the rows are read together, not drawn at random; "grouped":
    # besides, the model refuses a lone row (its rows are parts of one sample, MusicGen's codebooks).
    rows: str = ""
    # Set when the fresh model mixed too little of the past and the map was measured again with its
    # zero-initialised paths opened: what was jittered, and which of the two maps this one is.
    opened: dict | None = None

    @property
    def random_in_eval(self) -> bool:
        """Two identical rows differed: no change can be pinned on a token (whatever the cause)."""
        return self.noise > self.tolerance

    @property
    def seq_len(self) -> int:
        return self.delta.shape[0]

    @property
    def depends(self) -> torch.Tensor:
        """(T, T) bool: D[i, j]."""
        return self.delta > self.tolerance

    def past_share(self) -> float:
        """Share of the strictly-earlier pairs (i > j) with D[i, j]; 1.0 when T = 1."""
        T = self.seq_len
        if T < 2:
            return 1.0
        return float(torch.tril(self.depends, diagonal=-1).sum()) / (T * (T - 1) // 2)

    def future_share(self) -> float:
        """Share of the strictly-later pairs (j > i) with D[i, j]; 0.0 when T = 1."""
        T = self.seq_len
        if T < 2:
            return 0.0
        return float(torch.triu(self.depends, diagonal=1).sum()) / (T * (T - 1) // 2)

    def future_pairs(self) -> list[tuple[int, int]]:
        """(i, j) with j > i and D[i, j], sorted by i then j."""
        upper = torch.triu(self.depends, diagonal=1)
        return [tuple(pair) for pair in upper.nonzero().tolist()]

    def drawn(self) -> tuple[list[list[int]], int]:
        """The map max-pooled to at most DRAWN_SIZE a side, cells coded 0 none, 1 past/self,
        2 future; and the number of positions per cell."""
        T = self.seq_len
        step = max(1, math.ceil(T / DRAWN_SIZE))
        i = torch.arange(T)
        codes = torch.where(i[None, :] > i[:, None], FUTURE_DEPENDENCY, PAST_DEPENDENCY)
        coded = (self.depends.long() * codes).float()
        if step > 1:
            pad = step * math.ceil(T / step) - T
            coded = torch.nn.functional.pad(coded, (0, pad, 0, pad))
            coded = torch.nn.functional.max_pool2d(coded[None, None], step)[0, 0]
        return coded.long().tolist(), step


def dependency_map(forward, base: torch.Tensor, vocab_size: int, pad_id: int | None,
                   generator: torch.Generator | None = None) -> DependencyMap:
    """Measure D for `forward(ids [N, T]) -> logits [N, T, V]` around `base` [T]."""
    T = base.shape[0]
    # Replacement token for each position: different from the original and never the pad id.
    replacement = torch.randint(0, vocab_size, (T,), generator=generator).to(base.device)
    for _ in range(8):  # resample collisions; with V >= 3 this ends after a round or two
        clash = (replacement == base) | ((replacement == pad_id) if pad_id is not None else False)
        if not bool(clash.any()):
            break
        redraw = torch.randint(0, vocab_size, (T,), generator=generator).to(base.device)
        replacement = torch.where(clash, redraw, replacement)
    perturbed = base.repeat(T, 1)
    perturbed[torch.arange(T), torch.arange(T)] = replacement

    rows_per_chunk = max(1, min(T, CHUNK_LOGIT_BYTES // max(1, 4 * T * vocab_size) - 2))
    delta = torch.zeros(T, T)  # delta[j, i] while filling: row j perturbed, output position i
    scale, forwards, noise = 0.0, 0, 0.0
    with torch.no_grad():
        for start in range(0, T, rows_per_chunk):
            rows = perturbed[start:start + rows_per_chunk]
            # The first chunk carries the base twice: two identical rows must agree, or the model is
            # random in eval mode and no change can be pinned on a token.
            twins = 2 if start == 0 else 1
            batch = torch.cat([base[None]] * twins + [rows])
            logits = forward(batch).float()
            forwards += 1
            reference, changed = logits[0], logits[twins:]
            if twins == 2:  # the base row is the same in every chunk: its scale is measured once
                noise = float(torch.nan_to_num((logits[1] - reference).abs(), nan=float("inf")).max())
                scale = finite_scale(reference)
                first_batch, first_logits = batch, logits
            delta[start:start + rows.shape[0]] = (changed - reference).abs().amax(dim=-1).cpu()
    delta = delta.T.contiguous()  # now delta[i, j]
    delta = torch.nan_to_num(delta, nan=float("inf"))
    tolerance = RELATIVE_TOLERANCE * max(scale, 1e-30)
    rows = ""
    if noise > tolerance:
        rows, more = _how_rows_relate(forward, first_batch, first_logits, tolerance)
        forwards += more
    return DependencyMap(delta=delta, scale=scale, tolerance=tolerance, forwards=forwards, noise=noise, rows=rows)


def _how_rows_relate(forward, batch: torch.Tensor, logits: torch.Tensor, tolerance: float) -> tuple[str, int]:
    """Why two identical rows of `batch` (which gave `logits`) differed, and the forwards it took to tell:
    "" (random: the same batch run again differs too), "repeatable" (it does not: the model reads its
    rows together) or "grouped" (repeatable, and a lone row is refused: the rows are parts of one sample)."""
    with torch.no_grad():
        again = forward(batch).float()
        if float(torch.nan_to_num((logits - again).abs(), nan=float("inf")).max()) > tolerance:
            return "", 1
        try:
            forward(batch[:1])
        except Exception:  # noqa: BLE001 - the model's own refusal of a batch of one row
            return "grouped", 2
    return "repeatable", 2


def _fuller(fresh: DependencyMap, reopened: DependencyMap, perturbation: Perturbation) -> DependencyMap:
    """The map with opened paths when it shows more dependencies than the fresh one (each one seen
    is a real path: training opens it); the fresh map otherwise. Both record what was tried."""
    fresh_pairs, reopened_pairs = int(fresh.depends.sum()), int(reopened.depends.sum())
    use_reopened = not reopened.random_in_eval and reopened_pairs > fresh_pairs
    opened = {**perturbation.details(), "fresh_past_share": fresh.past_share(), "fresh_pairs": fresh_pairs,
              "opened_pairs": reopened_pairs, "judged": "opened" if use_reopened else "fresh"}
    chosen = reopened if use_reopened else fresh
    chosen.opened = opened
    chosen.forwards = fresh.forwards + reopened.forwards
    return chosen


def token_dependency_map(subject: Subject, implementation: str | None = None) -> DependencyMap:
    """D over the positions the subject predicts (the decoder's, for seq2seq, with the source held
    fixed), in eval mode. Computed once per run and attention implementation, shared by the checks.
    """

    def measure() -> DependencyMap:
        generator = torch.Generator().manual_seed(current().seed)
        base = random_tokens(subject, 1, subject.seq_len, generator)[0]
        if subject.kind == "seq2seq":
            source = random_tokens(subject, 1, subject.seq_len, generator)

            def forward(tgt):
                return call(subject, source.expand(tgt.shape[0], -1), tgt)
        else:

            def forward(ids):
                return call(subject, ids)

        with evaluation(subject.model):
            replacements = generator.get_state()
            fresh = dependency_map(forward, base, subject.vocab_size, subject.pad_id, generator)
            # A model that already mixes one whole triangle (the past, or the future as an inverted
            # mask does) has its paths open: only a model that mixes little either way is re-measured.
            if fresh.random_in_eval or max(fresh.past_share(), fresh.future_share()) >= MIXED_PAST_SHARE:
                return fresh
            jitter = torch.Generator().manual_seed(current().seed + 7)
            with opened_paths(subject.model, jitter) as perturbation:
                if perturbation is None:
                    return fresh
                generator.set_state(replacements)  # the same swapped tokens, so the maps compare
                reopened = dependency_map(forward, base, subject.vocab_size, subject.pad_id, generator)
            return _fuller(fresh, reopened, perturbation)

    key = ("dependency-map", id(subject.model), subject.kind, subject.seq_len, implementation)
    return memo(key, measure)
