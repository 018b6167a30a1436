"""Judging a traced step against the budget: the same verdict and remedies as the analytic mode, every
remedy derived from the one trace of fake_step.py (or, where shapes cannot tell T apart, traced again).

Measure, then judge: measure_traced runs the steps (TracedSteps, plain data) and judge_steps, a pure
function of those and the budget, gives the Verdict and its remedies.

Imports torch; the analytic mode never imports this module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tfdoctor.errors import SubjectError, UsageError
from tfdoctor.memory import derive
from tfdoctor.memory.analytic import Remedy, Verdict
from tfdoctor.memory.fake_step import PHASES, StepMeasure, fake_step
from tfdoctor.memory.kernels import changes_kernel, scores_note
from tfdoctor.subject import max_positions_of, vocab_size_of

# The shorter-sequence fallback (when the shapes cannot tell T apart) fits a quadratic through the
# step at T, T/2 and T/4, then traces the proposal, stepping down by this factor while it does not fit
# (the fit is close, not exact).
SEQ_STEP_DOWN = 0.97
SEQ_STEP_DOWNS = 3
# Gradient accumulation and ZeRO-3 are shown for this many GPUs when --gpus says one.
DEFAULT_SHARD_GPUS = 8
MIXED_CHANGE = "torch.autocast(dtype=torch.bfloat16) around the forward"


@dataclass
class TracedSteps:
    """What measure_traced measured: the step, what the model says of itself, and the steps traced again
    where the one trace cannot tell (None where nothing was traced again)."""

    main: StepMeasure
    positions: Optional[int]  # the model's largest sequence length, if it says
    parameter_count: int
    gradient_checkpointing: bool  # the model has gradient_checkpointing_enable() (Hugging Face)
    zero3_gpus: int  # the ZeRO-3 remedy's devices
    mixed_traced: Optional[int] = None  # bf16 traced again (it changes the attention kernel): its peak
    shorter_largest: Optional[int] = None  # traced lengths (T ambiguous): the largest vouched for
    shorter_proposal: Optional[tuple[int, int]] = None  # and (the length proposed, its peak), when shorter than T


def _no_progress(description: str, total: int) -> Callable[..., None]:
    return lambda n=1: None


def _wanted(remedies: bool, remedies_if_fits: bool, peak: int, budget: int) -> bool:
    return remedies and (remedies_if_fits or peak > budget)


def judge_traced(subject, target: str, batch: int, seq: int, budget: int, budget_source: str, *,
                 dtype: str = "fp32", optimizer: str = "adamw", gpus: int = 1, shard: str = "none",
                 remedies: bool = True, remedies_if_fits: bool = True, progress=None, device: Optional[str] = None):
    """Trace the step once, judge it, and derive the remedies from that trace (with
    remedies_if_fits=False, only when the step does not fit: the battery's check needs them then).

    progress follows tfdoctor.context.Progress: progress(description, total) -> advance(n=1); it is
    advanced once per phase of the trace, once for the remedies, and once per extra trace. device: the
    device (cpu, cuda) the model trains on, whose attention kernels are traced (default: its weights').
    """
    progress = progress or _no_progress
    subject, positions = _sized(subject, seq)
    # Under --shard every figure of the trace is already one rank's (fsdp_overlay.py), the derived
    # ones included; the ZeRO-3 remedy is a second view of the same trace.
    advance = progress(f"memory: tracing one training step at batch {batch} x seq {seq}", len(PHASES) + 1)
    steps = measure_traced(subject, batch, seq, budget, positions, dtype=dtype, optimizer=optimizer, gpus=gpus,
                           shard=shard, remedies=remedies, remedies_if_fits=remedies_if_fits, progress=progress,
                           advance=advance, device=device)
    verdict = judge_steps(steps, target, budget, budget_source, dtype=dtype, optimizer=optimizer, gpus=gpus,
                          shard=shard, remedies=remedies, remedies_if_fits=remedies_if_fits,
                          analytic=analytic_command(subject, batch, seq, dtype, optimizer))
    advance()
    return verdict


def _sized(subject, seq: int):
    """(the subject with its vocabulary size, the model's positions or None); refuses a --seq it cannot take."""
    model = subject.model
    if subject.vocab_size is None:
        vocab = vocab_size_of(model)
        if not vocab:
            raise SubjectError("cannot tell the vocabulary size: no config.vocab_size and no nn.Embedding",
                               "pass --vocab N")
        subject = dataclasses.replace(subject, vocab_size=vocab)
    positions = max_positions_of(model)
    if positions and seq > positions:
        raise UsageError(f"--seq {seq} is longer than the model's {positions} positions",
                         f"pass --seq {positions} or less, or build the model with more positions")
    return subject, positions


def measure_traced(subject, batch: int, seq: int, budget: int, positions: Optional[int], *, dtype: str,
                   optimizer: str, gpus: int, shard: str, remedies: bool, remedies_if_fits: bool, progress, advance,
                   device: Optional[str]) -> TracedSteps:
    """Trace the step, and trace again what the one trace cannot tell: bf16 where it changes the attention
    kernel, the shorter lengths where the shapes cannot tell T apart (searched against `budget`).
    `advance` is the step's progress task (one per phase); `progress` starts the shorter lengths' task."""
    model = subject.model
    autocast = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    zero3_gpus = gpus if gpus > 1 else DEFAULT_SHARD_GPUS
    main = fake_step(subject, batch, seq, optimizer=optimizer, autocast_dtype=autocast, on_phase=advance,
                     gpus=gpus, shard=shard, zero3_gpus=zero3_gpus if remedies else None, target=device)
    steps = TracedSteps(main, positions, sum(p.numel() for p in model.parameters()),
                        bool(getattr(model, "supports_gradient_checkpointing", False)), zero3_gpus)
    derivation = main.derivation
    if not _wanted(remedies, remedies_if_fits, main.peak_bytes, budget):
        return steps
    if derivation.mixed_peak is not None and changes_kernel(main.attention):
        # as on a GPU whose SDPA calls take the math path in float32 only for want of 16 bits (kernels.py)
        steps.mixed_traced = fake_step(subject, batch, seq, optimizer=optimizer, autocast_dtype=torch.bfloat16,
                                       gpus=gpus, shard=shard, target=device).peak_bytes
    if derivation.seq_ambiguous:
        steps.shorter_largest, steps.shorter_proposal = _traced_shorter(
            subject, batch, seq, optimizer, autocast, (gpus, shard, device), budget, positions, main.peak_bytes,
            progress)
    return steps


def analytic_command(subject, batch: int, seq: int, dtype: str, optimizer: str) -> str:
    """The `tfdoctor memory` command of the analytic mode for a GPT of this model's shape with fused
    attention (model-shape flags and a TARGET do not mix, so a note must give this one). The shape is
    read off a Hugging Face config's common names; what is not there stays a placeholder."""
    config = getattr(subject.model, "config", None)

    def read(*names):
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return str(value)
        return None

    width, depth, heads = _shape_of(subject.model, subject.vocab_size)
    shape = [("--d-model", read("hidden_size", "n_embd", "d_model") or width or "D"),
             ("--layers", read("num_hidden_layers", "n_layer", "num_layers") or depth or "L"),
             ("--heads", read("num_attention_heads", "n_head", "num_heads") or heads or "H"),
             ("--vocab", str(subject.vocab_size) if subject.vocab_size else "V")]
    extra = [f"--dtype {dtype}"] if dtype != "fp32" else []
    extra += [f"--optimizer {optimizer}"] if optimizer != "adamw" else []
    return " ".join(["tfdoctor memory", f"--batch {batch}", f"--seq {seq}",
                     *(f"{flag} {value}" for flag, value in shape), *extra, "--attention sdpa"])


def _shape_of(model, vocab) -> tuple:
    """(width, depth, heads) as strings read off a model without a config, or None each: the token
    embedding's width and the repeated blocks, found as depth-signal finds them (probes/depth.py), and
    an attention module's head count."""
    from tfdoctor.probes.depth import embedding_tables, find_stack

    token = embedding_tables(model, vocab).get("token")
    stack = find_stack(model)
    heads = next((str(value) for m in model.modules() for name in ("num_heads", "n_head", "n_heads", "nhead")
                  if isinstance(value := getattr(m, name, None), int) and value > 0), None)
    return (str(token[1].shape[1]) if token else None, str(len(stack.blocks)) if stack else None, heads)


def judge_steps(steps: TracedSteps, target: str, budget: int, budget_source: str, *, dtype: str, optimizer: str,
                gpus: int, shard: str, remedies: bool, remedies_if_fits: bool, analytic: str = "") -> Verdict:
    """The Verdict of measured steps against `budget`: whether it fits, the largest batch and length, and
    the remedies (derived from the trace, or read off the steps traced again)."""
    main = steps.main
    batch, seq = main.batch, main.seq
    derivation = main.derivation
    peak = main.peak_bytes
    positions = steps.positions

    found: list = []
    notes: list[str] = []
    largest_batch = derive.largest_batch(derivation.points, batch, budget)
    largest_seq: Optional[int] = None
    wanted = _wanted(remedies, remedies_if_fits, peak, budget)
    if not derivation.seq_ambiguous:
        largest_seq = derive.largest_seq(derivation.points, batch, seq, budget, limit=positions)
    if wanted:
        if derivation.mixed_peak is not None:
            found.append(_mixed_precision(steps, budget))
        if derivation.checkpoint_peak is not None:
            value = derivation.checkpoint_peak
            change = ("model.gradient_checkpointing_enable()" if steps.gradient_checkpointing
                      else f"torch.utils.checkpoint around each of the {derivation.blocks} blocks of the nn.ModuleList")
            found.append(Remedy("activation checkpointing", change + " (derived)", value, value <= budget))
        if batch > 1:
            micro = max(1, min(largest_batch or 1, batch - 1))
            while batch % micro:
                micro -= 1
            value = derivation.peak_at(micro, seq)
            found.append(Remedy("gradient accumulation", f"micro-batch {micro} x {batch // micro} accumulation "
                                "steps (derived)", value, value <= budget))
        if derivation.zero3_peak is not None:
            value = derivation.zero3_peak
            found.append(Remedy("ZeRO-3 / FSDP sharding", f"FSDP2 fully_shard on each block, then the model, over "
                                f"{steps.zero3_gpus} GPUs (derived)", value, value <= budget))
        if derivation.seq_ambiguous:
            largest_seq = steps.shorter_largest
            notes.append(f"{derivation.seq_ambiguous}, so the shapes cannot tell [.., T, T] scores from "
                         "[.., T, head size] tensors: the sequence lengths were traced")
            if steps.shorter_proposal is not None:
                found.append(_traced_shorter_remedy(*steps.shorter_proposal, budget))
        elif largest_seq is not None and largest_seq < seq:
            shorter = max(largest_seq, 1)
            value = derivation.peak_at(batch, shorter)
            change = f"--seq {shorter}, the largest that fits (derived)" if largest_seq else \
                "--seq 1 still does not fit (derived)"
            found.append(Remedy("shorter sequences", change, value, value <= budget, changes_training=True))
    elif derivation.seq_ambiguous:
        notes.append(f"{derivation.seq_ambiguous}: the largest sequence length is not derived")
    notes += [note] if (note := scores_note(main.attention, main.attention_scores_bytes, analytic)) else []
    traced = main.to_dict()
    traced.update(target=target, dtype=dtype, optimizer=optimizer, gpus=gpus, shard=shard,
                  parameter_count=steps.parameter_count, per_device_peak_bytes=peak, max_positions=positions)
    traced["peak_bytes"] = peak
    traced["notes"] = traced["notes"] + notes
    return Verdict(estimate=None, budget_bytes=budget, budget_source=budget_source, largest_seq=largest_seq,
                   largest_batch=largest_batch, remedies=found, mode="traced", traced=traced)


def _mixed_precision(steps: TracedSteps, budget: int) -> Remedy:
    """The bf16 autocast remedy: derived from the trace, or traced again where it changes the kernel, as
    on a GPU whose SDPA calls take the math path in float32 only for want of 16 bits (kernels.py)."""
    if steps.mixed_traced is None:
        value = steps.main.derivation.mixed_peak
        return Remedy("mixed precision", MIXED_CHANGE + " (derived)", value, value <= budget)
    value = steps.mixed_traced
    return Remedy("mixed precision", MIXED_CHANGE + " (traced: 16 bits let CUDA fuse attention)", value,
                  value <= budget)


def _traced_shorter_remedy(shorter: int, value: int, budget: int) -> Remedy:
    change = (f"--seq {shorter}, the largest that fits (traced)" if value <= budget else
              f"--seq {shorter} still does not fit (traced)")
    return Remedy("shorter sequences", change, value, value <= budget, changes_training=True)


def _traced_shorter(subject, batch, seq, optimizer, autocast, sharding, budget, positions, peak, progress):
    """The shorter-sequence lengths by tracing: a quadratic through the step at T, T/2 and T/4 places the
    largest length that fits, and the proposal is traced (stepping down while it does not fit), each
    per device under `sharding` (gpus, shard, the kernels' device). Returns (largest length vouched for,
    (the length proposed, its peak) or None when T fits)."""
    lengths = sorted({max(1, seq // 2), max(1, seq // 4)} - {seq})
    advance = progress("memory: tracing shorter sequences", len(lengths) + 1 + SEQ_STEP_DOWNS)
    traced = 0

    def run(t: int) -> int:
        nonlocal traced
        gpus, shard, device = sharding
        value = fake_step(subject, batch, t, optimizer=optimizer, autocast_dtype=autocast, gpus=gpus,
                          shard=shard, target=device).peak_bytes
        traced += 1
        advance()
        return value

    peaks = {t: run(t) for t in lengths}
    peaks[seq] = peak
    largest = derive.largest_quadratic(peaks, budget, limit=positions)
    proposal = None
    if largest < seq:
        shorter = max(largest, 1)
        value = run(shorter)
        for _ in range(SEQ_STEP_DOWNS):
            if value <= budget or shorter <= 1:
                break
            shorter = max(1, int(shorter * SEQ_STEP_DOWN))
            value = run(shorter)
        largest = shorter if value <= budget else None  # the fit was off: no length is vouched for
        proposal = (shorter, value)
    advance(len(lengths) + 1 + SEQ_STEP_DOWNS - traced)
    return largest, proposal
