"""Traced `tfdoctor memory`: each remedy derived from the one trace vs the same remedy traced again,
and the time of the whole command vs one trace, side by side in one run.

For every configuration (the shipped tiny GPT fixtures, a small Hugging Face GPT-2, and GPT-2
medium built on fake tensors), in a fresh process: the step is traced once, judged against a budget
it does not fit (so that every remedy is proposed), and each derived figure is then re-traced:
bf16 autocast, checkpointing of every block, the micro-batch, the shorter length, and the largest
batch and length that fit (traced at the value and one past it: the first must fit, the second not).
Time: judge_traced (one trace plus the derivations) vs trace_step alone, warm, in the same process;
and the whole `tfdoctor memory TARGET` command vs a command that loads the model and traces once.

    python bench/memory_remedies.py           # a few minutes on 2 cores
    python bench/memory_remedies.py --quick   # the fixtures only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from timing import wall  # noqa: E402

# A budget this fraction of the step's peak: out of memory, so that every remedy is proposed.
BUDGET_FRACTION = 0.55

CONFIGS = [  # (target, batch, seq)
    ("fixtures/gpt_correct.py:build", 8, 64),
    ("fixtures/gpt_sdpa.py:build", 8, 64),
    ("fixtures/gpt_correct.py:build", 1, 48),
    ("bench/memory_remedies.py:hf_gpt2", 4, 256),
    ("bench/memory_remedies.py:gpt2_medium", 8, 1024),
    ("bench/memory_remedies.py:gpt2_medium_sdpa", 4, 1024),
]
QUICK = 3  # the first configurations: the fixtures


def hf_gpt2():
    """A small Hugging Face GPT-2 (sdpa attention with dropout, as GPT2LMHeadModel ships)."""
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=1000, n_positions=256, n_embd=128,
                                                                n_layer=4, n_head=4))


def _fake_gpt(attention: str):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfdoctor.memory.gpt import GPT

    with FakeTensorMode(allow_non_fake_inputs=True):  # 355M parameters, no memory
        return GPT(vocab=50257, d_model=1024, n_head=16, n_layer=24, positions=1024, attention=attention)


def gpt2_medium():
    """GPT-2 medium's shape (24 layers, d_model 1024, 16 heads, T = 1024 = d_model), naive attention."""
    return _fake_gpt("naive")


def gpt2_medium_sdpa():
    return _fake_gpt("sdpa")


WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
import torch
from tfdoctor.loader import load_subject
from tfdoctor.runner import as_subject
from tfdoctor.memory.blocks import checkpointed_blocks
from tfdoctor.memory.fake_step import fake_step as trace_step
from tfdoctor.memory.traced_judge import judge_traced
target, B, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(2)
subject = as_subject(load_subject(target))
if subject.vocab_size is None:
    from tfdoctor.subject import vocab_size_of
    import dataclasses
    subject = dataclasses.replace(subject, vocab_size=vocab_size_of(subject.model))
trace_step(subject, B, T)  # warm-up: the first trace of a process pays one-time costs
start = time.perf_counter(); main = trace_step(subject, B, T); one = time.perf_counter() - start
budget = int(main.peak_bytes * float(sys.argv[5]))
start = time.perf_counter(); verdict = judge_traced(subject, target, B, T, budget, "bench")
judged = time.perf_counter() - start
peak = lambda b, t, **kw: trace_step(subject, b, t, **kw).peak_bytes
rows = []
for r in verdict.remedies:
    if r.name == "mixed precision":
        rows.append([r.name, r.peak_bytes, peak(B, T, autocast_dtype=torch.bfloat16)])
    elif r.name == "activation checkpointing" and "gradient_checkpointing_enable" in r.change:
        # Hugging Face's own switch (it also stops the KV cache, which a bare wrapper would refill
        # on recomputation)
        subject.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        rows.append([r.name + " (HF)", r.peak_bytes, peak(B, T)])
        subject.model.gradient_checkpointing_disable()
    elif r.name == "activation checkpointing":
        with checkpointed_blocks(subject.model):
            rows.append([r.name, r.peak_bytes, peak(B, T)])
    elif r.name == "gradient accumulation":
        micro = int(r.change.split()[1])
        rows.append([f"micro-batch {micro}", r.peak_bytes, peak(micro, T)])
    elif r.name == "shorter sequences":
        t = int(r.change.split()[1].rstrip(","))
        rows.append([f"--seq {t}" + (" (traced)" if "traced" in r.change else ""), r.peak_bytes, peak(B, t)])
d = main.derivation
limits = []
for name, value, at in (("largest batch", verdict.largest_batch, lambda v: (v, T)),
                        ("largest seq", verdict.largest_seq, lambda v: (B, v))):
    if not value:
        continue
    b, t = at(value)
    b1, t1 = at(value + 1)
    from tfdoctor.subject import max_positions_of
    over = None if name == "largest seq" and value + 1 > (max_positions_of(subject.model) or 1 << 30) else peak(b1, t1)
    limits.append([name, value, d.peak_at(b, t), peak(b, t), over])
print(json.dumps({"one": one, "judged": judged, "peak": main.peak_bytes, "budget": budget, "ops": main.ops,
                  "rows": rows, "limits": limits, "ambiguous": d.seq_ambiguous}))
"""

ONE_TRACE = r"""
import sys
sys.path.insert(0, sys.argv[4])
from tfdoctor.loader import load_subject
from tfdoctor.runner import as_subject
from tfdoctor.memory.fake_step import fake_step as trace_step
from tfdoctor.subject import vocab_size_of
import dataclasses
subject = as_subject(load_subject(sys.argv[1]))
subject = dataclasses.replace(subject, vocab_size=subject.vocab_size or vocab_size_of(subject.model))
trace_step(subject, int(sys.argv[2]), int(sys.argv[3]))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    worst = 0.0
    ratios = []
    for target, B, T in CONFIGS[:QUICK] if args.quick else CONFIGS:
        done = subprocess.run([sys.executable, "-c", WORKER, target, str(B), str(T), str(ROOT / "bench"),
                               str(BUDGET_FRACTION)], cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            print(f"{target} B={B} T={T} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        tfdoctor = str(Path(sys.executable).with_name("tfdoctor"))
        budget = f"{r['budget']}B"
        command = wall([tfdoctor, "memory", target, "--batch", str(B), "--seq", str(T), "--budget", budget], repeats=1)
        once = wall([sys.executable, "-c", ONE_TRACE, target, str(B), str(T), str(ROOT / "bench")], repeats=1)
        ratios.append(r["judged"] / r["one"])
        print(f"\n{target}  batch {B} x seq {T}: peak {r['peak']:,} B, budget {r['budget']:,} B, {r['ops']:,} ops"
              + (f"; {r['ambiguous']}" if r["ambiguous"] else ""))
        print(f"  time: judge_traced {r['judged']:.2f} s vs one trace {r['one']:.2f} s "
              f"= {r['judged'] / r['one']:.2f}x; "
              f"whole command {command:.1f} s vs load + one trace {once:.1f} s = {command / once:.2f}x")
        print(f"  {'remedy':<28} {'derived':>15} {'re-traced':>15} {'error':>8}")
        for name, derived, traced in r["rows"]:
            error = (derived - traced) / traced
            worst = max(worst, abs(error))
            print(f"  {name:<28} {derived:>15,} {traced:>15,} {error:>+8.2%}")
        for name, value, derived, traced, over in r["limits"]:
            error = (derived - traced) / traced
            worst = max(worst, abs(error))
            verdict = "fits" if traced <= r["budget"] else "DOES NOT FIT"
            beyond = ("" if over is None else
                      f"; {value + 1} traced: {'fits (too low)' if over <= r['budget'] else 'does not fit'}")
            print(f"  {name + ' ' + str(value):<28} {derived:>15,} {traced:>15,} {error:>+8.2%}  "
                  f"traced {verdict}{beyond}")
    if ratios:
        print(f"\nworst |error| of a derived peak: {worst:.2%}; judge_traced / one trace: "
              f"{min(ratios):.2f}x to {max(ratios):.2f}x (goal 1.5x)")


if __name__ == "__main__":
    main()
