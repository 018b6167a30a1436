"""What the invariance checks cost, measured side by side in one run.

    python bench/invariance_cost.py

Prints the whole battery (in-process, best of 3, torch already imported) on the tiny fixture GPTs
without the invariance family (as before it existed) and with it, and the ratio: the pad-aware GPT
(padding-equivalence runs on both sides), the packed GPT (packing-isolation) and the cached GPT
(cache-consistency). Each arrangement is one batched forward, not one per sequence; the naive
padding probe (every sequence alone, one forward each) is timed next to the batched one.
"""

import sys

import torch

from timing import ROOT, best_of

sys.path.insert(0, str(ROOT / "fixtures"))

INVARIANCE = ["padding-equivalence", "packing-isolation", "cache-consistency"]


def battery(build, skip):
    from tfdoctor import run_checks

    return run_checks(build(), skip=skip)


def main():
    import gpt_correct
    import gpt_kv_cache
    import gpt_packed
    import gpt_pad_masked

    from tfdoctor.probes.invariance import alone, compare_padded, padded_call
    from tfdoctor.subject import resolve

    print(f"{'fixture':28s} {'without':>9s} {'with':>9s} {'ratio':>7s}")
    for name, module in (("gpt_correct", gpt_correct), ("gpt_pad_masked", gpt_pad_masked), ("gpt_packed", gpt_packed),
                         ("gpt_kv_cache", gpt_kv_cache)):
        before = best_of(lambda: battery(module.build, INVARIANCE), repeats=3)
        after = best_of(lambda: battery(module.build, None), repeats=3)
        print(f"{name:28s} {before:8.2f}s {after:8.2f}s {after / before:6.2f}x")

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
    print(f"padding probe, one forward per row    {naive_s * 1000:8.2f} ms   batched / naive {batched_s / naive_s:5.2f}")


if __name__ == "__main__":
    main()
