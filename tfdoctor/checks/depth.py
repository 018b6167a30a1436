"""Depth checks: how the signal travels through the stack of blocks at initialisation."""

from __future__ import annotations

import math
import statistics

from tfdoctor.registry import check
from tfdoctor.result import Result

# Probe batch: one forward and one backward on this many rows of at most this many tokens.
PROBE_ROWS = 2
PROBE_MAX_LEN = 32

# Residual growth: the stream's RMS after the last block over its RMS after the first, divided by
# sqrt(L). A stack whose blocks each add a like amount of variance (pre-norm without 1/sqrt(N) scaling
# of its output projections, the common and healthy case) grows as sqrt(L), so this stays near 1;
# growth without bound (each block scaling the stream it is handed) leaves it far behind. Measured at
# 2, 6, 12 and 24 blocks (batch 2 x 32, seed 0): tinygpt 0.78-0.89, nanoGPT-style (std 0.02, no
# scaling) 0.77-0.88, HF GPT-2 (scaled c_proj) 0.25-0.77, HF Llama 0.80-1.02, torch pre-norm
# TransformerEncoder (d 128) 0.63-1.28, post-norm stacks (BERT, torch post-LN) <= 0.71; a stack with no
# norm at all (PyTorch's default init) 0.94-2.34. A block whose output already holds the residual,
# added again by the model's loop (x = x + block(x)), doubles the stream per block: 3.3 at 4 blocks,
# 10.9 at 6, 498 at 12.
GROWTH_WARN = 3.0
# Growth from the embeddings: the stream's RMS after the last block over its RMS entering the first (the
# embeddings' output). The ratio above starts from the first block's output, and so misses a first block
# that already swamps the embeddings: a 48-block pre-norm stack drawn at std 1/sqrt(fan_in) with embeddings
# at std 0.02 and no 1/sqrt(2 * n_layer) scaling of its output projections grows 308x from its input but
# only 10.5x (1.5 x sqrt(48)) from block 1 (fixtures/gpt_deep_unscaled.py; 125x at 12 blocks, 67x at 4).
# Its twin with the scaling (fixtures/gpt_deep_scaled.py) grows 24-31x at 2-48 blocks. Real models (batch
# 2 x 32, seed 0): the sweep's tiny configs (bench/hf_sweep.py --checks depth-signal --details depth-signal,
# 2-3 blocks of width 64) at most 78x (AFMoE; AXK1 49, Beam 45, GPT-1 36, OLMo-2 22, the rest under 12),
# CPM-Ant 4700x (HF draws its Linear layers at init_std 1.0; init-loss fails it too, +18 nats); GPT-2
# 12 x 768 11x, Llama 12 x 64 3.7x, 8 x 1024 57x, GPT-NeoX 12 x 256 23x, T5 6 x 256 3.3x, BERT 1x (post-norm).
# Library inits at std 0.02 reach this line at real widths, where 0.02 is ~1/sqrt(fan_in) and nothing
# scales the branches: Llama 4 x 2048 88x, GPT-NeoX 4 x 2048 117x, OLMo-2 4 x 2048 139x (its branch
# outputs are normalised, each adds RMS ~1 over embeddings at 0.02): the same growth as the planted stack.
INPUT_GROWTH_WARN = 100.0
# Both growths are judged from this many blocks on: over two or three, the first block's output is mostly
# the embedding it was handed (std 0.02 in most models) and the next block's add dominates it (HF OLMo-2 at
# 2 blocks: 4.9, AXK1: 32.9, both correct), which says nothing about growth with depth. From the
# embeddings, two or three blocks measure the first block's jump to its own scale, not growth with depth:
# GLM-4's sandwich norm normalises each branch's output (RMS ~1 over embeddings at 0.02), 103x at 2 blocks
# of its tiny config, 1.43x (~sqrt 2) of it from block 1 on; the planted stack is 67x at 4 blocks.
GROWTH_MIN_BLOCKS = 4
# Vanishing gradients: the median gradient norm of the first eighth of the blocks (at least one) over
# that of the last eighth: the two ends of the stack, a few blocks each so that one block's draw does
# not decide. Measured at init (batch 2 x 32, two batches each; post-LN at seeds 0-2): pre-norm stacks
# at 2-24 blocks 1.0-4.1 (tinygpt, nanoGPT-style, GPT-2, Llama, torch norm_first; the first blocks get
# more, not less), BERT 0.98-1.01; torch post-LN stacks (d 64) of 8 blocks 0.91-1.34, 24 blocks
# 0.14-2.1, 48 blocks 0.019-0.94, 64 blocks 0.0036-0.34, 96 blocks 0.0013-0.22: deep post-norm stacks
# starve their first blocks (Liu et al. 2020; Wang et al. 2022, DeepNet), by how much depends on the
# draw. Two orders of magnitude is where the first blocks barely move at a rate the last ones take;
# fixtures/postln_very_deep.py (96 blocks) measures 0.0018-0.0061 over run seeds 0-2.
VANISHING_WARN = 1e-2
ENDS_SHARE = 8
# Position vs token embeddings: RMS of the learned position table over the token table's. Measured:
# nanoGPT-style, GPT-2, BERT, RoBERTa, BART and the torch fixtures all 0.98-1.02 (both drawn alike);
# a position table left at randn (std 1) beside tokens at std 0.02 is 50. A factor 4 in RMS is 16 in
# variance: the position signal then swamps the token signal the first layers read.
POSITION_WARN = 4.0

GROWTH_HINT = (
    "keep each block's contribution bounded: add the residual once (the block returns x + f(x) and the model "
    "assigns x = block(x), or the block returns f(x) and the model adds it), normalise the input of every "
    "branch (pre-norm: x = x + attn(ln_1(x))), and scale output projections by 1/sqrt(2 * n_layer)"
)
INPUT_GROWTH_HINT = (
    "scale the output projection of every residual branch by 1/sqrt(2 * n_layer) at init (GPT-2, nanoGPT: "
    "nn.init.normal_(c_proj.weight, std=0.02 / math.sqrt(2 * n_layer))), or draw the branches smaller, so that "
    "what the blocks add together stays of the order of the embeddings"
)
VANISHING_HINT = (
    "move the LayerNorm inside the branches (pre-norm: x = x + f(ln(x)), nn.TransformerEncoderLayer("
    "norm_first=True)), or keep post-norm with a depth-scaled residual (DeepNorm: x = ln(alpha * x + f(x))) "
    "and a learning-rate warm-up"
)
POSITION_HINT = (
    "initialise the position table like the token table or smaller: nn.init.normal_(pos_emb, std=0.02) "
    "(or zeros for a learned nn.Parameter), not torch.randn"
)


@check("depth-signal", title="The residual stream and the gradients keep their scale through the stack at init",
       inputs=("model", "initial_weights"))
def depth_signal(subject) -> Result:
    """Catches a stack of blocks whose signal does not survive its depth at initialisation: a residual
    stream that grows without bound (a residual added twice, branches that scale the stream they are
    handed) or that ends orders of magnitude above the embeddings it was handed (deep stacks whose
    branches each add O(1) without the 1/sqrt(2 * n_layer) output scaling), first blocks whose
    gradients are orders of magnitude below the last ones' (vanishing in deep post-norm stacks), and
    position embeddings that swamp the token embeddings.

    Finds the repeated blocks (the nn.ModuleList / nn.Sequential of same-class children holding the most
    parameters: `model.layers`, `transformer.h`, `encoder.layer`, nn.TransformerEncoder's `.layers`) and
    runs one forward and backward at init with dropout off on 2 random rows: the RMS of the stream
    entering the first block (the embeddings' output), per block the RMS of its output and the norm of its
    parameters' gradient (torch.autograd.grad: no .grad is touched). Warns (never fails) when the last
    block's RMS over the first's exceeds 3 x sqrt(L) (compounding growth), when it is over 100x the
    stream entering the first block (a 48-block pre-norm stack at std 1/sqrt(fan_in) without output
    scaling: ~300x; with it: ~30x), when the median gradient norm of the first eighth
    of the blocks is below 1e-2 of the last eighth's, or when the learned position table's RMS is over
    4 x the token table's. Thresholds measured on nanoGPT, GPT-2, Llama, BERT and torch stacks at 2 to 96 blocks.
    Assumes the factory returns an untrained model (skipped under `run` when the script loads trained
    weights); skipped when no repeated block is found.

    Fix: add each residual once and normalise branch inputs (pre-norm); scale branch output projections
    by 1/sqrt(2 * n_layer); `norm_first=True` or a depth-scaled residual for deep stacks; initialise
    position tables like token tables (std 0.02).
    """
    import dataclasses

    import torch
    import torch.nn.functional as F

    from tfdoctor.context import current
    from tfdoctor.probes.depth import ModelRaised, find_stack, measure_depth
    from tfdoctor.probes.loss import lm_batch, task_loss
    from tfdoctor.probes.process_state import BackwardRefused
    from tfdoctor.subject import call

    stack = find_stack(subject.model)
    if stack is None:
        return Result.skipped("no repeated block found (no nn.ModuleList or nn.Sequential of two or more "
                              "modules of one class): nothing to follow through the depth")
    generator = torch.Generator().manual_seed(current().seed + 31)
    batch = lm_batch(subject, PROBE_ROWS, min(subject.seq_len, PROBE_MAX_LEN), generator)

    def loss():
        try:
            logits = call(subject, *batch.inputs)
        except Exception as exc:  # the model's own forward, at the probe's length with gradients on
            raise ModelRaised("forward", exc) from exc
        if (subject.task or "lm") != "lm":  # a classifier: graded on its random labels, whatever its shape
            return task_loss(subject, logits, batch.targets)
        if logits.shape[:2] != batch.targets.shape:  # Perceiver: a fixed number of latent outputs
            raise _Unaligned(f"{logits.shape[1]} outputs for {batch.targets.shape[1]} input tokens")
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch.targets.reshape(-1))

    try:
        signal = measure_depth(subject.model, stack, loss, subject.vocab_size)
    except BackwardRefused as refused:
        return Result.skipped(f"the model's {refused}")
    except ModelRaised as raised:  # the same error in eval() and in train() with every dropout at 0
        return Result.skipped(f"the model's {raised} (in eval() and in train() with dropout off), so the signal "
                              "through its blocks cannot be followed",
                              {"phase": raised.phase, "model_error": str(raised)})
    except _Unaligned as unaligned:
        return Result.skipped(f"the model returns {unaligned}: its outputs are not one per position, so no "
                              "per-token loss reaches the blocks to follow")
    return judge_depth(dataclasses.asdict(signal))


class _Unaligned(Exception):
    """The model's outputs do not line up with the probe's tokens."""


def _ratio(top: float, bottom: float) -> float | None:
    return top / bottom if bottom > 0 and math.isfinite(top) and math.isfinite(bottom) else None


def judge_depth(signal: dict) -> Result:
    """The verdict on measure_depth's numbers (DepthSignal as a dict)."""
    outputs, grads, calls = signal["output_rms"], signal["grad_norms"], signal["calls"]
    L = len(outputs)
    ends = max(1, L // ENDS_SHARE)
    growth = _ratio(outputs[-1], outputs[0])
    from_input = _ratio(outputs[-1], signal.get("input_rms") or math.nan)
    first_end, last_end = statistics.median(grads[:ends]), statistics.median(grads[-ends:])
    vanishing = _ratio(first_end, last_end)
    position = _ratio(signal["position_rms"] or math.nan, signal["token_rms"] or math.nan)
    details = {**signal, "blocks": L, "growth": growth, "growth_from_input": from_input,
               "growth_over_sqrt_depth": None if growth is None else growth / math.sqrt(L),
               "blocks_compared_at_each_end": ends, "grad_ratio_first_to_last": vanishing,
               "position_to_token": position,
               "thresholds": {"growth_over_sqrt_depth": GROWTH_WARN, "growth_from_input": INPUT_GROWTH_WARN,
                              "grad_ratio": VANISHING_WARN,
                              "position_to_token": POSITION_WARN}}
    where = f"{L} blocks of {signal['block_class']} in {signal['stack']}"
    if any(count != 1 for count in calls):
        return Result.skipped(f"{where}: the blocks did not run once each in a forward (runs: {calls}), so "
                              "their outputs are not one stream", details)
    findings, hints = [], []
    if growth is not None and L >= GROWTH_MIN_BLOCKS and growth / math.sqrt(L) > GROWTH_WARN:
        findings.append(f"the residual stream grows {growth:.3g}x from the first block's output (RMS "
                        f"{outputs[0]:.3g}) to the last's ({outputs[-1]:.3g}), {growth / math.sqrt(L):.1f}x the "
                        f"sqrt({L}) = {math.sqrt(L):.2f} of a stack whose blocks each add a like amount")
        hints.append(GROWTH_HINT)
    elif from_input is not None and L >= GROWTH_MIN_BLOCKS and from_input > INPUT_GROWTH_WARN:
        findings.append(f"the residual stream grows {from_input:.3g}x from the embeddings' output (RMS "
                        f"{signal['input_rms']:.3g}, entering the first block) to the last block's output "
                        f"({outputs[-1]:.3g}; {growth:.3g}x from the first block's output): what the blocks add "
                        "swamps what the tokens put in")
        hints.append(INPUT_GROWTH_HINT)
    if vanishing is not None and vanishing < VANISHING_WARN:
        findings.append(f"the first {ends} block(s) get a gradient {vanishing:.2g} of the last {ends}'s "
                        f"(median norms {first_end:.3g} vs {last_end:.3g}): the gradient vanishes on its way down")
        hints.append(VANISHING_HINT)
    if position is not None and position > POSITION_WARN:
        names = signal["embeddings"]
        findings.append(f"the position table {names.get('position')} (RMS {signal['position_rms']:.3g}) is "
                        f"{position:.1f}x the token table {names.get('token')} ({signal['token_rms']:.3g}): "
                        "positions swamp the tokens")
        hints.append(POSITION_HINT)
    if findings:
        return Result.warned(f"{where} at init: " + "; ".join(findings), "; ".join(hints), details)
    seen = [f"stream RMS {outputs[0]:.3g} -> {outputs[-1]:.3g}" if growth is not None else "stream RMS unreadable",
            f"gradient first/last blocks {vanishing:.2g}" if vanishing is not None else
            "the blocks are frozen (no parameter requires grad)" if not signal.get("trainable") else
            "no gradient reached the last blocks"]
    if position is not None:
        seen.append(f"position/token embedding RMS {position:.2f}")
    return Result.passed(f"{where} at init: " + ", ".join(seen), details)
