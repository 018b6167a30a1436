"""What the supervised worker costs, measured side by side in one run.

    python bench/worker_overhead.py            # the overhead
    python bench/worker_overhead.py --huge     # and the 500k-vocabulary case (about 5 minutes)

Prints the wall time of `tfdoctor check` on the tiny fixture GPT (the battery in a supervised worker
process, as users run it) next to the same request run in one process with no supervisor
(`tfdoctor.process.worker.run_check_request`, the worker's own code path), and the difference: the price of
the second process, the pipe and the budgets. Then the 500k-vocabulary, 8-wide model that used to run
for over 10 minutes: the whole battery under its default budgets, with the worker's peak RSS.
"""

import json
import resource
import subprocess
import sys
import time

from timing import ROOT, wall

IN_PROCESS = ("import sys, json; from tfdoctor.process.worker import run_check_request; "
              "r = run_check_request(json.loads(sys.argv[1])); print(len(r.results))")


def main():
    for only in ("init-loss", None):
        args = ["--only", only] if only else []
        request = {"target": "fixtures/gpt_correct.py:build", "only": only, "seed": 0}
        supervised = wall(["tfdoctor", "check", "fixtures/gpt_correct.py:build", "--format", "json", *args], repeats=5)
        direct = wall([sys.executable, "-c", IN_PROCESS, json.dumps(request)], repeats=5)
        label = only or "whole battery"
        print(f"{label:14s} supervised {supervised:6.2f} s   in one process {direct:6.2f} s   "
              f"worker overhead {supervised - direct:+6.2f} s")

    if "--huge" not in sys.argv:
        return
    start = time.perf_counter()
    done = subprocess.run(["tfdoctor", "check", "tests/targets/hostile.py:huge_vocab", "--format", "json"],
                          cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    report = json.loads(done.stdout)
    print(f"500k vocabulary, d_model 8: whole battery {seconds:6.1f} s, exit {done.returncode}, "
          f"largest child RSS {peak_mib:,.0f} MiB")
    for check in report["checks"]:
        if check["status"] != "skip":
            print(f"   {check['id']:22s} {check['status']:5s} {check['message'][:90]}")


if __name__ == "__main__":
    main()
