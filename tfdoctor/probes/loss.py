"""The language-modelling loss each kind of model is trained on, on random token batches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tfdoctor.probes.modes import evaluation
from tfdoctor.subject import Subject, call, random_tokens


@dataclass
class LMBatch:
    inputs: tuple  # what call(subject, *inputs) takes
    targets: torch.Tensor  # [B, T_out] ids the logits are graded against (-100 = ignored)


def lm_batch(subject: Subject, batch: int, length: int, generator: torch.Generator) -> LMBatch:
    """Causal: predict token t+1 from tokens <= t. Seq2seq: the decoder does the same on the target,
    given a source. Encoder: random labels drawn independently of the input, so the chance level is
    exactly ln(V) even though an encoder legitimately sees every input token."""
    ids = random_tokens(subject, batch, length + 1, generator)
    if subject.kind == "seq2seq":
        source = random_tokens(subject, batch, length, generator)
        return LMBatch((source, ids[:, :-1]), ids[:, 1:])
    if subject.kind == "encoder":
        return LMBatch((ids[:, :-1],), random_tokens(subject, batch, length, generator))
    return LMBatch((ids[:, :-1],), ids[:, 1:])


def lm_loss(subject: Subject, batch: LMBatch) -> torch.Tensor:
    logits = call(subject, *batch.inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch.targets.reshape(-1),
                           ignore_index=-100)


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
