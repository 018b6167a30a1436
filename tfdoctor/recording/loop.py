"""The `check --train` driver of the recorder: run the user's `train(model, batches)` once on a copy
of the model and return the `Trace` of what it did (`record_loop`); `run_loop` runs it unrecorded
(bench/trainloop_speed.py measures the recorder's cost against it).

The loop trains a copy (probes/isolation.py `isolated_copy`); the user's own model is snapshot before
and compared after, and anything the copy still shared with it is put back (`guarded`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch

from tfdoctor.probes.isolation import guarded, isolated_copy, same_values
from tfdoctor.probes.memorise import detached_attributes
from tfdoctor.recording.feed import Feed
from tfdoctor.recording.recorder import Recorder, finish
from tfdoctor.recording.trace import Trace
from tfdoctor.subject import Subject
from tfdoctor.usercode.auditing import audited_by


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
