"""`tfdoctor check TARGET`: the battery of checks on a model factory (and, with --train, its loop)."""

from __future__ import annotations

from typing import Optional

import typer

from tfdoctor.cli.app import app
from tfdoctor.cli.flags import check_battery_flags, format_ready, model_fields, positive, writable
from tfdoctor.cli.options import (
    DEFAULT_SEED,
    DEFAULT_TIMEOUT,
    DEFAULT_TIMEOUT_PER_CHECK,
    EosId,
    Fmt,
    Format,
    ModelKind,
    ModelTask,
    Only,
    Output,
    PackedAs,
    Padding,
    PadId,
    ProbeBatch,
    ProbeSeed,
    SeqLen,
    Skip,
    Strict,
    Timeout,
    TimeoutPerCheck,
    Vocab,
)
from tfdoctor.cli.outcome import end_command, fail_usage, report_from_outcome, stopped, supervised
from tfdoctor.errors import TfdoctorError


@app.command()
def check(
    target: str = typer.Argument(..., help="package.module:attr or path/to/file.py:attr: a factory, "
                                           "nn.Module or tfdoctor.Subject"),
    train: Optional[str] = typer.Option(None, "--train", help="MODULE:FN of your training loop train(model, batches)"),
    train_batches: Optional[int] = typer.Option(None, "--train-batches", help="--train: batches fed to your loop "
                                                                           "(default 16)"),
    vocab: Vocab = None,
    seq_len: SeqLen = None,
    batch: ProbeBatch = None,
    pad_id: PadId = None,
    eos_id: EosId = None,
    kind: ModelKind = None,
    task: ModelTask = None,
    only: Only = None,
    skip: Skip = None,
    fmt: Fmt = Format.rich,
    output: Output = None,
    strict: Strict = False,
    seed: ProbeSeed = DEFAULT_SEED,
    device: Optional[str] = typer.Option(None, "--device", help="move the model to this device (e.g. cpu, cuda)"),
    train_batch: Optional[int] = typer.Option(None, "--train-batch", help="memory check: training batch size"),
    train_seq: Optional[int] = typer.Option(None, "--train-seq", help="memory check: training sequence length"),
    budget: Optional[str] = typer.Option(None, "--budget", help="memory check: budget, e.g. 24GiB (default: "
                                                                "available memory)"),
    padding_side: Padding = None,
    packing: PackedAs = None,
    timeout: Timeout = DEFAULT_TIMEOUT,
    timeout_per_check: TimeoutPerCheck = DEFAULT_TIMEOUT_PER_CHECK,
) -> None:
    """Run the battery of checks on a model factory and report what is wrong."""
    try:
        check_battery_flags(vocab, seq_len, batch, pad_id, seed, timeout, timeout_per_check, only, skip)
        positive("--eos-id", eos_id, 0)
        positive("--train-batch", train_batch)
        positive("--train-seq", train_seq)
        positive("--train-batches", train_batches)
        if budget is not None:
            from tfdoctor.memory.sizes import parse_size

            parse_size(budget)  # a malformed size is a usage error now, not a check error later
        options = {k: v for k, v in dict(train_batch=train_batch, train_seq=train_seq, budget=budget,
                                         train_batches=train_batches,
                                         timeout_per_check=timeout_per_check).items() if v is not None}
        writable(output)
        format_ready(fmt)
    except TfdoctorError as error:
        fail_usage(error)
    fields = model_fields(vocab, seq_len, batch, pad_id, kind, padding_side, packing, eos_id, task)
    request = dict(command="check", target=target, train=train, fields=fields, only=only, skip=skip, seed=seed,
                   device=device, options=options)
    outcome = supervised(request, fmt is Format.rich, timeout, timeout_per_check)
    end_command(report_from_outcome(outcome, target, strict), fmt, output, error=stopped(outcome))
