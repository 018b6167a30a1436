"""The loss each kind of model is trained on, on random token batches: the language-modelling loss,
or for a classifier (tfdoctor/tasks.py) cross-entropy over its C classes against random labels (one
per row, or per token), and the mean squared error of a regression head against standard-normal
targets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tfdoctor.modes import evaluation
from tfdoctor.subject import Subject, call, random_tokens


@dataclass
class LMBatch:
    inputs: tuple  # what call(subject, *inputs) takes
    targets: torch.Tensor  # [B, T_out] ids the logits are graded against (-100 = ignored)


def lm_batch(subject: Subject, batch: int, length: int, generator: torch.Generator) -> LMBatch:
    """Causal: predict token t+1 from tokens <= t. Seq2seq: the decoder does the same on the target,
    given a source. Encoder: random labels drawn independently of the input, so the chance level is
    exactly ln(V) even though an encoder legitimately sees every input token. A classifier: random
    labels drawn independently of the input (chance is ln(C))."""
    if (subject.task or "lm") != "lm":
        ids = random_tokens(subject, batch, length, generator)
        targets = random_targets(subject, torch.ones_like(ids, dtype=torch.bool), generator)
        # a seq2seq head (BART's, T5's) reads its decoder: given the source, as the library feeds it
        return LMBatch((ids, ids) if subject.kind == "seq2seq" else (ids,), targets)
    ids = random_tokens(subject, batch, length + 1, generator)
    if subject.kind == "seq2seq":
        source = random_tokens(subject, batch, length, generator)
        return LMBatch((source, ids[:, :-1]), ids[:, 1:])
    if subject.kind == "encoder":
        return LMBatch((ids[:, :-1],), random_tokens(subject, batch, length, generator))
    return LMBatch((ids[:, :-1],), ids[:, 1:])


def lm_loss(subject: Subject, batch: LMBatch) -> torch.Tensor:
    return task_loss(subject, call(subject, *batch.inputs), batch.targets)


def random_targets(subject: Subject, graded: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Targets for the positions `graded` ((B, T) bool) marks, -100 elsewhere, as the task grades them:
    token ids [B, T] (a language model), labels in [0, C) [B, T] (a token classifier), one label per
    row [B] (a sequence classifier: -100 for a row with nothing graded), or standard-normal values
    [B, K] (a regression head: NaN for such a row). Labels are dealt round-robin over the classes, then
    shuffled, so every class appears once there are C rows: a model that ignores its input cannot beat
    ln(C) on them by luck."""
    import tfdoctor.tasks as tasks  # the module: `from tfdoctor import` would close an import circle

    task = subject.task or tasks.LM
    B, T = graded.shape
    device = graded.device
    if task == tasks.LM:
        return random_tokens(subject, B, T, generator).masked_fill(~graded.to(device), -100)
    if task == tasks.REGRESSION:
        values = torch.randn(B, subject.num_labels, generator=generator).to(device)
        return values.masked_fill(~graded.any(-1, keepdim=True).to(device), float("nan"))
    if task == tasks.QA:
        return _span_targets(graded, generator).to(device)
    if task == tasks.CHOICE:  # one right choice per question of C consecutive rows
        C = tasks.choices_in(task, B)
        answers = (torch.arange(B // C) % C)[torch.randperm(B // C, generator=generator)].to(device)
        asked = graded[: (B // C) * C].any(-1).reshape(-1, C).any(-1).to(device)
        return answers.masked_fill(~asked, -100)
    count = B if task == tasks.SEQUENCE else B * T
    labels = (torch.arange(count) % subject.num_labels)[torch.randperm(count, generator=generator)].to(device)
    if task == tasks.SEQUENCE:
        return labels.masked_fill(~graded.any(-1).to(device), -100)
    return labels.reshape(B, T).masked_fill(~graded.to(device), -100)


def _span_targets(graded: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(B, 2): each row's answer span, its start and its end each drawn uniformly from the row's graded
    positions (independently, as a uniform guess scores them); -100 for a row with none graded."""
    B, T = graded.shape
    draws = torch.rand(B, 2, T, generator=generator).masked_fill(~graded.cpu()[:, None, :], -1.0)
    return draws.argmax(-1).masked_fill(~graded.cpu().any(-1, keepdim=True), -100)


# A span head may take positions out of the competition by design: BigBird's question-answering head
# subtracts 1e6 from the question's positions, where an answer never lies. A score this far below its
# row's best is such a removal (its softmax weight is 0 in float32), never an initialisation's scale.
REMOVED_POSITION_GAP = 1e4


def span_chance_loss(subject: Subject, batch: LMBatch, generator: torch.Generator) -> tuple[float, float, float]:
    """A span head on `batch`'s ids: (its loss on answers drawn uniformly among the positions it keeps in
    the competition, the mean over rows and ends of ln(those positions), the loss of a uniform guess, and
    the mean number of positions it takes out)."""
    logits = call(subject, *batch.inputs).float()  # (B, T, 2): start and end scores
    kept = logits > logits.amax(1, keepdim=True) - REMOVED_POSITION_GAP
    draws = torch.rand(logits.shape, generator=generator).masked_fill(~kept.cpu(), -1.0)
    targets = draws.argmax(1).to(logits.device)  # (B, 2): a start and an end per row
    chance = float(torch.log(kept.sum(1).clamp(min=1).double()).mean())
    removed = float((~kept).sum(1).float().mean())
    return float(task_loss(subject, logits, targets)), chance, removed


def task_loss(subject: Subject, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension ignoring -100 (language models and classifiers), the mean
    squared error over the rows whose targets are not NaN (a regression head), for a question-answering
    head the mean of its start and end cross-entropies over the positions (as the library's heads take
    it), and for a multiple-choice head cross-entropy over each question's C choices (rows in groups of C,
    tfdoctor/tasks.py)."""
    import tfdoctor.tasks as tasks

    task = subject.task or tasks.LM
    if task == tasks.REGRESSION:
        keep = ~torch.isnan(targets).any(-1)
        return F.mse_loss(logits.float()[keep], targets[keep])
    if task == tasks.QA:  # logits (B, T, 2), targets (B, 2) positions
        ends = [F.cross_entropy(logits[..., k].float(), targets[:, k], ignore_index=-100) for k in range(2)]
        return (ends[0] + ends[1]) / 2
    if task == tasks.CHOICE:  # logits (B, 1): one score per (question, choice) row
        C = tasks.choices_in(task, logits.shape[0])
        asked = logits.float()[: targets.shape[0] * C].reshape(-1, C)
        return F.cross_entropy(asked, targets, ignore_index=-100)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def lm_batch_of(subject: Subject, batch) -> LMBatch:
    """A batch as a training loop is fed it (ids [B, T]; seq2seq: a (src, tgt) pair) as the
    next-token task: the inputs without their last token, graded on the tokens one to the right,
    padding ignored."""
    src, ids = batch if subject.kind == "seq2seq" else (None, batch)
    targets = ids[:, 1:]
    if subject.pad_id is not None:
        targets = targets.masked_fill(targets == subject.pad_id, -100)
    inputs = (src, ids[:, :-1]) if src is not None else (ids[:, :-1],)
    return LMBatch(inputs, targets)


def eval_loss(subject: Subject, model: torch.nn.Module, batch: LMBatch) -> float:
    """lm_loss of `model` (not necessarily subject.model) on `batch`, dropout off, no gradients."""
    clone = dataclasses.replace(subject, model=model)
    with torch.no_grad(), evaluation(model):
        return float(lm_loss(clone, batch))
