"""One forward per reduced-precision autocast dtype, compared with the model's own precision, with
every constant that goes into a float16/bfloat16 tensor watched (half-precision-mask's measurement)."""

from __future__ import annotations

import traceback

import torch

from tfdoctor.errors import first_line
from tfdoctor.probes.attention import watching_constants
from tfdoctor.subject import Subject, call

# Out-of-range constants listed per dtype in the details (a constant used in every layer repeats
# once per layer); the count covers them all.
CONSTANTS_LISTED = 10


def _listed(constants) -> dict:
    return {"constants": [c.to_dict() for c in constants[:CONSTANTS_LISTED]], "constants_seen": len(constants)}


def _raised_at(exc: BaseException) -> str:
    """file:line of the innermost frame the exception passed through."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def autocast_run(subject: Subject, device: str, dtype: torch.dtype, inputs: tuple,
                 reference: torch.Tensor) -> dict:
    """The forward on `inputs` under torch.autocast(device, dtype), in the caller's mode and grad
    setting, against `reference` (float32 logits of the model's own precision on the same inputs).

    outcome: "finite", "non-finite" (NaN/Inf where the reference is finite), "overflow error" (a
    constant that does not fit the dtype), or "raised" (the model cannot run this variant at all:
    the exception and where it was raised)."""
    with watching_constants(subject.model, (dtype,)) as constants:
        try:
            with torch.autocast(device, dtype=dtype):
                logits = call(subject, *inputs).float()
        except RuntimeError as exc:
            if "overflow" in str(exc):
                return {"outcome": "overflow error", "error": str(exc), **_listed(constants)}
            return {"outcome": "raised", "error": first_line(exc), "at": _raised_at(exc), **_listed(constants)}
        except Exception as exc:  # the model's own forward under a variant it may not support
            return {"outcome": "raised", "error": first_line(exc), "at": _raised_at(exc), **_listed(constants)}
    expected = torch.isfinite(reference)
    finite = torch.isfinite(logits)
    broken = expected & ~finite
    difference = (logits - reference).abs()
    both = finite & expected
    return {
        "outcome": "non-finite" if bool(broken.any()) else "finite",
        "nonfinite_outputs": int(broken.sum()), "outputs": finite.numel(),
        "max_abs_difference": float(difference[both].max()) if bool(both.any()) else None,
        **_listed(constants),
    }
