"""The command-line flags' validation, before anything runs: each raises UsageError with the line
the CLI prints (exit 2)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from tfdoctor.errors import UsageError, missing_file_hint


def positive(name: str, value: Optional[int], minimum: int = 1, maximum: Optional[int] = None) -> None:
    if value is not None and value < minimum:
        raise UsageError(f"{name} must be at least {minimum}, got {value}")
    if value is not None and maximum is not None and value > maximum:
        raise UsageError(f"{name} must be at most {maximum:,}, got {value:,}")


# Probe sizes beyond these are typos, not probes: the checks need a few rows of a few dozen tokens.
MAX_PROBE_BATCH = 4096
MAX_PROBE_SEQ = 1 << 16


# More ranks than this on one machine is a typo (torchrun starts every one as a process here).
MAX_NPROC = 64


def nproc_in_range(nproc: Optional[int]) -> None:
    positive("--nproc", nproc, 1, MAX_NPROC)
    if nproc is not None and nproc > 1 and os.environ.get("WORLD_SIZE"):
        raise UsageError("--nproc under torchrun: this process is already one rank of a job",
                         "give --nproc-per-node to torchrun, or drop torchrun and keep --nproc")


def seed_in_range(seed: int) -> None:
    if not 0 <= seed < 2 ** 63:  # torch.manual_seed takes a 64-bit seed
        raise UsageError(f"--seed must be between 0 and 2**63 - 1, got {seed}")


def budget_in_range(name: str, seconds: float) -> None:
    if not 0 < seconds <= 7 * 24 * 3600:
        raise UsageError(f"{name} must be a number of seconds above 0 (and at most a week), got {seconds:g}")


def format_ready(fmt) -> None:
    """--format html draws with matplotlib, an optional extra: missing, it is a usage error up front."""
    if fmt.value == "html":
        from tfdoctor.report.html import require_plotting  # imports no matplotlib

        require_plotting()


def writable(output: Optional[Path]) -> None:
    """--output is checked before anything runs: a report nobody can write is a wasted battery."""
    if output is None:
        return
    if output.is_dir():
        raise UsageError(f"--output {output} is a folder", "give a file path")
    folder = output.parent if str(output.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"--output {output}: the folder {folder} does not exist")
    existed = output.exists()
    try:  # root passes os.access everywhere; only opening it tells (/proc files refuse writers)
        with open(output, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise UsageError(f"--output {output} is not writable ({exc.strerror or exc})") from exc
    if not existed:
        output.unlink(missing_ok=True)


def check_battery_flags(vocab, seq_len, batch, pad_id, seed, timeout, timeout_per_check, only, skip) -> None:
    """The flags `check` and `run` share, validated before anything is loaded (UsageError)."""
    positive("--vocab", vocab)
    positive("--seq-len", seq_len, 2, MAX_PROBE_SEQ)
    positive("--batch", batch, 1, MAX_PROBE_BATCH)
    positive("--pad-id", pad_id, 0)
    seed_in_range(seed)
    budget_in_range("--timeout", timeout)
    budget_in_range("--timeout-per-check", timeout_per_check)
    selection_nonempty(only, skip)


def selection_nonempty(only, skip, run_judges: bool = False) -> None:
    """Unknown ids are a usage error (registry.select); so is a selection that leaves nothing to run."""
    from tfdoctor.registry import select

    if (only is not None and not only.replace(",", "").strip()) or not select(only, skip, run_judges=run_judges):
        what = "judge" if run_judges else "check"
        raise UsageError(f"the selection is empty: --only/--skip leave no {what} to run",
                         "run `tfdoctor checks` for the ids")


def script_argument(argv: list, module: Optional[str], command: str) -> Optional[str]:
    """`run` / `watch`: the script, taken off the front of `argv` (None under -m, which takes them all)."""
    if module is None and not argv:
        raise UsageError(f"give the script to {command}",
                         f"tfdoctor {command} train.py -- ARGS, or tfdoctor {command} -m pkg.mod")
    script = None if module is not None else argv.pop(0)
    if script is not None and not Path(script).is_file():
        raise UsageError(f"script not found: {script}",
                         missing_file_hint(script, "give the path of a Python file, or -m package.module"))
    return script


def model_fields(vocab, seq_len, batch, pad_id, kind, padding_side, packing, eos_id=None, task=None) -> dict:
    """The Subject fields the flags give (the ones left out are the Subject's or discovered)."""
    fields = dict(vocab_size=vocab, seq_len=seq_len, batch_size=batch, pad_id=pad_id, eos_id=eos_id,
                  kind=kind.value if kind else None, padding_side=padding_side.value if padding_side else None,
                  packing=packing.value if packing else None, task=task.value if task else None)
    return {k: v for k, v in fields.items() if v is not None}


def keeping_folder(keep_writes: Optional[Path], protected_by: list[str]) -> Optional[str]:
    """`watch --keep-writes DIR`: the folder (absolute) where a copy of a protected run's writes goes.
    Only a run that --max-steps/--max-time may cut short is protected; any other writes for real."""
    if keep_writes is None:
        return None
    if not protected_by:
        raise UsageError("--keep-writes keeps what a run cut short by --max-steps or --max-time wrote; without "
                         "them the watched run writes its files for real", "drop --keep-writes")
    if keep_writes.exists() and not keep_writes.is_dir():
        raise UsageError(f"--keep-writes {keep_writes} is a file", "give a folder (it is made if missing)")
    return os.path.abspath(keep_writes)


# The commands that run a script with arguments of its own (`SCRIPT -- ARGS`).
SCRIPT_COMMANDS = ("run", "watch")


def script_options_hint(error: Exception, argv: list[str]) -> str:
    """`tfdoctor watch train.py --device=cpu`: the parser takes the script's own option for tfdoctor's
    and rejects it ("No such option: --device"). The hint is the command line that works, the script's
    options moved after `--` and tfdoctor's own left before it: "; the script's own options go after
    --: tfdoctor watch train.py -- --device=cpu". "" for any other error, command, or a line that has
    its `--` already. `error` is the parser's (click's NoSuchOption, read by duck typing: no click
    import here); `argv` is the command line without the program's name."""
    ctx = getattr(error, "ctx", None)
    command = getattr(getattr(ctx, "command", None), "name", None)
    if type(error).__name__ != "NoSuchOption" or command not in SCRIPT_COMMANDS or command not in argv \
            or "--" in argv:
        return ""
    takes_value = {"--help": False}  # option string -> whether the next token is its value
    for param in getattr(ctx.command, "params", []):
        for opt in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]:
            if opt.startswith("-"):
                takes_value[opt] = not getattr(param, "is_flag", False) and not getattr(param, "count", False)
    ours, script_args, script = [], [], None
    tokens = argv[argv.index(command) + 1:]
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name = token.split("=", 1)[0]
        following = tokens[i + 1] if i + 1 < len(tokens) else None
        if token.startswith("-") and token != "-" and name in takes_value:
            ours.append(token)
            if takes_value[name] and "=" not in token and following is not None:
                ours.append(following)
                script = following if name in ("-m", "--module") else script
                i += 1
        elif token.startswith("-") and token != "-":
            script_args.append(token)
            # `--device cpu`: the next word is taken as its value, unless it is the script still to come
            if "=" not in token and following is not None and not following.startswith("-") \
                    and not (script is None and following.endswith(".py")):
                script_args.append(following)
                i += 1
        elif script is None:
            script = token
            ours.append(token)
        else:
            script_args.append(token)
        i += 1
    import shlex

    line = " ".join(shlex.quote(t) for t in ["tfdoctor", command, *ours, "--", *script_args])
    return f"; the script's own options go after --: {line}"


# What users type for a format that has another name here.
FORMAT_ALIASES = {"xml": "JUnit XML is --format junit", "junit-xml": "JUnit XML is --format junit",
                  "text": "the text report is --format rich (plain text when it is not on a terminal)",
                  "txt": "the text report is --format rich (plain text when it is not on a terminal)",
                  "htm": "--format html", "sarif2": "--format sarif"}


def format_alias_hint(message: str) -> str:
    """"; JUnit XML is --format junit" when the parser refused a --format value users commonly mean
    by another name, else ""."""
    import re

    refused = re.search(r"'--format'.*?'([^']+)' is not one of", message)
    said = FORMAT_ALIASES.get(refused.group(1).lower()) if refused else None
    return f"; {said}" if said else ""
