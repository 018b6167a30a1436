"""What watching a run costs per optimizer step: each script run bare and watched, in fresh processes,
alternating, ROUNDS rounds, and the median step time of each compared side by side.

    python bench/watch_overhead.py [ROUNDS] [--nanogpt PATH]

Scripts: the shipped nanoGPT-style fixture (fixtures/scripts/nanogpt_train.py), the watch fixture
healthy.py, and with --nanogpt PATH Karpathy's public nanoGPT train.py, unmodified, from a checkout at
PATH (run on a synthetic character corpus written into a temporary copy: no download).

Modes: bare (python SCRIPT), monitor (the hooks of `tfdoctor watch --format json`), live (the hooks
plus what the live view adds in the worker: rows sent a few times a second, the judges every 3 s).
Two processes of the same script differ by several percent on a shared machine, more than the
monitor costs, so the monitor run also sums the time spent inside the monitor's own methods (the
hooks' Python wrappers around them are not counted: about a microsecond per call).
In every mode the same optimizer step post-hook timestamps the steps; a step's time is the time
between two ends of steps, so whatever the monitor does at a step's end is counted in the next one.
The first WARMUP steps are left out (allocator and thread-pool warm-up).
"""

from __future__ import annotations

import json
import os
import pickle
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 10


def child(mode: str, script: str, args: list[str]) -> None:
    """One run in this process: print the step times as JSON on the last line of stdout."""
    import contextlib

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.set_num_threads(1)  # both modes alike; a busy 2-core machine is less noisy on one thread
    ends: list[float] = []
    register_optimizer_step_post_hook(lambda *a: ends.append(time.perf_counter()))
    stack = contextlib.ExitStack()
    own = [0.0]
    if mode == "monitor":
        _time_monitor_methods(own)
    if mode != "bare":
        from tfdoctor.watching.hooks import watching
        from tfdoctor.watching.monitor import Monitor

        feed = None
        if mode == "live":
            from tfdoctor.process.live import LiveFeed
            from tfdoctor.watching.judging import judge_run

            sink = open(os.devnull, "w")
            feed = LiveFeed(lambda event, **data: sink.write(json.dumps({"event": str(event), **data}) + "\n"),
                            judge=judge_run)
        monitor = Monitor(on_row=feed.row if feed else None)
        if feed:
            feed.bind(monitor)
        stack.enter_context(watching(monitor))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    with contextlib.redirect_stdout(sys.stderr), stack:
        runpy.run_path(script, run_name="__main__")
    deltas = [b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1:])]
    print(json.dumps({"steps": len(ends), "median": statistics.median(deltas), "mean": statistics.fmean(deltas),
                      "own": own[0] / max(1, len(ends)), "wall": ends[-1] - ends[0]}))


def _time_monitor_methods(own: list) -> None:
    """The time spent inside the monitor's own methods, summed: what the hooks cost a step, measured in
    the run itself, free of the noise between two processes."""
    import functools

    from tfdoctor.watching.monitor import Monitor

    for name in ("loss_called", "backward_called", "forward_called", "batch_waited", "clip_returned",
                 "scale_called", "step_begins", "step_ended", "scale_updated", "scheduler_stepped"):
        method = getattr(Monitor, name)

        def timed(*args, _method=method, **kwargs):
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                own[0] += time.perf_counter() - started

        setattr(Monitor, name, functools.wraps(method)(timed))


def measure(mode: str, script: str, args: list[str], cwd: str) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, script, *args], cwd=cwd,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if done.returncode != 0:
        raise SystemExit(f"{mode} {script} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def nanogpt_copy(path: str) -> str:
    """A temporary copy of a nanoGPT checkout with a synthetic shakespeare_char corpus (65 symbols
    from a fixed Markov chain: learnable, so the loss falls as on the real text)."""
    import numpy as np

    folder = tempfile.mkdtemp(prefix="nanogpt-")
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(os.path.join(path, name), folder)
    shutil.copytree(os.path.join(path, "config"), os.path.join(folder, "config"))
    data = os.path.join(folder, "data", "shakespeare_char")
    os.makedirs(data)
    rng = np.random.default_rng(0)
    successors = rng.integers(0, 65, size=(65, 3))
    for split, n in (("train", 400_000), ("val", 40_000)):
        tokens = np.empty(n, dtype=np.uint16)
        tokens[0] = 0
        picks, noise, anything = rng.integers(0, 3, n), rng.random(n) < 0.1, rng.integers(0, 65, n)
        for i in range(1, n):
            tokens[i] = anything[i] if noise[i] else successors[tokens[i - 1], picks[i]]
        tokens.tofile(os.path.join(data, f"{split}.bin"))
    with open(os.path.join(data, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": 65}, f)
    return folder


NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--dtype=float32",
                "--n_layer=2", "--n_head=4", "--n_embd=128", "--block_size=64", "--batch_size=12",
                "--max_iters=200", "--lr_decay_iters=200", "--warmup_iters=20", "--eval_interval=100",
                "--eval_iters=10", "--log_interval=50", "--always_save_checkpoint=False", "--dropout=0.0"]


def main(argv: list[str]) -> None:
    rounds = int(argv[0]) if argv and argv[0].isdigit() else 3
    runs = [("nanogpt_train (shipped)", "fixtures/scripts/nanogpt_train.py", [], ROOT),
            ("watch/healthy (shipped)", "fixtures/watch/healthy.py", ["--steps", "300"], ROOT)]
    if "--nanogpt" in argv:
        copy = nanogpt_copy(argv[argv.index("--nanogpt") + 1])
        runs.append(("nanoGPT train.py (public)", "train.py", NANOGPT_ARGS, copy))
    print(f"{'script':28} {'mode':8} {'steps':>6} {'median step':>12} {'ratio':>7}   (median of {rounds} rounds)")
    for label, script, args, cwd in runs:
        times = {mode: [] for mode in ("bare", "monitor", "live")}
        steps, own = {}, []
        for _ in range(rounds):
            for mode in times:  # alternating: a slow spell of the machine hits every mode alike
                result = measure(mode, script, args, cwd)
                times[mode].append(result["median"])
                steps[mode] = result["steps"]
                if mode == "monitor":
                    own.append(result["own"] / result["median"])
        bare = statistics.median(times["bare"])
        for mode, values in times.items():
            value = statistics.median(values)
            print(f"{label:28} {mode:8} {steps[mode]:>6} {value * 1e3:>10.2f}ms {value / bare:>7.3f}")
        print(f"{label:28} the monitor's own methods: {100 * statistics.median(own):.2f}% of the median step "
              f"(min {100 * min(own):.2f}%, max {100 * max(own):.2f}%)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main(sys.argv[1:])
