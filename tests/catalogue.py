"""Every check's planted bugs, in one table (ruff's test_case table, pylint's bad.py / good.py): for
each registered check id, the fixtures it must flag (bad) and the ones it must pass (good), each with
its exact status. tests/test_catalogue.py asserts every row, and that every registered id has one.

A case names the run that judges it, always one the family's own tests already make (shared in the
session by tests/conftest.py, so the table adds no run of its own):
  model(FIXTURE, CHECKS, train=LOOP, **fields)  run_checks on fixtures/FIXTURE.py's build() with CHECKS
                                                (checks_report; the family's table runs the same CHECKS)
  loop(LOOP)                                    the train checks on fixtures/loops/LOOP.py (loop_audit;
                                                tests/test_trainloop.py's matrix, EXPECTED there)
  ranks(NAME)                                   the rank checks on 2 ranks of fixtures/scripts/ddp_NAME.py
                                                (rank_digests; tests/test_ranks.py)
  watch(NAME, *ARGS)                            the run judges on a watched run of fixtures/watch/NAME.py
                                                (watch_audit; tests/test_curves.py, tests/test_run_health.py)
"""

MASK = ("future-leak", "mask-direction")  # tests/test_masking.py's table
NUMERICS = ("softmax-mask-order", "half-precision-mask")  # tests/test_numerics.py's table
PADDING = ("padding-mask", "masked-row-nan")  # tests/test_padding.py's table
TOKENS = ("token-weighting", "accumulation-scaling")  # tests/test_invariance.py's token-weighting runs
GENERATION = ("overfit-batch", "generation")  # tests/test_generation.py's runs (one memorisation shared)
DETERMINISM = ("eval-determinism",)  # tests/test_determinism.py's table
DEPTH = ("depth-signal",)  # tests/test_depth.py's table
BOUNDARIES = ("eos-trained", "packing-labels")  # tests/test_boundaries.py's loop runs on the tiny GPT-2
CLASSIFIER = ("padding-mask", "padding-equivalence", "init-loss", "overfit-batch")  # tests/test_classifiers.py
TAGGING = ("ignore-index", "token-weighting", "objective")  # tests/test_task_heads.py's token-classification loops
MEMORY_TIGHT = {"train_batch": 8, "train_seq": 64, "budget": "1MiB"}  # tests/test_memory_traced.py
MEMORY_ROOMY = {"train_batch": 2, "train_seq": 16, "budget": "80GB"}


def model(fixture: str, checks, train=None, **fields) -> tuple:
    return ("model", fixture, tuple(checks), train, tuple(sorted(fields.items())))


def loop(name: str) -> tuple:
    return ("loop", name)


def ranks(name: str) -> tuple:
    return ("ranks", name)


def watch(name: str, *args: str) -> tuple:
    return ("watch", name, *args)


def name(case: tuple) -> str:
    """A case as a short test id: gpt_triu_mask, loops/no_zero_grad, ddp_rank0_clip."""
    kind, target = case[0], case[1]
    if kind == "loop":
        return f"loops/{target}"
    if kind == "ranks":
        return f"ddp_{target}"
    if kind == "watch":
        return "watch/" + " ".join(case[1:])
    train = f"+loops/{case[3]}" if case[3] else ""
    options = "".join(f"[{k}]" for k, _ in case[4]) if case[4] else ""
    return f"{target}{train}{options}"


# check id -> ([(bad case, status)], [(good case, status)]), in the catalogue's order
PLANTED = {
    "future-leak": ([(model("gpt_triu_mask", MASK), "fail"), (model("gpt_no_mask", MASK), "fail")],
                    [(model("gpt_correct", MASK), "pass"), (model("gpt_blocked_triu", MASK), "pass")]),
    "mask-direction": ([(model("gpt_off_by_one", MASK), "fail"), (model("gpt_triu_mask", MASK), "fail")],
                       [(model("gpt_correct", MASK), "pass"), (model("gpt_sdpa", MASK), "pass")]),
    "bidirectional-encoder": ([(model("encoder_causal", ["bidirectional-encoder"]), "fail")],
                              [(model("encoder_correct", ["bidirectional-encoder"]), "pass")]),
    "cross-attention-mask": ([(model("seq2seq_causal_cross", ["cross-attention-mask"]), "fail")],
                             [(model("seq2seq_correct", ["cross-attention-mask"]), "pass")]),
    "finite-logits": ([(model("gpt_diagonal_blocked", ["future-leak", "init-loss"]), "fail")],
                      [(model("gpt_correct", ["finite-logits"]), "pass")]),
    "softmax-mask-order": ([(model("gpt_softmax_then_mask", NUMERICS), "fail")],
                           [(model("gpt_correct", NUMERICS), "pass"), (model("gpt_sdpa", NUMERICS), "pass")]),
    "half-precision-mask": ([(model("gpt_mask_minus_1e9", NUMERICS), "fail")],
                            [(model("gpt_correct", NUMERICS), "pass"), (model("gpt_sdpa", NUMERICS), "pass")]),
    "padding-mask": ([(model("gpt_left_padded", PADDING), "fail"), (model("gpt_pad_unmasked", PADDING), "warn"),
                      (model("classifier_attends_pads", CLASSIFIER), "fail")],
                     [(model("gpt_pad_masked", PADDING), "pass"), (model("gpt_right_padded", PADDING), "pass"),
                      (model("classifier_correct", CLASSIFIER), "pass")]),
    "masked-row-nan": ([(model("gpt_pad_neg_inf", PADDING), "fail")],
                       [(model("gpt_pad_masked", PADDING), "pass")]),
    "padding-equivalence": ([(model("gpt_left_pad_positions", ["padding-equivalence"]), "fail"),
                             (model("classifier_mean_over_pads", CLASSIFIER), "fail"),
                             (model("classifier_last_position", CLASSIFIER), "fail"),
                             (model("hf_whisper_causal", ["padding-equivalence"]), "fail")],
                            [(model("gpt_left_pad_mask_positions", ["padding-equivalence"]), "pass"),
                             (model("classifier_correct", CLASSIFIER), "pass"),
                             (model("gpt_right_pad_positions", ["padding-equivalence"],
                                    padding_side="right"), "pass")]),
    "packing-isolation": ([(model("gpt_packed_no_doc_mask", ["packing-isolation"]), "fail"),
                           (model("hf_roberta_packed", ["packing-isolation"]), "fail")],
                          [(model("gpt_packed", ["packing-isolation"]), "pass")]),
    "cache-consistency": ([(model("gpt_kv_cache_no_mask", ["cache-consistency"]), "fail")],
                          [(model("gpt_kv_cache", ["cache-consistency"]), "pass")]),
    "init-loss": ([(model("gpt_big_init", ["init-loss"]), "fail")],
                  [(model("gpt_correct", ["init-loss"]), "pass"), (model("classifier_correct", CLASSIFIER), "pass")]),
    "eval-determinism": ([(model("gpt_functional_dropout", DETERMINISM), "fail"),
                          (model("gpt_dropout_unused", DETERMINISM), "warn")],
                         [(model("gpt_functional_dropout_mode", DETERMINISM), "pass"),
                          (model("gpt_correct", DETERMINISM), "pass")]),
    "depth-signal": ([(model("gpt_double_residual", DEPTH), "warn"), (model("gpt_position_randn", DEPTH), "warn"),
                      (model("postln_very_deep", DEPTH), "warn"), (model("gpt_deep_unscaled", DEPTH), "warn")],
                     [(model("gpt_correct", DEPTH), "pass"), (model("postln_deep", DEPTH), "pass"),
                      (model("gpt_deep_scaled", DEPTH), "pass")]),
    "overfit-batch": ([(model("gpt_ignores_tokens", ["overfit-batch"]), "fail")],
                      [(model("gpt_correct", ["overfit-batch"]), "pass"),
                       (model("gpt_big_init", ["overfit-batch"]), "pass"),
                       (model("classifier_correct", CLASSIFIER), "pass")]),
    "generation": ([(model("gpt_triu_mask", GENERATION), "fail"), (model("gpt_positions_from_end", GENERATION), "fail"),
                    (model("gpt_kv_cache_positions", GENERATION), "fail"),
                    (model("gpt_generate_window", GENERATION), "fail"),
                    (model("gpt_generate_cache_position0", GENERATION), "fail")],
                   [(model("gpt_correct", GENERATION), "pass"), (model("gpt_kv_cache", GENERATION), "pass"),
                    (model("gpt_generate", GENERATION), "pass"), (model("gpt_generate_cached", GENERATION), "pass"),
                    (model("mamba_generate", GENERATION), "pass")]),
    "memory": ([(model("gpt_correct", ["memory"], options=MEMORY_TIGHT), "fail")],
               [(model("gpt_correct", ["memory"], options=MEMORY_ROOMY), "pass")]),
    "objective": ([(loop("identity_objective"), "fail"), (loop("hf_double_shift"), "fail")],
                  [(loop("correct"), "pass"), (loop("hf_labels"), "pass")]),
    "ignore-index": ([(loop("no_ignore_index"), "fail"), (loop("hf_eos_as_pad_twice"), "fail"),
                      (model("tagger_correct", TAGGING, train="tagging_pads_graded"), "fail")],
                     [(loop("correct"), "pass"), (loop("hf_eos_as_pad"), "pass"),
                      (model("tagger_correct", TAGGING, train="tagging"), "pass")]),
    "eos-trained": ([(model("hf_gpt2", BOUNDARIES, train="hf_eos_masked_as_pad", pad_id=1), "fail")],
                    [(model("hf_gpt2", BOUNDARIES, train="hf_eos_as_pad", pad_id=1), "pass"),
                     (model("hf_gpt2", BOUNDARIES, train="hf_labels", pad_id=0), "pass")]),
    "packing-labels": ([(model("hf_gpt2", BOUNDARIES, train="hf_packed_labels_cross", pad_id=0), "fail")],
                       [(model("hf_gpt2", BOUNDARIES, train="hf_packed_labels", pad_id=0), "pass")]),
    "unscale-before-clip": ([(loop("clip_before_unscale_cuda"), "fail")], [(loop("correct"), "pass")]),
    "accumulation-scaling": ([(loop("no_loss_division"), "fail"), (loop("accum_first_step"), "warn")],
                             [(loop("correct"), "pass"), (loop("annotated_label_smoothing"), "pass")]),
    "token-weighting": ([(model("gpt_pad_masked", TOKENS, train="per_micro_batch_mean"), "warn")],
                        [(model("gpt_pad_masked", TOKENS, train="token_sum_total"), "pass"),
                         (model("gpt_pad_masked", TOKENS, train="num_items_in_batch"), "pass")]),
    "scheduler-placement": ([(loop("scheduler_every_batch"), "fail")], [(loop("correct"), "pass")]),
    "zero-grad": ([(loop("no_zero_grad"), "fail"), (loop("zero_grad_after_backward"), "fail")],
                  [(loop("correct"), "pass"), (loop("lbfgs_closure"), "pass")]),
    "clip-global-norm": ([(loop("per_parameter_clip"), "warn"), (loop("clip_consumed_iterator"), "fail")],
                         [(loop("correct"), "pass")]),
    "lr-schedule": ([(loop("noam_default_lr"), "fail"), (loop("adam_sgd_rate"), "fail")],
                    [(loop("correct"), "pass"), (loop("muon_aux_adam"), "pass")]),
    "amp-loss-scaling": ([(loop("fp16_no_scaler_cuda"), "fail")], [(loop("correct"), "pass")]),
    "grad-health": ([(loop("nan_penalty"), "fail")], [(loop("correct"), "pass")]),
    "optimizer-coverage": ([(loop("norms_not_optimized"), "fail"), (loop("no_epoch"), "fail"),
                            (loop("optimizer_of_frozen"), "fail")],
                           [(loop("correct"), "pass"), (loop("optimizer_after_freezing"), "pass")]),
    "stale-update": ([(model("gpt_correct", ["stale-update"], train="bf16_weights"), "fail")],
                     [(model("gpt_correct", ["stale-update"], train="bf16_autocast"), "pass")]),
    "trained-in-eval": ([(loop("eval_mode_after_validation"), "fail")],
                        [(loop("eval_mode_restored"), "pass"), (loop("correct"), "pass")]),
    "rank-data": ([(ranks("no_sampler"), "fail"), (ranks("no_set_epoch"), "warn")], [(ranks("correct"), "pass")]),
    "rank-sync": ([(ranks("rank0_clip"), "fail")], [(ranks("correct"), "pass")]),
    "ddp-accumulation": ([(ranks("accum_no_no_sync"), "warn")], [(ranks("correct"), "pass")]),
    "rank-uniform": ([(ranks("rank0_clip"), "fail")], [(ranks("correct"), "pass")]),
    "rank-equivalence": ([(ranks("clip_before_all_reduce"), "fail"), (ranks("mean_of_means"), "warn")],
                         [(ranks("correct"), "pass"), (ranks("global_token_mean"), "pass")]),
    "loss-spike": ([(watch("lr_spike"), "fail")], [(watch("healthy"), "pass"), (watch("healthy_accum"), "pass")]),
    "loss-divergence": ([(watch("diverges"), "fail")], [(watch("healthy"), "pass"), (watch("healthy_accum"), "pass")]),
    "loss-plateau": ([(watch("plateau"), "fail")], [(watch("healthy"), "pass"), (watch("healthy_accum"), "pass")]),
    "grad-norm-trend": ([(watch("grad_growth"), "warn")],
                        [(watch("healthy"), "pass"), (watch("healthy_accum"), "pass")]),
    "scaler-overflow": ([(watch("fp16_overflow"), "fail")], [(watch("fp16_healthy"), "pass")]),
    "lr-trajectory": ([(watch("lr_zero_halfway"), "fail"), (watch("lightning_warmup_per_epoch"), "fail")],
                      [(watch("healthy"), "pass"), (watch("healthy_accum"), "pass"),
                       (watch("lightning_warmup"), "pass")]),
    "data-wait": ([(watch("slow_loader"), "warn")], [(watch("healthy"), "pass"), (watch("healthy_accum"), "pass")]),
    "memory-growth": ([(watch("leaky_total_loss"), "fail"), (watch("slow_leak"), "fail")],
                      [(watch("healthy"), "pass"), (watch("healthy_accum"), "pass"),
                       (watch("healthy_stairs"), "pass")]),
    "eval-gap": ([(watch("eval_on_train"), "fail"), (watch("val_copied"), "fail")],
                 [(watch("healthy"), "pass"), (watch("healthy_accum"), "pass"), (watch("nanogpt_splits"), "pass")]),
    "eval-mode-steps": ([(watch("eval_mode_stuck"), "fail")],
                        [(watch("healthy_accum"), "pass"), (watch("healthy"), "pass")]),
}
