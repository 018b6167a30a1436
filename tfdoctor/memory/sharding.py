"""Per-device sizes under FSDP2 for the analytic mode's GPT: which parameters each `fully_shard` group holds,
and what one rank keeps of them. Pure Python, no torch.

FSDP2 (torch.distributed.fsdp.fully_shard) shards every parameter along dim 0 in `torch.chunk` fashion,
padding dim 0 to a multiple of the world size N: each rank's shard has ceil(rows / N) rows (rank 0 always
has the full count, so it is the device these figures describe), and the all-gather buffer and the
unsharded parameter built from it have N times that. Gradients are reduce-scattered into shards of the
same padded size, and AdamW's states are `zeros_like` of the local shard.

Groups follow the documented idiom: `fully_shard(block)` for each block, then `fully_shard(model)`, so the
root group holds what is left: the token and position embeddings, ln_f and the LM head.
"""

from __future__ import annotations

FLOAT32 = 4


def block_shapes(d_model: int, d_ff: int) -> list[tuple[int, int]]:
    """(rows, columns) of each parameter of one block, as nn.Linear and nn.LayerNorm store them."""
    C, ff = d_model, d_ff
    return [(C, 1), (C, 1),  # ln_1 weight, bias
            (3 * C, C), (3 * C, 1),  # c_attn
            (C, C), (C, 1),  # attention c_proj
            (C, 1), (C, 1),  # ln_2
            (ff, C), (ff, 1),  # MLP up
            (C, ff), (C, 1)]  # MLP down


def root_shapes(vocab: int, d_model: int, positions: int, tied: bool) -> list[tuple[int, int]]:
    """The root group: what no block holds. A tied head shares the token embedding (one parameter)."""
    shapes = [(vocab, d_model), (positions, d_model), (d_model, 1), (d_model, 1)]  # wte, wpe, ln_f
    return shapes if tied else shapes + [(vocab, d_model)]  # + lm_head


def shard_rows(rows: int, world: int) -> int:
    return -(-rows // world)


def sharded_bytes(shapes: list[tuple[int, int]], world: int) -> int:
    """float32 bytes of one rank's padded shards."""
    return sum(shard_rows(r, world) * cols for r, cols in shapes) * FLOAT32


def unsharded_bytes(shapes: list[tuple[int, int]], world: int) -> int:
    """float32 bytes of the all-gather buffer, and of the unsharded parameters copied out of it."""
    return world * sharded_bytes(shapes, world)
