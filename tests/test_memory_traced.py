"""Traced memory mode: fake tensors agree with real ones, the analytic model agrees with the trace, and
HF GPT-2, the fixtures and a billion-parameter model trace without allocating."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tfdoctor.memory.analytic import Config, estimate
from tfdoctor.memory.gpt import GPT
from tfdoctor.memory.traced import judge_traced, trace_step
from tfdoctor.runner import run_checks
from tfdoctor.subject import Subject

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = str(ROOT / "fixtures" / "gpt_correct.py") + ":build"


def small_gpt(attention: str, positions: int = 256) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=1000, d_model=128, n_head=4, n_layer=2, positions=positions, attention=attention)


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_fake_trace_equals_real_step(attention):
    subject = Subject(small_gpt(attention), vocab_size=1000)
    fake = trace_step(subject, 2, 128)
    real = trace_step(subject, 2, 128, fake=False)
    assert fake.peak_bytes == real.peak_bytes
    assert (fake.peak_phase, fake.peak_op) == (real.peak_phase, real.peak_op)


@pytest.mark.parametrize("batch, seq, attention", [(2, 256, "naive"), (4, 256, "sdpa")])
def test_analytic_agrees_with_trace(batch, seq, attention):
    traced = trace_step(Subject(small_gpt(attention, positions=seq), vocab_size=1000), batch, seq).peak_bytes
    analytic = estimate(Config(batch=batch, seq=seq, d_model=128, heads=4, layers=2, vocab=1000,
                               attention=attention)).peak_bytes
    assert abs(analytic - traced) / traced < 0.10  # the accuracy goal for the analytic mode


def test_naive_peak_is_in_the_attention_softmax_backward():
    trace = trace_step(Subject(small_gpt("naive", positions=1024), vocab_size=1000), 2, 1024)
    assert (trace.peak_phase, trace.peak_node, trace.peak_module) == ("backward", "SoftmaxBackward0", "h.1.attn")
    assert trace.attention_scores_bytes == 2 * 4 * 1024 * 1024 * 4
    assert trace.kept_by_module[0][0].endswith(".attn")


def test_trace_leaves_the_model_as_found():
    model = small_gpt("naive").eval()
    before = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in before.items()}
    trace_step(Subject(model, vocab_size=1000), 2, 64)
    assert not model.training
    for name, p in model.named_parameters():
        assert p is before[name] and p.grad is None
        assert torch.equal(p, values[name])


def test_hugging_face_gpt2_traces():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=500, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    trace = trace_step(Subject(model, vocab_size=500), 2, 128)
    n_params = sum(p.numel() for p in model.parameters())
    assert trace.parameter_bytes >= 4 * n_params
    assert trace.optimizer_bytes >= 8 * n_params
    assert trace.peak_bytes > trace.parameter_bytes + trace.optimizer_bytes + trace.logits_bytes
    assert trace.logits_bytes == 2 * 128 * 500 * 4
    assert trace.peak_phase in ("forward", "loss", "backward")


def test_billion_parameters_at_8192_without_allocating():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):  # too big to build for real in a test
        model = GPT(vocab=50257, d_model=2048, n_head=16, n_layer=18, positions=8192, attention="sdpa")
    assert sum(p.numel() for p in model.parameters()) > 1_000_000_000
    trace = trace_step(Subject(model, vocab_size=50257), 1, 8192)
    analytic = estimate(Config(1, 8192, 2048, 16, 18, 50257, attention="sdpa")).peak_bytes
    assert trace.peak_bytes > 30 * 2**30  # more than this machine has
    assert abs(analytic - trace.peak_bytes) / trace.peak_bytes < 0.02


def test_judge_traced_remedies_on_fixture():
    from tfdoctor.loader import load_subject
    from tfdoctor.runner import as_subject

    verdict = judge_traced(as_subject(load_subject(FIXTURE)), FIXTURE, 8, 64, 2 * 2**20, "test")
    assert not verdict.fits
    names = {r.name for r in verdict.remedies}
    assert {"mixed precision", "activation checkpointing", "gradient accumulation"} <= names
    accumulation = next(r for r in verdict.remedies if r.name == "gradient accumulation")
    assert accumulation.peak_bytes < verdict.peak_bytes


def test_memory_check_skips_fails_and_passes():
    from tfdoctor.loader import load_subject

    model = load_subject(FIXTURE)
    assert run_checks(model, only="memory")["memory"].status.value == "skip"
    tight = run_checks(model, only="memory", options={"train_batch": 8, "train_seq": 64, "budget": "1MiB"})
    result = tight["memory"]
    assert result.status.value == "fail", result.message
    assert "137" in result.message and result.details["peak_bytes"] > 2**20
    roomy = run_checks(model, only="memory", options={"train_batch": 2, "train_seq": 16, "budget": "80GB"})
    assert roomy["memory"].status.value == "pass", roomy["memory"].message


@pytest.mark.skipif(shutil.which("tfdoctor") is None, reason="the tfdoctor command is not installed")
def test_traced_cli_exit_codes():
    run = lambda *a: subprocess.run(["tfdoctor", "memory", FIXTURE, *a], capture_output=True, text=True,
                                    timeout=300)
    out_of_memory = run("--batch", "8", "--seq", "64", "--budget", "2MiB")
    assert out_of_memory.returncode == 1, out_of_memory.stderr
    assert "OUT OF MEMORY" in out_of_memory.stdout and "traced" in out_of_memory.stdout
    too_long = run("--batch", "1", "--seq", "100000", "--budget", "80GB")
    assert too_long.returncode == 2 and "positions" in too_long.stderr
