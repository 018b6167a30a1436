"""What eos-trained and packing-labels (issue 20) add to a run, measured in one process.

    python bench/boundaries_cost.py [ROUNDS]

Both are judges of the recorded loop: without `--train` they skip at once, and with it the loop is
recorded once for every loop check (the first check that asks pays for it, here `objective`). Prints,
per case, the median over ROUNDS runs (default 3) of the whole battery's wall time and of each
judge's own seconds (Result.seconds), on the fixture GPT (its correct loop, --eos-id 5) and on the
tiny Hugging Face GPT-2 trained on packed rows (fixtures/loops/hf_packed_labels_cross.py).
"""

import statistics
import sys
import time

import torch

from timing import ROOT

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "fixtures"), str(ROOT / "fixtures" / "loops"), str(ROOT)]

JUDGES = ("eos-trained", "packing-labels")
CASES = {
    "gpt_correct, no loop": dict(fixture="gpt_correct"),
    "gpt_correct + loops/correct.py, --eos-id 5": dict(fixture="gpt_correct", loop="correct", pad_id=0, eos_id=5),
    "hf_gpt2 + loops/hf_packed_labels_cross.py": dict(fixture="hf_gpt2", loop="hf_packed_labels_cross", pad_id=0),
}


def one(fixture, loop=None, **fields):
    from helpers import build_fixture, train_fn
    from tfdoctor import run_checks

    torch.manual_seed(0)
    if loop is not None:
        fields["train"] = train_fn(loop)
    start = time.perf_counter()
    report = run_checks(build_fixture(fixture), **fields)
    return time.perf_counter() - start, {r.id: r.seconds for r in report.results}


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for name, case in CASES.items():
        runs = [one(**case) for _ in range(rounds)]
        battery = statistics.median(w for w, _ in runs)
        judged = {j: statistics.median(s[j] for _, s in runs) for j in JUDGES}
        share = sum(judged.values()) / battery
        print(f"{name}: battery {battery:.2f}s; " + ", ".join(f"{j} {s * 1000:.0f} ms" for j, s in judged.items())
              + f" ({share:.1%} of the battery)")


if __name__ == "__main__":
    main()
