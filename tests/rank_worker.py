"""One rank of a 2-process run for tests/test_ranks.py, until the distributed driver lands: runs a
fixture script with `record_script` inside a RankRecorder and leaves what it recorded in a file of
its own for the test to gather (the script destroys its process group in its finally, so nothing
goes over it afterwards).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python tests/rank_worker.py SCRIPT OUT_DIR STEPS

leaves OUT_DIR/rank{RANK}.pkl: {"digest": ..., "ended": ...}.
"""

import os
import pickle
import sys

from tfdoctor.recording.ranks import RankRecorder
from tfdoctor.recording.script import record_script


def main():
    script, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with RankRecorder(rank, world) as recorder:
        run = record_script(script, steps=steps)
    digest = recorder.digest(run.recorder.events, run.recorder.bound, run.recorder.scores)
    path = os.path.join(out, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump({"digest": digest, "ended": run.ended}, f)
    os.replace(path + ".part", path)  # whole or absent


if __name__ == "__main__":
    main()
