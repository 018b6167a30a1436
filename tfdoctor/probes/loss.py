"""The language-modelling loss each kind of model is trained on, on random token batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
