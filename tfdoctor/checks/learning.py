"""Learning checks: does the untrained model start where chance says, and can it learn at all?"""

from __future__ import annotations

import math

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

# overfit-batch: Karpathy's "overfit one batch" recipe. A wired-up Transformer memorises a handful of
# random sequences in well under 300 AdamW steps; the target is 0.01 nats or 5% of ln(V), whichever
# is looser, so a small vocabulary does not demand more than memorising requires.
OVERFIT_STEPS = 300
OVERFIT_LR = 3e-3
OVERFIT_ROWS = 4
OVERFIT_MAX_LEN = 32
OVERFIT_TARGET_SHARE = 0.05
OVERFIT_TARGET_NATS = 0.01
SPARKLINE_POINTS = 60


@check("init-loss", title="Initial loss sits at the random-chance baseline ln(V)")
def init_loss(subject) -> Result:
    """Catches oversized initial logits (loss far above ln(V)) and a model that can see the answer
    it is asked to predict (loss below ln(V) before any training).

    Cross-entropy of the untrained model on random tokens, in eval mode, against ln(V), the loss of
    a uniform guess. Assumes the factory returns an untrained model.
    """
    import torch

    from tfdoctor.context import current
    from tfdoctor.probes.loss import lm_batch, lm_loss
    from tfdoctor.probes.modes import evaluation

    generator = torch.Generator().manual_seed(current().seed + 1)
    losses = []
    with torch.no_grad(), evaluation(subject.model):
        for _ in range(INIT_LOSS_BATCHES):
            batch = lm_batch(subject, subject.batch_size, subject.seq_len, generator)
            losses.append(float(lm_loss(subject, batch)))
    loss = sum(losses) / len(losses)
    baseline = math.log(subject.vocab_size)
    excess = loss - baseline
    details = {"loss": loss, "ln_vocab": baseline, "excess_nats": excess, "vocab_size": subject.vocab_size,
               "tokens": INIT_LOSS_BATCHES * subject.batch_size * subject.seq_len}
    summary = f"initial loss {loss:.3f} vs ln(V) = {baseline:.3f} ({excess:+.3f} nats)"
    if not math.isfinite(loss):
        return Result.failed(f"initial loss is {loss}", "look for -inf masks on fully masked rows, or "
                             "overflowing initial weights", details)
    if excess > HIGH_FAIL_NATS or excess > HIGH_WARN_NATS:
        verdict = Result.failed if excess > HIGH_FAIL_NATS else Result.warned
        return verdict(f"{summary}: the untrained model is confidently wrong (oversized initial logits)",
                       "initialise embeddings and output projections small (e.g. nn.init.normal_(w, std=0.02)) "
                       "and zero the LM head bias", details)
    if -excess > LOW_FAIL_NATS or -excess > LOW_WARN_NATS:
        verdict = Result.failed if -excess > LOW_FAIL_NATS else Result.warned
        return verdict(f"{summary}: below chance before training, so the model sees what it predicts "
                       "(or the factory loads trained weights)",
                       "run future-leak and mask-direction; make sure targets are the inputs shifted by one",
                       details)
    return Result.passed(summary, details)


def sparkline(values: list[float], points: int = SPARKLINE_POINTS) -> str:
    """A one-line drawing of a curve, resampled to at most `points` characters."""
    if not values:
        return ""
    bars = "▁▂▃▄▅▆▇█"
    stride = max(1, math.ceil(len(values) / points))
    sampled = [values[i] for i in range(0, len(values), stride)]
    finite = [v for v in sampled if math.isfinite(v)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
    span = (high - low) or 1.0
    return "".join(bars[min(7, int((v - low) / span * 7.999))] if math.isfinite(v) else "!" for v in sampled)


@check("overfit-batch", title="The model can overfit a single small batch")
def overfit_batch(subject) -> Result:
    """Catches wiring bugs that stop learning altogether: a forward that ignores its input, a
    detached or frozen path, logits that never reach the loss.

    Trains a copy of the model (the user's is untouched) on one small random batch with AdamW and
    dropout off, for up to 300 steps, stopping as soon as the loss is under 0.01 or 5% of ln(V).
    A healthy Transformer memorises it; one that cannot has a bug between its input and its loss.

    With --train (causal and seq2seq models) your own loop trains the copy instead, fed the same batch
    160 times, so the real loss, optimizer and schedule are tested too; it passes when the next-token
    loss on that batch falls to 90% of its start or below.
    """
    if subject.train is not None and subject.kind != "encoder":
        from tfdoctor.checks.trainloop import overfit_with_loop

        return overfit_with_loop(subject)
    import copy
    import dataclasses

    import torch

    from tfdoctor.context import current, progress
    from tfdoctor.probes.loss import lm_batch, lm_loss

    model = copy.deepcopy(subject.model)
    model.eval()  # dropout off; gradients still flow
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return Result.skipped("the model has no trainable parameters")
    clone = dataclasses.replace(subject, model=model)
    generator = torch.Generator().manual_seed(current().seed + 2)
    batch = lm_batch(clone, min(OVERFIT_ROWS, subject.batch_size), min(OVERFIT_MAX_LEN, subject.seq_len),
                     generator)
    target = max(OVERFIT_TARGET_NATS, OVERFIT_TARGET_SHARE * math.log(subject.vocab_size))
    optimizer = torch.optim.AdamW(params, lr=OVERFIT_LR, weight_decay=0.0)
    advance = progress("overfit-batch", OVERFIT_STEPS)
    curve: list[float] = []
    with torch.enable_grad():
        for _ in range(OVERFIT_STEPS):
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(clone, batch)
            curve.append(float(loss.detach()))
            advance(1)
            if not math.isfinite(curve[-1]) or curve[-1] < target:
                break
            loss.backward()
            optimizer.step()
    advance(OVERFIT_STEPS - len(curve))
    final, steps = curve[-1], len(curve)
    details = {"steps": steps, "max_steps": OVERFIT_STEPS, "start_loss": curve[0], "final_loss": final,
               "best_loss": min(curve), "target_loss": target, "lr": OVERFIT_LR,
               "batch_shape": list(batch.targets.shape), "loss_curve": curve,
               "sparkline": sparkline(curve)}
    if final < target:
        return Result.passed(f"loss {curve[0]:.2f} -> {final:.4g} in {steps} steps (target < {target:.4g})", details)
    if not math.isfinite(final):
        return Result.failed(f"loss became {final} after {steps} steps on a single batch",
                             "look for -inf masks on fully masked rows and for overflowing activations",
                             details)
    return Result.failed(
        f"could not overfit one batch: loss {curve[0]:.2f} -> {final:.2f} after {steps} AdamW steps "
        f"(target {target:.3f}); something between the input tokens and the loss is broken",
        "check that the forward uses the token embeddings, that no tensor is detached or frozen on the "
        "way to the logits, and that the loss compares logits with the right targets", details)
