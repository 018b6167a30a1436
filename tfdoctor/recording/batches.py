"""The random token batches fed to the user's training loop."""

from __future__ import annotations

import torch

from tfdoctor.subject import Subject, random_tokens

# Padded rows keep at least this share of real tokens, so every row has something to learn from.
MIN_REAL_SHARE = 0.5
# Every other batch is a short one: its padded rows keep SHORT_REAL_SHARE..MIN_REAL_SHARE of their
# tokens. Consecutive micro-batches then hold different numbers of real tokens (about 1.7x apart at
# B=4, T=32), as a real data loader's do, so that a loop that averages each micro-batch over its own
# tokens shows its bias (token-weighting); every loop check is fed the same batches.
SHORT_REAL_SHARE = 0.125


def _pad(subject: Subject, ids: torch.Tensor, generator: torch.Generator, short: bool = False) -> torch.Tensor:
    """Pad every row but the first after a random length of real tokens: at its end, or at its
    start when the subject declares padding_side="left" (the loop is fed the side it trains on).
    A short batch's rows keep less (see SHORT_REAL_SHARE). With an eos id, each row's last real
    token is that id, as a tokenized document ends (eos-trained judges whether the loop grades it)."""
    if subject.pad_id is None:
        return _ended(subject, ids, torch.full((ids.shape[0],), ids.shape[1]))
    B, T = ids.shape
    low = max(2, int(T * MIN_REAL_SHARE))
    high = T
    if short:
        low, high = max(2, int(T * SHORT_REAL_SHARE)), low
    lengths = torch.randint(low, max(low + 1, high), (B,), generator=generator)
    lengths[0] = T  # one full row, as a real batch padded to its longest sequence has
    ids = _ended(subject, ids, lengths)
    positions = torch.arange(T)[None, :]
    if subject.padding_side == "left":
        positions = positions.flip(1)  # count real tokens from the end of the row
    return ids.masked_fill((positions >= lengths[:, None]).to(ids.device), subject.pad_id)


def _ended(subject: Subject, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The rows with their last real token (of `lengths` real tokens; the row's last position under
    left padding) replaced by eos_id; unchanged when the subject has none, or when it pads on the
    right with its eos id (GPT-2's convention: a padded row's first pad is its end-of-text already).
    Draws no random number, so the batches are otherwise the ones fed without an eos id."""
    if subject.eos_id is None or (subject.eos_id == subject.pad_id and subject.padding_side != "left"):
        return ids
    T = ids.shape[1]
    last = torch.full_like(lengths, T - 1) if subject.padding_side == "left" else lengths.clamp(1, T) - 1
    ids = ids.clone()
    ids[torch.arange(ids.shape[0]), last.to(ids.device)] = subject.eos_id
    return ids


def train_batches(subject: Subject, count: int, generator: torch.Generator) -> list:
    """`count` batches of LongTensor ids [B, T] (seq2seq: (src, tgt) pairs), padded with pad_id when
    the subject has one: at the end of each row, or at its start for padding_side="left"; every
    other batch shorter (more padding) than the one before."""
    B, T = subject.batch_size, subject.seq_len
    batches = []
    for i in range(count):
        short = i % 2 == 1
        ids = _pad(subject, random_tokens(subject, B, T, generator), generator, short)
        if subject.kind == "seq2seq":
            src = _pad(subject, random_tokens(subject, B, T, generator), generator, short)
            batches.append((src, ids))
        else:
            batches.append(ids)
    return batches
