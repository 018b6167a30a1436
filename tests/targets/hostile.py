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


class GradOff(nn.Module):
    """A forward that turns autograd off for the whole process and leaves it off."""

    def __init__(self):
        super().__init__()
        self.inner = correct_gpt()

    def forward(self, ids):
        torch.set_grad_enabled(False)
        return self.inner(ids)


def grad_off():
    return GradOff()


class OddLogits(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.inner = correct_gpt()
        self.kind = kind

    def forward(self, ids):
        logits = self.inner(ids)
        if self.kind == "complex":
            return torch.complex(logits, logits)
        if self.kind == "int":
            return logits.long()
        if self.kind == "bool":
            return logits > 0
        if self.kind == "detached":
            return logits.detach()
        return torch.full_like(logits, float("nan"))


def complex_logits():
    return OddLogits("complex")


def integer_logits():
    return OddLogits("int")


def bool_logits():
    return OddLogits("bool")


def detached_logits():
    return OddLogits("detached")


def nan_logits():
    return OddLogits("nan")


class TinyVocab(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, ids):
        return self.head(self.emb(ids).cumsum(1))


def vocab_1():
    return TinyVocab(1)


def vocab_2():
    return TinyVocab(2)


def on_meta():
    with torch.device("meta"):
        return correct_gpt()


def float64_default():
    torch.set_default_dtype(torch.float64)
    model = correct_gpt()
    return model.float()  # float32 weights, float64 default dtype for everything created later


class HugeVocab(nn.Module):
    """A 500k-token vocabulary on an 8-wide model: the logits dwarf everything else."""

    def __init__(self, vocab=500_000, width=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        T = ids.shape[1]
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=ids.device))
        weights = torch.zeros(T, T, device=ids.device).masked_fill(~causal, float("-inf")).softmax(-1)
        return self.head(self.mix(weights @ x))


def huge_vocab():
    return HugeVocab()


class ReadsAValue(nn.Module):
    """Branches on a tensor's value (`.item()`), which fake tensors cannot give."""

    def __init__(self):
        super().__init__()
        self.inner = correct_gpt()

    def forward(self, ids):
        if ids.max().item() > 1000:
            raise ValueError("ids out of range")
        return self.inner(ids)


def reads_a_value():
    return ReadsAValue()


def forks_a_lingering_child():
    """A factory whose helper process outlives it and inherits every open file, as a DataLoader
    worker or a logging daemon can."""
    import subprocess

    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False)
    return correct_gpt()
