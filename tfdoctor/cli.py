"""The `tfdoctor` command: parse, call, render, exit. The only module that prints or exits.

Torch is imported only by the commands that need it, so `--help`, `checks` and the analytic
`memory` stay fast.
"""

from __future__ import annotations

import enum
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from tfdoctor.errors import TfdoctorError, UsageError
from tfdoctor.result import ExitCode

app = typer.Typer(
    name="tfdoctor",
    help="A doctor for Transformer training code: finds the bugs that make training look better.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,
)


class Format(str, enum.Enum):
    rich = "rich"
    json = "json"
    junit = "junit"


class Kind(str, enum.Enum):
    causal = "causal"
    encoder = "encoder"
    seq2seq = "seq2seq"


def _fail_usage(error: TfdoctorError) -> None:
    typer.echo(f"tfdoctor: error: {error.one_line()}", err=True)
    raise typer.Exit(ExitCode.USAGE_ERROR)


def _positive(name: str, value: Optional[int], minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise UsageError(f"{name} must be at least {minimum}, got {value}")


def _show_version(value: bool) -> None:
    if value:
        from tfdoctor import __version__

        typer.echo(f"tfdoctor {__version__}")
        raise typer.Exit(ExitCode.OK)


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", help="print the version and exit", is_eager=True,
                                 callback=_show_version),
) -> None:
    """A doctor for Transformer training code: finds the bugs that make training look better."""


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
    kind: Optional[Kind] = typer.Option(None, "--kind", help="causal, encoder or seq2seq (default causal)"),
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
) -> None:
    """Run the battery of checks on a model factory and report what is wrong."""
    try:
        _positive("--vocab", vocab)
        _positive("--seq-len", seq_len, 2)
        _positive("--batch", batch)
        _positive("--pad-id", pad_id, 0)
        _positive("--train-batch", train_batch)
        _positive("--train-seq", train_seq)
        _positive("--train-batches", train_batches)
        if budget is not None:
            from tfdoctor.memory.sizes import parse_size

            parse_size(budget)  # a malformed size is a usage error now, not a check error later
        options = {k: v for k, v in dict(train_batch=train_batch, train_seq=train_seq, budget=budget,
                                         train_batches=train_batches).items() if v is not None}
        from tfdoctor.registry import select

        select(only, skip)  # unknown ids are a usage error before anything is loaded
        report = _run_check(target, train, vocab, seq_len, batch, pad_id, kind, only, skip, fmt, seed, device,
                            options)
    except TfdoctorError as error:
        _fail_usage(error)
    report.strict = strict
    _emit(report, fmt, output)
    raise typer.Exit(report.exit_code())


def _run_check(target, train, vocab, seq_len, batch, pad_id, kind, only, skip, fmt, seed, device,
                            options):
    from tfdoctor.loader import load_function, load_subject
    from tfdoctor.runner import run_checks

    subject = load_subject(target)
    train_fn = load_function(train) if train else None
    if device:
        subject = _move(subject, device)
    fields = dict(vocab_size=vocab, seq_len=seq_len, batch_size=batch, pad_id=pad_id,
                  kind=kind.value if kind else None, train=train_fn)
    with _progress(fmt is Format.rich) as start:
        return run_checks(subject, only, skip, seed=seed, target=target, progress=start, options=options,
                          **fields)


def _progress(wanted: bool):
    """The terminal bar when the report is for people; nothing in JSON/JUnit mode or off a terminal."""
    import contextlib

    from tfdoctor.report.progress import terminal_progress

    return terminal_progress() if wanted else contextlib.nullcontext(None)


def _move(subject, device: str):
    import torch

    from tfdoctor.runner import as_subject

    try:
        torch_device = torch.device(device)
        subject = as_subject(subject)
        subject.model.to(torch_device)
    except (RuntimeError, AssertionError) as exc:
        raise UsageError(f"cannot use device {device!r}: {exc}") from exc
    return subject


def _emit(report, fmt: Format, output: Optional[Path]) -> None:
    from tfdoctor.report import render

    if output is not None:
        with open(output, "w", encoding="utf-8") as out:
            render(report, fmt.value, out, width=100)
        typer.echo(f"tfdoctor: report written to {output}", err=True)
    else:
        render(report, fmt.value, sys.stdout)


@app.command("checks")
def list_checks(
    check_id: Optional[str] = typer.Argument(None, help="show this check's full documentation"),
) -> None:
    """List every check: id, title and what it catches (or one check's full documentation)."""
    from rich.console import Console
    from rich.table import Table

    from tfdoctor.registry import all_checks, select

    console = Console()
    if check_id is not None:
        try:
            (spec,) = select(only=check_id)
        except (TfdoctorError, ValueError) as error:
            _fail_usage(error if isinstance(error, TfdoctorError) else UsageError("give one check id"))
        console.print(f"[bold]{spec.id}[/bold]: {spec.title}", highlight=False)
        console.print(f"applies to: {', '.join(spec.kinds)} models"
                      + (f"; needs {', '.join(spec.needs)}" if spec.needs else ""), highlight=False)
        for paragraph in spec.doc.split("\n\n"):  # reflowed to the terminal's width
            console.print()
            console.print(" ".join(paragraph.split()), highlight=False, markup=False)
        return
    table = Table(show_lines=True)
    table.add_column("id", style="bold", no_wrap=True)
    table.add_column("title")
    table.add_column("what it catches")
    for spec in all_checks():
        table.add_row(spec.id, spec.title, spec.summary)
    console.print(table)
    console.print("`tfdoctor checks ID` prints one check's full documentation.", highlight=False, markup=False)


# --- memory command (issue 4) ---


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
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda[:N]: whose memory is the default budget"),
    fmt: MemoryFormat = typer.Option(MemoryFormat.rich, "--format", help="report format"),
) -> None:
    """Predict the peak memory of one training step, what makes it, and which remedy brings it under budget.

    Exit 0 when it fits, 1 when it is predicted out of memory, 2 on a usage error.
    """
    try:
        _positive("--batch", batch)
        _positive("--seq", seq)
        _positive("--gpus", gpus)
        from tfdoctor.memory.budget import resolve_budget

        budget_bytes, source = resolve_budget(budget, device)
        if target is None:
            from tfdoctor.memory.analytic import Config, DEFAULT_D_MODEL, DEFAULT_LAYERS, DEFAULT_VOCAB, judge

            config = Config(batch=batch, seq=seq, d_model=d_model or DEFAULT_D_MODEL, heads=heads,
                            layers=layers or DEFAULT_LAYERS, vocab=vocab or DEFAULT_VOCAB, d_ff=d_ff,
                            dtype=dtype.value, attention=(attention or Attention.naive).value,
                            checkpointing=(checkpointing or Checkpointing.none).value, optimizer=optimizer.value,
                            gpus=gpus, shard=shard.value, tied=tied)
            for name, value in (("--d-model", d_model), ("--layers", layers), ("--vocab", vocab)):
                _positive(name, value)
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
            _positive("--vocab", vocab)
            from tfdoctor.loader import load_subject
            from tfdoctor.memory.traced import judge_traced
            from tfdoctor.runner import as_subject

            subject = as_subject(load_subject(target), vocab_size=vocab)
            verdict = judge_traced(subject, target, batch, seq, budget_bytes, source, dtype=dtype.value,
                                   optimizer=optimizer.value, gpus=gpus, shard=shard.value)
    except TfdoctorError as error:
        _fail_usage(error)
    from tfdoctor.report.memory import render

    render(verdict, fmt.value, sys.stdout)
    raise typer.Exit(ExitCode.OK if verdict.fits else ExitCode.CHECKS_FAILED)


def _usage_exceptions() -> tuple[type, ...]:
    """Command-line parsing errors: recent Typer raises its own (it vendors click), older Typer
    raises click's."""
    kinds: list[type] = [getattr(typer, "TyperException", None)]
    try:
        import click

        kinds.append(click.exceptions.ClickException)
    except ImportError:
        pass
    return tuple(kind for kind in kinds if kind is not None)


def main() -> None:
    """Entry point: every usage problem, the parser's included, is one line on stderr and exit 2."""
    try:
        code = app(standalone_mode=False)
    except _usage_exceptions() as error:
        message = error.format_message()
        if type(error).__name__ == "NoArgsIsHelpError":  # bare `tfdoctor`: the help is the message
            typer.echo(message, err=True)
        else:
            typer.echo(f"tfdoctor: error: {' '.join(message.split())}", err=True)
        sys.exit(ExitCode.USAGE_ERROR)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("tfdoctor: aborted", err=True)
        sys.exit(130)
    except Exception as error:  # never a traceback; TFDOCTOR_DEBUG=1 shows it
        if os.environ.get("TFDOCTOR_DEBUG"):
            raise
        typer.echo(f"tfdoctor: internal error: {type(error).__name__}: {error} "
                   "(rerun with TFDOCTOR_DEBUG=1 for the traceback)", err=True)
        sys.exit(ExitCode.USAGE_ERROR)
    sys.exit(code if isinstance(code, int) else 0)
