"""Where the budget comes from: --budget SIZE, else this machine's available memory (psutil), else with
--device cuda the GPU's free memory. Torch is imported only for the GPU case."""

from __future__ import annotations

from tfdoctor.errors import UsageError
from tfdoctor.memory.sizes import format_bytes, parse_size


def resolve_budget(text: str | None, device: str | None = None) -> tuple[int, str]:
    """(bytes, where the figure came from)."""
    if text is not None:
        return parse_size(text), f"--budget {text}"
    if device and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA device is available", "pass --budget SIZE instead")
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return free, f"free memory of {device} ({format_bytes(free)} of {format_bytes(total)})"
    if device not in (None, "cpu"):
        raise UsageError(f"--device {device!r} is not cpu or cuda[:N]", "pass --budget SIZE for other devices")
    import psutil

    available = psutil.virtual_memory().available
    return available, "available memory of this machine"
