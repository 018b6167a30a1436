"""Targets that cannot be examined, for the CLI's exit-2 paths."""

import torch


def raises():
    raise ValueError("config file missing")


def returns_string():
    return "not a model"


class Pooled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 10)

    def forward(self, ids):
        return self.emb(ids).mean(1)  # [B, V]: forgot the time axis


def wrong_shape():
    return Pooled()


NOT_CALLABLE = 42


class ViewsItsIds(torch.nn.Module):
    """Correct, but calls .view on its ids, which needs contiguous memory (as a real batch has)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 10)

    def forward(self, ids):
        B, T = ids.shape
        return self.emb(ids.view(B * T)).view(B, T, 10)


def views_its_ids():
    return ViewsItsIds()
