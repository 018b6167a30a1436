"""The arithmetic that turns one traced step into the peak at another batch size or sequence length.

A trace records, after each op, the live bytes split six ways (see fake_step.Derivation.points):
index 3*s + p holds the bytes that scale with the batch when s = 1 and with T**p. At a batch b and
a length t, the live bytes after that op would be

    sum over (s, p) of points[k][3*s + p] * (b / B)**s * (t / T)**p

and the step's peak is the largest of these over the ops: a maximum of functions that only grow,
so the largest b (or t) that fits is the smallest of the largest each op allows. Pure Python, exact
integer arithmetic where it decides a fit.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

Point = Sequence[int]


def peak_at(points: Sequence[Point], batch: int, seq: int, b: int, t: int) -> int:
    """The step's peak at batch b and length t, from a trace at [batch, seq]."""
    best = 0
    for g in points:
        value = (g[0] + g[1] * t / seq + g[2] * (t / seq) ** 2
                 + (g[3] + g[4] * t / seq + g[5] * (t / seq) ** 2) * b / batch)
        best = max(best, value)
    return round(best)


def largest_batch(points: Sequence[Point], batch: int, budget: int) -> Optional[int]:
    """The largest batch whose peak stays within `budget` at the traced length; 0 when not even 1 fits;
    None when no op holds a per-sample byte (the batch does not move the peak)."""
    largest: Optional[int] = None
    for g in points:
        shared, per_sample = g[0] + g[1] + g[2], g[3] + g[4] + g[5]
        if per_sample == 0:
            if shared > budget:
                return 0
            continue
        # shared + per_sample * b / batch <= budget, in integers
        allowed = max(0, (budget - shared) * batch // per_sample) if budget >= shared else 0
        largest = allowed if largest is None else min(largest, allowed)
        if largest == 0:
            return 0
    return largest


def largest_seq(points: Sequence[Point], batch: int, seq: int, budget: int,
                limit: Optional[int] = None) -> Optional[int]:
    """The largest length whose peak stays within `budget` at the traced batch, capped by `limit` (the
    model's positions); 0 when not even 1 fits; None when nothing grows with T and there is no limit."""
    largest: Optional[int] = limit
    for g in points:
        a, b, c = g[0] + g[3], g[1] + g[4], g[2] + g[5]  # bytes ~ T**0, T**1, T**2
        if a > budget:
            return 0
        if b == 0 and c == 0:
            continue
        # a + b * (t / seq) + c * (t / seq)**2 <= budget  <=>  a*seq^2 + b*t*seq + c*t^2 <= budget*seq^2
        if c:
            r = (-b + math.sqrt(b * b + 4 * c * (budget - a))) / (2 * c)
        else:
            r = (budget - a) / b
        t = int(r * seq)

        def fits(t: int) -> bool:
            return a * seq * seq + b * t * seq + c * t * t <= budget * seq * seq

        while t > 0 and not fits(t):  # float rounding: settle on the exact integer
            t -= 1
        while fits(t + 1):
            t += 1
        largest = t if largest is None else min(largest, t)
        if largest == 0:
            return 0
    return largest


# Without a positions limit, the fitted quadratic is searched this far before the length is called
# unbounded (None), never reported as a number.
QUADRATIC_SEARCH = 1 << 24


def largest_quadratic(peaks: dict[int, int], budget: int, limit: Optional[int]) -> Optional[int]:
    """Fit peak(T) = c0 + c1 T + c2 T^2 through traced points and solve peak(T) = budget (the fallback
    when the shapes cannot say what grows with T); None when it fits however long, with no limit."""
    points = sorted(peaks.items())
    if len(points) < 3:
        ts = [t for t, p in points if p <= budget]
        return max(ts) if ts else 0
    (t0, p0), (t1, p1), (t2, p2) = points[:3]
    # Newton's divided differences: exact for three points.
    d01 = (p1 - p0) / (t1 - t0)
    d12 = (p2 - p1) / (t2 - t1)
    c2 = (d12 - d01) / (t2 - t0)
    c1 = d01 - c2 * (t0 + t1)
    c0 = p0 - c1 * t0 - c2 * t0 * t0

    def value(t: int) -> float:
        return c0 + c1 * t + c2 * t * t

    cap = limit or QUADRATIC_SEARCH
    if value(1) > budget:
        return 0
    low, high = 1, 2
    while high <= cap and value(high) <= budget:
        low, high = high, high * 2
    if high > cap and limit is None:
        return None
    high = min(high, cap + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if value(mid) <= budget else (low, mid)
    return min(low, cap)
