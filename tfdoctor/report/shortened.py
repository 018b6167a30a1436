"""A finding's message cut to fit one line of the live view, keeping what happened, where, and why.

A judge's message reads "what happened, where (the numbers compared); what moved with it; what it
cost": its leading clause up to the first "; ", then more clauses. Cut from the end, a loss spike's
line lost its cause ("loss spiked at step 151 (batch 152): 3.134 against a band of 1.875 ± 0.062
over the pre…", the rate that jumped 42x never reached the screen). So a judge that knows the cause
names it, short, in its details ("cause": "the rate jumped 42x just before"), and a line is cut by
these steps, the first that fits winning:

1. the whole message;
2. the leading clause without its parenthesised asides, then the cause; else as many of the leading
   clause's comma-separated parts as fit, then the cause;
3. the leading clause's head (up to its first ": ", where the numbers begin), then the cause;
4. that head cut with "…", the cause kept whole;
5. the cause cut with "…" (a line narrower than the cause).

No Rich, no torch: text in, text out.
"""

from __future__ import annotations

import re

ELLIPSIS = "…"
SEPARATOR = "; "
# Step 4 keeps at least this many characters of the head ("loss spiked at s…"): fewer would say nothing
# of what happened, and the cause is cut instead.
MIN_HEAD = 12
_ASIDE = re.compile(r"\s*\([^()]*\)")


def shortened(message: str, width: int, cause: str = "") -> str:
    """`message` in at most `width` characters, its leading clause and `cause` kept as long as they fit
    (see the module's steps)."""
    message, cause = " ".join(message.split()), " ".join((cause or "").split())
    if len(message) <= width:
        return message
    lead = without_asides(message.split(SEPARATOR, 1)[0])
    tail = SEPARATOR + cause if cause else ""
    pieces = lead.split(", ")
    for kept in range(len(pieces), 0, -1):
        candidate = ", ".join(pieces[:kept]) + tail
        if len(candidate) <= width:
            return candidate
    candidate = lead.split(": ", 1)[0] + tail
    if len(candidate) <= width:
        return candidate
    head = lead.split(": ", 1)[0]
    room = width - len(tail) - len(ELLIPSIS)
    if room >= MIN_HEAD:
        return head[:room].rstrip() + ELLIPSIS + tail
    return cut(head + tail, width)


def without_asides(text: str) -> str:
    """"3.134 against a band (peak 3.3 at step 154), back" -> "3.134 against a band, back"."""
    return _ASIDE.sub("", text).strip()


def cut(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    return text[:max(0, width - len(ELLIPSIS))].rstrip() + ELLIPSIS if width > 0 else ""
