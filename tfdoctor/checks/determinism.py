"""Determinism checks: eval() forwards that must not be random, and train() forwards that must be
when the model declares dropout."""

from __future__ import annotations

from tfdoctor.registry import check
from tfdoctor.result import Result

# Probe batch: two rows, one forward per run (two to five runs), so small.
PROBE_ROWS = 2
# Declared dropouts named in the message; the details list them all.
DECLARED_SHOWN = 3

EVAL_RANDOM_HINT = (
    "make every dropout follow the module's mode: use nn.Dropout(p) modules, or pass "
    "training=self.training to F.dropout (its default is training=True, so F.dropout(x, p) drops in eval() "
    "too); keep random ops (torch.rand, randn, bernoulli) behind `if self.training:`"
)
STATEFUL_HINT = (
    "make the forward a function of its inputs in eval(): reset caches, counters and running statistics "
    "between calls, or keep them out of the forward"
)
DROPOUT_UNUSED_HINT = (
    "apply the dropout you declare: call the nn.Dropout module in the forward, or pass the stored rate "
    "on (F.dropout(x, self.dropout, training=self.training), F.scaled_dot_product_attention(..., "
    "dropout_p=self.dropout if self.training else 0.0)); or set the rate to 0 if you meant none"
)


@check("eval-determinism", title="Eval forwards are deterministic, and declared dropout is applied in train()")
def eval_determinism(subject) -> Result:
    """Catches a forward that is random in eval(): dropout that ignores the module's mode
    (`F.dropout(x, p)`, whose `training` defaults to True) or a random op left in the forward, so that
    evaluation, generation and every eval-mode measurement are noisy. And the reverse: a model that
    declares dropout (an nn.Dropout with p > 0, a stored float rate such as `self.dropout = 0.1`) whose
    train() forwards are never random, so the regularisation it was configured with never happens.

    Runs the same random ids through the model twice in eval() under two RNG seeds, comparing the
    logits and every module's output (forward hooks): a difference beyond 1e-5 of the largest logit
    fails, naming its size and the first module whose output differs; a third run under the first
    seed tells randomness from state carried between calls (which warns). Where dropout is declared,
    train() forwards under different seeds must differ (up to 4 tried), else a warning; a model whose
    only declared dropout drops whole layers (LayerDrop, drop_path) is not judged on that. No gradients; the RNG, the
    modes, the weights and the buffers are put back.

    Fix: `F.dropout(x, p, training=self.training)` or nn.Dropout modules; call the dropout you declare.
    """
    import torch

    from tfdoctor.context import current
    from tfdoctor.probes.stochastic import measure_randomness
    from tfdoctor.subject import call, random_tokens

    seed = current().seed
    generator = torch.Generator().manual_seed(seed + 29)
    count = 2 if subject.kind == "seq2seq" else 1
    ids = tuple(random_tokens(subject, PROBE_ROWS, subject.seq_len, generator) for _ in range(count))
    measured = measure_randomness(subject.model, lambda: call(subject, *ids), seed)
    return judge_randomness(measured, [PROBE_ROWS, subject.seq_len])


def judge_randomness(measured, probe_shape: list[int]) -> Result:
    """The verdict on what measure_randomness saw."""
    from tfdoctor.probes.stochastic import LAYER_DROP_WORDS

    pair, again = measured.eval_pair, measured.eval_same_seed
    details = {"probe_shape": probe_shape, "eval_pair": pair.to_dict(),
               "eval_same_seed": again.to_dict() if again else None, "declared_dropout": measured.declared,
               "train_pair": measured.train_pair.to_dict() if measured.train_pair else None,
               "train_error": measured.train_error, "train_forwards": measured.train_seeds}
    if pair.differs:
        where = (f"; it starts in the forward of {pair.origin} (first seen in {pair.first_module}'s output; "
                 f"{pair.modules_differing} of {pair.modules_compared} module outputs differ)"
                 if pair.first_module else "")
        size = f"by up to {pair.max_abs:.3g} ({pair.relative:.1%} of the largest logit)"
        if again is not None and again.differs:
            return Result.warned(f"two eval() forwards of the same ids differ {size} even under the same RNG "
                                 f"seed{where}: the forward carries state from one call to the next", STATEFUL_HINT,
                                 details)
        return Result.failed(f"two eval() forwards of the same ids differ {size}, and agree when the RNG seed is "
                             f"repeated, so the forward is random in eval(){where}: dropout that ignores the "
                             "module's mode, or a random op left in the forward", EVAL_RANDOM_HINT, details)
    quiet = f"two eval() forwards of the same ids agree ({pair.modules_compared} module outputs compared)"
    if not measured.declared:
        return Result.passed(f"{quiet}; the model declares no dropout", details)
    shown = ", ".join(measured.declared[:DECLARED_SHOWN]) + (
        f" and {len(measured.declared) - DECLARED_SHOWN} more" if len(measured.declared) > DECLARED_SHOWN else "")
    if measured.train_pair is None:
        return Result.passed(f"{quiet}; train() forwards could not be compared ({measured.train_error})", details)
    if measured.train_pair.differs:
        return Result.passed(f"{quiet}; train() forwards vary (by up to {measured.train_pair.max_abs:.3g}), so the "
                             "declared dropout is applied", details)
    if all(any(word in declared.lower() for word in LAYER_DROP_WORDS) for declared in measured.declared):
        return Result.passed(f"{quiet}; the only dropout declared drops whole layers ({shown}), whose draws at small "
                             f"rates often keep every layer: {measured.train_seeds} train() forwards alike, not judged",
                             details)
    return Result.warned(f"the model declares dropout ({shown}) yet {measured.train_seeds} train() forwards under "
                         "different RNG seeds are identical: the dropout is never applied", DROPOUT_UNUSED_HINT,
                         details)
