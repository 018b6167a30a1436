"""Whether a model can take sequences of the length a flag asks for, settled before anything runs.

`check --train-seq T` traces a training step at T tokens (the memory check) and `memory --seq T`
does nothing else: a T the model cannot take is the user's input, not a crash of a check. Two ways
to know: the model says its limit (config.max_position_embeddings, block_size, n_positions, a
learned position table: subject.max_positions_of), or one forward of a row of T tokens raises where
a short row does not (an `assert T <= block_size`, a causal-mask buffer sliced to T, a rotary table
of fixed length). That forward runs on fake tensors (shapes without values): nothing is allocated,
so asking costs no memory even for a T that would not fit.
"""

from __future__ import annotations

import textwrap
from typing import Optional

from tfdoctor.errors import UsageError

# The short row the long one is compared with: a length every model takes (the probes' own default).
SHORT_SEQ = 16


def refuse_unfit_seq(subject, seq: int, flag: str) -> None:
    """Raise UsageError naming `flag` when the model cannot take `seq` tokens; else return."""
    from tfdoctor.subject import max_positions_of

    positions = max_positions_of(subject.model)
    if positions and seq > positions:
        raise UsageError(f"{flag} {seq} is longer than the model's {positions} positions",
                         f"pass {flag} {positions} or less, or build the model with more positions")
    short = min(SHORT_SEQ, seq - 1)
    if short < 1:
        return
    raised = _forward_error(subject, seq)
    # A model that raises at any length (an unusual call, a value read on fake tensors) has no length
    # problem that tfdoctor can name: its checks say what is wrong.
    if raised is None or _forward_error(subject, short) is not None:
        return
    takes = _longest_taken(subject, short, seq)
    said = textwrap.shorten(str(raised), 120, placeholder="...")
    raise UsageError(f"{flag} {seq} is longer than the model takes: it raised {type(raised).__name__} on "
                     f"{seq} tokens and runs on {takes} ({said})",
                     f"pass {flag} {takes} or less, or build the model for longer sequences")


def _longest_taken(subject, good: int, bad: int) -> int:
    """The longest length in [good, bad) the model runs on, by bisection (a limit is a threshold)."""
    while bad - good > 1:
        middle = (good + bad) // 2
        if _forward_error(subject, middle) is None:
            good = middle
        else:
            bad = middle
    return good


def _forward_error(subject, seq: int) -> Optional[Exception]:
    """The exception one eval forward of a row of `seq` tokens raises on fake tensors, or None."""
    import torch

    from tfdoctor.memory.blocks import swapped_tensors
    from tfdoctor.modes import evaluation
    from tfdoctor.subject import call, device_of, vocab_size_of
    from tfdoctor.usercode.torch_compat import fake_tensor_errors_quiet, fake_tensor_mode

    model = subject.model
    vocab = subject.vocab_size or vocab_size_of(model)
    if not isinstance(model, torch.nn.Module) or not vocab:
        return None
    fake_mode = fake_tensor_mode(allow_non_fake_inputs=True)
    device = device_of(model)
    # The fake-tensor dispatcher logs every op that fails, traceback and all: here a failure is the
    # answer asked for, so that logger is quiet while the forward runs.
    try:
        with fake_tensor_errors_quiet(), swapped_tensors(model, fake_mode.from_tensor), evaluation(model), \
                torch.no_grad(), fake_mode:
            ids = torch.randint(0, vocab, (1, seq), device=device)
            call(subject, *([ids] * (2 if subject.kind == "seq2seq" else 1)))
    except Exception as exc:  # noqa: BLE001 - the model's own error is the answer
        return exc
    return None
