"""`tfdoctor memory`: the peak memory of a training step, analytic from model shape flags or traced
from a TARGET."""

from __future__ import annotations

import enum
from typing import Optional

import typer

from tfdoctor.cli.app import app
from tfdoctor.cli.flags import format_ready, positive, writable
from tfdoctor.cli.options import DEFAULT_TIMEOUT, DEFAULT_TIMEOUT_PER_CHECK, Output
from tfdoctor.cli.outcome import end_command, fail_usage, supervised
from tfdoctor.errors import TfdoctorError, UsageError
from tfdoctor.process.protocol import Ended
from tfdoctor.result import ExitCode


class MemoryDtype(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Attention(str, enum.Enum):
    naive = "naive"
    sdpa = "sdpa"


class Checkpointing(str, enum.Enum):
    none = "none"
    full = "full"


class Optimizer(str, enum.Enum):
    adamw = "adamw"
    sgd = "sgd"
    none = "none"


class Shard(str, enum.Enum):
    none = "none"
    zero1 = "zero1"
    zero2 = "zero2"
    zero3 = "zero3"


class MemoryFormat(str, enum.Enum):
    rich = "rich"
    json = "json"
    html = "html"


@app.command()
def memory(
    target: Optional[str] = typer.Argument(None, help="trace this model factory (as for `check`); "
                                                      "without it, estimate a GPT-2-style decoder analytically"),
    batch: int = typer.Option(..., "--batch", help="batch size per device"),
    seq: int = typer.Option(..., "--seq", help="sequence length"),
    d_model: Optional[int] = typer.Option(None, "--d-model", help="analytic: model width (default 512)"),
    heads: Optional[int] = typer.Option(None, "--heads", help="analytic: attention heads (default d_model / 64)"),
    layers: Optional[int] = typer.Option(None, "--layers", help="analytic: layers (default 6)"),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="vocabulary (analytic default 50257; traced: "
                                                              "the model's)"),
    d_ff: Optional[int] = typer.Option(None, "--d-ff", help="analytic: MLP width (default 4 x d_model)"),
    tied: bool = typer.Option(False, "--tied", help="analytic: LM head tied to the token embedding"),
    dtype: MemoryDtype = typer.Option(MemoryDtype.fp32, "--dtype", help="fp32, or bf16/fp16 mixed precision "
                                                                        "(float32 weights and states)"),
    attention: Optional[Attention] = typer.Option(None, "--attention", help="analytic: naive (stores T x T) or "
                                                                            "sdpa (fused; default naive)"),
    checkpointing: Optional[Checkpointing] = typer.Option(None, "--checkpointing", help="analytic: activation "
                                                                                      "checkpointing (default none)"),
    optimizer: Optimizer = typer.Option(Optimizer.adamw, "--optimizer", help="adamw, sgd, or none (inference)"),
    gpus: int = typer.Option(1, "--gpus", help="data-parallel devices; figures are per device"),
    shard: Shard = typer.Option(Shard.none, "--shard", help="ZeRO stage: none, zero1, zero2, zero3"),
    budget: Optional[str] = typer.Option(None, "--budget", help="e.g. 24GiB or 80GB (default: available memory, "
                                                                "or the GPU's free memory with --device cuda)"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda[:N]: whose memory is the default budget "
                                                                "and whose attention kernels a TARGET runs"),
    fmt: MemoryFormat = typer.Option(MemoryFormat.rich, "--format", help="report format (html: give --output FILE)"),
    output: Output = None,
) -> None:
    """Predict the peak memory of one training step, what makes it, and which remedy brings it under budget.

    Exit 0 when it fits, 1 when it is predicted out of memory, 2 on a usage error.
    """
    try:
        positive("--batch", batch)
        positive("--seq", seq)
        positive("--gpus", gpus)
        writable(output)
        format_ready(fmt)
        from tfdoctor.memory.budget import resolve_budget

        budget_bytes, source = resolve_budget(budget, device)
        if target is None:
            from tfdoctor.memory.analytic import DEFAULT_D_MODEL, DEFAULT_LAYERS, DEFAULT_VOCAB, Config, judge

            config = Config(batch=batch, seq=seq, d_model=d_model or DEFAULT_D_MODEL, heads=heads,
                            layers=layers or DEFAULT_LAYERS, vocab=vocab or DEFAULT_VOCAB, d_ff=d_ff,
                            dtype=dtype.value, attention=(attention or Attention.naive).value,
                            checkpointing=(checkpointing or Checkpointing.none).value, optimizer=optimizer.value,
                            gpus=gpus, shard=shard.value, tied=tied)
            for name, value in (("--d-model", d_model), ("--layers", layers), ("--vocab", vocab)):
                positive(name, value)
            verdict = judge(config.validated(), budget_bytes, source)
        else:
            shape_flags = [name for name, value in (("--d-model", d_model), ("--heads", heads), ("--layers", layers),
                                                    ("--d-ff", d_ff), ("--attention", attention),
                                                    ("--checkpointing", checkpointing)) if value is not None]
            if tied:
                shape_flags.append("--tied")
            if shape_flags:
                raise UsageError(f"{', '.join(shape_flags)} describe the analytic model, not a traced TARGET",
                                 "drop them: the traced model's own code decides")
            positive("--vocab", vocab)
            verdict = None
    except TfdoctorError as error:
        fail_usage(error)
    if verdict is None:  # traced: the user's code runs in the supervised worker, as for `check`
        request = dict(command="memory", target=target, vocab=vocab, batch=batch, seq=seq, budget_bytes=budget_bytes,
                       budget_source=source, dtype=dtype.value, optimizer=optimizer.value, gpus=gpus,
                       shard=shard.value, device=device)
        outcome = supervised(request, fmt is MemoryFormat.rich, DEFAULT_TIMEOUT, DEFAULT_TIMEOUT_PER_CHECK)
        if outcome.ended != Ended.DONE or outcome.verdict is None:
            end_command(None, fmt, output, error=outcome.message or "the trace delivered no verdict")
        verdict = outcome.verdict
    end_command(verdict, fmt, output, code=ExitCode.OK if verdict.fits else ExitCode.CHECKS_FAILED)
