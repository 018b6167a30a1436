"""What a model predicts (its task), read from what it says and what it returns, most trusted first:

1. a declared task (`Subject(task=...)`, `--task`) always wins;
2. a Hugging Face head's class: `*ForSequenceClassification` (regression when its config's
   problem_type says so, or it has one label, as the library itself decides), `*ForTokenClassification`,
   `*ForQuestionAnswering`, `*ForMultipleChoice`;
3. the structure of the output: a span's start and end scores (`start_logits` / `end_logits`, or a pair of
   [B, T] tensors) are an extractive question-answering head;
4. the shape of the output on ids [B, T]: [B, T, V] over the vocabulary is a language model (next-token,
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
QA = "question-answering"
CHOICE = "multiple-choice"
assert (LM, SEQUENCE, TOKEN, REGRESSION, QA, CHOICE) == TASKS

# What each task's output looks like, for messages: [B, T, V] and the rest.
SHAPES = {LM: "[B, T, V]", SEQUENCE: "[B, C]", TOKEN: "[B, T, C]", REGRESSION: "[B, K]",
          QA: "start and end scores [B, T] each", CHOICE: "[B, C] from inputs [B, C, T]"}
# Words for a task in a message: "a sequence classifier".
NAMES = {LM: "a language model", SEQUENCE: "a sequence classifier", TOKEN: "a token classifier",
         REGRESSION: "a regression head", QA: "a question-answering head", CHOICE: "a multiple-choice head"}

# What a pooled head's one prediction per row is called in a message.
POOLED_SCORES = {SEQUENCE: "class scores", REGRESSION: "predicted values", CHOICE: "choice scores"}


def pooled_scores(task: Optional[str]) -> str:
    """"class scores", or what the pooled head of `task` returns in their place."""
    return POOLED_SCORES.get(task, "class scores")


# How tfdoctor holds what these two heads return, so that every probe reads one tensor:
# - a question-answering head's start and end scores, stacked as [B, T, 2] (one pair per position: its
#   per-position checks read them as a token classifier's; its loss is over the positions, ln(T) at chance);
# - a multiple-choice head is fed each probe row as a question with one choice ([B, 1, T]) and answers
#   [B, 1], one score per (question, choice) sequence; its loss groups CHOICES consecutive rows into one
#   question (ln(CHOICES) at chance). Rows of Hugging Face's heads are scored apart (they flatten
#   [B, C, T] to [B*C, T]), so grouping them afterwards is what the head computes on [B/C, C, T].
SPAN_ENDS = 2
CHOICES = 4  # SWAG, RACE, ARC and CommonsenseQA's four or five; the probe batches hold 4 rows


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
    if any(name.endswith("ForQuestionAnswering") for name in lineage):
        return QA
    if any(name.endswith("ForMultipleChoice") for name in lineage):
        return CHOICE
    return None


def span_scores(output: Any, length: Optional[int] = None) -> Any:
    """A question-answering head's start and end scores stacked [B, T, 2], or None when `output` holds
    none: an object or dict with start_logits and end_logits (Hugging Face's), or a pair of 2-D tensors
    of one shape [B, `length`] (a hand-written head's `return start, end`)."""
    import torch

    pair = None
    if isinstance(output, dict):
        pair = output.get("start_logits"), output.get("end_logits")
    elif hasattr(output, "start_logits"):
        pair = getattr(output, "start_logits", None), getattr(output, "end_logits", None)
    elif isinstance(output, (tuple, list)) and len(output) == 2:
        pair = tuple(output)
        if not all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.is_floating_point() for t in pair) \
                or pair[0].shape != pair[1].shape or (length is not None and pair[0].shape[1] != length):
            return None
    if pair is None or not all(isinstance(t, torch.Tensor) for t in pair) or pair[0].shape != pair[1].shape:
        return None
    return torch.stack(pair, -1)  # (B, T, 2)


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
    if task == QA:
        return shape == (batch, length, SPAN_ENDS)
    if task == CHOICE:
        return shape == (batch, 1)
    if task == TOKEN:
        return len(shape) == 3 and shape[:2] == (batch, length)
    return len(shape) == 2 and shape[0] == batch


def outputs_of(task: str, shape: tuple, vocab: int) -> int:
    """C: the classes (or regression outputs) an output of `shape` scores; V for a language model; the
    choices a question is given for a multiple-choice head; the span's two ends for question answering."""
    if task == CHOICE:
        return CHOICES
    return vocab if task == LM else int(shape[-1])


def choices_in(task: Optional[str], rows: int) -> int:
    """How many consecutive rows of a batch of `rows` make one multiple-choice question (1 otherwise)."""
    return max(1, min(CHOICES, rows)) if task == CHOICE else 1


def chance_classes(subject: Any, length: int, rows: int) -> int:
    """The number of equally likely answers a uniform guess spreads over, whose log is the loss at chance:
    V tokens, C classes, the `length` positions a span can start (or end) at, a question's choices."""
    task = subject.task or LM
    if task == QA:
        return length
    if task == CHOICE:
        return choices_in(task, rows)
    return subject.num_labels or subject.vocab_size


def pooled(task: Optional[str]) -> bool:
    return task in POOLED_TASKS


CLASSIFIER_TASKS = (SEQUENCE, TOKEN, REGRESSION, QA, CHOICE)


def for_classifiers(why: str) -> dict:
    """skip_reasons for a check written for language models: `why`, said of every classifier task."""
    return {task: f"{NAMES[task]} ({SHAPES[task]}): {why}" for task in CLASSIFIER_TASKS}
