"""Speed of the core, measured side by side in one run.

    python bench/battery_speed.py

Prints: `tfdoctor --help` wall time (no torch import), the whole battery on the fixture GPT
(d_model 64, 2 layers, T=32) through the installed command, torch import included, and the
future-leak probe next to one forward of the same model and next to the naive probe that runs one
forward per perturbed position.
"""

import sys

import torch

from timing import ROOT, best_of, wall

sys.path.insert(0, str(ROOT / "fixtures"))


def main():
    help_s = wall(["tfdoctor", "--help"])
    battery_s = wall(["tfdoctor", "check", "fixtures/gpt_correct.py:build", "--format", "json"])
    print(f"tfdoctor --help                       {help_s * 1000:8.0f} ms")
    print(f"whole battery, gpt_correct (T=32)     {battery_s:8.2f} s   (subprocess, torch import included)")

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
    print(f"naive probe ({T + 1} forwards)             {naive_s * 1000:8.2f} ms   = {naive_s / one_forward:5.1f} x one forward")
    print(f"batched / naive                        {probe / naive_s:8.2f}")


if __name__ == "__main__":
    main()
