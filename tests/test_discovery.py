"""What `tfdoctor run` reads off a recorded script (tfdoctor/recording/discovery.py), in process, on
Traces built by hand: the pad id and where it was read from, the padding side, a tokenizer's pad id
beside the batches' evidence, and packed rows. The same facts are asserted end to end, on real
scripts, by tests/test_run.py; here each heuristic gets its own small batch. And where a finding or
an error is located: the user's loop line under `check --train`, tfdoctor's own line for its own error."""

import pytest
import torch

from tfdoctor.recording.discovery import discover_packing, discover_padding, tokenizer_padding
from tfdoctor.recording.trace import Event, Trace

PAD = 0


def spec(ids: torch.Tensor) -> dict:
    """One argument of the recorded call, as the script recorder describes it."""
    return {"tensor": True, "dtype": str(ids.dtype).replace("torch.", ""), "shape": list(ids.shape),
            "floating": ids.is_floating_point(), "value": ids}


def trace_of(*forwards, losses=()) -> Trace:
    """A Trace of training forwards (each a list of (input name, int tensor)) and losses on them
    (each (forward index, targets, ignore_index))."""
    events = [Event("forward", 0, {"index": i, "inputs": list(inputs), "grad": True})
              for i, inputs in enumerate(forwards)]
    events += [Event("loss", 0, {"forward": i, "targets": targets, "ignore_index": ignore})
               for i, targets, ignore in losses]
    return Trace(events, len(forwards), [], [], [], 0)


def padded(lengths, T=16, pad=PAD, side="right", vocab=(5, 50), seed=0) -> torch.Tensor:
    """Rows of random tokens (never `pad`) of these real lengths, padded with `pad` on `side`."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        row = torch.full((T,), pad, dtype=torch.long)
        tokens = torch.randint(*vocab, (n,), generator=g)
        if side == "right":
            row[:n] = tokens
        else:
            row[T - n:] = tokens
        rows.append(row)
    return torch.stack(rows)


LENGTHS = [16, 11, 7, 13]


def test_the_attention_mask_gives_the_pad_id_and_its_side():
    """As a Hugging Face Trainer script shows it (test_run: hf_trainer.py)."""
    ids = padded(LENGTHS)
    call = {"args": [], "kwargs": {"input_ids": spec(ids), "attention_mask": spec((ids != PAD).long())}}
    trace = trace_of([("input_ids", ids), ("attention_mask", (ids != PAD).long())])
    assert discover_padding(trace, call) == {"pad_id": 0, "pad_id_source": "attention_mask", "padding_side": "right"}


def test_labels_set_to_minus_100_give_the_pad_id():
    ids = padded(LENGTHS, pad=3, side="left")
    labels = ids.masked_fill(ids == 3, -100)
    call = {"args": [], "kwargs": {"input_ids": spec(ids), "labels": spec(labels)}}
    trace = trace_of([("input_ids", ids), ("labels", labels)])
    assert discover_padding(trace, call) == {"pad_id": 3, "pad_id_source": "labels == -100", "padding_side": "left"}


def test_targets_at_the_loss_ignore_index_give_the_pad_id():
    """model(ids), then cross_entropy(logits, targets, ignore_index=-100) with the pads' targets at -100
    (test_run: plain_loop.py). The target of position t is token t + 1."""
    ids = padded(LENGTHS)
    targets = torch.cat([ids[:, 1:], torch.full((len(LENGTHS), 1), PAD)], 1)
    trace = trace_of([("0", ids)], losses=[(0, targets.masked_fill(targets == PAD, -100).reshape(-1), -100)])
    found = discover_padding(trace, {"args": [spec(ids)], "kwargs": {}})
    assert (found["pad_id"], found["pad_id_source"], found["padding_side"]) == (0, "targets set to ignore_index",
                                                                                "right")


def test_prompt_tokens_masked_with_minus_100_are_not_padding():
    """Instruction tuning masks the prompt's tokens, many ids: none explains PAD_SHARE_MIN of them."""
    ids = torch.randint(5, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :6] = -100  # the prompt
    call = {"args": [], "kwargs": {"input_ids": spec(ids), "labels": spec(labels)}}
    assert discover_padding(trace_of([("input_ids", ids), ("labels", labels)]), call) == {}


def test_runs_of_one_id_at_the_rows_ends_read_as_padding_nobody_masks():
    for side, where in (("right", "end"), ("left", "start")):
        ids = padded(LENGTHS, pad=39, side=side)
        found = discover_padding(trace_of([("0", ids)]), {"args": [spec(ids)], "kwargs": {}})
        assert found == {"pad_id": 39, "pad_id_source": f"runs of one id at the rows' {where}", "padding_side": side}


def test_fixed_length_blocks_have_no_padding_to_find():
    """Blocks cut from one long text (test_run: plain_loop_no_accum_division.py): pad_id None."""
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(2))
    assert discover_padding(trace_of([("0", ids)]), {"args": [spec(ids)], "kwargs": {}}) == {}
    assert discover_padding(trace_of(), None) == {}  # and no forward at all


def test_a_tokenizer_that_disagrees_with_the_batches_wins_and_leaves_a_note():
    """The collator pads with 0 and grades nothing there, the tokenizer it holds pads with 39 (test_run's
    tokenizer_pads_masked.py run with --collator-pad 0)."""
    ids = padded(LENGTHS)
    targets = torch.cat([ids[:, 1:], torch.full((len(LENGTHS), 1), PAD)], 1)
    trace = trace_of([("0", ids)], losses=[(0, targets.masked_fill(targets == PAD, -100).reshape(-1), -100)])
    call = {"args": [spec(ids)], "kwargs": {}}
    batches = discover_padding(trace, call)
    found, note = tokenizer_padding(trace, call, batches, [("loader.collate_fn.tokenizer", 39)])
    assert found["pad_id"] == 39 and (found["batch_pad_id"], found["batch_pad_id_source"]) == \
        (0, "targets set to ignore_index")
    assert [note] == ["the tokenizer (loader.collate_fn.tokenizer) pads with 39 but the batches mark 0 as "
                      "padding (targets set to ignore_index); judged with 39: pass --pad-id 0 if the batches "
                      "are right"]
    agreeing, none = tokenizer_padding(trace, call, batches, [("tokenizer", 0)])
    assert none is None and (agreeing["pad_id"], agreeing["pad_id_source"], agreeing["tokenizer"]) == \
        (0, "tokenizer.pad_token_id", "tokenizer")
    assert tokenizer_padding(trace, call, batches, []) == (batches, None)  # no tokenizer: the batches' word


def test_packed_rows_are_read_from_a_document_id_argument_or_restarting_positions():
    ids = torch.randint(0, 50, (2, 8))
    restarting = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]] * 2)
    assert discover_packing(trace_of([("input_ids", ids), ("doc_ids", torch.zeros(2, 8, dtype=torch.long))])) == \
        {"packed": "documents", "packed_source": "a document-id argument (doc_ids=...)"}
    assert discover_packing(trace_of([("input_ids", ids), ("position_ids", restarting)])) == \
        {"packed": "position_ids", "packed_source": "position_ids restart inside a row"}
    assert discover_packing(trace_of([("input_ids", ids), ("position_ids", torch.arange(8).expand(2, 8))])) == {}


# --- where a finding or an error is located ---------------------------------------------------------

def test_check_train_findings_carry_the_loop_line_too():
    # the same recorder and judges under `check --train`: the finding names the user's loop line
    import importlib.util

    from helpers import FIXTURES, build_fixture
    from tfdoctor import run_checks

    spec = importlib.util.spec_from_file_location("no_loss_division", FIXTURES / "loops" / "no_loss_division.py")
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    report = run_checks(build_fixture("gpt_correct"), only=["accumulation-scaling"], train=loop.train)
    result = report["accumulation-scaling"]
    assert result.status.value == "fail"
    source = (FIXTURES / "loops" / "no_loss_division.py").read_text().splitlines()
    path, line = result.details["location"].rsplit(":", 1)
    assert path.endswith("fixtures/loops/no_loss_division.py") and ".backward()" in source[int(line) - 1]
    assert result.details["call"] == "backward()"


def test_an_exception_raised_in_tfdoctors_own_code_is_located_there():
    from tfdoctor.errors import OutputShapeError
    from tfdoctor.subject import extract_logits
    from tfdoctor.usercode.call_sites import raised_in_tfdoctor

    with pytest.raises(OutputShapeError) as ours:
        extract_logits(object())
    assert raised_in_tfdoctor(ours.value).startswith("tfdoctor/subject.py:")
    assert raised_in_tfdoctor(ours.value).endswith(" in extract_logits")
    with pytest.raises(ZeroDivisionError) as theirs:
        1 / 0
    assert raised_in_tfdoctor(theirs.value) is None
