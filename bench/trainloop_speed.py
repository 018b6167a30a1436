"""What the training-loop audit adds to the battery, measured side by side in one run.

    python bench/trainloop_speed.py

Prints the whole battery on the fixture GPT through `python -m tfdoctor` run from this tree (so it
measures this tree's code whatever is installed; torch import included),
without and with `--train fixtures/loops/correct.py:train`, and, in process, the recorded run of the
loop (16 batches) next to the same loop run bare, i.e. the cost of tracing it.
"""

import copy
import sys

import torch

from timing import ROOT, best_of, wall

sys.path.insert(0, str(ROOT / "fixtures"))
sys.path.insert(0, str(ROOT))

TARGET = "fixtures/gpt_correct.py:build"
LOOP = "fixtures/loops/correct.py:train"


def main():
    base = [sys.executable, "-m", "tfdoctor", "check", TARGET, "--format", "json"]
    without = wall(base)
    with_train = wall(base + ["--train", LOOP])
    train_only = wall(base + ["--train", LOOP, "--only", "objective,ignore-index,unscale-before-clip,"
                              "accumulation-scaling,scheduler-placement,zero-grad,clip-global-norm,lr-schedule,"
                              "amp-loss-scaling,grad-health"])
    print(f"battery without --train              {without:6.2f} s   (subprocess, torch import included)")
    print(f"battery with --train                 {with_train:6.2f} s   = +{with_train - without:.2f} s")
    print(f"the 10 train checks alone            {train_only:6.2f} s   (subprocess, torch import included)")

    from gpt_correct import build
    from tfdoctor.loader import load_function
    from tfdoctor.recording.loop import record_loop, run_loop, train_batches
    from tfdoctor.subject import Subject, resolve

    torch.set_num_threads(1)
    subject = resolve(Subject(build(), pad_id=0, train=load_function(str(ROOT / LOOP))))
    batches = train_batches(subject, 16, torch.Generator().manual_seed(0))
    bare = best_of(lambda: run_loop(subject, copy.deepcopy(subject.model), batches), repeats=5)
    traced = best_of(lambda: record_loop(subject, batches), repeats=5)
    print(f"correct loop, 16 batches, bare       {bare * 1000:6.0f} ms")
    print(f"correct loop, 16 batches, recorded   {traced * 1000:6.0f} ms   = {traced / bare:4.2f} x bare")


if __name__ == "__main__":
    main()
