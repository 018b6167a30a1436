"""One-line drawings of a series of numbers (a loss curve, gradient norms, learning rates): the
reporters draw the series checks keep in their details, and a message that quotes a curve draws it
the same way. No torch and no Rich here.
"""

from __future__ import annotations

import math

# The widest drawing, in characters: longer series are resampled.
SPARKLINE_POINTS = 60


def sparkline(values: list[float], points: int = SPARKLINE_POINTS) -> str:
    """A one-line drawing of a curve, resampled to at most `points` characters."""
    if not values:
        return ""
    bars = "▁▂▃▄▅▆▇█"
    stride = max(1, math.ceil(len(values) / points))
    sampled = [values[i] for i in range(0, len(values), stride)]
    finite = [v for v in sampled if math.isfinite(v)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
    span = (high - low) or 1.0
    return "".join(bars[min(7, int((v - low) / span * 7.999))] if math.isfinite(v) else "!" for v in sampled)
