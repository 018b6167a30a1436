"""`tfdoctor run SCRIPT`: the first optimizer steps of an unmodified training script, recorded and judged."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tfdoctor.cli.app import DEFAULT_TIMEOUT, DEFAULT_TIMEOUT_PER_CHECK, Format, Kind, Packing, PaddingSide, Task, app
from tfdoctor.cli.flags import (
    check_battery_flags,
    format_ready,
    model_fields,
    nproc_in_range,
    positive,
    script_argument,
    writable,
)
from tfdoctor.cli.outcome import fail_usage, finish, launched, report_from_outcome, supervised
from tfdoctor.errors import TfdoctorError
from tfdoctor.process.protocol import Ended

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
    task: Optional[Task] = typer.Option(None, "--task", help="what the model predicts: lm, sequence-classification, "
                                                           "token-classification, regression, question-answering or "
                                                           "multiple-choice (default: detected)"),
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
        fail_usage(error)
    if nproc is not None and nproc > 1:
        launched(nproc)
    from tfdoctor.usercode.world import world

    me = world()
    fields = model_fields(vocab, seq_len, batch, pad_id, kind, padding_side, packing, eos_id, task)
    target = script if script is not None else f"-m {module}"
    request = dict(command="run", script=script, module=module, args=argv, steps=steps, model=model, target=target,
                   fields=fields, only=only, skip=skip, seed=seed, strict=strict, timeout=timeout,
                   options={"timeout_per_check": timeout_per_check}, release=me.distributed and me.rank == 0)

    def conclude(outcome) -> None:
        if outcome.ended == Ended.RANK_EXIT:
            raise typer.Exit(outcome.code)
        report = report_from_outcome(outcome, f"run {target}", strict)
        if report is not None:
            report.discovered = dict(outcome.discovered)
        finish(outcome, report, fmt, output)

    # Under torchrun rank 0 speaks for the job: the other ranks draw no bar and print no report.
    supervised(request, fmt is Format.rich and me.rank == 0, timeout, timeout_per_check, then=conclude)
