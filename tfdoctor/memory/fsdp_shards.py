"""Per-device memory under FSDP2: which parameters each `fully_shard` group holds, what one rank keeps of
them, and what FSDP2 allocates and frees on that rank at its hooks (Fsdp2Schedule). Pure Python, no torch:
the analytic mode replays the schedule in its ledger, the traced mode lays it over a traced step
(tfdoctor/memory/fsdp_overlay.py).

FSDP2 (torch.distributed.fsdp.fully_shard) shards every parameter along dim 0 in `torch.chunk` fashion,
padding dim 0 to a multiple of the world size N: each rank's shard has ceil(rows / N) rows (rank 0 always
has the full count, so it is the device these figures describe), and the all-gather buffer and the
unsharded parameter built from it have N times that. Gradients are reduce-scattered into shards of the
same padded size, and AdamW's states are `zeros_like` of the local shard.

Groups follow the documented idiom: `fully_shard(block)` for each block, then `fully_shard(model)`, so the
root group holds what is left: the token and position embeddings, ln_f and the LM head.
"""

from __future__ import annotations

from typing import Protocol

FLOAT32 = 4
ROOT = "root"  # the root group's name in the schedule
# The categories the schedule files its allocations under (the analytic ledger's own names).
PARAMETERS = "parameters"
GRADIENTS = "gradients"


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


def sharded_bytes(shapes: list[tuple[int, int]], world: int, itemsize: int = FLOAT32) -> int:
    """Bytes of one rank's padded shards (float32 unless told)."""
    return sum(shard_rows(r, world) * cols for r, cols in shapes) * itemsize


def unsharded_bytes(shapes: list[tuple[int, int]], world: int, itemsize: int = FLOAT32) -> int:
    """Bytes of the all-gather buffer, and of the unsharded parameters copied out of it."""
    return world * sharded_bytes(shapes, world, itemsize)


class Ledger(Protocol):
    def alloc(self, name: str, nbytes: int, category: str) -> None: ...
    def free(self, *names: str) -> None: ...
    def mark(self, op: str) -> None: ...


class Fsdp2Schedule:
    """What FSDP2 adds to one rank's memory at its hooks, for `fully_shard` on each block, then the root.

    The ZeRO formulae (parameters, gradients, optimizer states each divided by N) miss most of it; against
    FSDPMemTracker and our own counter on a fake process group (tfdoctor/memory/fsdp_measured.py, torch 2.13) they
    were 14-40% low per device on GPT-2 small at batch 1 (bench/memory_accuracy.py). What one rank holds on
    top of its padded shards, as measured:
    - the root group (embeddings, ln_f, LM head) unsharded from the root's all-gather to the end of
      backward: FSDP2 does not reshard the root after forward, whatever the blocks do;
    - a block's unsharded parameters during its forward (zero3; zero2 keeps every block's from its
      forward to its backward) and its backward, and each all-gather buffer (the size of the unsharded
      group) until the next group's copy-out has finished; in backward the block that ran before it in
      forward is prefetched, so a block computes its backward beside the next one's all-gather buffer;
    - unsharded gradients: a block's until its post-backward reduce-scatter, the root's (the LM head's and
      the embeddings', V x C each) until the end of backward; each reduce-scatter's input (the group's
      padded gradients) until the next reduce-scatter is issued, the root's until backward ends.

    `groups` maps each group (ROOT and the blocks) to (unsharded bytes, one rank's shard bytes). The
    schedule allocates and frees its own buffers in `led` and calls `led.mark` where a peak can fall; the
    gradients it frees at a reduce-scatter are the caller's names, passed to post_backward.
    """

    def __init__(self, led: Ledger, zero3: bool, groups: dict[str, tuple[int, int]]) -> None:
        self.led, self.zero3, self.groups = led, zero3, groups
        self.order: list[str] = []  # the blocks in the order their forwards ran; backward goes in reverse
        self.held: set[str] = set()  # the schedule's own buffers alive now
        self.gathered: str | None = None  # the all-gather buffer still alive
        self.scattered: str | None = None  # the reduce-scatter input still alive
        self.reduced: set[str] = set()  # groups whose gradients were reduce-scattered this step

    def _alloc(self, name: str, nbytes: int, category: str) -> None:
        self.led.alloc(name, nbytes, category)
        self.held.add(name)

    def _free(self, name: str | None) -> None:
        if name in self.held:
            self.held.discard(name)
            self.led.free(name)

    def _all_gather(self, group: str) -> None:
        nbytes = self.groups[group][0]
        self._alloc(f"all-gather {group}", nbytes, PARAMETERS)
        self.led.mark(f"{group} all-gather")
        self._alloc(f"unsharded {group}", nbytes, PARAMETERS)
        self.led.mark(f"{group} copy-out")

    def _release_gathered(self, keep: str | None = None) -> None:
        self._free(self.gathered)
        self.gathered = keep

    def _prefetch(self, group: str) -> None:
        self._alloc(f"all-gather {group}", self.groups[group][0], PARAMETERS)
        self.gathered = f"all-gather {group}"
        self.led.mark(f"{group} prefetch all-gather")

    def root_pre_forward(self) -> None:
        self._all_gather(ROOT)
        self.gathered = f"all-gather {ROOT}"

    def pre_forward(self, group: str) -> None:
        self.order.append(group)
        self._all_gather(group)
        self._release_gathered(f"all-gather {group}")

    def post_forward(self, group: str) -> None:
        if self.zero3:
            self._free(f"unsharded {group}")

    def root_post_forward(self) -> None:
        self._release_gathered()

    def root_pre_backward(self) -> None:
        """zero3 prefetches the block that ran last; zero2 kept every block unsharded."""
        if self.zero3 and self.order:
            self._prefetch(self.order[-1])

    def pre_backward(self, group: str) -> None:
        """zero3: copy the prefetched block out, and prefetch the one that ran before it in forward."""
        if not self.zero3 or f"unsharded {group}" in self.held:
            return
        if self.gathered != f"all-gather {group}":  # not prefetched: gathered on demand
            self._release_gathered()
            self._alloc(f"all-gather {group}", self.groups[group][0], PARAMETERS)
            self.gathered = f"all-gather {group}"
            self.led.mark(f"{group} all-gather")
        self._alloc(f"unsharded {group}", self.groups[group][0], PARAMETERS)
        self.led.mark(f"{group} copy-out")
        self._release_gathered()
        at = self.order.index(group) if group in self.order else 0
        if at:
            self._prefetch(self.order[at - 1])

    def post_backward(self, group: str, grads: list[str]) -> None:
        """Reshard, copy the group's gradients (`grads`, the caller's names) into the reduce-scatter
        input, keep the shard."""
        full, shard = self.groups[group]
        self._free(f"unsharded {group}")
        self._alloc(f"reduce-scatter {group}", full, GRADIENTS)
        self.led.mark(f"{group} reduce-scatter copy-in")
        self.led.free(*grads)
        self._free(self.scattered)
        self.scattered = f"reduce-scatter {group}"
        self._alloc(f"sharded grads {group}", shard, GRADIENTS)
        self.led.mark(f"{group} reduce-scatter")
        self.reduced.add(group)

    def pending(self) -> list[str]:
        """Groups not reduce-scattered yet, the root first: what FSDP2's end-of-backward callback does."""
        return [g for g in self.groups if g not in self.reduced]

    def end_backward(self) -> None:
        self._free(self.scattered)
        self.scattered = None
