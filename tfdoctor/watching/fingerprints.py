"""The rows a watched loop trained on, as fingerprints (one int64 per row: a random linear hash of its
token ids, computed where the ids live), so that an evaluation on training rows is seen. Kept as int64
tensors on the CPU, 8 bytes per row: a Python set would cost ~70 bytes a row, and its growth over a
long run would be the monitor's own memory growth."""

from __future__ import annotations

import torch

# Trained rows remembered: 8 MiB of fingerprints. Past it, later rows are not remembered (the facts say).
MAX_TRAINED_ROWS = 1 << 20
# Chunks kept before they are merged into one sorted tensor.
MERGE_EVERY = 256


class TrainedRows:
    def __init__(self, limit: int = MAX_TRAINED_ROWS) -> None:
        self.limit = limit
        self.merged = torch.empty(0, dtype=torch.int64)
        self.chunks: list[torch.Tensor] = []
        self.count = 0
        self.full = False

    def add(self, prints: torch.Tensor) -> None:
        if self.count >= self.limit:
            self.full = True
            return
        on_cpu = prints.device.type == "cpu" and prints.dtype == torch.int64
        self.chunks.append(prints if on_cpu else prints.detach().to("cpu", torch.int64))
        self.count += self.chunks[-1].numel()
        if len(self.chunks) >= MERGE_EVERY:
            self._merge()

    def trained(self, prints: torch.Tensor) -> int:
        """How many of `prints` are fingerprints of trained rows."""
        return int(self.members(prints).sum())

    def members(self, prints: torch.Tensor) -> torch.Tensor:
        """Which of `prints` are fingerprints of trained rows (a bool per print)."""
        self._merge()
        return torch.isin(prints.detach().to("cpu", torch.int64), self.merged)

    def _merge(self) -> None:
        if self.chunks:
            self.merged = torch.unique(torch.cat([self.merged, *self.chunks]))
            self.chunks = []
            self.count = self.merged.numel()


def fingerprints(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One int64 per row of `ids` (B, T; more dimensions are more rows; (T,) is one row); `weights`:
    T random int64 drawn for that length, on the ids' device. int64 products wrap around, which a
    hash may do."""
    with torch.no_grad():
        rows = ids.reshape(-1, ids.shape[-1]) if ids.dim() > 1 else ids.reshape(1, -1)
        return (rows * weights).sum(-1)  # integer ids promote to int64 with the weights
