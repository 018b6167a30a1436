"""This process's place in a distributed job (its rank and the job's size), read from the environment
torchrun sets: no torch import, so the command line reads it before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    rank: int
    size: int

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's rank and the job's size, as torchrun (and every launcher that follows its
    convention: SLURM wrappers, accelerate launch) sets them; one process otherwise."""
    try:
        return World(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return World(0, 1)
