"""Distributed scripts tfdoctor cannot audit, each ending one way (--case NAME), for the bad-input
tests of `tfdoctor run --nproc` (tests/test_distributed.py). Not fixtures: none is a training bug.

- no-init: every rank trains alone, never calling init_process_group under WORLD_SIZE=2;
- rank-killed: rank 1 is killed by SIGKILL in the middle of its first steps (an OOM kill);
- rank-raises: rank 1 raises before its first step (its data is missing), rank 0 trains on.
"""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "fixtures", "scripts"))
from tinylm import TinyLM  # noqa: E402

VOCAB = 50


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=["no-init", "rank-killed", "rank-raises"])
    case = parser.parse_args().case
    rank = int(os.environ["RANK"])
    if case != "no-init":
        dist.init_process_group("gloo")
    if case == "rank-raises" and rank == 1:
        raise FileNotFoundError("shard-1.bin")
    torch.manual_seed(0)
    model = TinyLM(VOCAB)
    if case != "no-init":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(8):
        rows = torch.randint(0, VOCAB, (4, 17), generator=g)
        loss = F.cross_entropy(model(rows[:, :-1]).reshape(-1, VOCAB), rows[:, 1:].reshape(-1))
        loss.backward()
        if case == "rank-killed" and rank == 1 and step == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
