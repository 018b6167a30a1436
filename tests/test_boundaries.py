"""Document-boundary judges (issue 20): eos-trained (the end-of-sequence token is a graded target) and
packing-labels (no packed position is graded on the next document's first token).

Both judge the gradient each scored position received, on loops of fixtures/loops/ run on the tiny
Hugging Face GPT-2 (the catalogue's cases, shared through conftest's checks_report), on real libraries'
models from tests/real_models.py, and end to end on `tfdoctor run` of fixtures/scripts/.
"""

import pytest
import torch

from catalogue import BOUNDARIES
from helpers import SCRIPTS, build_fixture, tfdoctor, train_fn
from real_models import hf_llama, hf_t5
from tfdoctor import Subject, run_checks
from tfdoctor.errors import UsageError
from tfdoctor.recording.loop import train_batches
from tfdoctor.subject import resolve

pytest.importorskip("transformers")


def _boundaries(checks_report, loop: str, pad_id: int):
    return checks_report("hf_gpt2", BOUNDARIES, train=loop, pad_id=pad_id)


# --- eos-trained ----------------------------------------------------------------------------------------

def test_pad_equal_to_eos_masked_by_id_fails_naming_the_cause(checks_report):
    result = _boundaries(checks_report, "hf_eos_masked_as_pad", 1)["eos-trained"]
    assert result.status.value == "fail"
    assert "pad_id == eos_id == 1" in result.message and "never learns to stop" in result.message
    assert "attention_mask == 0" in result.hint
    d = result.details
    assert d["pad_is_eos"] and d["graded_eos_targets"] == 0 and d["rows_with_eos"] > 0 and d["eos_targets"] > 0
    assert d["location"].endswith("hf_eos_masked_as_pad.py:20")  # the loss call


def test_first_pad_kept_as_end_of_text_passes(checks_report):
    result = _boundaries(checks_report, "hf_eos_as_pad", 1)["eos-trained"]
    assert result.status.value == "pass", result.message
    d = result.details
    assert d["rows_with_eos_graded"] == d["rows_with_eos"] > 0  # one per row: each row's real end-of-text


def test_eos_distinct_from_pad_is_graded_like_any_token(checks_report):
    result = _boundaries(checks_report, "hf_labels", 0)["eos-trained"]
    assert result.status.value == "pass", result.message
    assert not result.details["pad_is_eos"] and result.details["graded_eos_targets"] > 0


def test_loop_that_masks_eos_by_ignore_index_fails_without_pad_story():
    def train(model, batches):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for ids in batches:
            labels = ids.masked_fill((ids == 0) | (ids == model.config.eos_token_id), -100)
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    torch.manual_seed(0)
    result = run_checks(build_fixture("hf_gpt2"), only=["eos-trained"], pad_id=0, train=train)["eos-trained"]
    assert result.status.value == "fail" and "pad_id ==" not in result.message
    assert "the loss masks EOS" in result.message


def test_data_without_eos_is_skipped_saying_so():
    def train(model, batches):  # the loop's data never holds the end-of-sequence id
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for ids in batches:
            ids = ids.masked_fill(ids == model.config.eos_token_id, 5)
            model(input_ids=ids, labels=ids.masked_fill(ids == 0, -100)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    torch.manual_seed(0)
    result = run_checks(build_fixture("hf_gpt2"), only=["eos-trained"], pad_id=0, train=train)["eos-trained"]
    assert result.status.value == "skip" and "never ends a document with EOS" in result.message


def test_no_eos_id_skips_with_the_flag_to_give():
    torch.manual_seed(0)
    result = run_checks(build_fixture("gpt_correct"), only=["eos-trained"], pad_id=0,
                        train=train_fn("correct"))["eos-trained"]
    assert result.status.value == "skip" and "--eos-id" in result.message


def test_eos_id_given_on_a_hand_written_model_judges_its_loop():
    torch.manual_seed(0)
    report = run_checks(build_fixture("gpt_correct"), only=["eos-trained"], pad_id=0, eos_id=7,
                        train=train_fn("correct"))
    assert report["eos-trained"].status.value == "pass", report["eos-trained"].message
    torch.manual_seed(0)  # pad == eos with ignore_index=pad: the nanoGPT idiom that masks every EOS
    report = run_checks(build_fixture("gpt_correct"), only=["eos-trained"], pad_id=0, eos_id=0,
                        train=train_fn("correct"))
    assert report["eos-trained"].status.value == "fail" and "pad_id == eos_id == 0" in report["eos-trained"].message


# --- the rows --train feeds, and where the eos id comes from --------------------------------------------

def _subject(**fields):
    return resolve(Subject(build_fixture("gpt_correct"), **fields))


def test_train_rows_end_with_eos_before_their_pads_and_are_otherwise_unchanged():
    with_eos, without = _subject(pad_id=0, eos_id=3), _subject(pad_id=0)
    for short in (False, True):
        a = train_batches(with_eos, 2, torch.Generator().manual_seed(1))[int(short)]
        b = train_batches(without, 2, torch.Generator().manual_seed(1))[int(short)]
        real = (b != 0).sum(-1)
        last = a[torch.arange(a.shape[0]), real - 1]
        assert bool((last == 3).all())  # each row's last real token is EOS, pads after it
        assert bool((a == 0).eq(b == 0).all())  # the same pads where they were
        changed = a != b
        assert int(changed.sum(-1).max()) <= 1  # nothing else moved: the same random draws


def test_left_padded_rows_end_with_eos_at_the_last_position():
    batch = train_batches(_subject(pad_id=0, eos_id=3, padding_side="left"), 1, torch.Generator().manual_seed(1))[0]
    assert bool((batch[:, -1] == 3).all()) and bool((batch[:, 0] == 0)[1:].any())


def test_pad_equal_to_eos_writes_no_eos_on_the_right_but_does_on_the_left():
    right = train_batches(_subject(pad_id=3, eos_id=3), 1, torch.Generator().manual_seed(1))[0]
    plain = train_batches(_subject(pad_id=3), 1, torch.Generator().manual_seed(1))[0]
    assert torch.equal(right, plain)  # each padded row's first pad is its end-of-text already
    left = train_batches(_subject(pad_id=3, eos_id=3, padding_side="left"), 1, torch.Generator().manual_seed(1))[0]
    assert bool((left[:, -1] == 3).all())  # no pad follows a left-padded row's tokens: its EOS is written


def test_eos_id_defaults_to_the_config_and_is_dropped_outside_the_vocabulary():
    assert resolve(Subject(build_fixture("hf_gpt2"))).eos_id == 1
    from transformers import GPT2Config, GPT2LMHeadModel

    small = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    assert resolve(Subject(small)).eos_id is None  # GPT-2's 50256 in a 64-token test vocabulary
    with pytest.raises(UsageError, match="eos_id 64 is outside"):
        resolve(Subject(small, eos_id=64))


def test_eos_id_flag_is_checked_before_anything_runs():
    from helpers import refused

    done = refused("check", "fixtures/tinygpt.py:build", "--eos-id", "-1")
    assert done.code == 2 and "--eos-id must be at least 0" in done.stderr


# --- packing-labels -------------------------------------------------------------------------------------

def test_packed_labels_across_boundaries_fail_with_count_and_share(checks_report):
    result = _boundaries(checks_report, "hf_packed_labels_cross", 0)["packing-labels"]
    assert result.status.value == "fail"
    d = result.details
    assert d["graded"] == d["boundaries"] > 0 and d["graded_share"] == 1.0
    assert d["packed_by"] == "position_ids restart inside a row" and d["examples"]
    assert f"{d['graded']} of {d['boundaries']} document boundaries (100%)" in result.message
    assert "-100" in result.hint


def test_packed_labels_masked_at_document_starts_pass(checks_report):
    result = _boundaries(checks_report, "hf_packed_labels", 0)["packing-labels"]
    assert result.status.value == "pass", result.message
    assert result.details["boundaries"] > 0 and result.details["graded"] == 0


def test_unpacked_rows_are_skipped(checks_report):
    result = _boundaries(checks_report, "hf_labels", 0)["packing-labels"]
    assert result.status.value == "skip" and "not packed" in result.message


@pytest.mark.parametrize("on_pads", ["clamped to 0", "set to 1"])
def test_left_padded_rows_with_positions_from_the_mask_are_not_packed(on_pads):
    # position_ids = cumsum(mask) - 1 restart nowhere among the real tokens: the pads are no documents
    def train(model, batches):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for ids in batches:
            mask = (ids != 0).long()
            positions = mask.cumsum(-1) - 1
            positions = positions.clamp(min=0) if on_pads == "clamped to 0" else positions.masked_fill(mask == 0, 1)
            loss = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         labels=ids.masked_fill(mask == 0, -100)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    torch.manual_seed(0)
    result = run_checks(build_fixture("hf_gpt2"), only=["packing-labels"], pad_id=0, padding_side="left",
                        train=train)["packing-labels"]
    assert result.status.value == "skip" and "not packed" in result.message


# --- real libraries: a tiny Llama from tests/real_models.py ---------------------------------------------

@pytest.mark.parametrize("loop, eos, packing", [
    ("hf_eos_masked_as_pad", "fail", "skip"),
    ("hf_eos_as_pad", "pass", "skip"),
    ("hf_packed_labels_cross", None, "fail"),
    ("hf_packed_labels", None, "pass"),
])
def test_real_llama(loop, eos, packing):
    torch.manual_seed(0)
    model = hf_llama()  # eos_token_id 0, which the loops pad with (pad == eos)
    report = run_checks(model, only=list(BOUNDARIES), pad_id=0, train=train_fn(loop))
    if eos is not None:
        assert report["eos-trained"].status.value == eos, report["eos-trained"].message
    assert report["packing-labels"].status.value == packing, report["packing-labels"].message


def _seq2seq_loop(mask_eos: bool):
    def train(model, batches):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        pad, eos = model.config.pad_token_id, model.config.eos_token_id
        for src, tgt in batches:
            masked = (tgt == pad) | (tgt == eos) if mask_eos else tgt == pad
            loss = model(input_ids=src, attention_mask=(src != pad).long(), labels=tgt.masked_fill(masked, -100)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    return train


def test_real_t5_grades_the_eos_its_target_rows_end_with():
    torch.manual_seed(0)
    report = run_checks(hf_t5(), only=list(BOUNDARIES), train=_seq2seq_loop(False))
    assert report["eos-trained"].status.value == "pass", report["eos-trained"].message
    assert report["packing-labels"].status.value == "skip"  # one target sequence per row
    # given only labels=, the model's decoder input is read off them: an EOS set to -100 cannot be told
    # from padding, so the check says so instead of guessing
    torch.manual_seed(0)
    masked = run_checks(hf_t5(), only=["eos-trained"], train=_seq2seq_loop(True))["eos-trained"]
    assert masked.status.value == "skip" and "-100 in the labels" in masked.message


# --- end to end: `tfdoctor run` on scripts --------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("script, check, status, expected", [
    ("hf_eos_pad_masked.py", "eos-trained", "fail", "pad_id == eos_id == 47"),
    ("hf_eos_attention_masked.py", "eos-trained", "pass", "8 of 8 rows train it"),
    ("hf_sft_completion_only.py", "eos-trained", "pass", "eos_id=2"),  # the config's eos, no tokenizer
    ("packed_labels_cross.py", "packing-labels", "fail", "document boundaries (100%) are graded"),
    ("packed_doc_mask.py", "packing-labels", "pass", "(a document-id argument (doc_ids=...))"),
    ("packed_no_doc_mask.py", "packing-labels", "pass", "left out of the loss"),
    ("hf_packed.py", "packing-labels", "pass", "(position_ids restart inside a row)"),
    ("hf_packed_seq_idx.py", "packing-labels", "pass", "(seq_idx=...)"),
])
def test_run_scripts(script, check, status, expected):
    done = tfdoctor("run", f"{SCRIPTS}/{script}", "--format", "json", "--only", check)
    result = done.checks[check]
    assert result["status"] == status and expected in result["message"], result


@pytest.mark.e2e
def test_run_reads_the_eos_id_off_the_scripts_tokenizer_and_the_flag_overrides_it():
    done = tfdoctor("run", f"{SCRIPTS}/hf_eos_pad_masked.py", "--format", "json", "--only", "eos-trained")
    found = done.json["discovered"]
    assert found["eos_id"] == 47 and found["eos_id_source"] == "tokenizer.eos_token_id"
    done = tfdoctor("run", f"{SCRIPTS}/hf_eos_pad_masked.py", "--format", "json", "--only", "eos-trained",
                    "--eos-id", "5")
    assert done.json["discovered"]["overridden"] == {"--eos-id": 5}
    assert "eos_id=5" in done.checks["eos-trained"]["message"]
