"""What keeping the user's files as they were costs (tfdoctor/process/sandbox), measured side by side.

    python bench/sandbox_cost.py

1. `import torch` in a fresh process, bare and inside the overlay the worker makes (the current folder
   and the home folder covered, the interpreter's folders bound back), medians of 5 interleaved.
2. The interposer's price per call, in this process: os.stat and open+read of a small file in a
   protected folder, a write (open 'w' + close) of one, before and after install (best of 20 x 200).
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

from timing import ROOT, best_of

OVERLAY = ("import os, sys; from tfdoctor.process.sandbox import overlay; "
           "from tfdoctor.process.sandbox.roots import exempt_folders; "
           "roots = sorted({os.getcwd(), os.path.expanduser('~')}); "
           "overlay.enter(roots, sys.argv[1], exempt_folders(roots)); import torch")


def import_times(repeats: int = 5) -> tuple[float, float]:
    bare, covered = [], []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(repeats):
        for times, code in ((bare, "import torch"), (covered, OVERLAY)):
            with tempfile.TemporaryDirectory() as scratch:
                start = time.perf_counter()
                done = subprocess.run([sys.executable, "-c", code, scratch], cwd=ROOT, env=env, capture_output=True)
                times.append(time.perf_counter() - start)
                if done.returncode:
                    return statistics.median(bare), float("nan")  # no overlay on this machine
    return statistics.median(bare), statistics.median(covered)


def per_call() -> dict:
    from tfdoctor.process.sandbox import interpose

    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "user", "f.txt")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as out:
        out.write("x" * 100)

    def stat():
        for _ in range(200):
            os.stat(path)

    def read():
        for _ in range(200):
            with open(path) as f:
                f.read()

    def write():
        for _ in range(200):
            with open(path + ".new", "w") as f:
                f.write("y")

    before = {name: best_of(fn) / 200 for name, fn in (("stat", stat), ("read", read), ("write", write))}
    installed = interpose.install([os.path.dirname(path)], os.path.join(folder, "scratch"))
    try:
        after = {name: best_of(fn) / 200 for name, fn in (("stat", stat), ("read", read), ("write", write))}
    finally:
        installed.uninstall()
    return {name: (before[name], after[name]) for name in before}


def main():
    bare, covered = import_times()
    print(f"import torch: bare {bare:.2f} s, inside the overlay {covered:.2f} s ({covered / bare:.2f}x)")
    for name, (before, after) in per_call().items():
        print(f"interposer, {name:5s}: {before * 1e6:6.1f} us bare, {after * 1e6:6.1f} us interposed "
              f"(+{(after - before) * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
