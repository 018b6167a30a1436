"""What a logged column, tag or key is: the spellings the common trainers and loggers use for each series
of a run, in one table, and the `--tag SERIES=NAME` overrides for the names it does not know.

A name is compared in a normal form: lower case, every run of `/ - . : space` an underscore, and
Lightning's `_step` suffix (a metric logged with on_step=True) dropped. So `train/loss`, `train-loss`
and `train_loss_step` are one spelling. Whoever logs a name this table lacks maps it with --tag.

No torch, no third-party import: `tfdoctor judge` starts on a laptop without them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from tfdoctor.errors import UsageError


@dataclass(frozen=True)
class Role:
    """What one column holds: `series` is a StepRow field (loss, grad_norm, lr, scale, skipped, wall, tokens,
    rss, cuda_allocated), "eval" (an evaluation loss), "step" or "time" (a clock: seconds, for wall);
    `group` the parameter group of a rate; `unit` what turns the logged value into the series' unit
    (bytes, seconds); `how` how a token count is logged: per-step, cumulative or per-second."""

    series: str
    group: int = 0
    unit: float = 1.0
    how: str = ""


# The series a log can give (the keys of LoggedRun.sources and of --tag). "lr" is the rate of the first
# parameter group; "lr:1", "lr:2", ... the next ones. "eval" names one more evaluation loss.
TAG_SERIES = ("step", "loss", "grad_norm", "lr", "scale", "skipped", "wall", "tokens", "rss", "cuda_allocated",
              "eval", "time")

STEP_NAMES = {"step", "steps", "global_step", "iter", "iters", "iteration", "it", "trainer_global_step",
              "train_global_step", "num_steps", "batch_idx"}
LOSS_NAMES = {"loss", "train_loss", "training_loss", "loss_train", "train_lm_loss", "lm_loss", "train_loss_avg",
              "avg_loss", "trn_loss", "loss_avg", "train_ce_loss", "ce_loss", "train_nll", "nll_loss",
              "train_loss_mean", "reduced_train_loss"}  # reduced_train_loss: NeMo
GRAD_NORM_NAMES = {"grad_norm", "gradient_norm", "gnorm", "grad_l2_norm", "total_grad_norm", "global_grad_norm",
                   "train_grad_norm", "grads_norm", "grad_norm_total", "grad_2_0_norm_total",  # Lightning's grad_norm()
                   "gradient_norm_total", "train_gradient_norm"}
LR_NAMES = {"lr", "learning_rate", "train_lr", "train_learning_rate", "optimizer_lr", "lr_abs", "current_lr"}
SCALE_NAMES = {"loss_scale", "scale", "grad_scale", "loss_scaler", "amp_scale", "scaler_scale", "train_loss_scale"}
SKIPPED_NAMES = {"skipped", "skipped_step", "skipped_iter", "skipped_iterations", "num_skipped_iterations",
                 "overflow", "found_inf"}
# seconds per optimizer step, as logged; the _ms spellings in milliseconds
STEP_SECONDS = {"step_time", "time_per_step", "iter_time", "iteration_time", "dt", "batch_time",
                "train_step_time", "sec_per_step", "seconds_per_step", "step_seconds", "elapsed_time_per_iteration",
                "time_per_iteration", "train_step_timing", "step_timing"}  # train_step_timing: NeMo
STEP_MILLISECONDS = {"dt_ms", "step_time_ms", "time_ms", "iter_time_ms", "iteration_time_ms",
                     "elapsed_time_per_iteration_ms", "step_ms", "ms_per_step"}
# a clock read when the point was logged: seconds (wall-clock or since the start); wall is its difference
CLOCK_NAMES = {"time", "timestamp", "wall_time", "walltime", "elapsed", "elapsed_time", "runtime", "_runtime",
               "_timestamp", "time_s"}
TOKENS_PER_STEP = {"tokens", "tokens_per_step", "batch_tokens", "ntokens", "num_tokens_step", "tokens_in_batch"}
TOKENS_SEEN = {"num_input_tokens_seen", "tokens_seen", "consumed_tokens", "total_tokens", "tokens_total",
               "cumulative_tokens", "train_tokens_seen"}
TOKENS_PER_SECOND = {"tokens_per_second", "tokens_per_sec", "tok_per_sec", "tok_s", "tokens_s", "tps",
                     "throughput_tokens_per_sec", "train_tokens_per_second", "tokens_per_sec_per_gpu"}
RSS_NAMES = {"rss", "memory_rss", "cpu_memory", "cpu_mem", "host_memory", "ram", "process_rss"}
CUDA_NAMES = {"cuda_allocated", "memory_allocated", "gpu_mem", "gpu_memory", "gpu_memory_allocated",
              "mem_allocated", "cuda_memory_allocated", "allocated_memory", "max_memory_allocated",
              "mem_allocated_bytes", "gpu_mem_allocated", "torch_cuda_memory_allocated"}
# Units a memory or time name carries at its end: `gpu_mem_gb`, `rss_mib`, `mem_allocated_bytes`.
UNITS = {"bytes": 1, "b": 1, "kb": 1024, "kib": 1024, "mb": 2 ** 20, "mib": 2 ** 20, "gb": 2 ** 30, "gib": 2 ** 30}
# Columns that say where a point is (or are summaries): read by the readers, never listed as unread.
PLACE_NAMES = {"epoch", "epochs", "_epoch", "trainer_epoch", "train_epoch"} | STEP_NAMES

EVAL_WORDS = ("val", "valid", "validation", "eval", "evaluation", "test", "dev", "heldout", "held_out")
# An evaluation's loss: any name with one of EVAL_WORDS and `loss` (or nll, ce, lm_loss) among its words,
# and no word of another kind of number (its runtime, a count, a rate)
EVAL_LOSS_WORDS = ("loss", "nll", "ce")
NOT_A_LOSS = ("runtime", "samples", "steps_per_second", "per_second", "time", "count", "acc", "accuracy", "ppl",
              "perplexity", "f1", "bleu", "rouge", "epoch_end")


def normal(name: str) -> str:
    """The form names are compared in: `Train/Loss_step` -> `train_loss`."""
    text = re.sub(r"[/\-.:\s]+", "_", name.strip().lower()).strip("_")
    if text in PLACE_NAMES:  # global_step is a step column, not `global` logged per step
        return text
    return text[:-5] if text.endswith("_step") and len(text) > 5 else text


# Lightning's LearningRateMonitor: `lr-AdamW`, `lr-AdamW/pg2` (its groups count from 1), `lr-AdamW-1` (a
# second optimizer of the same class), `lr-AdamW-momentum` / `-weight_decay` (not rates)
_MONITOR_RATE = re.compile(r"^lr-(?P<opt>[A-Za-z0-9_]+?)(?:-(?P<nth>\d+))?(?:/pg(?P<pg>\d+))?$")
# `lr/group_1`, `lr_group1`, `learning_rate_pg0`, `lr_1`, `lr/pg2` (the numbering as written: `pg` from 1)
_GROUP_RATE = re.compile(r"^(?:train_)?(?:lr|learning_rate)_(?:(?P<word>group|param_group|pg)_?)?(?P<n>\d+)$")


def role_of(name: str) -> Optional[Role]:
    """The series `name` holds by the table, or None."""
    monitor = _MONITOR_RATE.match(name.strip())
    if monitor:
        if monitor.group("nth"):  # a second optimizer: not the one the run's rows follow
            return None
        return Role("lr", group=int(monitor.group("pg")) - 1 if monitor.group("pg") else 0)
    key = normal(name)
    if key in PLACE_NAMES:
        return Role("step") if key in STEP_NAMES else None
    if key in LOSS_NAMES:
        return Role("loss")
    if key in GRAD_NORM_NAMES:
        return Role("grad_norm")
    if key in LR_NAMES:
        return Role("lr")
    grouped = _GROUP_RATE.match(key)
    if grouped:
        n = int(grouped.group("n"))
        return Role("lr", group=n - 1 if grouped.group("word") == "pg" and n > 0 else n)
    if key in SCALE_NAMES:
        return Role("scale")
    if key in SKIPPED_NAMES:
        return Role("skipped")
    if key in STEP_SECONDS:
        return Role("wall")
    if key in STEP_MILLISECONDS:
        return Role("wall", unit=1e-3)
    if key in CLOCK_NAMES:
        return Role("time")
    if key in TOKENS_PER_STEP:
        return Role("tokens", how="per-step")
    if key in TOKENS_SEEN:
        return Role("tokens", how="cumulative")
    if key in TOKENS_PER_SECOND:
        return Role("tokens", how="per-second")
    memory = _memory_role(key)
    if memory is not None:
        return memory
    if _is_eval_loss(key):
        return Role("eval")
    return None


def _memory_role(key: str) -> Optional[Role]:
    words = key.split("_")
    unit = UNITS.get(words[-1]) if len(words) > 1 else None
    stem = "_".join(words[:-1]) if unit is not None else key
    if stem in RSS_NAMES:
        return Role("rss", unit=unit or 1)
    if stem in CUDA_NAMES:
        return Role("cuda_allocated", unit=unit or 1)
    return None


def _is_eval_loss(key: str) -> bool:
    words = key.split("_")
    if not any(word in EVAL_WORDS for word in words):
        return False
    if any(bad in key for bad in NOT_A_LOSS):
        return False
    return any(word in EVAL_LOSS_WORDS for word in words)


# Numbers a log keeps beside its series that are no series and need no mapping (the Trainer's eval rows)
BOOKKEEPING_ENDINGS = ("_runtime", "samples_per_second", "steps_per_second", "total_flos")


def is_place(name: str) -> bool:
    """A column that says where a point is (step, epoch) or is bookkeeping (an evaluation's runtime): read,
    never listed as unread."""
    key = normal(name)
    return key in PLACE_NAMES or key.endswith(BOOKKEEPING_ENDINGS)


# ------------------------------------------------------------------------------ --tag SERIES=NAME


def role_for_tag(series: str) -> Role:
    """The Role a --tag key names: `loss`, `lr:1` (the second group's rate), `wall_ms`, `eval`, ..."""
    key, _, group = series.partition(":")
    if key == "wall_ms":
        return Role("wall", unit=1e-3)
    if key == "tokens_seen":
        return Role("tokens", how="cumulative")
    if key == "tokens_per_second":
        return Role("tokens", how="per-second")
    if key not in TAG_SERIES or (group and (key != "lr" or not group.isdigit())):
        import difflib

        known = [*TAG_SERIES, "lr:1", "wall_ms", "tokens_seen", "tokens_per_second"]
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
        raise UsageError(f"--tag {series}=...: no series called {series!r}",
                         (f"did you mean {close[0]}? " if close else "") + "the series are " + ", ".join(known))
    return Role(key, group=int(group) if group else 0, how="per-step" if key == "tokens" else "")


def parse_tags(pairs: list[str]) -> dict[str, str]:
    """`["loss=train/loss_epoch", "eval=ppl_val"]` -> {"loss": "train/loss_epoch", "eval:ppl_val": "ppl_val"}
    (each --tag eval=NAME one more evaluation source); UsageError for a pair without `=` or a series
    that does not exist."""
    tags: dict[str, str] = {}
    for pair in pairs:
        series, sep, name = pair.partition("=")
        series, name = series.strip(), name.strip()
        if not sep or not series or not name:
            raise UsageError(f"--tag {pair!r} is not SERIES=NAME", "e.g. --tag loss=train/loss_epoch")
        role_for_tag(series)
        key = f"eval:{name}" if series == "eval" else series
        if key in tags and tags[key] != name:
            raise UsageError(f"--tag {series} is given twice ({tags[key]} and {name})", "give each series once")
        tags[key] = name
    return tags
