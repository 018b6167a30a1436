"""The `tfdoctor` command: parse, call, render, exit. The only module that prints or exits.

Torch is imported only by the commands that need it, so `--help`, `checks` and the analytic
`memory` stay fast.
"""

from __future__ import annotations

import enum
import math
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from tfdoctor.errors import TfdoctorError, UsageError
from tfdoctor.flags import (budget_in_range, check_battery_flags, format_ready, model_fields, nproc_in_range,
                            positive, script_argument, script_options_hint, seed_in_range, selection_nonempty,
                            writable)
from tfdoctor.protocol import Ended
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
    sarif = "sarif"  # SARIF 2.1.0: each finding at the user's file:line, for code-scanning UIs
    html = "html"  # one self-contained page with the figures (needs the html extra: matplotlib)


DEFAULT_TIMEOUT = 600.0  # seconds for the whole run: generous, but a CI job never waits forever
DEFAULT_TIMEOUT_PER_CHECK = 300.0


class PaddingSide(str, enum.Enum):
    left = "left"
    right = "right"


class Packing(str, enum.Enum):
    position_ids = "position_ids"


class Kind(str, enum.Enum):
    causal = "causal"
    encoder = "encoder"
    seq2seq = "seq2seq"


def _fail_usage(error: TfdoctorError) -> None:
    typer.echo(f"tfdoctor: error: {_whose()}{_shown(error.one_line())}", err=True)
    raise typer.Exit(ExitCode.USAGE_ERROR)


def _shown(text: str) -> str:
    """The user's text in our line, escape sequences and control characters shown, not obeyed."""
    from tfdoctor.report.text import clean

    return clean(text)


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
    eos_id: Optional[int] = typer.Option(None, "--eos-id", help="end-of-sequence token id (default: tokenizer or "
                                                                "config eos_token_id)"),
    kind: Optional[Kind] = typer.Option(None, "--kind", help="causal, encoder or seq2seq (default: what the model announces, else causal)"),
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
        _fail_usage(error)
    fields = model_fields(vocab, seq_len, batch, pad_id, kind, padding_side, packing, eos_id)
    request = dict(command="check", target=target, train=train, fields=fields, only=only, skip=skip, seed=seed,
                   device=device, options=options)
    outcome = _supervised(request, fmt is Format.rich, timeout, timeout_per_check)
    _finish(outcome, report_of(outcome, target, strict), fmt, output)


def _finish(outcome, report, fmt: "Format", output: Optional[Path]) -> None:
    """Write what the worker delivered, then exit: 2 with its one line when it stopped early."""
    if report is not None:
        _emit(report, fmt, output)
    if outcome.ended != Ended.DONE:
        typer.echo(f"tfdoctor: error: {_whose()}{_shown(outcome.message)}", err=True)
        raise typer.Exit(ExitCode.USAGE_ERROR)
    raise typer.Exit(report.exit_code())


# `tfdoctor run`: optimizer steps recorded before the script is stopped. Two steps are two
# accumulation windows: the first can be uneven (`if step % k == 0` steps after one micro-batch) and
# zero-grad needs a backward after a step.
DEFAULT_RUN_STEPS = 2
MIN_RUN_STEPS = 2


@app.command(context_settings={"allow_interspersed_args": True})
def run(
    argv: Optional[list[str]] = typer.Argument(None, metavar="[SCRIPT] [-- ARGS...]",
                                               help="the training script and, after --, its own arguments"),
    module: Optional[str] = typer.Option(None, "-m", "--module", help="run this module as `python -m` does "
                                                                      "(then every argument is the script's)"),
    steps: int = typer.Option(DEFAULT_RUN_STEPS, "--steps", help="optimizer steps to record before the script is "
                                                                 "stopped (default 2, at least 2)"),
    model: Optional[str] = typer.Option(None, "--model", help="a script that trains several models: audit this "
                                                              "one, by class name or the script's variable name "
                                                              "(default: the most trained parameters)"),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="vocabulary size (default: discovered)"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="probe sequence length (default: the batches', "
                                                                  "at most 64)"),
    batch: Optional[int] = typer.Option(None, "--batch", help="probe batch size (default 4)"),
    pad_id: Optional[int] = typer.Option(None, "--pad-id", help="padding token id (default: discovered)"),
    eos_id: Optional[int] = typer.Option(None, "--eos-id", help="end-of-sequence token id (default: the script's "
                                                                "tokenizer, else config eos_token_id)"),
    kind: Optional[Kind] = typer.Option(None, "--kind", help="causal, encoder or seq2seq (default: detected)"),
    padding_side: Optional[PaddingSide] = typer.Option(None, "--padding-side", help="left or right (default: "
                                                                                   "discovered)"),
    packing: Optional[Packing] = typer.Option(None, "--packing", help="position_ids (default: discovered from "
                                                                      "position ids that restart inside a row)"),
    only: Optional[str] = typer.Option(None, "--only", help="run only these check ids (comma-separated)"),
    skip: Optional[str] = typer.Option(None, "--skip", help="skip these check ids (comma-separated)"),
    fmt: Format = typer.Option(Format.rich, "--format", help="report format"),
    output: Optional[Path] = typer.Option(None, "--output", help="write the report to this file instead of stdout"),
    strict: bool = typer.Option(False, "--strict", help="treat warnings as failures"),
    seed: int = typer.Option(0, "--seed", help="torch seed set before the script starts, and of the probes"),
    timeout: float = typer.Option(DEFAULT_TIMEOUT, "--timeout", help="seconds the whole run may take"),
    timeout_per_check: float = typer.Option(DEFAULT_TIMEOUT_PER_CHECK, "--timeout-per-check",
                                            help="seconds the script (up to its stop) and each check may take"),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="start the script as this many ranks with torchrun "
                                                              "(gloo on a CPU) and audit the distributed run"),
) -> None:
    """Run an unmodified training script, record its first optimizer steps and audit them.

    The script runs as __main__ (like `python SCRIPT ARGS`, or `python -m MODULE ARGS` with -m) and is
    stopped after --steps optimizer steps. The loop checks judge what it did; the model checks judge a
    copy of the model it trains, taken at its first forward, called the way the script calls it.

    A script that trains several models, each with its own optimizer (an LM and a value head, a GAN's
    pair, a draft model), gets one audited: by default the one with the most trained parameters among
    those called before the first optimizer step; --model NAME picks another by its class name or the
    script's variable name. The others are listed under "discovered" and their steps, backwards and
    forwards are left out of what the loop checks judge.
    """
    argv = list(argv or [])
    try:
        script = script_argument(argv, module, "run")
        positive("--steps", steps, MIN_RUN_STEPS)
        check_battery_flags(vocab, seq_len, batch, pad_id, seed, timeout, timeout_per_check, only, skip)
        positive("--eos-id", eos_id, 0)
        writable(output)
        format_ready(fmt)
        nproc_in_range(nproc)
    except TfdoctorError as error:
        _fail_usage(error)
    if nproc is not None and nproc > 1:
        _launched(nproc)
    from tfdoctor.recording.distributed import world

    me = world()
    fields = model_fields(vocab, seq_len, batch, pad_id, kind, padding_side, packing, eos_id)
    target = script if script is not None else f"-m {module}"
    request = dict(command="run", script=script, module=module, args=argv, steps=steps, model=model, target=target,
                   fields=fields, only=only, skip=skip, seed=seed, strict=strict, timeout=timeout,
                   options={"timeout_per_check": timeout_per_check}, release=me.distributed and me.rank == 0)

    def conclude(outcome) -> None:
        if outcome.ended == Ended.RANK_EXIT:
            raise typer.Exit(outcome.code)
        report = report_of(outcome, f"run {target}", strict)
        if report is not None:
            report.discovered = dict(outcome.discovered)
        _finish(outcome, report, fmt, output)

    # Under torchrun rank 0 speaks for the job: the other ranks draw no bar and print no report.
    _supervised(request, fmt is Format.rich and me.rank == 0, timeout, timeout_per_check, then=conclude)


@app.command(context_settings={"allow_interspersed_args": True})
def watch(
    argv: Optional[list[str]] = typer.Argument(None, metavar="[SCRIPT] [-- ARGS...]",
                                               help="the training script and, after --, its own arguments"),
    module: Optional[str] = typer.Option(None, "-m", "--module", help="run this module as `python -m` does"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="stop the run after this many optimizer "
                                                                      "steps (default: run to its end)"),
    max_time: Optional[float] = typer.Option(None, "--max-time", help="stop the run after this many seconds"),
    only: Optional[str] = typer.Option(None, "--only", help="run only these judges (comma-separated ids)"),
    skip: Optional[str] = typer.Option(None, "--skip", help="skip these judges (comma-separated ids)"),
    fmt: Format = typer.Option(Format.rich, "--format", help="report format (json carries every series)"),
    output: Optional[Path] = typer.Option(None, "--output", help="write the report to this file instead of stdout"),
    strict: bool = typer.Option(False, "--strict", help="treat warnings as failures"),
    seed: Optional[int] = typer.Option(None, "--seed", help="torch seed set before the script starts (default: "
                                                            "none, the script's own randomness)"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="seconds after which the run is stopped as "
                                                                    "hung (default: none)"),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="start the script as this many ranks with torchrun; "
                                                              "rank 0's run is judged"),
) -> None:
    """Watch a whole training run: record every optimizer step and judge the run's curves.

    The script runs as __main__ (as `python SCRIPT ARGS`, or `python -m MODULE ARGS`) to its end or to
    --max-steps / --max-time, each step's loss, gradient norm, rates, loss scale, data wait, tokens/s,
    memory and evaluation loss recorded, then judged. A terminal shows a live view; JSON carries it all.
    """
    argv = list(argv or [])
    try:
        script = script_argument(argv, module, "watch")
        positive("--max-steps", max_steps)
        if max_time is not None:
            budget_in_range("--max-time", max_time)
        if timeout is not None:
            budget_in_range("--timeout", timeout)
        if seed is not None:
            seed_in_range(seed)
        selection_nonempty(only, skip, run_judges=True)
        writable(output)
        format_ready(fmt)
        nproc_in_range(nproc)
    except TfdoctorError as error:
        _fail_usage(error)
    if nproc is not None and nproc > 1:
        _launched(nproc, "watch")
    from tfdoctor.recording.distributed import world

    me = world()
    target = script if script is not None else f"-m {module}"
    request = dict(command="watch", script=script, module=module, args=argv, max_steps=max_steps, max_time=max_time,
                   target=target, only=only, skip=skip, seed=seed)
    budget = timeout if timeout is not None else math.inf
    # The live view only where one process draws: another rank's output would tear it.
    live = fmt is Format.rich and output is None and not me.distributed
    from tfdoctor.supervisor import supervise

    with _watch_view(live, target) as view:
        outcome = _handled(supervise(request, timeout=budget, timeout_per_check=budget, progress=view))
    if me.rank != 0:  # rank 0 speaks for the job
        raise typer.Exit(ExitCode.OK if outcome.ended == Ended.DONE else ExitCode.USAGE_ERROR)
    report = report_of(outcome, f"watch {target}", strict)
    if report is not None:
        report.series = outcome.discovered.pop("series", {})
        report.discovered = dict(outcome.discovered)
        if report.discovered.get("ended") == "interrupted":  # Ctrl-C: the steps it took are judged
            _emit(report, fmt, output)
            typer.echo(f"tfdoctor: interrupted (Ctrl-C) after {report.discovered.get('steps')} optimizer step(s), "
                       "judged above", err=True)
            raise typer.Exit(130)
        if report.discovered.get("error"):  # judged on the steps it took, but the run itself failed
            _emit(report, fmt, output)
            how = "raised" if report.discovered["ended"] == "raised" else "exited with"
            _fail_usage(UsageError(f"the watched script {how} {report.discovered['error']}"))
    _finish(outcome, report, fmt, output)


def report_of(outcome, target: str, strict: bool):
    from tfdoctor.supervisor import report_of as made  # here, not at start-up: --help stays fast

    return made(outcome, target, strict)


def _watch_view(live: bool, target: str):
    """The live view on a terminal (report/dashboard.py), else nothing."""
    import contextlib

    if not live:
        return contextlib.nullcontext(None)
    from tfdoctor.report.dashboard import terminal_dashboard

    return terminal_dashboard(target)


def _supervised(request: dict, show_progress: bool, timeout: float, timeout_per_check: float, then=None):
    """Run the request in a supervised worker; usage errors, internal errors and Ctrl-C end here.

    `then(outcome)` (which exits) concludes the command. Given, it runs while the worker still waits:
    rank 0 of a distributed run prints its report before the other ranks are told its exit code,
    since torchrun ends every rank as soon as one has exited."""
    from tfdoctor.supervisor import supervise

    hold = (lambda outcome: then(_handled(outcome))) if then is not None and request.get("release") else None
    with _progress(show_progress) as start:
        outcome = supervise(request, timeout=timeout, timeout_per_check=timeout_per_check, progress=start,
                            hold=hold)
    outcome = _handled(outcome)
    if then is not None:
        then(outcome)
    return outcome


def _handled(outcome):
    """The outcomes every command ends the same way: each one line on stderr and its exit code."""
    if outcome.ended == Ended.USAGE_ERROR:
        if outcome.quiet:  # another rank's line, which rank 0 prints
            raise typer.Exit(ExitCode.USAGE_ERROR)
        _fail_usage(UsageError(outcome.message))
    if outcome.ended == Ended.INTERNAL_ERROR:
        if os.environ.get("TFDOCTOR_DEBUG"):
            typer.echo(outcome.debug, err=True)
        typer.echo(f"tfdoctor: internal error: {_whose()}{outcome.message} (rerun with TFDOCTOR_DEBUG=1 for the traceback)",
                   err=True)
        raise typer.Exit(ExitCode.USAGE_ERROR)
    if outcome.ended == Ended.INTERRUPTED:
        typer.echo(f"tfdoctor: {_whose()}{outcome.message}", err=True)
        raise typer.Exit(outcome.code or 130)
    return outcome


def _whose() -> str:
    """Under torchrun every rank's line lands on the same stderr: the other ranks' say whose they are."""
    from tfdoctor.recording.distributed import world  # no torch: reads torchrun's environment

    me = world()
    return f"rank {me.rank} of {me.size}: " if me.rank != 0 else ""


def _launched(nproc: int, command: str = "run") -> None:
    """--nproc N: torchrun runs this same command as N ranks; their exit code is ours."""
    from tfdoctor.recording.launch import launch

    args = sys.argv[1:]
    args = args[args.index(command) + 1:] if command in args else args
    try:
        code = launch(nproc, args, command)
    except TfdoctorError as error:
        _fail_usage(error)
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM, SIGHUP (recording/launch.py): every rank has ended
        typer.echo(f"tfdoctor: {getattr(stop, 'said', 'interrupted')} while the {nproc} ranks ran", err=True)
        raise typer.Exit(getattr(stop, "code", 130))
    raise typer.Exit(code)


def _progress(wanted: bool):
    """The terminal bar when the report is for people; nothing in JSON/JUnit mode or off a terminal."""
    import contextlib

    from tfdoctor.report.progress import terminal_progress

    return terminal_progress() if wanted else contextlib.nullcontext(None)


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

    from tfdoctor.registry import all_checks, select
    from tfdoctor.report.catalogue import render_catalogue, render_check

    console = Console()
    if check_id is not None:
        try:
            (spec,) = select(only=check_id, run_judges=check_id in {s.id for s in all_checks() if s.judges_run})
        except (TfdoctorError, ValueError) as error:
            _fail_usage(error if isinstance(error, TfdoctorError) else UsageError("give one check id"))
        render_check(spec, console)
        return
    render_catalogue(all_checks(), console)


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
    fmt: MemoryFormat = typer.Option(MemoryFormat.rich, "--format", help="report format (html: redirect stdout "
                                                                          "to a file)"),
) -> None:
    """Predict the peak memory of one training step, what makes it, and which remedy brings it under budget.

    Exit 0 when it fits, 1 when it is predicted out of memory, 2 on a usage error.
    """
    try:
        positive("--batch", batch)
        positive("--seq", seq)
        positive("--gpus", gpus)
        format_ready(fmt)
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
        _fail_usage(error)
    if verdict is None:  # traced: the user's code runs in the supervised worker, as for `check`
        request = dict(command="memory", target=target, vocab=vocab, batch=batch, seq=seq, budget_bytes=budget_bytes,
                       budget_source=source, dtype=dtype.value, optimizer=optimizer.value, gpus=gpus,
                       shard=shard.value, device=device)
        outcome = _supervised(request, fmt is MemoryFormat.rich, DEFAULT_TIMEOUT, DEFAULT_TIMEOUT_PER_CHECK)
        if outcome.ended != Ended.DONE or outcome.verdict is None:
            typer.echo(f"tfdoctor: error: {outcome.message or 'the trace delivered no verdict'}", err=True)
            raise typer.Exit(ExitCode.USAGE_ERROR)
        verdict = outcome.verdict
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
            hint = script_options_hint(error, sys.argv[1:])  # `watch train.py --device=cpu`: the script's own
            typer.echo(f"tfdoctor: error: {' '.join(message.split())}{_shown(hint)}", err=True)
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
