"""What the invariance checks cost, measured side by side in one run.

    python bench/invariance_cost.py

Prints the whole battery (in-process, torch already imported) on the tiny fixture GPTs: the time of
the checks that existed before the invariance family, the invariance checks' own time in the same
run, the sum and the ratio (best of 5 each): the plain GPT (all three skip), the pad-aware GPT
(padding-equivalence runs on both sides), the packed GPT (packing-isolation) and the cached GPT
(cache-consistency). Each arrangement is one batched forward, not one per sequence; the naive
padding probe (every sequence alone, one forward each) is timed next to the batched one.
"""

import sys

import torch

from timing import ROOT, best_of

sys.path.insert(0, str(ROOT / "fixtures"))

INVARIANCE = ["padding-equivalence", "packing-isolation", "cache-consistency"]


def split_seconds(build):
    """(seconds of the other checks, seconds of the invariance checks) of one whole battery: timed
    in the same run, so a busy machine slows both alike."""
    from tfdoctor import run_checks

    report = run_checks(build())
    mine = sum(r.seconds for r in report.results if r.id in INVARIANCE)
    return sum(r.seconds for r in report.results) - mine, mine


def main():
    import gpt_correct
    import gpt_kv_cache
    import gpt_packed
    import gpt_pad_masked
    from tfdoctor.probes.invariance import alone, compare_padded, padded_call
    from tfdoctor.subject import resolve

    print(f"{'fixture':20s} {'without':>9s} {'invariance':>11s} {'with':>9s} {'ratio':>7s}   (best of 5)")
    for name, module in (("gpt_correct", gpt_correct), ("gpt_pad_masked", gpt_pad_masked), ("gpt_packed", gpt_packed),
                         ("gpt_kv_cache", gpt_kv_cache)):
        runs = [split_seconds(module.build) for _ in range(5)]
        before = min(other for other, _ in runs)
        added = min(mine for _, mine in runs)
        print(f"{name:20s} {before:8.2f}s {added:10.3f}s {before + added:8.2f}s {(before + added) / before:6.2f}x")

    torch.set_num_threads(1)
    subject = resolve(gpt_pad_masked.build())
    subject.model.eval()
    with torch.no_grad():
        def batched():
            probe = alone(subject, torch.Generator().manual_seed(0))
            for side in ("right", "left"):
                compare_padded(subject, probe, side)

        def naive():  # every sequence alone, then alone padded, one forward each
            probe = alone(subject, torch.Generator().manual_seed(0))
            for L in probe.lengths:
                row = probe.sequences[:1, :L]
                padded_call(subject, row, torch.ones_like(row, dtype=torch.bool))
            for side in ("right", "left"):
                compare_padded(subject, probe, side)

        batched_s, naive_s = best_of(batched), best_of(naive)
    print(f"padding probe, batched reference      {batched_s * 1000:8.2f} ms")
    print(f"padding probe, one forward per row    {naive_s * 1000:8.2f} ms   "
          f"batched / naive {batched_s / naive_s:5.2f}")


if __name__ == "__main__":
    main()
