"""`tfdoctor run SCRIPT`: an unmodified training script, run as __main__ and stopped after its first
optimizer steps, audited end to end through the installed command (fixtures/scripts/)."""

import json
import subprocess

import pytest

from helpers import E2E, ROOT, SCRIPTS, command_line, tfdoctor

pytestmark = E2E
# The loop checks read the recorded trace (instant); of the model checks only a cheap pair runs where
# the test is about the loop.
LOOP_ONLY = ["--skip", "future-leak,mask-direction,softmax-mask-order,half-precision-mask,padding-mask,"
                       "masked-row-nan,padding-equivalence,overfit-batch,generation,bidirectional-encoder,"
                       "cross-attention-mask,packing-isolation,cache-consistency,memory"]


def test_correct_plain_loop_is_quiet_and_discovered(shared_tfdoctor):
    # the README's own example (its process is this one: shared_tfdoctor)
    done = shared_tfdoctor("run", f"{SCRIPTS}/plain_loop.py", "--format", "json", "--", "--accum", "2",
                           env={"COLUMNS": "100"}, timeout=600)
    assert done.returncode == 0, done.stderr
    report = done.json
    bad = done.problems
    assert not bad
    found = report["discovered"]
    assert found["model"] == "TinyLM" and found["model_defined_in"] == f"{SCRIPTS}/tinylm.py:8"
    assert found["called_as"] == "model(ids)"
    assert found["batch_shape"] == [4, 16] and found["vocab_size"] == 50
    assert (found["pad_id"], found["pad_id_source"], found["padding_side"]) == (0, "targets set to ignore_index",
                                                                                "right")
    assert found["steps"] == 2 and found["ended"] == "stopped" and found["optimizers"] == ["AdamW"]
    checks = done.checks
    # every model check ran on the discovered model, every loop check on the real trace
    assert checks["padding-mask"]["status"] == "pass" and checks["init-loss"]["status"] == "pass"
    assert checks["ignore-index"]["status"] == "pass" and checks["accumulation-scaling"]["status"] == "pass"
    # overfit-batch trains with the script's own optimizer first, at its base rate (the scheduler's initial_lr)
    assert checks["overfit-batch"]["details"]["attempts"][0]["optimizer"] == "your AdamW (lr 1e-03, weight_decay 0.01)"
    # the script's own prints went to stderr, never into the JSON on stdout
    assert "epoch 0 step 1" in done.stderr and "epoch 0 step" not in done.stdout


def test_missing_accumulation_division_fails_at_the_backward_line():
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop_no_accum_division.py", "--format", "json", *LOOP_ONLY)
    assert done.returncode == 1, done.stderr
    checks = done.checks
    accumulation = checks["accumulation-scaling"]
    assert accumulation["status"] == "fail"
    assert accumulation["details"]["micro_batches_per_step"] == 2
    assert accumulation["details"]["gradient_factor"] == pytest.approx(2.0, rel=0.05)
    line = open(ROOT / SCRIPTS / "plain_loop_no_accum_division.py").read().splitlines().index(
        "        loss.backward()") + 1
    assert accumulation["details"]["location"] == f"{SCRIPTS}/plain_loop_no_accum_division.py:{line}"
    assert accumulation["details"]["call"] == "backward()"
    assert done.json["discovered"]["pad_id"] is None  # fixed-length blocks: no padding to find


def test_stops_after_the_steps_asked_and_reaches_nothing_after(tmp_path):
    out = tmp_path / "model.pt"
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop.py", "--steps", "3", "--format", "json", *LOOP_ONLY,
                    "--", "--accum", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    found = done.json["discovered"]
    assert found["steps"] == 3 and found["stopped_at"].startswith(f"{SCRIPTS}/plain_loop.py:")
    assert "epoch 0 step 2 " in done.stderr and "epoch 0 step 3 " not in done.stderr  # stopped inside step 3
    assert not out.exists()  # the checkpoint written after the loop was never reached
    assert str(out) not in done.json.get("sandbox", {}).get("written", [])  # not even in the sandbox


def test_rich_report_shows_discovered_header_and_locations():
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop_no_accum_division.py", *LOOP_ONLY)
    assert done.returncode == 1
    assert "discovered model TinyLM" in done.stdout and "called as model(ids)" in done.stdout
    assert "2 optimizer step(s) recorded" in done.stdout
    assert f"at {SCRIPTS}/plain_loop_no_accum_division.py:" in done.stdout and "(backward())" in done.stdout


def test_module_form_and_python_dash_m(tmp_path):
    # `-m pkg.mod` runs like `python -m`: from the current directory, every argument the script's
    done = tfdoctor("run", "-m", "plain_loop", "--format", "json", "--only", "accumulation-scaling", "--",
                    "--accum", "2", cwd=ROOT / SCRIPTS)
    assert done.returncode == 0, done.stderr
    assert done.json["discovered"]["script"] == "-m plain_loop"
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop.py", "--format", "json", "--only", "zero-grad", module=True)
    assert done.returncode == 0, done.stderr
    assert done.checks["zero-grad"]["status"] == "pass"


@pytest.mark.parametrize("script, args, expected", [
    # ("missing.py": refused before anything runs, test_usage.py)
    ("bad/raises_early.py", [], "raised FileNotFoundError: no such corpus: data/train.bin at "
                                "fixtures/scripts/bad/raises_early.py:7 in load_corpus "
                                "before its first optimizer step"),
    ("bad/exits_early.py", [], "called sys.exit(3) at fixtures/scripts/bad/exits_early.py:10 in <module> before its "
                               "first optimizer step"),
    ("bad/never_steps.py", [], "ended without an optimizer step: "
                               "3 forward(s) of a model and 3 backward() call(s) seen"),
    ("bad/empty_loop.py", [], "ended without an optimizer step: 0 forward(s) of a model and 0 backward() call(s) seen"),
    # issue 18: stdin is empty (input() raises at once, its open prompt line is ended), a multi-line message is folded
    ("bad/reads_stdin.py", [], "raised EOFError: EOF when reading a line at fixtures/scripts/bad/reads_stdin.py:7"),
    ("bad/raises_multiline.py", [], "raised ValueError: invalid config: | lr must be positive | got -1.0 at "
                                    "fixtures/scripts/bad/raises_multiline.py:8 in <module>"),
    ("bad/hangs.py", ["--timeout-per-check", "3"], "running the script up to its last recorded step ran past its 3 s "
                                                   "budget (--timeout-per-check); it was at "
                                                   "fixtures/scripts/bad/hangs.py:10 in <module>"),
])
def test_bad_scripts_are_one_line_and_exit_2(script, args, expected):
    done = tfdoctor("run", f"{SCRIPTS}/{script}", "--format", "json", *args)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.startswith("tfdoctor:")]
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert done.stderr.splitlines()[-1] == lines[0]  # tfdoctor's line is the last one on stderr
    assert done.stdout == ""


def _line(script: str, text: str) -> int:
    return open(ROOT / SCRIPTS / script).read().splitlines().index(text) + 1


def test_nanogpt_style_script_is_quiet_and_called_with_its_targets():
    # nanoGPT's model returns only the last position's logits without targets: the model checks must
    # call it as the script does, model(X, Y), or they would judge [B, 1, V]
    done = tfdoctor("run", f"{SCRIPTS}/nanogpt_train.py", "--format", "json")
    assert done.returncode == 0, done.stderr
    report = done.json
    bad = done.problems
    assert not bad
    found = report["discovered"]
    assert found["called_as"] == "model(ids, int64[4, 16])" and found["probe_call"] == "as the script called it"
    assert found["pad_id"] is None and "notes" not in found  # the no_grad evaluation at iter 0 is not the model's call
    checks = done.checks
    assert checks["future-leak"]["status"] == "pass" and checks["future-leak"]["details"]["seq_len"] == 16
    assert checks["amp-loss-scaling"]["status"] == "pass" and checks["unscale-before-clip"]["status"] == "pass"
    assert (checks["grad-health"]["details"]["steps"] == 2
            and min(checks["grad-health"]["details"]["pre_clip_norms"]) > 0)


def test_nanogpt_clip_before_unscale_fails_at_the_clip_line():
    done = tfdoctor("run", f"{SCRIPTS}/nanogpt_clip_before_unscale.py", "--format", "json", *LOOP_ONLY)
    assert done.returncode == 1, done.stderr
    checks = done.checks
    clip = checks["unscale-before-clip"]
    assert clip["status"] == "fail" and "2 of 2 steps" in clip["message"]
    line = _line("nanogpt_clip_before_unscale.py",
                 "        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)")
    assert clip["details"]["location"] == f"{SCRIPTS}/nanogpt_clip_before_unscale.py:{line}"
    assert [c["id"] for c in done.json["checks"] if c["status"] in ("fail", "warn", "error")] == \
        ["unscale-before-clip"]


def test_hugging_face_trainer_script_is_quiet():
    pytest.importorskip("accelerate")
    done = tfdoctor("run", f"{SCRIPTS}/hf_trainer.py", "--format", "json")
    assert done.returncode == 0, done.stderr
    report = done.json
    bad = done.problems
    assert not bad
    found = report["discovered"]
    assert found["model"] == "LlamaForCausalLM" and found["optimizers"] == ["AdamW"]
    assert (found["pad_id"], found["pad_id_source"], found["padding_side"]) == (0, "attention_mask", "right")
    assert found["called_as"].startswith("model(input_ids=ids, attention_mask=int64[4, ")
    checks = done.checks
    # the Trainer's optimizer, scheduler and clip are seen through its wrappers
    assert checks["scheduler-placement"]["status"] == "pass" and checks["clip-global-norm"]["status"] == "pass"
    assert checks["accumulation-scaling"]["details"]["micro_batches_per_step"] == 2
    assert checks["padding-mask"]["status"] == "pass"


def test_hugging_face_trainer_grading_pads_fails_ignore_index():
    pytest.importorskip("accelerate")
    done = tfdoctor("run", f"{SCRIPTS}/hf_trainer_pads_in_labels.py", "--format", "json", *LOOP_ONLY)
    assert done.returncode == 1, done.stderr
    report = done.json
    assert report["discovered"]["pad_id"] == 0  # read from the attention mask, since the labels keep the pads
    ignore = done.checks["ignore-index"]
    assert ignore["status"] == "fail" and ignore["details"]["graded_pad_targets"] > 0
    assert ignore["details"]["location"] == f"{SCRIPTS}/hf_trainer_pads_in_labels.py:" \
                                            f"{_line('hf_trainer_pads_in_labels.py', '    trainer.train()')}"


def test_accelerate_loop_is_quiet():
    pytest.importorskip("accelerate")
    done = tfdoctor("run", f"{SCRIPTS}/accelerate_loop.py", "--format", "json",
                    "--skip", "overfit-batch,generation,memory")
    assert done.returncode == 0, done.stderr
    report = done.json
    bad = done.problems
    assert not bad
    checks = done.checks
    # accelerator.backward divides by the accumulation steps; the prepared optimizer skips in between
    assert checks["accumulation-scaling"]["status"] == "pass"
    assert checks["accumulation-scaling"]["details"]["micro_batches_per_step"] == 2
    assert report["discovered"]["steps"] == 2 and "step 2 loss" in done.stderr and "step 3 loss" not in done.stderr


def test_a_resumed_checkpoint_skips_init_loss_and_flags_override(tmp_path):
    import torch

    from tinylm import TinyLM

    checkpoint = tmp_path / "ckpt.pt"
    torch.save(TinyLM(50).state_dict(), checkpoint)
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop.py", "--format", "json", "--only", "init-loss,ignore-index",
                    "--pad-id", "7", "--", "--resume", str(checkpoint))
    assert done.returncode == 1, done.stderr
    report = done.json
    line = _line("plain_loop.py", "        model.load_state_dict(torch.load(args.resume))")
    assert report["discovered"]["checkpoint"] == f"{SCRIPTS}/plain_loop.py:{line}"
    init = done.checks["init-loss"]
    assert init["status"] == "skip" and f"loaded trained weights before its first forward ({SCRIPTS}/plain_loop.py:" \
                                       f"{line})" in init["message"]
    # --pad-id wins over the discovered 0: token 7 is a real, graded target, so it reads as padding graded
    assert report["discovered"]["pad_id"] == 0 and report["discovered"]["overridden"] == {"--pad-id": 7}
    ignore = done.checks["ignore-index"]
    assert ignore["status"] == "fail" and ignore["details"]["pad_id"] == 7


def test_sarif_puts_each_finding_on_its_line():
    done = tfdoctor("run", f"{SCRIPTS}/plain_loop_no_accum_division.py", "--format", "sarif", "--only",
                    "accumulation-scaling,zero-grad")
    assert done.returncode == 1, done.stderr
    log = json.loads(done.stdout)
    assert log["version"] == "2.1.0" and log["runs"][0]["tool"]["driver"]["name"] == "tfdoctor"
    (result,) = log["runs"][0]["results"]  # the pass is not a result
    assert result["ruleId"] == "accumulation-scaling" and result["level"] == "error"
    assert "Fix: divide before backward" in result["message"]["text"]
    where = result["locations"][0]["physicalLocation"]
    assert where["artifactLocation"]["uri"] == f"{SCRIPTS}/plain_loop_no_accum_division.py"
    assert where["region"]["startLine"] == _line("plain_loop_no_accum_division.py", "        loss.backward()")
    rules = log["runs"][0]["tool"]["driver"]["rules"]
    assert rules == [{"id": "accumulation-scaling", "name": "accumulation-scaling",
                      "shortDescription": {"text": "Accumulated losses are divided by the number of micro-batches"}}]


@pytest.mark.parametrize("script, packed, status, expected", [
    ("packed_no_doc_mask.py", "documents", "fail", "attention crosses the document boundary"),
    ("packed_doc_mask.py", "documents", "pass", "gets the same logits as alone"),
    ("hf_packed.py", "position_ids", "pass", "gets the same logits as alone"),
    ("hf_packed_seq_idx.py", "documents", "pass", "gets the same logits as alone"),  # TRL's padding-free rows
])
def test_packed_batches_turn_packing_isolation_on(script, packed, status, expected):
    if script.startswith("hf_"):
        pytest.importorskip("transformers")
    done = tfdoctor("run", f"{SCRIPTS}/{script}", "--format", "json", "--only", "packing-isolation,objective")
    report = done.json
    assert report["discovered"]["packed"] == packed
    check = done.checks["packing-isolation"]
    assert check["status"] == status and expected in check["message"], check


def test_ctrl_c_during_a_script_exits_130_with_one_line():
    import signal
    import time

    proc = subprocess.Popen(command_line("run", f"{SCRIPTS}/bad/hangs.py"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(6)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1].startswith("tfdoctor: interrupted (Ctrl-C) during ")


def test_two_models_audit_the_larger_and_judge_its_loop_alone():
    # the draft model steps every micro-batch and never clears its gradients; the LM accumulates 2
    done = tfdoctor("run", f"{SCRIPTS}/two_models.py", "--format", "json")
    assert done.returncode == 0, done.stderr
    report = done.json
    bad = done.problems
    assert not bad
    found = report["discovered"]
    assert found["model"] == "TinyLM" and found["steps"] == 2
    assert found["other_models"] == [{"model": "DraftLM", "names": ["draft"], "trained_parameters": 850}]
    assert any("--model NAME audits another: DraftLM (draft)" in note for note in found["notes"])
    checks = done.checks
    assert checks["accumulation-scaling"]["details"]["micro_batches_per_step"] == 2
    assert checks["accumulation-scaling"]["details"]["window_sizes"] == [2, 2]
    assert checks["zero-grad"]["status"] == "pass" and checks["scheduler-placement"]["status"] == "pass"


@pytest.mark.parametrize("name", ["draft", "DraftLM"])
def test_model_flag_picks_the_other_by_variable_or_class_name(name):
    done = tfdoctor("run", f"{SCRIPTS}/two_models.py", "--format", "json", "--model", name, *LOOP_ONLY)
    assert done.returncode == 1, done.stderr
    report = done.json
    assert report["discovered"]["model"] == "DraftLM"
    assert [m["model"] for m in report["discovered"]["other_models"]] == ["TinyLM"]
    checks = done.checks
    assert checks["zero-grad"]["status"] == "fail" and checks["zero-grad"]["details"]["zero_grad_calls"] == 0
    # the LM's accumulation, clip and scheduler are not the draft's
    assert checks["accumulation-scaling"]["status"] == "skip"
    assert "does not clip" in checks["clip-global-norm"]["message"]
    assert checks["scheduler-placement"]["status"] == "skip"


@pytest.mark.parametrize("wanted, audited, other, stopped_in", [
    (None, "TinyLM", "DraftLM", "optimizer.step(lm_closure)"), ("draft", "DraftLM", "TinyLM", "draft_opt.step(")])
def test_two_models_stepped_with_closures_settle_when_the_first_closure_returns(wanted, audited, other, stopped_in):
    # Nothing is called before the first step (the draft's closure step): the models are settled when
    # its closure returns, and a step of the model not audited is not one of the audited loop's.
    model_flag = ["--model", wanted] if wanted else []
    # the draft's constant rate (lr-schedule) is its own choice, not what is judged here
    skip = [LOOP_ONLY[0], LOOP_ONLY[1] + ",lr-schedule"]
    done = tfdoctor("run", f"{SCRIPTS}/closure_two_models.py", "--format", "json", *model_flag, *skip)
    report = done.json
    found = report["discovered"]
    assert (found["model"], found["steps"], found["ended"]) == (audited, 2, "stopped"), done.stderr
    assert [m["model"] for m in found["other_models"]] == [other]
    lines = (ROOT / SCRIPTS / "closure_two_models.py").read_text().splitlines()
    assert stopped_in in lines[int(found["stopped_at"].rsplit(":", 1)[1]) - 1]
    assert "step 1 loss" in done.stderr and "step 2 loss" not in done.stderr
    checks = done.checks
    bad = done.problems
    assert not bad and done.returncode == 0
    assert checks["zero-grad"]["status"] == "pass" and checks["accumulation-scaling"]["status"] == "skip"
    # the LM's warm-up and clip are not the draft's
    assert checks["scheduler-placement"]["status"] == ("pass" if audited == "TinyLM" else "skip")
    assert ("does not clip" in checks["clip-global-norm"]["message"]) == (audited == "DraftLM")


def test_model_flag_that_matches_nothing_lists_the_candidates():
    done = tfdoctor("run", f"{SCRIPTS}/two_models.py", "--format", "json", "--model", "critic")
    assert done.returncode == 2 and done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.startswith("tfdoctor:")]
    assert lines == ["tfdoctor: error: --model critic matches none of the models the script trains: TinyLM (model), "
                     "18,016 trained parameters; DraftLM (draft), 850 trained parameters; give --model one of those "
                     "class or variable names"], done.stderr


def test_tokenizer_held_by_the_collator_gives_the_pad_id():
    pytest.importorskip("tokenizers")
    done = tfdoctor("run", f"{SCRIPTS}/tokenizer_pads_masked.py", "--format", "json")
    assert done.returncode == 0, done.stderr
    report = done.json
    bad = done.problems
    assert not bad
    found = report["discovered"]
    assert (found["pad_id"], found["pad_id_source"], found["tokenizer"]) == (39, "tokenizer.pad_token_id",
                                                                           "loader.collate_fn.tokenizer")
    # the batches' own evidence stays beside it, and agrees
    assert (found["batch_pad_id"], found["batch_pad_id_source"]) == (39, "targets set to ignore_index")
    assert found["padding_side"] == "right" and "notes" not in found
    checks = done.checks
    assert checks["ignore-index"]["status"] == "pass" and checks["padding-mask"]["status"] == "pass"


def test_only_the_tokenizer_reveals_pads_the_loss_grades():
    pytest.importorskip("tokenizers")
    done = tfdoctor("run", f"{SCRIPTS}/tokenizer_pads_graded.py", "--format", "json", *LOOP_ONLY)
    assert done.returncode == 1, done.stderr
    report = done.json
    found = report["discovered"]
    assert (found["pad_id"], found["pad_id_source"], found["tokenizer"]) == (39, "tokenizer.pad_token_id", "tokenizer")
    assert "batch_pad_id" not in found  # neither masked nor -100, and too few short rows for a run of pads
    ignore = done.checks["ignore-index"]
    assert ignore["status"] == "fail" and ignore["details"]["pad_id"] == 39
    assert ignore["details"]["graded_pad_targets"] > 0


def test_seq2seq_script_is_discovered_and_judged_as_check_judges_one():
    done = tfdoctor("run", f"{SCRIPTS}/seq2seq_reverse.py", "--format", "json")
    assert done.returncode == 0, done.stderr
    report = done.json
    bad = done.problems
    assert not bad
    found = report["discovered"]
    assert found["called_as"] == "model(src_ids, tgt_ids)" and found["kind"] == "seq2seq"
    assert found["decoder_ids"] == "argument 1"
    assert (found["pad_id"], found["padding_side"]) == (0, "right")
    checks = done.checks
    # the encoder-decoder checks ran, the decoder-only ones skipped with check's reasons
    assert checks["cross-attention-mask"]["status"] == "pass" and checks["padding-mask"]["status"] == "pass"
    assert checks["future-leak"]["status"] == "pass" and checks["mask-direction"]["status"] == "pass"
    assert "written for decoder-only and encoder models" in checks["padding-equivalence"]["message"]
    # the loop's targets line up with the decoder's input (teacher forcing), not the source
    assert checks["objective"]["status"] == "pass" and checks["objective"]["details"]["offset"] == 1


def test_nanogpt_check_fixture_of_the_bench_is_quiet():
    # bench/run_vs_check.py times this beside `tfdoctor run nanogpt_train.py`: it must be the same clean audit
    done = tfdoctor("check", "fixtures/loops/nanogpt.py:build", "--train", "fixtures/loops/nanogpt.py:train",
                    "--train-batches", "4", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert done.json  # the report parses as JSON
    bad = done.problems
    assert not bad
    checks = done.checks
    assert checks["accumulation-scaling"]["details"]["micro_batches_per_step"] == 2
    assert checks["unscale-before-clip"]["status"] == "pass" and checks["amp-loss-scaling"]["status"] == "pass"


# Outputs that are not [B, T, V] (issue 17, item 8): recovered where the shape says how, else only the
# model checks skip; the loop checks always judge the trace.
@pytest.mark.parametrize("script, only, code, expected", [
    ("lightning_demo_seq2seq.py", "future-leak,init-loss,objective", 0,
     {"future-leak": "pass", "init-loss": "pass", "objective": "pass"}),
    ("lightning_demo_target_leak.py", "future-leak", 1, {"future-leak": "fail"}),
    ("xt_seq2seq_copy.py", "future-leak,objective,accumulation-scaling", 0,
     {"future-leak": "pass", "objective": "pass", "accumulation-scaling": "pass"}),
    ("xt_seq2seq_copy_no_accum_division.py", "accumulation-scaling", 1, {"accumulation-scaling": "fail"}),
    ("loss_only_tied_head.py", "future-leak,objective", 1, {"future-leak": "skip", "objective": "fail"}),
])
def test_outputs_that_are_not_logits_still_get_a_report(script, only, code, expected):
    done = tfdoctor("run", f"{SCRIPTS}/{script}", "--format", "json", "--only", only)
    assert done.returncode == code, done.stderr
    report = done.json
    assert {k: c["status"] for k, c in done.checks.items()} == expected
    if script.startswith("lightning_demo"):
        assert "flattened" in report["discovered"]["probe_call"]
    if script.startswith("xt_"):
        assert ".decoder.net" in report["discovered"]["probe_call"]
    if script == "loss_only_tied_head.py":
        assert "TiedLossLM's output is not logits" in done.checks["future-leak"]["message"]


def test_ddp_with_an_unused_parameter_and_find_unused_parameters_is_quiet():
    """Issue 17 item 9: DDP(find_unused_parameters=True) hands the returned logits back with a None
    gradient and the unused parameter gets none: tfdoctor's hooks take both, on every rank."""
    done = tfdoctor("run", "--nproc", "2", f"{SCRIPTS}/ddp_unused_parameter.py", "--steps", "2", "--format", "json",
                    "--only", "objective,zero-grad,grad-health,optimizer-coverage,rank-sync")
    assert done.returncode == 0, done.stderr
    assert {c["status"] for c in done.json["checks"]} == {"pass"}


def test_zero_grad_between_backward_and_step_fails_at_its_line():
    """Issue 17 item 10: every step ran on cleared gradients (pre-clip norm 0 -> 0)."""
    done = tfdoctor("run", f"{SCRIPTS}/zero_grad_before_step.py", "--format", "json", "--only", "zero-grad")
    assert done.returncode == 1, done.stderr
    result = done.checks["zero-grad"]
    assert result["status"] == "fail" and result["details"]["steps_on_wiped_gradients"] == [1, 2]
    line = _line("zero_grad_before_step.py",
                 "    optimizer.zero_grad(set_to_none=True)  # the bug: after the step, not here")
    assert result["details"]["location"] == f"{SCRIPTS}/zero_grad_before_step.py:{line}"


def test_completion_only_packed_fine_tuning_is_the_token_mean():
    """Issue 17 item 11: prompt tokens at -100 and padding-free packed rows, the model's loss over
    the Trainer's num_items_in_batch: every graded token is counted, the step is their mean."""
    done = tfdoctor("run", f"{SCRIPTS}/hf_sft_completion_only.py", "--format", "json",
                    "--only", "accumulation-scaling,token-weighting", "--", "--packed")
    assert done.returncode == 0, done.stderr
    checks = done.checks
    assert checks["accumulation-scaling"]["status"] == "pass"
    assert checks["accumulation-scaling"]["details"]["gradient_factor"] == pytest.approx(1.0, abs=0.02)
    assert checks["token-weighting"]["status"] == "pass"


@pytest.mark.parametrize("script, zero_grad", [("swallows_stop.py", "pass"), ("swallows_stop_no_zero_grad.py", "fail")])
def test_a_script_that_catches_the_stop_is_judged_on_the_steps_asked_for(script, zero_grad):
    # issue 18: a bare `except:` (or `except BaseException:`, around a `while True:` loop) swallows the
    # stop; the recording still ends at step 2, the script is ended, and only those steps are judged
    done = tfdoctor("run", f"{SCRIPTS}/{script}", "--format", "json", "--only", "zero-grad,grad-health")
    assert done.returncode == (1 if zero_grad == "fail" else 0), done.stderr
    report = done.json
    found, checks = report["discovered"], done.checks
    assert found["steps"] == 2 and found["ended"] == "stopped"
    assert any("caught tfdoctor's stop" in note for note in found["notes"])
    assert checks["zero-grad"]["status"] == zero_grad and checks["zero-grad"]["details"]["steps_checked"] == 1
    assert checks["grad-health"]["details"]["steps"] == 2


@pytest.mark.parametrize("script, args, objective", [("compiled_gpt.py", ["eager", "inplace"], "pass"),
                                                     ("compiled_gpt_targets_equal_inputs.py", ["eager"], "fail")])
def test_a_model_under_torch_compile_fullgraph_runs_and_is_judged(script, args, objective):
    # issue 18: dynamo traced tfdoctor's Module.__call__ wrapper and hooks (fullgraph=True refused them):
    # inside a compiled region they step aside, and the calls around it are recorded
    done = tfdoctor("run", f"{SCRIPTS}/{script}", "--format", "json", "--only", "objective,zero-grad", "--", *args)
    assert done.returncode == (1 if objective == "fail" else 0), done.stderr
    report = done.json
    assert report["discovered"]["model"] == "GPT" and report["discovered"]["steps"] == 2
    checks = done.checks
    assert checks["objective"]["status"] == objective and checks["zero-grad"]["status"] == "pass"


@pytest.mark.parametrize("load, judged", [("config", True), ("weights", False)])
def test_init_loss_skips_only_weights_loaded_with_from_pretrained(load, judged):
    # A model built with from_config from a config read with from_pretrained has fresh weights (its
    # config still names the checkpoint): judged. from_pretrained's weights are trained: skipped.
    done = tfdoctor("run", f"{SCRIPTS}/hf_from_config.py", "--format", "json", "--only", "init-loss",
                    "--", "--load", load)
    assert done.returncode in (0, 1), done.stderr
    init = done.checks["init-loss"]
    if judged:
        assert init["status"] != "skip", init["message"]
    else:
        assert init["status"] == "skip" and "from_pretrained('" in init["message"], init["message"]


def test_a_model_the_probes_cannot_call_leaves_the_loop_verdicts_standing():
    # issue 29: an optimizer over frozen parameters only, in a script whose model raises when called
    # outside its bfloat16 autocast
    done = tfdoctor("run", f"{SCRIPTS}/frozen_optimizer_bf16.py", "--format", "json")
    assert done.returncode == 1, done.stderr[-2000:]
    checks = done.checks
    coverage = checks["optimizer-coverage"]
    assert coverage["status"] == "fail" and "only frozen parameters" in coverage["message"]
    assert "head.weight" in coverage["message"]
    assert checks["future-leak"]["status"] == "skip" and "could not call Classifier" in checks["future-leak"]["message"]
    assert checks["zero-grad"]["status"] == "pass"  # no misplaced zero_grad() is blamed for the empty steps


def test_the_script_s_own_warnings_reach_its_stderr():
    done = tfdoctor("run", f"{SCRIPTS}/own_warnings.py", "--only", "zero-grad", "--format", "json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "UserWarning: this script's own UserWarning" in done.stderr
    assert "FutureWarning: this script's own FutureWarning" in done.stderr
    assert "own UserWarning" not in done.stdout  # stdout is the report's alone
