"""What one check's forwards leave on the user's model (issue 29): the Annotated Transformer keeps each
attention map as `self.attn`, a non-leaf tensor after a forward that tracks gradients, which
copy.deepcopy refuses. No check may leave it there for the next one, and the loop checks copy a model
that already holds one."""

import pytest
import torch

from helpers import TRAIN_IDS, build_fixture, train_fn
from tfdoctor import run_checks

FIXTURE, LOOP = "annotated_model_keeps_attention", "annotated_label_smoothing"


def _maps(subject):
    return [layer.multihead_attn.attn for layer in subject.model.decoder.layers]


@pytest.fixture(scope="module")
def full_battery():
    subject = build_fixture(FIXTURE)
    report = run_checks(subject, skip=["memory"], train=train_fn(LOOP), pad_id=0)
    return subject, report


def test_the_full_battery_and_only_give_the_loop_checks_the_same_verdicts(full_battery):
    _, full = full_battery
    alone = run_checks(build_fixture(FIXTURE), only=TRAIN_IDS, train=train_fn(LOOP), pad_id=0)
    assert not [r.id for r in full.results if r.status.value == "error"], [r.message for r in full.results]
    assert {i: full[i].status.value for i in TRAIN_IDS} == {i: alone[i].status.value for i in TRAIN_IDS}


def test_the_model_is_left_without_what_the_checks_forwards_kept(full_battery):
    subject, report = full_battery
    assert report["depth-signal"].status.value == "pass"  # it ran a forward and a backward on the model
    assert _maps(subject) == [None, None]


def test_the_loop_is_recorded_on_a_copy_of_a_model_that_already_holds_a_non_leaf_map():
    import dataclasses

    from tfdoctor.recording.loop import record_loop, train_batches
    from tfdoctor.subject import resolve

    subject = resolve(dataclasses.replace(build_fixture(FIXTURE), train=train_fn(LOOP)))
    ids = torch.randint(1, 96, (2, 8))
    subject.forward(subject.model, ids, ids).sum()  # the user's own forward, under grad, before tfdoctor's
    kept = _maps(subject)
    assert not kept[0].is_leaf
    trace = record_loop(subject, train_batches(subject, 4, torch.Generator().manual_seed(0)))
    assert trace.batches_fed == 4
    assert all(a is b for a, b in zip(_maps(subject), kept))  # the user's maps stay theirs
