"""init-loss: does the untrained model start where chance says (ln V, ln C, ln T)?"""

from __future__ import annotations

import math
import statistics

from tfdoctor.registry import check
from tfdoctor.result import Result

# init-loss thresholds, in nats above or below ln(V). Logits with standard deviation s cost about
# s^2 / 2 nats over ln(V); correct models measured here start +0.0 to +0.75 above (tiny T5 +0.75,
# x-transformers +0.25, GPT-2 and the fixtures ~0), so a warning starts at +1.5 (s ~ 1.7) and a
# failure at +3 (s ~ 2.4, confidently wrong from step one).
HIGH_WARN_NATS = 1.5
HIGH_FAIL_NATS = 3.0
# Below ln(V) is out of reach for a model that cannot see its random targets; a few tenths allows
# for sampling noise over the few hundred probe tokens.
LOW_WARN_NATS = 0.3
LOW_FAIL_NATS = 1.0
INIT_LOSS_BATCHES = 4
# How far past a line the loss must be for the line to count (at least; three standard errors of
# the batch mean when larger). Above: Youtu's deliberate init sits at +1.5 to +1.6 nats and flipped
# between warn and pass with the seed. Below: the lines are a few tenths, so is the margin.
CLOSE_HIGH_NATS = 0.5
CLOSE_LOW_NATS = 0.1


@check("init-loss", title="Initial loss sits at the random-chance baseline ln(V)",
       inputs=("model", "initial_weights"), tasks=("lm", "sequence-classification", "token-classification",
                                                    "question-answering", "multiple-choice"),
       skip_reasons={"regression": "a regression head has no chance level: its initial error is the targets' "
                                   "spread, which only the data knows"})
def init_loss(subject) -> Result:
    """Catches oversized initial logits (loss far above ln(V)) and a model that can see the answer
    it is asked to predict (loss below ln(V) before any training).

    Cross-entropy of the untrained model on random tokens, in eval mode, against ln(V), the loss of
    a uniform guess. Assumes the factory returns an untrained model. A classifier is judged the same
    way against ln(C) for its C classes, on random labels; a question-answering head against ln(T), a
    uniform guess of a span's start (and end) over T positions; a multiple-choice head against ln(C) for a
    question's C choices.

    Fix: initialise embeddings and heads small (`std=0.02`); shift targets by one.
    """
    import torch

    from tfdoctor.context import current
    from tfdoctor.modes import evaluation
    from tfdoctor.probes.loss import lm_batch, lm_loss, span_chance_loss
    from tfdoctor.tasks import CHOICES, QA, TOKEN, chance_classes, multi_label

    if multi_label(subject.model):
        return Result.skipped("a multi-label classifier (one sigmoid per label): its chance loss is not ln(C)")
    generator = torch.Generator().manual_seed(current().seed + 1)
    losses, chances, removed = [], [], []
    # a multiple-choice head's batch is B questions of C choice rows, not B rows (one question of 4: the
    # mean over 4 questions left ModernBERT's head a standard error of 0.7 nats, a close call at +1.4)
    rows = subject.batch_size * (CHOICES if subject.task == "multiple-choice" else 1)
    with torch.no_grad(), evaluation(subject.model):
        for _ in range(INIT_LOSS_BATCHES):
            batch = lm_batch(subject, rows, subject.seq_len, generator)
            if subject.task == QA:  # answers among the positions the head keeps (probes/loss.py)
                loss, chance, taken_out = span_chance_loss(subject, batch, generator)
                losses.append(loss)
                chances.append(chance)
                removed.append(taken_out)
            else:
                losses.append(float(lm_loss(subject, batch)))
    loss = sum(losses) / len(losses)
    classes = chance_classes(subject, subject.seq_len, rows)  # V, C classes, T positions, C choices
    baseline = sum(chances) / len(chances) if chances else math.log(classes)
    excess = loss - baseline
    details = {"loss": loss, "ln_vocab": baseline, "excess_nats": excess, "vocab_size": subject.vocab_size,
               "tokens": INIT_LOSS_BATCHES * subject.batch_size * subject.seq_len}
    symbol = "V"
    if (subject.task or "lm") != "lm":
        symbol = "T" if subject.task == QA else "C"
        per_batch = {TOKEN: subject.batch_size * subject.seq_len, "multiple-choice": rows // classes}
        details.update(ln_classes=baseline, classes=classes, task=subject.task,
                       graded=INIT_LOSS_BATCHES * per_batch.get(subject.task, subject.batch_size))
    removed_note = ""
    if removed and sum(removed) > 0:  # the head takes positions out (BigBird's question mask)
        details["positions_removed"] = sum(removed) / len(removed)
        removed_note = (f"; the head scores {details['positions_removed']:.2g} of the {classes} positions of a row "
                        "1e4 or more below its best on average (out of the competition, as a question mask does), "
                        "so chance is a uniform guess over the rest")
    summary = f"initial loss {loss:.3f} vs ln({symbol}) = {baseline:.3f} ({excess:+.3f} nats){removed_note}"
    if not math.isfinite(loss):
        return Result.failed(f"initial loss is {loss}", "look for -inf masks on fully masked rows, or "
                             "overflowing initial weights", details)
    # A verdict must not hinge on which side of a line noise lands: a line counts as crossed only
    # beyond its margin (CLOSE_HIGH_NATS / CLOSE_LOW_NATS, or three standard errors of the batch mean);
    # a close call is the milder verdict with a note.
    spread = statistics.stdev(losses) / math.sqrt(len(losses)) if len(losses) > 1 else 0.0
    details["standard_error"] = spread
    high = [(HIGH_FAIL_NATS, Result.failed, "fail"), (HIGH_WARN_NATS, Result.warned, "warning")]
    low = [(LOW_FAIL_NATS, Result.failed, "fail"), (LOW_WARN_NATS, Result.warned, "warning")]
    for side, sign, lines, close_nats, message, hint in (
            ("+", excess, high, CLOSE_HIGH_NATS,
             "the untrained model is confidently wrong (oversized initial logits)",
             "initialise embeddings and output projections small (e.g. nn.init.normal_(w, std=0.02)) "
             "and zero the LM head bias"),
            ("-", -excess, low, CLOSE_LOW_NATS,
             "below chance before training, so the model sees what it predicts (or the factory loads trained "
             "weights)", "run future-leak and mask-direction; make sure targets are the inputs shifted by one")):
        margin = max(close_nats, 3 * spread)
        crossed = [(line, verdict) for line, verdict, _ in lines if sign > line + margin]
        close = [(line, name) for line, _, name in lines if line - margin < sign <= line + margin]
        note = (f" (within {margin:.2f} nats of the {side}{close[0][0]:g}-nat {close[0][1]} line: a close call, "
                "reported as the milder verdict)" if close else "")
        if crossed:
            return crossed[0][1](f"{summary}: {message}{note}", hint, details)
        if close:
            details["close_call"] = {"line_nats": float(f"{side}{close[0][0]}")}
            return (Result.warned(f"{summary}: {message}{note}", hint, details) if close[0][1] == "fail"
                    else Result.passed(f"{summary}{note}", details))
    return Result.passed(summary, details)
