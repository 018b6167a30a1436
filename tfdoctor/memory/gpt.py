"""The model the analytic estimator describes, written out so that it can be traced and measured.

A GPT-2-style pre-norm decoder: learned token and position embeddings, biases everywhere but the
LM head, LayerNorm, 4x GELU MLP, no dropout, untied head unless `tied`. `attention="naive"` builds
the [B, nh, T, T] score tensor; `"sdpa"` calls the fused `F.scaled_dot_product_attention`.

Used by the tests and by bench/memory_accuracy.py to hold the analytic mode to its claims; it is not
part of what a user runs. Imports torch.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, future, attention: str):
        super().__init__()
        assert d_model % n_head == 0
        self.n_head, self.attention = n_head, attention
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        if attention == "naive":  # one [P, P] bool mask shared by every layer: P*P bytes once
            self.register_buffer("future", future, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(self.future[:T, :T], float("-inf"))
            y = F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, d_ff: int, future, attention: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, future, attention)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_head: int, n_layer: int, positions: int,
                 d_ff: int | None = None, attention: str = "naive", tied: bool = False):
        super().__init__()
        self.block_size = positions  # read by tfdoctor.subject.max_positions_of
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(positions, d_model)
        # True above the diagonal: the future a position must not see.
        future = torch.ones(positions, positions, dtype=torch.bool).triu(1) if attention == "naive" else None
        self.h = nn.ModuleList(Block(d_model, n_head, d_ff or 4 * d_model, future, attention)
                               for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)
