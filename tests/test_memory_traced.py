"""Traced memory mode: fake tensors agree with real ones, the analytic model agrees with the trace, and
HF GPT-2, the fixtures and a billion-parameter model trace without allocating."""

from pathlib import Path

import pytest
import torch

from tfdoctor.memory.analytic import Config, estimate
from tfdoctor.memory.fake_step import fake_step
from tfdoctor.memory.gpt import GPT
from tfdoctor.memory.traced_judge import judge_traced
from tfdoctor.subject import Subject

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = str(ROOT / "fixtures" / "gpt_correct.py") + ":build"


def small_gpt(attention: str, positions: int = 256) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=1000, d_model=128, n_head=4, n_layer=2, positions=positions, attention=attention)


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_fake_trace_equals_real_step(attention):
    subject = Subject(small_gpt(attention), vocab_size=1000)
    fake = fake_step(subject, 2, 128)
    real = fake_step(subject, 2, 128, fake=False)
    assert fake.peak_bytes == real.peak_bytes
    assert (fake.peak_phase, fake.peak_op) == (real.peak_phase, real.peak_op)


@pytest.mark.parametrize("batch, seq, attention", [(2, 256, "naive"), (4, 256, "sdpa")])
def test_analytic_agrees_with_trace(batch, seq, attention):
    traced = fake_step(Subject(small_gpt(attention, positions=seq), vocab_size=1000), batch, seq).peak_bytes
    analytic = estimate(Config(batch=batch, seq=seq, d_model=128, heads=4, layers=2, vocab=1000,
                               attention=attention)).peak_bytes
    assert abs(analytic - traced) / traced < 0.10  # the accuracy goal for the analytic mode


def test_naive_peak_is_in_the_attention_softmax_backward():
    trace = fake_step(Subject(small_gpt("naive", positions=1024), vocab_size=1000), 2, 1024)
    assert (trace.peak_phase, trace.peak_node, trace.peak_module) == ("backward", "SoftmaxBackward0", "h.1.attn")
    assert trace.attention_scores_bytes == 2 * 4 * 1024 * 1024 * 4
    assert trace.kept_by_module[0][0].endswith(".attn")


def test_trace_leaves_the_model_as_found():
    model = small_gpt("naive").eval()
    before = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in before.items()}
    fake_step(Subject(model, vocab_size=1000), 2, 64)
    assert not model.training
    for name, p in model.named_parameters():
        assert p is before[name] and p.grad is None
        assert torch.equal(p, values[name])


def test_hugging_face_gpt2_traces():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=500, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    trace = fake_step(Subject(model, vocab_size=500), 2, 128)
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
    trace = fake_step(Subject(model, vocab_size=50257), 1, 8192)
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


def test_memory_check_skips_fails_and_passes(checks_report):
    # FIXTURE's model, each run on a fresh build (shared with the catalogue's rows)
    assert checks_report("gpt_correct", ["memory"])["memory"].status.value == "skip"
    tight = checks_report("gpt_correct", ["memory"], options={"train_batch": 8, "train_seq": 64, "budget": "1MiB"})
    result = tight["memory"]
    assert result.status.value == "fail", result.message
    assert "137" in result.message and result.details["peak_bytes"] > 2**20
    roomy = checks_report("gpt_correct", ["memory"], options={"train_batch": 2, "train_seq": 16, "budget": "80GB"})
    assert roomy["memory"].status.value == "pass", roomy["memory"].message


# --- remedies derived from the one trace (issue 8, items 2 and 4) ----------------------------------

def fixture_subject():
    from tfdoctor.loader import load_subject
    from tfdoctor.runner import as_subject

    subject = as_subject(load_subject(FIXTURE))
    return subject if subject.vocab_size else Subject(subject.model, vocab_size=96)


def test_largest_batch_at_batch_one_is_a_traced_fact():
    """Batch 1 used to report a placeholder cap (1,048,576); the derived largest batch must fit when
    traced, and one more must not."""
    subject = fixture_subject()
    budget = 64 * 2**20
    verdict = judge_traced(subject, FIXTURE, 1, 64, budget, "test")
    largest = verdict.largest_batch
    assert isinstance(largest, int) and 1 < largest < 1 << 20
    assert fake_step(subject, largest, 64).peak_bytes <= budget
    assert fake_step(subject, largest + 1, 64).peak_bytes > budget
    assert verdict.largest_seq == 64  # the fixture's positions


def test_remedies_are_derived_from_one_trace(monkeypatch):
    import tfdoctor.memory.traced_judge as traced_judge

    subject = fixture_subject()
    calls = []
    real = fake_step
    monkeypatch.setattr(traced_judge, "fake_step", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    main = real(subject, 8, 64)
    budget = int(main.peak_bytes * 0.55)
    verdict = judge_traced(subject, FIXTURE, 8, 64, budget, "test")
    assert calls == [(8, 64)]  # one trace, nothing traced again
    monkeypatch.undo()
    remedies = {r.name: r for r in verdict.remedies}
    assert {"mixed precision", "activation checkpointing", "gradient accumulation",
            "shorter sequences"} <= set(remedies)
    assert all(r.change.endswith("(derived)") for r in verdict.remedies)
    micro = int(remedies["gradient accumulation"].change.split()[1])
    shorter = int(remedies["shorter sequences"].change.split()[1].rstrip(","))
    from tfdoctor.memory.blocks import checkpointed_blocks

    with checkpointed_blocks(subject.model):
        checkpointed = fake_step(subject, 8, 64).peak_bytes
    again = {"mixed precision": fake_step(subject, 8, 64, autocast_dtype=torch.bfloat16).peak_bytes,
             "activation checkpointing": checkpointed,
             "gradient accumulation": fake_step(subject, micro, 64).peak_bytes,
             "shorter sequences": fake_step(subject, 8, shorter).peak_bytes}
    for name, traced_peak in again.items():
        # bench/memory_remedies.py measured -2.0% for checkpointing, under 1% for the rest
        assert abs(remedies[name].peak_bytes - traced_peak) / traced_peak < 0.03, name
    assert fake_step(subject, 8, verdict.largest_seq).peak_bytes <= budget
    assert fake_step(subject, 8, verdict.largest_seq + 1).peak_bytes > budget


def test_mixed_precision_follows_the_cpu_math_attention():
    """sdpa with dropout takes the CPU's float32 math path even under bf16 autocast."""
    from tfdoctor.loader import load_subject

    subject = Subject(load_subject(str(ROOT / "fixtures" / "gpt_sdpa.py") + ":build"), vocab_size=96)
    derived = fake_step(subject, 4, 32).derivation.mixed_peak
    traced = fake_step(subject, 4, 32, autocast_dtype=torch.bfloat16).peak_bytes
    assert abs(derived - traced) / traced < 0.01


def test_head_size_equal_to_seq_traces_the_lengths():
    """[B, nh, T, hs] with hs = T looks like a score tensor: the lengths are traced, not derived."""
    subject = Subject(small_gpt("sdpa", positions=64), vocab_size=1000)  # d_model 128 / 4 heads: hs = 32
    main = fake_step(subject, 4, 32)
    assert "head size" in main.derivation.seq_ambiguous
    budget = (main.peak_bytes + fake_step(subject, 4, 16).peak_bytes) // 2  # fits between T/2 and T
    verdict = judge_traced(subject, "gpt", 4, 32, budget, "test")
    shorter = next(r for r in verdict.remedies if r.name == "shorter sequences")
    assert shorter.change.endswith("(traced)") and shorter.fits
    assert any("head size" in note for note in verdict.traced["notes"])
    assert fake_step(subject, 4, verdict.largest_seq).peak_bytes <= budget
    assert "head size" not in fake_step(subject, 4, 48).derivation.seq_ambiguous


def test_progress_advances_every_task_to_its_total():
    started = []

    def progress(description, total):
        task = {"description": description, "total": total, "done": 0}
        started.append(task)

        def advance(n=1):
            task["done"] += n
        return advance

    subject = Subject(small_gpt("sdpa", positions=64), vocab_size=1000)
    judge_traced(subject, "gpt", 4, 32, 2**20, "test", progress=progress)  # ambiguous: a second task
    assert len(started) == 2 and "tracing" in started[0]["description"]
    assert all(task["done"] == task["total"] for task in started), started


def test_hooks_are_removed_after_a_real_step():
    model = small_gpt("naive")
    fake_step(Subject(model, vocab_size=1000), 2, 16, fake=False)
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


@pytest.mark.parametrize("shape, power", [
    ((8, 64, 128), 1),        # [B, T, C]
    ((8, 64, 64), 1),         # [B, T, C] with C = T
    ((512, 64), 1),           # [B*T, C] with C = T
    ((8, 4, 64, 64), 2),      # [B, nh, T, T] scores
    ((32, 64, 64), 2),        # [B*nh, T, T] scores
    ((32, 64, 16), 1),        # [B*nh, T, hs]
    ((128, 256), 0),          # a weight
    ((), 0),
])
def test_seq_power_per_sample(shape, power):
    from tfdoctor.memory.counter import seq_power

    assert seq_power(shape, 8, 64, True) == power


def test_seq_power_shared_and_batch_one():
    from tfdoctor.memory.counter import seq_power

    assert seq_power((64, 64), 8, 64, False) == 2   # a [T, T] causal mask
    assert seq_power((64, 64), 1, 64, True) == 1    # [B*T, C] at B = 1 with C = T
    assert seq_power((4, 64, 64), 1, 64, True) == 2  # [nh, T, T] scores at B = 1


def test_derive_solves_the_envelope_exactly():
    from tfdoctor.memory import derive

    # two ops: 100 shared + 10 per sample (at B = 2: 5 each), and 50 shared + 30 per sample growing ~T
    points = [(100, 0, 0, 10, 0, 0), (50, 0, 0, 0, 30, 0)]
    assert derive.peak_at(points, 2, 10, 2, 10) == 110
    assert derive.peak_at(points, 2, 10, 4, 20) == max(100 + 20, 50 + 30 * 2 * 2)
    assert derive.largest_batch(points, 2, 200) == min((200 - 100) * 2 // 10, (200 - 50) * 2 // 30)
    assert derive.largest_batch([(300, 0, 0, 0, 0, 0)], 2, 200) == 0
    assert derive.largest_batch([(100, 0, 0, 0, 0, 0)], 2, 200) is None  # the batch does not move the peak
    # peak(t) = 50 + 30 t/10 at the traced batch: fits while t <= 50
    assert derive.largest_seq(points, 2, 10, 200) == 50
    assert derive.largest_seq(points, 2, 10, 200, limit=32) == 32
    assert derive.largest_seq([(10, 0, 5, 0, 0, 0)], 1, 10, 30) == 20  # 10 + 5 (t/10)^2 <= 30
    assert derive.largest_seq([(10, 0, 0, 0, 0, 0)], 1, 10, 30) is None
    assert derive.largest_quadratic({1: 10, 2: 20, 4: 40}, 1000, None) == 100
    assert derive.largest_quadratic({1: 10, 2: 10, 4: 10}, 1000, None) is None  # no placeholder cap


# --- per device under --shard (fsdp_overlay.py): the analytic mode's FSDP2 schedule over the trace ---------
# The model of tests/test_memory_analytic.py's hand-worked FSDP2 figures (V 4096, C 64, T 64, one block,
# 4 devices): shards 578,496 bytes, the root unsharded 2,114,048 bytes, one block unsharded 4 x 12,496 floats.
SHARD_SHARDS, SHARD_ROOT, SHARD_BLOCK = 578_496, 2_114_048, 4 * 12_496 * 4
ADAMW_STEPS = 17 * 4  # AdamW's float32 `step` of each of the 17 parameters, which FSDP2 leaves whole


def shard_subject() -> Subject:
    torch.manual_seed(0)
    return Subject(GPT(vocab=4096, d_model=64, n_head=1, n_layer=1, positions=64, attention="sdpa"), vocab_size=4096)


def test_traced_zero3_holds_the_hand_worked_fsdp2_bytes():
    trace = fake_step(shard_subject(), 4, 64, gpus=4, shard="zero3")
    assert trace.parameter_bytes == SHARD_SHARDS  # padded dim-0 shards, no buffers in this model
    assert trace.optimizer_bytes == 2 * SHARD_SHARDS + ADAMW_STEPS
    # the peak is the log-softmax backward, with the root still unsharded beside the shards (the old
    # ZeRO-3 formula, parameters / N, left the 2,114,048 bytes out)
    assert trace.peak_op == "_log_softmax_backward_data"
    assert trace.peak_breakdown["parameters and buffers"] == SHARD_SHARDS + SHARD_ROOT
    analytic = estimate(Config(batch=4, seq=64, d_model=64, heads=1, layers=1, vocab=4096, attention="sdpa",
                               gpus=4, shard="zero3"))
    assert abs(trace.peak_bytes - analytic.peak_bytes) / analytic.peak_bytes < 0.001


def test_traced_zero2_keeps_the_block_unsharded_and_zero1_shards_only_the_states():
    subject = shard_subject()
    zero2 = fake_step(subject, 4, 64, gpus=4, shard="zero2")
    assert zero2.peak_breakdown["parameters and buffers"] == SHARD_SHARDS + SHARD_ROOT + SHARD_BLOCK
    alone = fake_step(subject, 4, 64)
    zero1 = fake_step(subject, 4, 64, gpus=4, shard="zero1")
    assert zero1.parameter_bytes == alone.parameter_bytes
    assert zero1.optimizer_bytes == (alone.optimizer_bytes - ADAMW_STEPS) // 4 + ADAMW_STEPS
    assert zero1.peak_bytes < alone.peak_bytes


def test_traced_sharding_leaves_the_model_as_it_was():
    subject = shard_subject()
    model = subject.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fake_step(subject, 2, 32, gpus=4, shard="zero3", zero3_gpus=8)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_sharded_remedies_are_per_device_and_from_one_trace(monkeypatch):
    """Under --shard, every derived remedy is one rank's figure (a sharded trace with the remedy applied
    agrees), and the ZeRO-3 remedy is a second view of the same trace."""
    import tfdoctor.memory.traced_judge as traced_judge

    subject = fixture_subject()
    real = fake_step
    main = real(subject, 8, 64, gpus=2, shard="zero2")
    budget = int(main.peak_bytes * 0.6)
    calls = []
    monkeypatch.setattr(traced_judge, "fake_step", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    verdict = judge_traced(subject, FIXTURE, 8, 64, budget, "test", gpus=2, shard="zero2")
    monkeypatch.undo()
    assert calls == [(8, 64)]
    assert verdict.peak_bytes == main.peak_bytes
    remedies = {r.name: r for r in verdict.remedies}
    micro = int(remedies["gradient accumulation"].change.split()[1])
    assert remedies["gradient accumulation"].peak_bytes == real(subject, micro, 64, gpus=2, shard="zero2").peak_bytes
    assert remedies["ZeRO-3 / FSDP sharding"].peak_bytes == real(subject, 8, 64, gpus=2, shard="zero3").peak_bytes
    largest = verdict.largest_batch
    assert real(subject, largest, 64, gpus=2, shard="zero2").peak_bytes <= budget
    assert real(subject, largest + 1, 64, gpus=2, shard="zero2").peak_bytes > budget


# -- the attention kernel the model runs where it trains (memory/kernels.py) -------------------------------

@pytest.fixture(scope="module")
def llama_both_ways():
    """A tiny HF Llama configured for SDPA, built on meta and on the CPU, each traced once at [2, 128]."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import llama_meta

    traces = {}
    for name in ("build", "build_empty", "build_cpu"):  # build_empty: accelerate's init_empty_weights
        model = getattr(llama_meta, name)()
        traces[name] = fake_step(Subject(model, vocab_size=256), 2, 128)
    traces["real"] = fake_step(Subject(model, vocab_size=256), 2, 128, fake=False)  # the CPU-built one, for real
    return traces


def test_meta_built_sdpa_llama_traces_as_on_the_cpu(llama_both_ways):
    meta, cpu, real = llama_both_ways["build"], llama_both_ways["build_cpu"], llama_both_ways["real"]
    assert meta.peak_bytes == cpu.peak_bytes == real.peak_bytes  # ratio 1.000 (the math path read 8.8x)
    assert llama_both_ways["build_empty"].peak_bytes == cpu.peak_bytes
    assert meta.attention_scores_bytes is None
    assert meta.attention["device"] == "cpu" and "meta" in meta.attention["why"]
    [kernel] = meta.attention["kernels"]
    assert kernel["op"] == "_scaled_dot_product_flash_attention_for_cpu" and kernel["calls"] == 2


def test_own_sdpa_model_on_meta_and_its_math_path_under_dropout():
    import sdpa_meta

    peaks = {name: fake_step(Subject(getattr(sdpa_meta, name)(), vocab_size=256), 2, 256)
             for name in ("build", "build_cpu", "build_dropout")}
    assert peaks["build"].peak_bytes == peaks["build_cpu"].peak_bytes
    dropout = peaks["build_dropout"]  # the CPU's fused kernel has no dropout: math is what the CPU runs
    [kernel] = dropout.attention["kernels"]
    assert not kernel["fused"] and "dropout" in kernel["reason"]
    assert dropout.attention_scores_bytes == 2 * 4 * 256 * 256 * 4
    from tfdoctor.memory.kernels import scores_note

    note = scores_note(dropout.attention, dropout.attention_scores_bytes)
    assert "math path" in note and "dropout" in note and "not traced" not in note
    on_gpu = fake_step(Subject(sdpa_meta.build_dropout(), vocab_size=256), 2, 256, target="cuda")
    [kernel] = on_gpu.attention["kernels"]  # CUDA's fused kernels take dropout; float32 rules out flash
    assert kernel["op"] == "_scaled_dot_product_efficient_attention" and on_gpu.attention["emulated"]
    assert on_gpu.attention_scores_bytes is None and on_gpu.peak_bytes < dropout.peak_bytes


@pytest.mark.parametrize("dtype, head, mask, gqa, expected", [
    (torch.bfloat16, 64, False, True, "_scaled_dot_product_flash_attention"),
    (torch.float32, 64, False, False, "_scaled_dot_product_efficient_attention"),
    (torch.float16, 64, True, False, "_scaled_dot_product_efficient_attention"),  # flash takes no mask
    (torch.float32, 6, False, False, "math"),  # efficient needs head sizes divisible by 4 in float32
    (torch.bfloat16, 64, False, False, "_scaled_dot_product_flash_attention"),
    (torch.float32, 64, False, True, "math"),  # grouped KV heads: flash (16-bit only) or math, never efficient
])
def test_cuda_choice_follows_torch_gates(dtype, head, mask, gqa, expected):
    from tfdoctor.memory.kernels import cuda_choice

    q = torch.empty(2, 8, 16, head, dtype=dtype, device="meta")
    kv = torch.empty(2, 2 if gqa else 8, 16, head, dtype=dtype, device="meta")
    attn_mask = torch.empty(16, 16, dtype=torch.bool, device="meta") if mask else None
    op, _ = cuda_choice(dict(query=q, key=kv, value=kv, attn_mask=attn_mask, dropout_p=0.1, is_causal=not mask,
                             scale=None, enable_gqa=gqa))
    assert op == expected


def test_report_names_the_kernel_assumed():
    """HF Llama (grouped KV heads) in float32 for a GPU: flash needs 16 bits, memory-efficient takes no grouped
    heads, so CUDA runs the math path, and the Rich and JSON reports say so and why."""
    import io
    import json

    pytest.importorskip("transformers")
    import llama_meta
    from tfdoctor.report import render

    verdict = judge_traced(Subject(llama_meta.build(), vocab_size=256), "llama", 2, 64, 2**20, "test",
                           device="cuda")
    rich, doc = io.StringIO(), io.StringIO()
    render(verdict, "rich", rich, width=400)
    render(verdict, "json", doc)
    assert ("attention on cuda (CUDA's choice on an sm80+ GPU, emulated): math path (stores the T x T scores) in 2 "
            "of 2 SDPA calls (flash attention needs float16 or bfloat16") in rich.getvalue()
    attention = json.loads(doc.getvalue())["attention"]
    assert attention["device"] == "cuda" and attention["emulated"] and not attention["kernels"][0]["fused"]
    assert "grouped" in attention["kernels"][0]["reason"]
    assert any("under bf16 autocast (--dtype bf16) they could take flash attention" in note
               for note in verdict.traced["notes"])
    bf16 = judge_traced(Subject(llama_meta.build(), vocab_size=256), "llama", 2, 64, 2**40, "test",
                        remedies=False, device="cuda", dtype="bf16")
    assert [k["op"] for k in bf16.traced["attention"]["kernels"]] == ["_scaled_dot_product_flash_attention"]
    assert bf16.traced["attention_scores_bytes"] is None
    mixed = next(r for r in verdict.remedies if r.name == "mixed precision")  # traced: bf16 changes the kernel
    assert mixed.change.endswith("(traced: 16 bits let CUDA fuse attention)") and mixed.peak_bytes == bf16.peak_bytes


@pytest.mark.e2e
def test_the_note_on_stored_scores_gives_an_analytic_command_that_runs():
    # issue 29: the note named `tfdoctor memory --attention sdpa`, which a TARGET refuses
    import json
    import re
    import shlex

    from helpers import tfdoctor

    traced = tfdoctor("memory", "fixtures/gpt_correct.py:build", "--batch", "4", "--seq", "64", "--format", "json")
    note = next(n for n in json.loads(traced.stdout)["trace"]["notes"] if "analytic mode" in n)
    command = shlex.split(re.search(r"`(tfdoctor memory [^`]+)`", note).group(1))
    assert command[command.index("--d-model") + 1] == "64" and command[command.index("--layers") + 1] == "2"
    analytic = tfdoctor(*command[1:])
    assert analytic.code in (0, 1), analytic.stderr
