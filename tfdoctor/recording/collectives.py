"""Whether the model's forward communicates: tensor parallelism written by hand (or a library's)
sums or gathers its partial results across the ranks with collectives inside the forward, so the
model runs only with every rank taking part, and a model check on rank 0 alone would wait for the
others until its budget ran out. While a script is recorded, torch.distributed's collectives are
wrapped: one called inside a module's call (the recorder's call depth above 0) from outside torch's
own packages is noted with the user's line. DDP's and FSDP's own communication (torch's code, on a
wrapper the checks unwrap) is not the model's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Callable, Iterator

from tfdoctor.usercode.call_sites import call_site
from tfdoctor.usercode.patches import Patches

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "send", "recv")


def _torch_folder() -> str:
    import torch

    return os.path.dirname(torch.__file__) + os.sep


@contextlib.contextmanager
def watching_collectives(inside_forward: Callable[[], bool], seen: dict) -> Iterator[None]:
    """Wrap torch.distributed's collectives while the script runs; `seen` gets {name: "path:line"} of
    those made inside a forward (`inside_forward()`), the first of each."""
    import torch.distributed as dist

    if not dist.is_available():
        yield
        return
    torch_folder = _torch_folder()

    def wrapped(name: str, original: Callable) -> Callable:
        def collective(*args, **kwargs):
            if name not in seen and inside_forward():
                caller = sys._getframe(1).f_code.co_filename
                if not caller.startswith(torch_folder):  # DDP's buffers, FSDP's gathers: torch's own
                    seen[name] = call_site() or caller
            return original(*args, **kwargs)

        return collective

    with Patches() as patches:
        for name in COLLECTIVES:
            if callable(getattr(dist, name, None)):
                patches.wrap(dist, name, functools.partial(wrapped, name))
        yield


def communicating_reason(seen: dict) -> str:
    """The model checks' skip reason for a forward that communicates."""
    first = next(iter(seen.items()))
    calls = ", ".join(f"dist.{name}" for name in seen)
    return (f"model checks skipped: the model's forward issues collectives ({calls}; first at {first[1]}), as "
            "tensor parallelism does: it runs only with every rank taking part, so one rank cannot probe it "
            "alone; the loop and rank checks judge what the ranks recorded")
