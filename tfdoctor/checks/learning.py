"""Learning checks: can the model learn at all (overfit one batch), and decode what it learned?"""

from __future__ import annotations

import math

from tfdoctor.checks.verdicts.generation import generation_verdict
from tfdoctor.registry import check
from tfdoctor.result import Result
from tfdoctor.tasks import for_classifiers

# overfit-batch: Karpathy's "overfit one batch" recipe. A wired-up Transformer memorises a handful of
# random sequences in well under 300 AdamW steps; the target is 0.01 nats or 5% of ln(V), whichever
# is looser, so a small vocabulary does not demand more than memorising requires.
OVERFIT_STEPS = 300
OVERFIT_LR = 3e-3
OVERFIT_ROWS = 4
OVERFIT_MAX_LEN = 32
OVERFIT_TARGET_SHARE = 0.05
OVERFIT_TARGET_NATS = 0.01
# Below this many tokens (a binary vocabulary, say) the memorisation target is within the init's
# reach or out of it by chance: the verdict flipped with the seed on a correct model (issue 10).
OVERFIT_MIN_VOCAB = 8
# When tfdoctor's first rate does not memorise the batch, lower rates are tried (probes/memorise.py)
# for this many steps each: a model that stalls at a rate too high for it memorises quickly at one
# that fits (x-transformers' enwik8 model: 7 steps at 3e-4).
OVERFIT_RETRY_STEPS = 100
# Steps an attempt may take beyond its budget while its loss is still falling (probes/memorise.py):
# a slow learner is not a broken one. Still falling at the end: inconclusive, never a failure.
OVERFIT_EXTRA_STEPS = 300
# A causal model whose outputs read at most this many of its past tokens (a bigram drafter reads
# one) is judged against H(next | those tokens) on the batch, the loss its context allows.
CONTEXT_FLOOR_MAX_OFFSETS = 4

# overfit-batch through the user's loop (--train). The loop is fed the same batch up to this many
# times and passes as soon as the next-token loss on it is at this share of its start or below.
# Measured on the fixture GPT: loops at peak rates 3e-4..1e-3 (warm-up 10..100 steps, with or
# without accumulation) cut it by 14% to 60% in 160 batches, a Muon loop by 99% within 10.
LOOP_BATCHES = 160
LOOP_PASS_SHARE = 0.9
# The loss is measured (one forward, dropout off) every this many batches, so that a loop that has
# shown it learns stops early: a tenth of a training step's cost per batch at most.
LOOP_PROBE_EVERY = 10
# When the loop has not passed, its optimizer is replayed at the rates it used with a plain
# next-token loss (see tfdoctor/recording/overfit.py). That reference must itself fall by the pass
# bar (10%) for the loop to fail, and the loop then fails when it achieved at most a quarter of the
# reference's fall. Measured on the fixtures: broken loops at normal rates leave the loss at -2% to
# +8% of its start while their full replay falls 55% (labels shifted twice) to 67% (targets =
# inputs), i.e. at most 0.15 of it; correct loops at small rates reach 0.90 (5e-5 decaying to 0,
# HF fine-tuning) to 0.95 (Noam, 3000-step warm-up) of their reference's fall.
REFERENCE_PASS_DROP = 1 - LOOP_PASS_SHARE
LOOP_FAIL_SHARE = 0.25
# Below the pass bar: a reference fall of 2% is far above rounding (thread counts move these
# losses by ~1e-7) and the loop's own dropout noise; a loop that matches half of it learns as far
# as its rates allow (nanoGPT's 2000-step warm-up: 6.0% against 6.6%).
REFERENCE_MEASURABLE_DROP = 0.02
LOOP_MATCH_SHARE = 0.5


@check("overfit-batch", title="The model can overfit a single small batch")
def overfit_batch(subject) -> Result:
    """Catches wiring bugs that stop learning altogether: a forward that ignores its input, a
    detached or frozen path, logits that never reach the loss.

    Trains a copy of the model (the user's is untouched) on one small random batch with AdamW and
    dropout off, for up to 300 steps, stopping as soon as the loss is under 0.01 or 5% of ln(V).
    A healthy Transformer memorises it; one that cannot has a bug between its input and its loss.

    With --train (causal and seq2seq models) your own loop trains the copy instead, fed the same batch
    up to 160 times, so the real loss, optimizer and schedule are tested too; it passes as soon as the
    next-token loss on that batch falls to 90% of its start. When it does not, your optimizer is
    replayed at the learning rates your loop really used, with a plain next-token loss: the loop
    fails only if that reference learns and your loop does not (targets = inputs, detached logits,
    gradients cleared before step()). A schedule whose rate is still too small to move the loss (a
    long warm-up, a fine-tuning rate decaying to 0) is reported as inconclusive, with the rate.

    The check stops at its time budget (--timeout-per-check) and reports what it measured so far.

    Fix: make sure the forward uses the token embeddings and that nothing between them and the loss
    is detached or frozen.
    """
    from tfdoctor.context import time_budget

    budget = time_budget()
    if subject.train is not None and subject.kind != "encoder" and (subject.task or "lm") == "lm":
        return _overfit_with_loop(subject, budget)
    return _memorised(subject, budget)[0]


def _memorised(subject, budget=None) -> tuple:
    """(overfit-batch's Result on the model alone, {"model": the memorised copy, "batch": its batch} or
    {} when it did not memorise), once per run: generation decodes the same copy, never training again."""
    from tfdoctor.context import memo, time_budget

    def run() -> tuple:
        kept: dict = {}
        return _overfit_alone(subject, budget or time_budget(), kept), kept

    return memo(("overfit-alone", id(subject.model)), run)


def _overfit_alone(subject, budget, kept: dict) -> Result:
    """overfit-batch on a copy of the model with tfdoctor's optimizers (see the check's doc); the
    memorised copy and its batch are left in `kept`."""
    import torch

    from tfdoctor.context import current, progress
    from tfdoctor.errors import first_line
    from tfdoctor.probes.memorise import memorise, plans, trainable_copy
    from tfdoctor.probes.process_state import BackwardRefused
    from tfdoctor.tasks import chance_classes

    classifier = (subject.task or "lm") != "lm"
    if subject.vocab_size < OVERFIT_MIN_VOCAB and not classifier:  # a classifier's labels are dealt evenly
        return Result.skipped(f"a vocabulary of {subject.vocab_size} tokens: memorising random tokens this "
                              "coarse depends on the init more than on the wiring, so it cannot be judged")
    if not any(p.requires_grad for p in subject.model.parameters()):
        return Result.skipped("the model has no trainable parameters")
    try:
        first = trainable_copy(subject.model)
    except Exception as exc:  # a module attribute deepcopy cannot follow: the user's model stays untouched
        return Result.skipped(f"the model cannot be copied to train it apart from yours ({first_line(exc)}), "
                              "and training yours would change it", {"copy_error": first_line(exc)})
    generator = torch.Generator().manual_seed(current().seed + 2)
    batch, unmatched = _aligned_batch(subject, generator)
    if unmatched:
        # A model that decodes a fixed number of outputs (Perceiver) answers a short batch with as many
        # outputs as ever: its per-position loss runs through a latent bottleneck, so failing to memorise
        # would measure that capacity, not a broken path; nothing aligned, no loss can be taken at all.
        return Result.skipped(f"the model returns {unmatched}: it decodes a fixed number of outputs rather "
                              "than one per token, so memorising a batch would measure its latent bottleneck, "
                              "not its wiring", {"outputs_vs_inputs": unmatched})
    # a classifier memorises its labels (ln(C) at chance; a regression head its values, MSE ~1 at chance; a
    # question-answering head its spans, ln(T); a multiple-choice head its answers, ln(C) for C choices)
    rows, length = batch.inputs[-1].shape[:2]
    chance = 1.0 if subject.task == "regression" else math.log(chance_classes(subject, length, rows))
    target = max(OVERFIT_TARGET_NATS, OVERFIT_TARGET_SHARE * chance)
    goal, floor, attempts, note = target, None, [], None
    for plan in plans(_first_recorded(current().options.get("recorded_optimizers"))):
        model, note = first if not attempts else trainable_copy(subject.model)
        steps = OVERFIT_STEPS if not attempts else OVERFIT_RETRY_STEPS
        try:
            attempt = memorise(subject, model, batch, plan, goal, steps, budget.exceeded,
                               progress(f"overfit-batch ({plan.label})", steps),
                               0 if attempts else OVERFIT_EXTRA_STEPS)
        except BackwardRefused as refused:
            return Result.skipped(f"the model cannot be trained at these shapes: {refused} (pass the --seq-len "
                                  "it trains at)", {"eval_error": first_line(refused.in_eval),
                                                    "train_error": first_line(refused.in_train)})
        attempts.append(attempt)
        if attempt.detached or attempt.out_of_time or attempt.curve[-1] < goal:
            break
        if floor is None:
            floor = _context_floor(subject, batch)
            goal = target + floor["nats"] if floor else target
            if floor and attempt.curve[-1] < goal:
                break
    if attempts[-1].curve[-1] < goal and not attempts[-1].detached:
        kept.update(model=model, batch=batch)
    return _overfit_verdict(subject, batch, attempts, target, goal, floor, note, budget)


def _first_recorded(recorded) -> tuple[str, dict] | None:
    """(class name, first param group's hyperparameters) of the first optimizer `tfdoctor run` recorded
    (a list of recording/trace.OptimizerRecord), or None."""
    if not recorded or not recorded[0].groups:
        return None
    return recorded[0].class_name, recorded[0].groups[0]


def _aligned_batch(subject, generator):
    """The overfit batch, and None when the model answers it with one output per token, else what it
    returned instead. A model whose output length does not follow its input's (Perceiver decodes its
    maximum positions) is not aligned even where the batch is as long as that maximum: with
    max_position_embeddings 32 (or 16) its 32 outputs line up with the batch by coincidence, and its
    best loss, 1.18 (0.33) against a target of 0.28, measures 16 latents, not the wiring."""
    import torch

    from tfdoctor.modes import evaluation
    from tfdoctor.probes.loss import lm_batch
    from tfdoctor.subject import call

    batch = lm_batch(subject, min(OVERFIT_ROWS, subject.batch_size), min(OVERFIT_MAX_LEN, subject.seq_len),
                     generator)
    if (subject.task or "lm") != "lm":  # a classifier's outputs are checked against its task (preflight)
        return batch, None
    length = batch.targets.shape[1]
    with torch.no_grad(), evaluation(subject.model):
        outputs = call(subject, *batch.inputs).shape[1]
        if outputs != length:
            return batch, f"{outputs} outputs for {length} input tokens"
        half = length // 2
        try:  # the same rows cut to half their length: one output per token gives half the outputs
            shorter = call(subject, *(x[:, :half] for x in batch.inputs)).shape[1] if half else half
        except Exception:  # a model that takes only its own length (a chunked attention): nothing to tell
            shorter = half
    if shorter == outputs:
        return batch, f"{outputs} outputs for {length} input tokens, and as many for {half}"
    return batch, None


def _context_floor(subject, batch) -> dict:
    """The loss a causal model that reads only a few of its past tokens (measured by the dependency
    map) can reach on the batch; {} when it reads its whole past, or no token at all."""
    from tfdoctor.probes.dependency import token_dependency_map
    from tfdoctor.probes.memorise import context_floor, context_offsets

    if subject.kind != "causal" or (subject.task or "lm") != "lm":
        return {}
    offsets = context_offsets(token_dependency_map(subject).depends)
    if offsets is None or len(offsets) > CONTEXT_FLOOR_MAX_OFFSETS:
        return {}
    nats = context_floor(batch.inputs[0], batch.targets, offsets)
    return {"nats": nats, "offsets": offsets} if nats > 0 else {}


def _overfit_verdict(subject, batch, attempts, target, goal, floor, note, budget) -> Result:
    from tfdoctor.probes.memorise import still_falling

    last = attempts[-1]
    if not (last.curve[-1] < goal or last.out_of_time or last.detached):  # failed: show the best attempt
        last = min(attempts, key=lambda a: a.best if math.isfinite(a.best) else math.inf)
    curve = last.curve
    final, steps = curve[-1], len(curve)
    details = {"steps": steps, "max_steps": last.steps,
               "start_loss": curve[0], "final_loss": final, "best_loss": last.best, "target_loss": goal,
               "lr": last.plan.lr, "optimizer": last.plan.label, "dropout_off_by": last.mode,
               "batch_shape": list(batch.targets.shape), "loss_curve": curve,
               "attempts": [{"optimizer": a.plan.label, "lr": a.plan.lr, "steps": len(a.curve),
                             "start_loss": a.curve[0], "best_loss": a.best, "final_loss": a.curve[-1]}
                            for a in attempts]}
    if floor:
        details["context_floor"] = floor
    notes = []
    if note:
        notes.append(note)
    if last.mode == "train":
        notes.append("its backward refuses eval(), so dropout was switched off in train() (every p = 0)")
    tried = [a for a in attempts if a is not last]
    if tried:
        notes.append("before: " + "; ".join(f"{a.plan.label} got no lower than {a.best:.3f} in {len(a.curve)} "
                                            "steps" for a in tried))
    suffix = f" ({'; '.join(notes)})" if notes else ""
    if last.detached:
        return Result.failed(
            "the loss does not require grad after a forward with gradients on: the forward turns "
            "autograd off (torch.no_grad, torch.set_grad_enabled(False)) or detaches the logits, "
            "so no training step can change the weights",
            "keep the forward differentiable: remove the no_grad / set_grad_enabled(False) / "
            ".detach() on the path to the logits", details)
    if final < goal:
        default = last is attempts[0] and not last.plan.recorded  # tfdoctor's own first rate: no need to say
        by = "" if default else f" with {last.plan.label}"
        reached = f"loss {curve[0]:.2f} -> {final:.4g} in {steps} steps{by} (target < {goal:.4g})"
        if floor:
            reached += (f": the model reads only the input tokens at offsets {floor['offsets']} before each "
                        f"target (measured dependency map), so its floor on this batch is H(next | those "
                        f"tokens) = {floor['nats']:.3f} nats, and it reaches it")
        return Result.passed(reached + suffix, details)
    if last.out_of_time:
        details["budget"] = budget.describe()
        return Result.skipped(f"stopped at its {budget.seconds:g} s time budget after {steps} steps with "
                              f"{last.plan.label}: loss {curve[0]:.2f} -> {final:.3f} so far, target {goal:.3f} "
                              f"not reached (raise --timeout-per-check to finish){suffix}", details)
    rates = ", ".join(f"{a.plan.label} (best {a.best:.3f})" for a in attempts)
    first = attempts[0]
    if still_falling(first.curve):  # the first attempt ran past its steps and was still learning
        return Result.skipped(f"inconclusive: loss {first.curve[0]:.2f} -> {first.curve[-1]:.3f} in "
                              f"{len(first.curve)} steps with {first.plan.label}, still falling at the end but not "
                              f"under {goal:.3f} (tried {rates}): the model learns, too slowly for this probe to tell",
                              details)
    if not math.isfinite(final):
        return Result.failed(f"loss became {final} after {steps} steps on a single batch, at every rate tried: "
                             f"{rates}", "look for -inf masks on fully masked rows and for overflowing "
                             "activations", details)
    if last.collapsed:  # measured: rows with different labels ended as one output
        pairs = ", ".join(f"{i} and {j}" for i, j in last.collapsed[:3])
        return Result.failed(
            f"could not overfit one batch: loss {curve[0]:.2f} -> {final:.2f} (target {goal:.3f}) with each of "
            f"{rates}; rows {pairs} end with the same scores although their labels differ: the model maps "
            "different inputs to one output (a saturated activation, such as a tanh pooler at +-1, or a "
            "collapsed state), so no update can fit both",
            "keep the activations in range: normalise the states the head reads (a LayerNorm before the pooler), "
            "initialise smaller, or lower the learning rate", {**details, "collapsed_rows": last.collapsed})
    return Result.failed(
        f"could not overfit one batch: loss {curve[0]:.2f} -> {final:.2f} (target {goal:.3f}) with each of "
        f"{rates}; something between the input tokens and the loss is broken",
        "check that the forward uses the token embeddings, that no tensor is detached or frozen on the "
        "way to the logits, and that the loss compares logits with the right targets", details)


def _drop(start: float, final: float) -> float:
    """The share of the start loss the loss fell by (negative when it rose)."""
    return 1 - final / start if start > 0 and math.isfinite(final) else 0.0


def _overfit_with_loop(subject, budget) -> Result:
    """overfit-batch through the user's own loop: feed it one batch over and over on a copy of the
    model (tfdoctor/recording/overfit.py measures) and judge the next-token loss the copy reaches on
    it, against what a correct loss reaches with the same optimizer at the same rates when the loop
    does not pass on its own."""
    from tfdoctor.context import current, progress
    from tfdoctor.recording.overfit import overfit_loop, replay

    # a classifier memorises its labels (ln(C) at chance; a regression head its values, MSE ~1 at chance)
    chance = 1.0 if subject.task == "regression" else math.log(subject.num_labels or subject.vocab_size)
    target = max(OVERFIT_TARGET_NATS, OVERFIT_TARGET_SHARE * chance)
    learned = lambda loss, start: loss < target or loss <= LOOP_PASS_SHARE * start  # noqa: E731
    run = overfit_loop(subject, LOOP_BATCHES, LOOP_PROBE_EVERY, learned, budget.exceeded,
                       progress("overfit-batch (your loop)", LOOP_BATCHES), current().seed)
    details = _loop_details(run, target)
    verdict = _judged_loop(run, learned, budget, details)
    if verdict is not None:
        return verdict
    log, loop_drop = run.log, details["loss_drop"]
    steps = len(log.iterations())
    advance_ref = progress("overfit-batch (reference)", steps)
    out_of_time = []

    def stop(curve: list[float]) -> bool:
        if budget.exceeded():
            out_of_time.append(True)
            return True
        return _concluded(curve, loop_drop)

    curve = replay(subject, log, run.batch, stop, advance_ref)
    advance_ref(max(0, steps - len(curve) + 1))
    return _judged_reference(run, curve, bool(out_of_time), budget, details)


def _loop_details(run, target: float) -> dict:
    """The evidence of the loop's own run: losses, batches, optimizers and their rates."""
    log = run.log
    return {"start_loss": run.start, "final_loss": run.final, "loss_drop": _drop(run.start, run.final),
            "target_loss": target, "batches": run.handed, "max_batches": LOOP_BATCHES,
            "pass_share": LOOP_PASS_SHARE, "batch_shape": run.batch_shape, "loop": True,
            "stopped_early": bool(run.learned), "loss_at_batches": run.probes,
            "optimizers": [type(o).__name__ for o in log.optimizers], "optimizer_steps": len(log.iterations()),
            "peak_lr": log.peak_rate(), "lr_curve": log.rate_curve(),
            "params_with_grad": len(log.with_grad), "params_stepped": len(log.params)}


def _summary(run, details: dict) -> str:
    return (f"your loop, fed the same batch {run.handed} times, took its next-token loss {run.start:.2f} -> "
            f"{run.final:.3f} ({-details['loss_drop']:+.1%})")


def _judged_loop(run, learned, budget, details: dict) -> Result | None:
    """The verdict on the loop's own run, or None when only a replay of its optimizer can tell."""
    log, final, fed = run.log, run.final, run.handed
    summary = _summary(run, details)
    if learned(final, run.start):
        return Result.passed(f"{summary} (needs <= {LOOP_PASS_SHARE:.0%} of the start)", details)
    if not math.isfinite(final):
        return Result.failed(f"{summary}: the weights became non-finite",
                             "run grad-health and fix the first NaN gradient", details)
    if run.out_of_time:
        details["budget"] = budget.describe()
        return Result.skipped(f"stopped at its {budget.seconds:g} s time budget after {fed} of {LOOP_BATCHES} "
                              f"batches: {summary} so far, not yet to {LOOP_PASS_SHARE:.0%} of the start "
                              "(raise --timeout-per-check to finish)", details)
    if fed == 0:
        return Result.skipped("the loop never iterated over the batches it was given, so it cannot be "
                              "fed one batch over and over", details)
    if not log.steps:
        if not run.weights_changed:
            return Result.failed(f"{summary}: the weights never changed, and no optimizer.step() ran",
                                 "call optimizer.step() after loss.backward() in every training step", details)
        return Result.skipped(f"{summary}; the loop updates the weights itself (no optimizer.step()), so its "
                              "learning rate cannot be replayed to tell a broken gradient from a small rate",
                              details)
    if not log.with_grad:
        return Result.failed(
            f"{summary}: none of the parameters had a non-zero gradient at any of the {len(log.steps)} "
            "optimizer steps, so the loss never reaches the weights",
            "compute the logits with gradients on (no torch.no_grad() or .detach() between model(...) and "
            "the loss; loss.requires_grad_() only hides that), keep requires_grad=True on the parameters "
            "you train, and clear gradients before backward(), not between backward() and step()", details)
    return None


def _concluded(curve: list[float], loop_drop: float) -> bool:
    """The reference has fallen by the pass bar and by four times what the loop managed: it can
    only fall further, so the verdict is fail whatever the rest of the replay does."""
    reached = _drop(curve[0], curve[-1])
    return reached >= REFERENCE_PASS_DROP and loop_drop <= LOOP_FAIL_SHARE * reached


def _judged_reference(run, curve: list[float], out_of_time: bool, budget, details: dict) -> Result:
    """The verdict once the loop's optimizer was replayed with a plain next-token loss (`curve`)."""
    log, loop_drop, fed = run.log, details["loss_drop"], run.handed
    summary = _summary(run, details)
    steps = len(log.iterations())
    ref_drop = _drop(curve[0], curve[-1])
    updates = len(curve) - 1
    details["reference"] = {"start_loss": curve[0], "final_loss": curve[-1], "loss_drop": ref_drop,
                            "steps": updates, "loss_curve": curve}
    optimizers = "+".join(dict.fromkeys(details["optimizers"]))
    rates = f"peak learning rate {log.peak_rate():.1e} over {steps} {optimizers} steps"
    reference = f"a plain next-token loss {curve[0]:.2f} -> {curve[-1]:.3f} ({-ref_drop:+.1%})"
    if _concluded(curve, loop_drop):
        return Result.failed(
            f"{summary}, while the same optimizer at the same rates ({rates}) takes {reference} within "
            f"{updates} steps: the loop's gradient does not teach the next token",
            "check the loop's objective (targets are the inputs shifted by one: run objective), that "
            "nothing is detached on the way from the logits to the loss, and that optimizer.step() "
            "follows loss.backward()", details)
    if out_of_time:
        details["budget"] = budget.describe()
        return Result.skipped(f"stopped at its {budget.seconds:g} s time budget after replaying {updates} of "
                              f"{steps} optimizer steps with a plain next-token loss ({reference} so far); "
                              f"{summary} (raise --timeout-per-check to finish)", details)
    if ref_drop >= REFERENCE_PASS_DROP:
        return Result.passed(f"{summary}; the same optimizer at the same rates ({rates}) takes {reference}: "
                             f"the loop learns at {loop_drop / ref_drop:.0%} of that pace", details)
    if ref_drop >= REFERENCE_MEASURABLE_DROP and loop_drop >= LOOP_MATCH_SHARE * ref_drop:
        return Result.passed(f"{summary}, as far as its rates allow: the same optimizer at the same rates "
                             f"({rates}) takes {reference}", details)
    return Result.skipped(
        f"inconclusive: the loop's learning rate stays below {log.peak_rate():.1e} for the whole probe "
        f"({steps} {optimizers} steps on {fed} batches), too small to move the loss yet: at those rates the "
        f"same optimizer takes even a plain next-token loss only from {curve[0]:.2f} to {curve[-1]:.3f} "
        f"({-ref_drop:+.1%}), and {summary}. lr-schedule "
        "judges the whole schedule (a long warm-up, a fine-tuning rate decaying to 0); this check without "
        "--train tests the model alone", details)




@check("generation", title="Greedy decoding reproduces a memorised batch", kinds=("causal",),
       skip_reasons={"encoder": "an encoder does not decode left to right",
                     "seq2seq": "written for causal LMs (a decoder given its source is not decoded here)",
                     **for_classifiers("it predicts no next token to decode")}, tasks=("lm",))
def generation(subject) -> Result:
    """Catches a train/inference mismatch: a model that trains well (the loss falls, even to nearly
    zero) but generates something else, such as its first token over and over. The forward that
    training grades sees what decoding left to right does not: a mask that lets a position read the
    token it predicts, positions counted from the end of the sequence, anything that depends on the
    length of the input. Also a cached decoding path that differs from the full forward.

    Takes the copy that overfit-batch trained until it memorised its batch (no second training) and
    decodes greedily from each row's first token, feeding the whole prefix at every step; where the
    decoded token departs from the batch although the full forward of the batch predicts the batch's
    token there (same prefix, so the same prediction is due), the model is judged inconsistent, at
    that position. Then the same decoding runs through the cache: departing only there through your
    Subject.incremental fails (the cache path differs); through a library's generate() it is noted and
    cache-consistency judges (a library whose cached decoding crashes is named as the library's).
    A model with a generate() method of its own (nanoGPT's generate(idx, max_new_tokens, temperature,
    top_k), minGPT's, nanochat's) is decoded through it too, from the same first tokens, greedily
    (do_sample=False, top_k=1, else a tiny temperature, else each torch.multinomial draw taken as its
    most likely choice; seeded): departing from the batch where tfdoctor's loop reproduces it fails,
    naming the method's line (a window left-filled with a filler token, each cached token embedded at
    position 0). A method that cannot be called with token ids, or samples at random even so, is
    noted and not judged. Skips when the model did not memorise the batch or cannot be trained on it,
    and under --train (overfit-batch trains through your loop, which stops long before memorising).

    Fix: give every position at training exactly the context it has when decoding: a causal mask
    `torch.tril(ones(T, T))`, positions counted from the start (`arange(past, past + T)`), nothing
    that depends on the sequence's length or its future; make generate() feed the model the last
    block_size tokens as they are, each new cached token at position cache length.
    """
    from tfdoctor.errors import first_line
    from tfdoctor.probes.decoding import MODEL_ERRORS, raised_by_model
    from tfdoctor.probes.greedy import MisshapedDecode, decode_memorised

    if subject.train is not None:
        return Result.skipped("under --train, overfit-batch trains through your loop, which stops once the loss "
                              "falls by 10%: there is no memorised copy to decode (run without --train)")
    classifier = (subject.task or "lm") != "lm"
    if subject.vocab_size < OVERFIT_MIN_VOCAB and not classifier:  # a classifier's labels are dealt evenly
        return Result.skipped(f"a vocabulary of {subject.vocab_size} tokens: overfit-batch cannot judge "
                              "memorising it, so there is no memorised copy to decode")
    try:
        result, kept = _memorised(subject)
    except MODEL_ERRORS as exc:  # overfit-batch reports the crash; here there is nothing to decode
        if not raised_by_model(exc):
            raise
        return Result.skipped(_untrainable(subject, exc), {"error": first_line(exc)})
    if "model" not in kept:
        return Result.skipped(f"the model did not memorise the batch (overfit-batch: {result.status.value}), so "
                              "what it decodes says nothing about a mismatch")
    try:
        run = decode_memorised(subject, kept.pop("model"), kept["batch"])  # the copy is freed once decoded
    except MisshapedDecode as exc:
        return Result.skipped(f"{exc} while decoding one token at a time: its outputs cannot be read as the next "
                              "token's prediction (see cache-consistency)", {"error": str(exc)})
    except MODEL_ERRORS as exc:  # the model refuses a prefix shorter than its training rows: not decodable here
        if not raised_by_model(exc):
            raise
        return Result.skipped(f"the model refuses the short prefixes greedy decoding feeds it (from 1 token on): "
                              f"{first_line(exc)}", {"error": first_line(exc)})
    return generation_verdict(run)


def _untrainable(subject, exc) -> str:
    """Why generation has no memorised copy when training a copy raised in the model's code."""
    from tfdoctor.errors import first_line
    from tfdoctor.probes.decoding import library_crash, modified_in_place
    from tfdoctor.probes.implementations import library_release

    cause = first_line(exc)
    if modified_in_place(exc):
        cause = ("its backward refuses the graph: a tensor the forward saved for the gradient is modified in place "
                 "afterwards (a recurrent state or cache updated in place)")
    where = library_crash(exc) if not modified_in_place(exc) else None
    whose = (f" inside {library_release(subject.model)} ({where})" if where else
             f" ({library_release(subject.model)})" if modified_in_place(exc) else "")
    return (f"the model cannot be trained on a batch{whose}: {cause}; so there is no memorised copy to decode "
            "(overfit-batch reports the same)")
