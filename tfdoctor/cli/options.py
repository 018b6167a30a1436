"""The command-line options more than one command takes, each declared once, and the choices they offer.

A command names an option in its signature by its alias, `only: Only = None`; the default stays in the
signature because Typer wants it there. Where one flag tells a command a little more (what `run` discovers
from the script, what `watch` leaves to the user's real run), the variants sit side by side here, each help
text saying what differs. A command's own flags (run --steps, watch --max-steps, judge --follow, check
--train) live with it, and so do memory's --batch, --vocab, --device and --budget: the same names, but a
training step's shape, not the probes'.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Optional

import typer


class Format(str, enum.Enum):
    rich = "rich"
    json = "json"
    junit = "junit"
    sarif = "sarif"  # SARIF 2.1.0: each finding at the user's file:line, for code-scanning UIs
    html = "html"  # one self-contained page with the figures (needs the html extra: matplotlib)


class PaddingSide(str, enum.Enum):
    left = "left"
    right = "right"


class Packing(str, enum.Enum):
    position_ids = "position_ids"


class Kind(str, enum.Enum):
    causal = "causal"
    encoder = "encoder"
    seq2seq = "seq2seq"


class Task(str, enum.Enum):  # registry.TASKS
    lm = "lm"
    sequence_classification = "sequence-classification"
    token_classification = "token-classification"
    regression = "regression"
    question_answering = "question-answering"
    multiple_choice = "multiple-choice"


# The selection and the report: check, run, watch and judge (memory takes --output).
Only = Annotated[Optional[str], typer.Option("--only", help="run only these check ids (comma-separated)")]
Skip = Annotated[Optional[str], typer.Option("--skip", help="skip these check ids (comma-separated)")]
OnlyJudges = Annotated[Optional[str], typer.Option("--only", help="run only these judges (comma-separated ids)")]
SkipJudges = Annotated[Optional[str], typer.Option("--skip", help="skip these judges (comma-separated ids)")]
Fmt = Annotated[Format, typer.Option("--format", help="report format")]
SeriesFmt = Annotated[Format, typer.Option("--format", help="report format (json carries every series)")]
Output = Annotated[Optional[Path], typer.Option("--output", help="write the report to this file instead of stdout")]
Strict = Annotated[bool, typer.Option("--strict", help="treat warnings as failures")]

# --seed and --timeout differ between the commands on purpose. check and run seed with 0 and stop after
# DEFAULT_TIMEOUT: the same command gives the same evidence, and a CI job never waits forever. watch runs
# the user's real training run, which may take days: it keeps the script's own randomness and stops the
# run as hung only when --timeout says so.
DEFAULT_SEED = 0
DEFAULT_TIMEOUT = 600.0  # seconds for the whole run: generous, but a CI job never waits forever
DEFAULT_TIMEOUT_PER_CHECK = 300.0
ProbeSeed = Annotated[int, typer.Option("--seed", help="seed for the random probe tokens")]
ScriptSeed = Annotated[int, typer.Option("--seed", help="torch seed set before the script starts, and of the "
                                                        "probes")]
WatchSeed = Annotated[Optional[int], typer.Option("--seed", help="torch seed set before the script starts "
                                                                 "(default: none, the script's own randomness)")]
Timeout = Annotated[float, typer.Option("--timeout", help="seconds the whole run may take")]
WatchTimeout = Annotated[Optional[float], typer.Option("--timeout", help="seconds after which the run is stopped "
                                                                         "as hung (default: none)")]
TimeoutPerCheck = Annotated[float, typer.Option("--timeout-per-check", help="seconds each check (and loading the "
                                                                            "target) may take")]
ScriptTimeoutPerCheck = Annotated[float, typer.Option("--timeout-per-check", help="seconds the script (up to its "
                                                                                  "stop) and each check may take")]

# The script: run and watch.
Script = Annotated[Optional[list[str]], typer.Argument(metavar="[SCRIPT] [-- ARGS...]",
                                                       help="the training script and, after --, its own arguments")]
Module = Annotated[Optional[str], typer.Option("-m", "--module", help="run this module as `python -m` does (then "
                                                                      "every argument is the script's)")]
Nproc = Annotated[Optional[int], typer.Option("--nproc", help="start the script as this many ranks with torchrun "
                                                              "(gloo on a CPU) and audit the distributed run")]
WatchNproc = Annotated[Optional[int], typer.Option("--nproc", help="start the script as this many ranks with "
                                                                   "torchrun; rank 0's run is judged")]

# What the model is and how the probes feed it: check and run. check reads the defaults off the target;
# run discovers them from what the script did (the Script* variants say so).
Vocab = Annotated[Optional[int], typer.Option("--vocab", help="vocabulary size (default: config or first "
                                                              "nn.Embedding)")]
ScriptVocab = Annotated[Optional[int], typer.Option("--vocab", help="vocabulary size (default: discovered)")]
SeqLen = Annotated[Optional[int], typer.Option("--seq-len", help="probe sequence length (default 32, capped by "
                                                                 "the model)")]
ScriptSeqLen = Annotated[Optional[int], typer.Option("--seq-len", help="probe sequence length (default: the "
                                                                       "batches', at most 64)")]
ProbeBatch = Annotated[Optional[int], typer.Option("--batch", help="probe batch size (default 4)")]
PadId = Annotated[Optional[int], typer.Option("--pad-id", help="padding token id")]
ScriptPadId = Annotated[Optional[int], typer.Option("--pad-id", help="padding token id (default: discovered)")]
EosId = Annotated[Optional[int], typer.Option("--eos-id", help="end-of-sequence token id (default: tokenizer or "
                                                               "config eos_token_id)")]
ScriptEosId = Annotated[Optional[int], typer.Option("--eos-id", help="end-of-sequence token id (default: the "
                                                                     "script's tokenizer, else config "
                                                                     "eos_token_id)")]
ModelKind = Annotated[Optional[Kind], typer.Option("--kind", help="causal, encoder or seq2seq (default: what the "
                                                                  "model announces, else causal)")]
ScriptKind = Annotated[Optional[Kind], typer.Option("--kind", help="causal, encoder or seq2seq (default: "
                                                                   "detected)")]
ModelTask = Annotated[Optional[Task], typer.Option("--task", help="what the model predicts: lm, "
                                                                  "sequence-classification, token-classification, "
                                                                  "regression, question-answering or "
                                                                  "multiple-choice (default: detected)")]
Padding = Annotated[Optional[PaddingSide], typer.Option("--padding-side", help="where your batches' pads sit: "
                                                                               "left or right (default: unknown)")]
ScriptPadding = Annotated[Optional[PaddingSide], typer.Option("--padding-side", help="left or right (default: "
                                                                                     "discovered)")]
PackedAs = Annotated[Optional[Packing], typer.Option("--packing", help="how your model is fed packed documents: "
                                                                       "position_ids (the Hugging Face "
                                                                       "convention)")]
ScriptPackedAs = Annotated[Optional[Packing], typer.Option("--packing", help="position_ids (default: discovered "
                                                                             "from position ids that restart "
                                                                             "inside a row)")]
