"""Cached decoding against one full forward: a prefill, then one token at a time, driven by the
Subject's incremental function or, for a Hugging Face model, by the model's own generate()."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tfdoctor.probes.dependency import finite_scale
from tfdoctor.probes.generation import decode_as_generate, without_stop_tokens
from tfdoctor.subject import Subject, call, extract_logits, random_tokens
from tfdoctor.tolerances import EQUIVALENCE_TOLERANCE

# Tokens decoded one at a time after the prefill. A skipped causal mask shows in the prefill, an
# offset cache position at the first decoded token; 8 steps also show a drift.
DECODE_STEPS = 8


# What a model's own code raises when it cannot run a variant (a padded mask, another kernel), or
# where its library breaks (transformers 5.25's BLT reads config.num_hidden_layers, which its config
# lacks, as soon as generate() builds its cache: AttributeError). raised_by_model tells them from
# tfdoctor's own.
MODEL_ERRORS = (RuntimeError, ValueError, IndexError, TypeError, AssertionError, NotImplementedError,
                AttributeError, KeyError)


class NotComparable(Exception):
    """The model's decoding has nothing to compare (no cache kept): a reason to skip, not a fault."""


def _frames(exc: BaseException) -> list:
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def _torch_root() -> str:
    import os

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def modified_in_place(exc: BaseException) -> bool:
    """An autograd error on a tensor the forward saved and then changed in place: raised in the
    backward() tfdoctor calls, but caused by the model's forward (transformers 5.25's xLSTM updates
    its recurrent state in place when use_cache=True, in train and eval mode alike)."""
    return isinstance(exc, RuntimeError) and "modified by an inplace operation" in str(exc)


def raised_by_model(exc: BaseException) -> bool:
    """Whether the exception comes from the model's (or its library's) code: the innermost frame
    outside torch itself is not tfdoctor's, or autograd refused a graph the forward changed in place.
    tfdoctor's own exceptions stay errors."""
    import os

    import tfdoctor

    if modified_in_place(exc):
        return True
    ours = os.path.dirname(os.path.abspath(tfdoctor.__file__)) + os.sep
    library = _torch_root()
    files = [os.path.abspath(f) for f, _ in _frames(exc)]
    innermost = next((f for f in reversed(files) if not f.startswith(library)), None)
    return innermost is not None and not innermost.startswith(ours)


def library_crash(exc: BaseException) -> Optional[str]:
    """Where an installed library other than torch raised `exc` ("transformers/cache_utils.py:2121"),
    when no user code is on its way (a library's model class used as it is): the library's crash,
    not the user's model's. None when the user's code is in the traceback, or no such library is."""
    import os

    from tfdoctor.usercode.call_sites import is_library

    torch_root = _torch_root()
    frames = _frames(exc)
    if any(not is_library(f) for f, _ in frames):  # "<frozen ...>" is no user file: is_library sees the raw name
        return None
    for path, line in reversed([(os.path.abspath(f), line) for f, line in frames]):
        for marker in (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}"):
            if marker in path and not path.startswith(torch_root):
                return f"{path.split(marker, 1)[1]}:{line}"
    return None


@dataclass
class CacheComparison:
    label: str  # "unpadded" or "left-padded prompts"
    prefill: int  # tokens given to the first (cached) call
    diff: torch.Tensor  # [L] largest logit difference at each position over the batch's real tokens
    scale: float
    details: dict = field(default_factory=dict)
    shape_defect: Optional[dict] = None  # a call whose logits were not [B, t, V]: what it got and gave
    rerun_full: Optional[Callable[[], torch.Tensor]] = None  # the full forward again (randomness test)
    full: Optional[torch.Tensor] = None
    steps: Optional[torch.Tensor] = None  # [B, L, V] the cached logits
    compared: Optional[torch.Tensor] = None  # [B, L] the positions compared
    forward_upto: Optional[Callable[[int], torch.Tensor]] = None  # full forward of the first n tokens
    rerun_steps: Optional[Callable[[], torch.Tensor]] = None  # the cached decoding again (randomness test)

    @property
    def tolerance(self) -> float:
        return EQUIVALENCE_TOLERANCE * max(self.scale, 1e-30)

    @property
    def relative(self) -> float:
        return float(self.diff.max()) / max(self.scale, 1e-30) if self.diff.numel() else 0.0

    def uncached_gap(self, at: int) -> float:
        """The cached logits at position `at` against a forward without cache of the tokens generation
        had then (the prompt for a prefill position, tokens 0..at for a decoded one)."""
        n = self.prefill if at < self.prefill else at + 1
        with torch.no_grad():
            reference = self.forward_upto(n).float()
        gap = (self.steps[:, at].to(reference.device) - reference[:, at]).abs().amax(-1)
        gap = torch.nan_to_num(gap, nan=float("inf")).masked_fill(~self.compared[:, at].to(gap.device), 0.0)
        return float(gap.max())

    def first_divergence(self) -> Optional[int]:
        over = (self.diff > self.tolerance).nonzero()
        return int(over[0]) if over.numel() else None


def cache_lengths(subject: Subject) -> tuple[int, int]:
    """(prefill, total): half the probe length as the prompt, then up to DECODE_STEPS tokens."""
    T = subject.seq_len
    prefill = max(2, T // 2) if T >= 3 else 1
    return prefill, min(T, prefill + DECODE_STEPS)


def generation_positions(real: torch.Tensor) -> torch.Tensor:
    """Position ids as generate() builds them from the attention mask (pads at 0)."""
    return (real.long().cumsum(-1) - 1).masked_fill(~real, 0)


def _full_forward(model, ids: torch.Tensor, real: torch.Tensor, given: set) -> torch.Tensor:
    """One forward of the whole sequence with what generate() gave its first call (`given`, the
    argument names): the attention mask, and position ids from it, where generate passed them; no
    cache."""
    kwargs = {"input_ids": ids}
    if "attention_mask" in given:
        kwargs["attention_mask"] = real.long()
    if "position_ids" in given:
        kwargs["position_ids"] = generation_positions(real)
    if "use_cache" in given:
        kwargs["use_cache"] = False
    return extract_logits(model(**kwargs)).float()


def _probe_batch(subject: Subject, generator: torch.Generator, left_padded: bool):
    prefill, total = cache_lengths(subject)
    B = subject.batch_size
    ids = random_tokens(subject, B, total, generator)
    real = torch.ones(B, total, dtype=torch.bool, device=ids.device)
    if left_padded:
        pad = subject.pad_id if subject.pad_id is not None else 0
        for r in range(1, B):  # row 0 keeps its whole prompt; the others lose a growing share to pads
            count = min(prefill - 1, r * prefill // B)
            ids[r, :count] = pad
            real[r, :count] = False
    return ids, real, prefill


def _shape_defect(logits: list[torch.Tensor], fed: list[int], B: int, V: int) -> Optional[int]:
    """The first call whose logits are not [B, n, V] with 1 <= n <= the tokens it was fed."""
    for k, (out, n) in enumerate(zip(logits, fed)):
        if out.dim() != 3 or out.shape[0] != B or out.shape[2] != V or not 1 <= out.shape[1] <= max(n, 1):
            return k
    return None


def _via_generate(subject: Subject, ids, real, prefill: int) -> CacheComparison:
    model = subject.model
    ids = without_stop_tokens(model, ids, prefill, subject.vocab_size)
    run = decode_as_generate(model, ids, real, prefill, subject.pad_id if subject.pad_id is not None else 0)
    calls = [{"input_ids": [ids.shape[0], c.fed], "logits": c.logits_shape, "arguments": c.arguments}
             for c in run.calls[:2]]
    if not run.calls:
        raise NotComparable(f"{type(model).__name__}.generate() never called the model's forward")
    refed = run.refeeds()
    if refed is not None:
        raise NotComparable(f"{type(model).__name__}.generate() feeds the whole sequence again at every step "
                            f"({refed.fed} tokens on a decoding call): the model keeps no cache, so there is no "
                            "cached decoding to compare")
    if run.calls[0].fed != prefill:
        raise NotComparable(f"{type(model).__name__}.generate() fed {run.calls[0].fed} tokens for a {prefill}-token "
                            "prompt (it adds tokens of its own), so its steps cannot be lined up with a full forward")
    given = set(run.calls[0].arguments)
    full = _full_forward(model, ids, real, given)
    B, total, V = full.shape
    details = {"driver": "generate", "decoding_calls": calls}
    bad = _shape_defect(run.logits, [c.fed for c in run.calls], B, V)
    if bad is not None:
        call_ = run.calls[bad]
        defect = {"call": bad, "input_ids": [B, call_.fed], "logits": call_.logits_shape, "expected": [B, call_.fed, V],
                  "arguments": call_.arguments}
        return CacheComparison("", prefill, torch.zeros(total), finite_scale(full), details, defect)
    steps, covered = _lined_up(run, full, prefill)
    details["positions_compared"] = int(covered.sum())
    compared = real & covered.to(real.device)[None]
    diff, scale = _compare_steps(full, steps, compared)
    pad = subject.pad_id if subject.pad_id is not None else 0
    return CacheComparison("", prefill, diff, scale, details, rerun_full=lambda: _full_forward(model, ids, real, given),
                           full=full, steps=steps, compared=compared,
                           forward_upto=lambda n: _full_forward(model, ids[:, :n], real[:, :n], given),
                           rerun_steps=lambda: _lined_up(decode_as_generate(model, ids, real, prefill, pad), full,
                                                         prefill)[0])


def _lined_up(run, full: torch.Tensor, prefill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of generate()'s calls at the positions they predict from: ([B, L, V], covered [L])."""
    total = full.shape[1]
    steps = torch.zeros_like(full)
    covered = torch.zeros(total, dtype=torch.bool)
    first = run.logits[0]
    steps[:, prefill - first.shape[1]:prefill] = first.to(full.device)
    covered[prefill - first.shape[1]:prefill] = True
    for k, out in enumerate(run.logits[1:total - prefill + 1]):  # call k + 1 was fed position prefill + k
        steps[:, prefill + k] = out[:, -1].to(full.device)
        covered[prefill + k] = True
    return steps, covered


def _incremental_outputs(subject: Subject, ids, prefill: int) -> list:
    first, state = subject.incremental(subject.model, ids[:, :prefill].contiguous(), None)
    outputs = [extract_logits(first)]
    for i in range(prefill, ids.shape[1]):
        step, state = subject.incremental(subject.model, ids[:, i:i + 1].contiguous(), state)
        outputs.append(extract_logits(step))
    return outputs


def _incremental_steps(subject: Subject, ids, prefill: int) -> torch.Tensor:
    return torch.cat([o.float() for o in _incremental_outputs(subject, ids, prefill)], dim=1)


def _via_incremental(subject: Subject, ids, prefill: int) -> CacheComparison:
    full = call(subject, ids).float()
    outputs = _incremental_outputs(subject, ids, prefill)
    fed = [prefill] + [1] * (len(outputs) - 1)
    B, _, V = full.shape
    bad = _shape_defect(outputs, fed, B, V)
    if bad is not None or sum(o.shape[1] for o in outputs) != full.shape[1]:
        from tfdoctor.errors import SubjectError

        k = bad if bad is not None else 0
        raise SubjectError(f"incremental(model, input_ids [{B}, {fed[k]}], state) returned logits "
                           f"{list(outputs[k].shape)} on call {k + 1} (the full forward gives {list(full.shape)})",
                           "return logits [B, t, V] for the t tokens given at each call")
    steps = torch.cat([o.float() for o in outputs], dim=1)
    real = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    diff, scale = _compare_steps(full, steps, real)
    return CacheComparison("", prefill, diff, scale, {"driver": "incremental"},
                           rerun_full=lambda: call(subject, ids).float(), full=full, steps=steps, compared=real,
                           forward_upto=lambda n: call(subject, ids[:, :n]).float(),
                           rerun_steps=lambda: _incremental_steps(subject, ids, prefill))


def _compare_steps(full: torch.Tensor, steps: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, float]:
    gap = torch.nan_to_num((steps.to(full.device) - full).abs().amax(-1), nan=float("inf"), posinf=float("inf"))
    gap = gap.masked_fill(~real, 0.0)  # [B, L]
    scale = finite_scale(full[real]) if bool(real.any()) else 0.0
    return gap.amax(0).cpu(), scale


def compare_cache(subject: Subject, generator: torch.Generator, left_padded: bool = False) -> CacheComparison:
    """Prefill then one token at a time through the model's cache (Subject.incremental when given,
    else the model's own generate()), against one full forward. Raises NotComparable when the
    model's generate() keeps no cache.
    left_padded: prompts of different lengths left-padded in one batch with their attention mask, as
    batched generation runs them (Hugging Face only)."""
    ids, real, prefill = _probe_batch(subject, generator, left_padded)
    with torch.no_grad():
        if subject.incremental is None:
            comparison = _via_generate(subject, ids, real, prefill)
        else:
            comparison = _via_incremental(subject, ids, prefill)
    comparison.label = "left-padded prompts" if left_padded else "unpadded"
    if left_padded:
        comparison.details["pads_per_row"] = (~real[:, :prefill]).sum(1).tolist()
    return comparison


def crash_reason(model: torch.nn.Module, exc: BaseException) -> str:
    """What to say when the model's generate() raised: the library's crash, named with its release
    and the line that raised, or the model's."""
    from tfdoctor.errors import first_line
    from tfdoctor.probes.implementations import library_release

    name = type(model).__name__
    where = library_crash(exc)
    if where is not None:
        return (f"{name}'s cached decoding crashes inside {library_release(model)} itself ({first_line(exc)}, "
                f"raised at {where}): the library's failure, not your model's")
    return f"{name}.generate() raises {first_line(exc)}"
