"""`tfdoctor run SCRIPT`: the first optimizer steps of an unmodified training script, recorded and judged."""

from __future__ import annotations

from typing import Optional

import typer

from tfdoctor.cli.app import app
from tfdoctor.cli.flags import (
    check_battery_flags,
    format_ready,
    model_fields,
    nproc_in_range,
    positive,
    script_argument,
    writable,
)
from tfdoctor.cli.options import (
    DEFAULT_SEED,
    DEFAULT_TIMEOUT,
    DEFAULT_TIMEOUT_PER_CHECK,
    Fmt,
    Format,
    ModelTask,
    Module,
    Nproc,
    Only,
    Output,
    ProbeBatch,
    Script,
    ScriptEosId,
    ScriptKind,
    ScriptPackedAs,
    ScriptPadding,
    ScriptPadId,
    ScriptSeed,
    ScriptSeqLen,
    ScriptTimeoutPerCheck,
    ScriptVocab,
    Skip,
    Strict,
    Timeout,
)
from tfdoctor.cli.outcome import end_command, fail_usage, launched, report_from_outcome, stopped, supervised
from tfdoctor.errors import TfdoctorError
from tfdoctor.process.protocol import Ended

# `tfdoctor run`: optimizer steps recorded before the script is stopped. Two steps are two
# accumulation windows: the first can be uneven (`if step % k == 0` steps after one micro-batch) and
# zero-grad needs a backward after a step.
DEFAULT_RUN_STEPS = 2
MIN_RUN_STEPS = 2


@app.command(context_settings={"allow_interspersed_args": True})
def run(
    argv: Script = None,
    module: Module = None,
    steps: int = typer.Option(DEFAULT_RUN_STEPS, "--steps", help="optimizer steps to record before the script is "
                                                                 "stopped (default 2, at least 2)"),
    model: Optional[str] = typer.Option(None, "--model", help="a script that trains several models: audit this "
                                                              "one, by class name or the script's variable name "
                                                              "(default: the most trained parameters)"),
    vocab: ScriptVocab = None,
    seq_len: ScriptSeqLen = None,
    batch: ProbeBatch = None,
    pad_id: ScriptPadId = None,
    eos_id: ScriptEosId = None,
    kind: ScriptKind = None,
    task: ModelTask = None,
    padding_side: ScriptPadding = None,
    packing: ScriptPackedAs = None,
    only: Only = None,
    skip: Skip = None,
    fmt: Fmt = Format.rich,
    output: Output = None,
    strict: Strict = False,
    seed: ScriptSeed = DEFAULT_SEED,
    timeout: Timeout = DEFAULT_TIMEOUT,
    timeout_per_check: ScriptTimeoutPerCheck = DEFAULT_TIMEOUT_PER_CHECK,
    nproc: Nproc = None,
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
        if outcome.ended == Ended.RANK_EXIT:  # another rank: rank 0 prints the report, this one only exits
            raise typer.Exit(outcome.code)
        end_command(report_from_outcome(outcome, f"run {target}", strict), fmt, output, error=stopped(outcome))

    # Under torchrun rank 0 speaks for the job: the other ranks draw no bar and print no report.
    supervised(request, fmt is Format.rich and me.rank == 0, timeout, timeout_per_check, then=conclude)
