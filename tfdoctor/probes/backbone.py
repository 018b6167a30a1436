"""A pooled classifier's per-position states: the view the mask checks read (future-leak,
mask-direction, bidirectional-encoder), since its class scores [B, C] have no position to read a
mask from. The backbone's states [B, T, H] do: position i of a causal backbone must not move with
a later token, whatever the head pools afterwards.

Where the states come from: `Subject.states(model, ids)` when given; a Hugging Face model's last
hidden state (output_hidden_states=True, called as tfdoctor calls it, with the attention mask from
the pad id); else there are none, and the check says how to give them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tfdoctor.subject import Subject, is_hugging_face

NO_STATES = ("{name} is a pooled classifier ({shape}): no output per position to read a mask from, and "
             "no per-position states are exposed (give Subject(states=lambda model, ids: the backbone's "
             "[B, T, H] states) to judge its backbone)")
SEQ2SEQ_STATES = "a seq2seq classifier: its decoder's states are not read (the mask checks judge LM outputs)"


def _hugging_face_states(pad_id: Optional[int]):
    def states(model, input_ids):  # a multiple-choice head's ids come as [B, 1, T] (subject.call): mask alike
        mask = None if pad_id is None else (input_ids != pad_id).long()
        output = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
        return output.hidden_states[-1]  # (B, T, H)

    return states


UNALIGNED_STATES = ("{name}'s last hidden state has {length} positions for {seq_len} input tokens (a backbone that "
                    "pools its sequence or decodes latents): no state per input position to read a mask from")


def _states_length(view: Subject):
    """The number of positions of the view's states for one row of seq_len random ids (once per run)."""
    import torch

    from tfdoctor.context import memo
    from tfdoctor.modes import evaluation
    from tfdoctor.subject import call, random_tokens

    def measure():
        ids = random_tokens(view, 1, view.seq_len, torch.Generator().manual_seed(0))
        with torch.no_grad(), evaluation(view.model):
            states = call(view, ids)
        return int(states.shape[1]) if states.dim() == 3 else None

    return memo(("backbone-states-length", id(view.model)), measure)


def backbone_view(subject: Subject) -> tuple[Optional[Subject], str]:
    """(the subject called for its backbone's states [B, T, H], how) or (None, why there are none)."""
    from tfdoctor.tasks import SHAPES

    if subject.kind == "seq2seq":
        return None, SEQ2SEQ_STATES
    if subject.states is not None:
        return dataclasses.replace(subject, forward=subject.states, batch_first=True), "Subject.states"
    if subject.forward is None and is_hugging_face(subject.model):
        view = dataclasses.replace(subject, forward=_hugging_face_states(subject.pad_id))
        length = _states_length(view)
        if length != subject.seq_len:  # Funnel pools its sequence, Perceiver's latents are its own
            return None, UNALIGNED_STATES.format(name=type(subject.model).__name__, length=length,
                                                 seq_len=subject.seq_len)
        return view, "the last hidden state (output_hidden_states=True)"
    return None, NO_STATES.format(name=type(subject.model).__name__, shape=SHAPES[subject.task])
