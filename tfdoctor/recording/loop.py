"""The `check --train` driver of the recorder: the batches it feeds the user's `train(model, batches)`
and the run itself.

- `train_batches`: random token batches, padded the way the subject declares, every other one shorter;
- `Feed`: those batches as a list that can stop handing them out (`FeedStopped`), the one list every
  loop driver hands the user's loop: the recorded run here and the overfit probe (overfit.py);
- `record_loop`: run the user's `train(model, batches)` once on a copy of the model and return the
  `Trace` of what it did; `run_loop` runs it unrecorded (bench/trainloop_speed.py measures the
  recorder's cost against it).

The loop trains a copy (probes/isolation.py `isolated_copy`); the user's own model is snapshot before
and compared after, and anything the copy still shared with it is put back (`guarded`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional

import torch

from tfdoctor.probes.isolation import guarded, isolated_copy, same_values
from tfdoctor.probes.memorise import detached_attributes
from tfdoctor.recording.recorder import Recorder, finish
from tfdoctor.recording.trace import Trace
from tfdoctor.subject import Subject, random_tokens
from tfdoctor.usercode.auditing import audited_by

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


class FeedStopped(BaseException):
    """Raised out of the loop's iteration over a Feed once it is told to stop: a BaseException, so the
    user's `except Exception` lets it through."""


class Feed(list):
    """The batches as a list (len() works, epochs re-iterate). `before(index, handed)` runs before each
    batch is handed out, with its index in this pass and the count handed out in all passes; it stops
    the feed for good by returning False (FeedStopped is raised), and any other answer goes on."""

    def __init__(self, batches, before: Callable[[int, int], Optional[bool]]):
        super().__init__(batches)
        self.before = before
        self.handed = 0
        self.stopped = False

    def __iter__(self):
        for index, batch in enumerate(list.__iter__(self)):
            if self.stopped or self.before(index, self.handed) is False:
                self.stopped = True
                raise FeedStopped
            self.handed += 1
            yield batch

    def drive(self, train: Callable, model) -> None:
        """train(model, self), until it returns or the feed stops it."""
        try:
            train(model, self)
        except FeedStopped:
            pass


def record_loop(subject: Subject, batches: list, advance: Callable[[int], None] = lambda n=1: None) -> Trace:
    """Run the user's loop once on a copy of the model and return what it did.

    The user's exception, if the loop raises, propagates after every patch and hook is removed and
    the user's model is put back as it was."""
    with detached_attributes(subject.model):  # a map kept from a forward (`self.attn`): deepcopy refuses it
        model, rebuilt = isolated_copy(subject.model)
    for p in model.parameters():
        p.grad = None
    # the scores the loss grades: over the vocabulary, or over a token classifier's C labels
    scored = subject.num_labels if subject.task == "token-classification" else subject.vocab_size
    recorder = Recorder(model, scored)
    recorder.advance = advance
    feed = Feed(batches, lambda index, handed: recorder.on_batch(index))
    with guarded(subject.model) as restored:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with audited_by("tfdoctor check --train"), recorder.installed(subject.train), torch.enable_grad():
                subject.train(model, feed)
                recorder._manual_update()  # a manual update after the last backward
    trace = finish(recorder, caught)
    trace.isolation = {"rebound": rebuilt, "restored": restored}
    if not recorder.stepped:  # no step seen: whether anything unseen (torch.autograd.grad) trained it
        with torch.no_grad():
            trace.isolation["weights_changed"] = any(
                not same_values(a.detach(), b.detach()) for a, b in zip(model.parameters(), subject.model.parameters()))
    return trace


def run_loop(subject: Subject, model: torch.nn.Module, batches: list,
             advance: Callable[[int], None] = lambda n=1: None) -> list[str]:
    """Run the user's loop on `model` (a copy: see `isolated_copy`) without recording; its warnings
    are swallowed. Returns the names of the user's own tensors it still changed, which are put back."""
    with guarded(subject.model) if model is not subject.model else contextlib.nullcontext([]) as restored:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.enable_grad():
                subject.train(model, Feed(batches, lambda index, handed: advance(1)))
    return restored
