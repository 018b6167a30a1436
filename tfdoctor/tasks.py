"""What a model predicts (its task), read from what it says and what it returns, most trusted first:

1. a declared task (`Subject(task=...)`, `--task`) always wins;
2. a Hugging Face head's class: `*ForSequenceClassification` (regression when its config's
   problem_type says so, or it has one label, as the library itself decides), `*ForTokenClassification`;
3. the shape of the output on ids [B, T]: [B, T, V] over the vocabulary is a language model (next-token,
   masked or seq2seq: the kind says which); [B, C] is one prediction per row from a pooled state, a
   sequence classifier (a regression head when C == 1); [B, T, C] with C fewer than the vocabulary's
   tokens is one label per token. Under `tfdoctor run` the loss the loop grades the output with says it
   too (recording/discovery.py).

An output left ambiguous stays an error the user can settle with --task: [B, V] (as many scores as the
vocabulary, pooled: an LM that averaged its positions away as much as a classifier), [B, T, C] with more
classes than tokens (a vocabulary read off the wrong table as much as a token classifier).
"""

from __future__ import annotations

from typing import Any, Optional

from tfdoctor.registry import POOLED_TASKS, TASKS

LM = "lm"
SEQUENCE = "sequence-classification"
TOKEN = "token-classification"
REGRESSION = "regression"
assert (LM, SEQUENCE, TOKEN, REGRESSION) == TASKS

# What each task's output looks like, for messages: [B, T, V] and the rest.
SHAPES = {LM: "[B, T, V]", SEQUENCE: "[B, C]", TOKEN: "[B, T, C]", REGRESSION: "[B, K]"}
# Words for a task in a message: "a sequence classifier".
NAMES = {LM: "a language model", SEQUENCE: "a sequence classifier", TOKEN: "a token classifier",
         REGRESSION: "a regression head"}


def named_task(model: Any) -> Optional[str]:
    """The task a Hugging Face head's class names, or None (an LM head, a base model, any other)."""
    lineage = [cls.__name__ for cls in type(model).__mro__]
    config = getattr(model, "config", None)
    if any(name.endswith("ForSequenceClassification") for name in lineage):
        problem = getattr(config, "problem_type", None)
        if problem == "regression" or (problem is None and getattr(config, "num_labels", None) == 1):
            return REGRESSION
        return SEQUENCE
    if any(name.endswith("ForTokenClassification") for name in lineage):
        return TOKEN
    return None


def multi_label(model: Any) -> bool:
    """A Hugging Face sequence classifier trained with one sigmoid per label (BCEWithLogitsLoss), not a
    softmax over them: its chance loss is not ln(C)."""
    return getattr(getattr(model, "config", None), "problem_type", None) == "multi_label_classification"


def shaped_task(shape: tuple, batch: int, length: int, vocab: int) -> Optional[str]:
    """The task an output of `shape` on ids [batch, length] says, or None when the shape says none."""
    if len(shape) == 3 and shape[:2] == (batch, length):
        if shape[2] == vocab:
            return LM
        return TOKEN if 2 <= shape[2] < vocab else None
    if len(shape) == 2 and shape[0] == batch and shape[1] != vocab:
        return REGRESSION if shape[1] == 1 else SEQUENCE
    return None


def fits(task: str, shape: tuple, batch: int, length: int, vocab: int) -> bool:
    """Whether an output of `shape` on ids [batch, length] is what `task` predicts."""
    if task == LM:
        return shape == (batch, length, vocab)
    if task == TOKEN:
        return len(shape) == 3 and shape[:2] == (batch, length)
    return len(shape) == 2 and shape[0] == batch


def outputs_of(task: str, shape: tuple, vocab: int) -> int:
    """C: the classes (or regression outputs) an output of `shape` scores; V for a language model."""
    return vocab if task == LM else int(shape[-1])


def pooled(task: Optional[str]) -> bool:
    return task in POOLED_TASKS


CLASSIFIER_TASKS = (SEQUENCE, TOKEN, REGRESSION)


def for_classifiers(why: str) -> dict:
    """skip_reasons for a check written for language models: `why`, said of every classifier task."""
    return {task: f"{NAMES[task]} ({SHAPES[task]}): {why}" for task in CLASSIFIER_TASKS}
