"""`tfdoctor run` on the tiny nanoGPT-style script next to `tfdoctor check` on the same model and
loop, measured side by side in one run (issue 11: goal within 2x).

    python bench/run_vs_check.py

Both are the whole command, torch import and worker start-up included, report as JSON:
- run:   `tfdoctor run fixtures/scripts/nanogpt_train.py` (the script up to its 2nd optimizer step,
         2 micro-batches each, then every loop and model check);
- check: `tfdoctor check fixtures/loops/nanogpt.py:build --train fixtures/loops/nanogpt.py:train
         --train-batches 4` (the same GPT and the script's loop as train(model, batches), fed the same
         4 micro-batches = 2 steps).
Alternated, median of REPEATS each. The two batteries differ by design in one place: check's
overfit-batch drives the user's loop where run's, with no loop to call again, uses tfdoctor's own
optimizer.

Measured on the shared 2-core dev machine (other engineers' tests running): run median 4.84 s,
check median 4.12 s: run / check = 1.18x.
"""

import statistics
import subprocess
import sys
import time

from timing import ROOT

REPEATS = 5
RUN = [sys.executable, "-m", "tfdoctor", "run", "fixtures/scripts/nanogpt_train.py", "--format", "json"]
CHECK = [sys.executable, "-m", "tfdoctor", "check", "fixtures/loops/nanogpt.py:build", "--train",
         "fixtures/loops/nanogpt.py:train", "--train-batches", "4", "--format", "json"]


def once(args) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, check=False)
    return time.perf_counter() - start, done.returncode


def main() -> None:
    times = {"run": [], "check": []}
    for _ in range(REPEATS):  # alternated: a busy moment of the machine hits both alike
        for name, args in (("run", RUN), ("check", CHECK)):
            seconds, code = once(args)
            if code not in (0, 1):
                sys.exit(f"{name} exited {code}: {' '.join(args)}")
            times[name].append(seconds)
    run, check = statistics.median(times["run"]), statistics.median(times["check"])
    print(f"tfdoctor run   nanogpt_train.py          median {run:6.2f} s  (runs: "
          f"{', '.join(f'{t:.2f}' for t in times['run'])})")
    print(f"tfdoctor check nanogpt.py:build --train  median {check:6.2f} s  (runs: "
          f"{', '.join(f'{t:.2f}' for t in times['check'])})")
    print(f"run / check = {run / check:.2f}x (goal: within 2x)")


if __name__ == "__main__":
    main()
