"""`tfdoctor check TARGET`: the battery of checks on a model factory (and, with --train, its loop)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tfdoctor.cli.app import DEFAULT_TIMEOUT, DEFAULT_TIMEOUT_PER_CHECK, Format, Kind, Packing, PaddingSide, Task, app
from tfdoctor.cli.flags import check_battery_flags, format_ready, model_fields, positive, writable
from tfdoctor.cli.outcome import fail_usage, finish, report_from_outcome, supervised
from tfdoctor.errors import TfdoctorError


@app.command()
def check(
    target: str = typer.Argument(..., help="package.module:attr or path/to/file.py:attr: a factory, "
                                           "nn.Module or tfdoctor.Subject"),
    train: Optional[str] = typer.Option(None, "--train", help="MODULE:FN of your training loop train(model, batches)"),
    train_batches: Optional[int] = typer.Option(None, "--train-batches", help="--train: batches fed to your loop "
                                                                           "(default 16)"),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="vocabulary size (default: config or first nn.Embedding)"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="probe sequence length (default 32, capped by the model)"),
    batch: Optional[int] = typer.Option(None, "--batch", help="probe batch size (default 4)"),
    pad_id: Optional[int] = typer.Option(None, "--pad-id", help="padding token id"),
    eos_id: Optional[int] = typer.Option(None, "--eos-id", help="end-of-sequence token id (default: tokenizer or "
                                                                "config eos_token_id)"),
    kind: Optional[Kind] = typer.Option(None, "--kind", help="causal, encoder or seq2seq (default: what the model announces, else causal)"),
    task: Optional[Task] = typer.Option(None, "--task", help="what the model predicts: lm, sequence-classification, "
                                                           "token-classification, regression, question-answering or "
                                                           "multiple-choice (default: detected)"),
    only: Optional[str] = typer.Option(None, "--only", help="run only these check ids (comma-separated)"),
    skip: Optional[str] = typer.Option(None, "--skip", help="skip these check ids (comma-separated)"),
    fmt: Format = typer.Option(Format.rich, "--format", help="report format"),
    output: Optional[Path] = typer.Option(None, "--output", help="write the report to this file instead of stdout"),
    strict: bool = typer.Option(False, "--strict", help="treat warnings as failures"),
    seed: int = typer.Option(0, "--seed", help="seed for the random probe tokens"),
    device: Optional[str] = typer.Option(None, "--device", help="move the model to this device (e.g. cpu, cuda)"),
    train_batch: Optional[int] = typer.Option(None, "--train-batch", help="memory check: training batch size"),
    train_seq: Optional[int] = typer.Option(None, "--train-seq", help="memory check: training sequence length"),
    budget: Optional[str] = typer.Option(None, "--budget", help="memory check: budget, e.g. 24GiB (default: available memory)"),
    padding_side: Optional[PaddingSide] = typer.Option(None, "--padding-side", help="where your batches' pads sit: "
                                                                                   "left or right (default: unknown)"),
    packing: Optional[Packing] = typer.Option(None, "--packing", help="how your model is fed packed documents: "
                                                                      "position_ids (the Hugging Face convention)"),
    timeout: float = typer.Option(DEFAULT_TIMEOUT, "--timeout", help="seconds the whole run may take"),
    timeout_per_check: float = typer.Option(DEFAULT_TIMEOUT_PER_CHECK, "--timeout-per-check",
                                            help="seconds each check (and loading the target) may take"),
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
    finish(outcome, report_from_outcome(outcome, target, strict), fmt, output)
