"""Which tfdoctor command is auditing this process, if one is: `tfdoctor run` and `check --train` (the
loop recorder, recording/) and `tfdoctor watch` (the monitor, watching/) say so for as long as the
user's code runs under them.

A TfdoctorCallback in a script one of them runs stands aside (integrations/common.py). Its monitor's
wrappers of `Tensor.backward` and `F.cross_entropy` hide those calls from the recorder, which knows
torch's own functions: `tfdoctor run` on a Trainer script carrying the callback recorded one optimizer
step of 40 (every later backward unseen), so it never stopped the script and failed
scheduler-placement ("ran 40 times for 1 optimizer steps"). Under `watch` the callback would record
every step a second time.

No torch here: a callback asks before it imports anything.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

_auditors: list[str] = []  # the commands auditing this process, innermost last


@contextlib.contextmanager
def audited_by(command: str) -> Iterator[None]:
    """`command` ("tfdoctor run", ...) audits the user's code run inside this block."""
    _auditors.append(command)
    try:
        yield
    finally:
        _auditors.pop()


def auditor() -> Optional[str]:
    """The command auditing this process now, or None (the user's own `python train.py`)."""
    return _auditors[-1] if _auditors else None
