"""What `tfdoctor run` costs, measured side by side in one run.

    python bench/run_overhead.py

1. Recording overhead, in process: each fixture script's first K optimizer steps run bare (stopped by
   a plain optimizer post-hook, nothing recorded) and recorded (tfdoctor.recording.script, which
   `tfdoctor run` uses), from the script's start to the stop point (imports warmed up first; the
   fastest of a few runs each, alternated). plain_loop.py ends after 8 steps (one epoch), so it is
   measured to its end.
2. The whole command: `python -m tfdoctor run SCRIPT` (script, loop checks and model checks, torch
   import included) next to `python SCRIPT` run to its end, as a user would run it. Issue 11 asks for
   `tfdoctor run` on nanogpt_train.py next to `tfdoctor check` on the same model and loop: there is no
   such check target (nanogpt_model.py has no factory to build the model from, and the script's loop
   is module-level code, no `train(model, batches)` to pass as --train), so the script itself is the
   reference.

Measured on the shared 2-core dev machine, first 20 steps (fastest of 5), the recorder of commit
41399dc and the current one run side by side:
  before: plain_loop 0.025 s bare vs 0.071 s recorded (2.81x); nanogpt_train 0.059 s vs 0.175 s (2.97x)
  after:  plain_loop 0.025 s bare vs 0.048 s recorded (1.89x); nanogpt_train 0.059 s vs 0.114 s (1.92x)
  whole command: plain_loop `python SCRIPT` (its 8 steps) 2.29 s vs `tfdoctor run` 2.16 s;
  nanogpt_train (its 100 iterations) 2.48 s vs 2.21 s.
Where the recorded time went (cProfile, nanogpt_train): the TorchFunctionMode itself (~1.3x on its
own: an empty mode costs that much, every torch call passes through Python), reading the scores'
gradient (~60 small tensor calls per micro-batch, now once for all the micro-batches that fit in
READ_CHUNK_ELEMENTS), per-tensor isfinite scans in the gradient norms (now only when the norm is not
finite), relpath per recorded call site (now cached), and our own tensor calls from hooks and patched
calls passing through the mode (now run with it popped).
"""

import os
import runpy
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook

from timing import ROOT, wall

sys.path.insert(0, str(ROOT))
SCRIPTS = ["fixtures/scripts/plain_loop.py", "fixtures/scripts/nanogpt_train.py"]
STEPS = 20
REPEATS = 5


class _Stop(BaseException):
    pass


def bare(path: str, steps: int) -> float:
    """The script run as __main__ until its `steps`-th optimizer step, recording nothing."""
    done = [0]

    def count(optimizer, args, kwargs):
        done[0] += 1
        if done[0] >= steps:
            raise _Stop()

    handle = register_optimizer_step_post_hook(count)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv, sys.path[0:1] = [path], [os.path.dirname(os.path.abspath(path))]
    start = time.perf_counter()
    try:
        runpy.run_path(path, run_name="__main__")
    except _Stop:
        pass
    finally:
        seconds = time.perf_counter() - start
        handle.remove()
        sys.argv, sys.path[:] = saved_argv, saved_path
    return seconds


def recorded(path: str, steps: int) -> float:
    from tfdoctor.recording.script import record_script

    return record_script(path, steps=steps).seconds


def main():
    os.chdir(ROOT)
    devnull = open(os.devnull, "w")
    print(f"recording overhead, first {STEPS} optimizer steps (fastest of {REPEATS}):")
    for path in SCRIPTS:
        real_stdout, sys.stdout = sys.stdout, devnull  # the scripts' own logging
        try:
            bare(path, STEPS), recorded(path, STEPS)  # warm-up: imports, first-call costs
            b, r = [], []
            for _ in range(REPEATS):
                b.append(bare(path, STEPS))
                r.append(recorded(path, STEPS))
        finally:
            sys.stdout = real_stdout
        print(f"  {path}: bare {min(b):.3f} s, recorded {min(r):.3f} s ({min(r) / min(b):.2f}x)")
    print("whole command (median of 3, torch import included):")
    for path in SCRIPTS:
        script = wall([sys.executable, path], repeats=3)
        run = wall([sys.executable, "-m", "tfdoctor", "run", path, "--format", "json"], repeats=3)
        print(f"  {path}: python SCRIPT (to its end) {script:.2f} s, tfdoctor run {run:.2f} s "
              f"({run / script:.2f}x)")
    print("  (no `tfdoctor check` equivalent of nanogpt_train.py: no model factory, and its loop is "
          "module-level, nothing to pass as --train)")


if __name__ == "__main__":
    main()
