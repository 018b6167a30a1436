"""Targets that misbehave the ways real code does: hang, exit, print, leave threads behind.

tfdoctor runs them in a supervised worker; each must end in one clear line and exit 2 (or, for
the printing model, a clean report on stdout), never a hang and never a silent exit 0.
"""

import os
import sys
import threading
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "fixtures"))
from gpt_correct import build as correct_gpt  # noqa: E402


def sleeps():
    time.sleep(3600)  # a factory that waits on a lock, a download, a debugger prompt


class BlocksInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = correct_gpt()
        self.calls = 0

    def forward(self, ids):
        self.calls += 1
        if self.calls > 1:  # the preflight call returns; the first check's call never does
            threading.Event().wait()
        return self.inner(ids)


def blocks_in_forward():
    return BlocksInForward()


class StartsAThread(nn.Module):
    """Starts a non-daemon thread that never ends, as a logging or prefetch helper might."""

    def __init__(self):
        super().__init__()
        self.inner = correct_gpt()
        threading.Thread(target=threading.Event().wait, daemon=False).start()

    def forward(self, ids):
        return self.inner(ids)


def starts_a_thread():
    return StartsAThread()


def exits_0():
    sys.exit(0)


def exits_hard():
    os._exit(0)


class Chatty(nn.Module):
    """Prints as many real models do: a parameter count at build, a line per forward."""

    def __init__(self):
        super().__init__()
        self.inner = correct_gpt()
        print(f"number of parameters: {sum(p.numel() for p in self.parameters())}")

    def forward(self, ids):
        print("forward", tuple(ids.shape))
        os.write(1, b"raw write to fd 1\n")
        return self.inner(ids)


def chatty():
    return Chatty()


def train_forever(model, batches):
    while True:
        time.sleep(0.05)


def train_exits(model, batches):
    sys.exit(0)


def chatty_train(model, batches):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, ids in enumerate(batches):
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), ignore_index=0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.3f}")
