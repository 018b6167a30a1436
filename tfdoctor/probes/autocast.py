"""One forward per reduced-precision autocast dtype, compared with the model's own precision, with
every constant that goes into a float16/bfloat16 tensor watched (half-precision-mask's measurement)."""

from __future__ import annotations

import torch

from tfdoctor.errors import first_line
from tfdoctor.probes.attention import watching_constants
from tfdoctor.subject import Subject, call
from tfdoctor.usercode.call_sites import raised_outside_tfdoctor

# Out-of-range constants listed per dtype in the details (a constant used in every layer repeats
# once per layer); the count covers them all.
CONSTANTS_LISTED = 10


def _listed(constants) -> dict:
    return {"constants": [c.to_dict() for c in constants[:CONSTANTS_LISTED]], "constants_seen": len(constants)}


def _raised(exc: BaseException, constants) -> dict:
    """The model could not run this variant: the error, where the model's code made the failing call
    (not the frame of tfdoctor's constant watcher, which re-runs every op), and the constants seen."""
    return {"outcome": "raised", "error": first_line(exc), "at": raised_outside_tfdoctor(exc), **_listed(constants)}


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
            return _raised(exc, constants)
        except Exception as exc:  # the model's own forward under a variant it may not support
            return _raised(exc, constants)
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
