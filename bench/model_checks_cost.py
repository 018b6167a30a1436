"""Cost of issue 20's model checks (eval-determinism, depth-signal) on the fixture GPT, side by side.

    python bench/model_checks_cost.py [ROUNDS]

Prints the whole battery through the installed command with and without the two checks (the battery
as it was before issue 20), the commands taking turns ROUNDS times (default 5), each line the median
of its rounds, wall and CPU time (user + system of the process tree); then each check's own seconds
inside a whole-battery run (in process, best of ROUNDS), beside init-loss's and the battery's.
The target: the whole battery at most 1.2x the battery before the issue.
"""

import statistics
import subprocess
import sys
import time

import torch

from battery_speed import _cpu
from timing import ROOT

sys.path.insert(0, str(ROOT / "fixtures"))

TARGET = "fixtures/gpt_correct.py:build"
NEW = ("eval-determinism", "depth-signal")
COMMANDS = {
    "battery before issue 20": ["tfdoctor", "check", TARGET, "--format", "json", "--skip", ",".join(NEW)],
    "whole battery": ["tfdoctor", "check", TARGET, "--format", "json"],
}


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    times = {name: [] for name in COMMANDS}
    for _ in range(rounds):
        for name, args in COMMANDS.items():
            start, cpu = time.perf_counter(), _cpu()
            subprocess.run(args, cwd=ROOT, capture_output=True, check=False)
            times[name].append((time.perf_counter() - start, _cpu() - cpu))
    medians = {name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
               for name, v in times.items()}
    before_wall, before_cpu = medians["battery before issue 20"]
    print(f"medians of {rounds} rounds")
    for name, (wall_s, cpu_s) in medians.items():
        print(f"{name:<26} wall {wall_s:6.2f} s = {wall_s / before_wall:4.2f}x   CPU {cpu_s:6.2f} s = "
              f"{cpu_s / before_cpu:4.2f}x")

    from gpt_correct import build
    from tfdoctor import run_checks

    seconds = {check_id: [] for check_id in (*NEW, "init-loss", "battery")}
    for _ in range(rounds):
        torch.manual_seed(0)
        report = run_checks(build())
        for result in report.results:
            if result.id in seconds:
                seconds[result.id].append(result.seconds)
        seconds["battery"].append(sum(result.seconds for result in report.results))
    for name, values in seconds.items():
        print(f"{name:<26} {min(values) * 1000:8.1f} ms in process (best of {rounds})")


if __name__ == "__main__":
    main()
