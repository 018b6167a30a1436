"""Speed of the core, measured side by side in one run.

    python bench/battery_speed.py [ROUNDS]

Prints: `tfdoctor --help` wall time (no torch import); against `python -c "import torch"`, the
floor every run pays: the whole battery on the fixture GPT (d_model 64, 2 layers, T=32) through the
installed command, one check alone, and the battery without overfit-batch, each as a ratio to the
torch import (the target: the whole battery at most 1.5x). The commands take turns, ROUNDS times
(default 5), and each line is the median of its rounds, so a machine whose load changes during the
run slows every command alike; CPU time (user + system of the command's process tree) is printed
beside the wall time as the steadier measure on a busy machine. Then the future-leak probe next to one
forward of the same model and next to the naive probe that runs one forward per perturbed position.
"""

import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from timing import ROOT, best_of

sys.path.insert(0, str(ROOT / "fixtures"))

TARGET = "fixtures/gpt_correct.py:build"
COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "whole battery": ["tfdoctor", "check", TARGET, "--format", "json"],
    "one check (future-leak)": ["tfdoctor", "check", TARGET, "--format", "json", "--only", "future-leak"],
    "battery without overfit-batch": ["tfdoctor", "check", TARGET, "--format", "json", "--skip", "overfit-batch"],
}


def _cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _once(args) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, the command's whole process tree) of one run."""
    start, cpu = time.perf_counter(), _cpu()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return elapsed, _cpu() - cpu


def side_by_side(rounds: int) -> dict[str, tuple[float, float]]:
    """Median wall and CPU time of each command, the commands taking turns round after round."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in COMMANDS}
    for _ in range(rounds):
        for name, args in COMMANDS.items():
            times[name].append(_once(args))
    return {name: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
            for name, values in times.items()}


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    help_s = statistics.median(_once(["tfdoctor", "--help"])[0] for _ in range(3))
    print(f"tfdoctor --help                       {help_s * 1000:8.0f} ms")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    medians = side_by_side(rounds)
    floor, floor_cpu = medians["import torch"]
    print(f"medians of {rounds} rounds, load average {load:.1f} at the start, {os.cpu_count()} CPUs "
          "(CPU: user + system of the whole process tree, steadier than wall time on a busy machine)")
    for name, (seconds, cpu) in medians.items():
        ratio = "" if name == "import torch" else f" = {seconds / floor:4.2f}x import torch"
        cpu_ratio = "" if name == "import torch" else f" = {cpu / floor_cpu:4.2f}x"
        print(f"{name:<30} wall {seconds:6.2f} s{ratio:<21}  CPU {cpu:6.2f} s{cpu_ratio}")

    from gpt_correct import build
    from tfdoctor.probes.dependency import dependency_map

    torch.set_num_threads(1)
    model = build().eval()
    T, V = 32, 96
    base = torch.randint(0, V, (T,))
    with torch.no_grad():
        one_forward = best_of(lambda: model(base[None]))
        probe = best_of(lambda: dependency_map(model, base, V, None))

        def naive():  # one forward per perturbed position, the obvious way
            reference = model(base[None])
            for j in range(T):
                ids = base.clone()
                ids[j] = (ids[j] + 1) % V
                (model(ids[None]) - reference).abs().amax(-1)

        naive_s = best_of(naive)
    print(f"single forward [1, {T}]                {one_forward * 1000:8.2f} ms")
    print(f"future-leak probe (batched)           {probe * 1000:8.2f} ms   = {probe / one_forward:5.1f} x one forward")
    print(f"naive probe ({T + 1} forwards)             {naive_s * 1000:8.2f} ms   "
          f"= {naive_s / one_forward:5.1f} x one forward")
    print(f"batched / naive                        {probe / naive_s:8.2f}")


if __name__ == "__main__":
    main()
