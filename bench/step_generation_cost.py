"""What stale-update and generation (issue 20) add to the battery on the fixture GPT, side by side.

    python bench/step_generation_cost.py [ROUNDS] [BEFORE_TREE]

Runs, taking turns ROUNDS times (default 5), through `python -m tfdoctor` with PYTHONPATH set to
each tree: the whole battery on fixtures/gpt_correct.py:build from BEFORE_TREE (a checkout from
before issue 20; default: none, then only this tree is measured) and from this tree; the battery
without generation; generation alone (it memorises the batch itself when overfit-batch is not
selected); and the battery with `--train` (the correct loop) with and without stale-update. Prints
medians of wall and CPU time (user + system of the whole process tree, steadier on a busy machine)
and the ratios the 1.2x budget is judged on.
"""

import os
import statistics
import subprocess
import sys

from battery_speed import _cpu
from timing import ROOT

TARGET = "fixtures/gpt_correct.py:build"
LOOP = ["--train", "fixtures/loops/correct.py:train", "--pad-id", "0"]


def _command(tree: str, *args: str) -> tuple[list[str], dict]:
    env = dict(os.environ, PYTHONPATH=tree)
    return [sys.executable, "-m", "tfdoctor", "check", TARGET, "--format", "json", *args], env


def _once(args, env) -> tuple[float, float]:
    import time

    start, cpu = time.perf_counter(), _cpu()
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, check=False)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return time.perf_counter() - start, _cpu() - cpu


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    here = str(ROOT)
    commands = {}
    if len(sys.argv) > 2:
        commands["battery, before issue 20"] = _command(sys.argv[2])
    commands.update({
        "battery": _command(here),
        "battery without generation": _command(here, "--skip", "generation"),
        "generation alone": _command(here, "--only", "generation"),
        "overfit-batch alone": _command(here, "--only", "overfit-batch"),
        "battery --train": _command(here, *LOOP),
        "battery --train without stale-update": _command(here, *LOOP, "--skip", "stale-update"),
    })
    times = {name: [] for name in commands}
    for _ in range(rounds):
        for name, (args, env) in commands.items():
            times[name].append(_once(args, env))
    load = os.getloadavg()[0]
    print(f"medians of {rounds} rounds, load average {load:.1f} at the end, {os.cpu_count()} CPUs")
    medians = {name: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
               for name, v in times.items()}
    for name, (wall, cpu) in medians.items():
        print(f"{name:<40} wall {wall:6.2f} s  CPU {cpu:6.2f} s")
    base = medians.get("battery, before issue 20")
    if base:
        print(f"battery / before issue 20: wall {medians['battery'][0] / base[0]:.2f}x, "
              f"CPU {medians['battery'][1] / base[1]:.2f}x")
    print(f"battery / without generation: CPU {medians['battery'][1] / medians['battery without generation'][1]:.2f}x")
    print(f"--train / without stale-update: CPU "
          f"{medians['battery --train'][1] / medians['battery --train without stale-update'][1]:.2f}x")


if __name__ == "__main__":
    main()
