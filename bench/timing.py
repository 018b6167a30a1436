"""Timing helpers shared by the bench scripts (not a test: speed lives here, measured side by side)."""

import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall(args, repeats=3) -> float:
    """Median wall time of a whole command, start-up included."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(args, cwd=ROOT, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def best_of(fn, repeats=20) -> float:
    """Fastest of several in-process runs: the least disturbed by a busy machine."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
