"""What issue 20's checks add to the battery on the fixture GPT, side by side (the budget: 1.2x).

    python bench/new_checks_cost.py [ROUNDS] [BEFORE_TREE]
    git worktree add /tmp/before ede5e46 && python bench/new_checks_cost.py 5 /tmp/before

Runs, taking turns ROUNDS times (default 5), through `python -m tfdoctor` with PYTHONPATH set to
each tree: the whole battery on fixtures/gpt_correct.py:build from BEFORE_TREE (a checkout from
before issue 20; default: none, then only this tree is measured) and from this tree; this tree's
battery without the issue's checks; generation alone (it memorises the batch itself when
overfit-batch is not selected); and the battery with `--train` (the correct loop) with and without
them. Prints medians of wall and CPU time (user + system of the whole process tree, steadier on a
busy machine) and the ratios the budget is judged on. (bench/model_checks_cost.py and
bench/boundaries_cost.py time single checks in one process.)
"""

import os
import statistics
import subprocess
import sys

from battery_speed import _cpu
from timing import ROOT

TARGET = "fixtures/gpt_correct.py:build"
LOOP = ["--train", "fixtures/loops/correct.py:train", "--pad-id", "0"]
NEW = "eval-determinism,depth-signal,generation,eos-trained,packing-labels,stale-update,rank-equivalence"


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
        "battery without issue 20's checks": _command(here, "--skip", NEW),
        "generation alone": _command(here, "--only", "generation"),
        "overfit-batch alone": _command(here, "--only", "overfit-batch"),
        "battery --train": _command(here, *LOOP),
        "battery --train without issue 20's": _command(here, *LOOP, "--skip", NEW),
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
    alone = medians["battery without issue 20's checks"]
    print(f"battery / without issue 20's checks: wall {medians['battery'][0] / alone[0]:.2f}x, "
          f"CPU {medians['battery'][1] / alone[1]:.2f}x")
    trained = medians["battery --train without issue 20's"]
    print(f"--train / without issue 20's checks: CPU {medians['battery --train'][1] / trained[1]:.2f}x")


if __name__ == "__main__":
    main()
