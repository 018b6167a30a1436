"""Accuracy of `tfdoctor memory`: real peak vs traced vs analytic, each configuration in a fresh process.

Ground truth is the peak of live tensor bytes in one real steady-state training step on the CPU (the
same op-by-op counter as the traced mode, on real tensors). Goals (issue 4): traced within 2% of the
real peak, analytic within 10%.

    python bench/memory_accuracy.py            # reduced grid (a few minutes on 2 cores)
    python bench/memory_accuracy.py --full     # the issue's whole grid
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys

WORKER = r"""
import json, sys, torch
from tfdoctor.memory.analytic import Config, estimate
from tfdoctor.memory.gpt import GPT
from tfdoctor.memory.traced import trace_step
from tfdoctor.subject import Subject
B, T, C, L, V, att = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(2)
model = GPT(vocab=V, d_model=C, n_head=C // 64, n_layer=L, positions=T, attention=att)
subject = Subject(model, vocab_size=V)
traced = trace_step(subject, B, T)
real = trace_step(subject, B, T, fake=False)
analytic = estimate(Config(B, T, C, C // 64, L, V, attention=att)).peak_bytes
print(json.dumps({"real": real.peak_bytes, "traced": traced.peak_bytes, "analytic": analytic,
                  "where": f"{real.peak_phase}:{real.peak_op}", "trace_s": traced.seconds}))
"""


def grid(full: bool):
    if full:
        return itertools.product((1, 4), (128, 512, 2048), (128, 256), (2, 4), (1000, 8000), ("naive", "sdpa"))
    return [(1, 128, 128, 2, 1000, "naive"), (4, 512, 256, 2, 8000, "naive"), (2, 1024, 128, 4, 1000, "naive"),
            (1, 2048, 256, 2, 8000, "naive"), (4, 512, 256, 4, 1000, "sdpa"), (1, 2048, 128, 2, 8000, "sdpa"),
            (4, 2048, 256, 4, 8000, "sdpa"), (2, 128, 128, 4, 8000, "sdpa")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--full", action="store_true")
    args = parser.parse_args()
    print(f"{'B':>2} {'T':>5} {'C':>4} {'L':>2} {'V':>5} {'attn':>5} | {'real peak':>14} {'traced':>14} "
          f"{'err':>7} {'analytic':>14} {'err':>7} | peak at")
    worst_traced = worst_analytic = 0.0
    for config in grid(args.full):
        done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(config)], capture_output=True, text=True)
        if done.returncode:
            print(config, "failed:", done.stderr.strip().splitlines()[-1])
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        e_t = (r["traced"] - r["real"]) / r["real"]
        e_a = (r["analytic"] - r["real"]) / r["real"]
        worst_traced, worst_analytic = max(worst_traced, abs(e_t)), max(worst_analytic, abs(e_a))
        B, T, C, L, V, att = config
        print(f"{B:>2} {T:>5} {C:>4} {L:>2} {V:>5} {att:>5} | {r['real']:>14,} {r['traced']:>14,} {e_t:>+7.2%} "
              f"{r['analytic']:>14,} {e_a:>+7.2%} | {r['where']}", flush=True)
    print(f"worst |error|: traced {worst_traced:.2%} (goal 2%), analytic {worst_analytic:.2%} (goal 10%)")


if __name__ == "__main__":
    main()
