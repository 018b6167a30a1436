"""Analytic memory mode: exact figures on the configuration that gets a run killed (batch 8, seq 5000,
d_model 512: SEED), sizes, validation, remedies; no torch."""

import dataclasses
import io
import json
import subprocess
import sys

import pytest

from tfdoctor.errors import UsageError
from tfdoctor.memory.analytic import Config, estimate, judge, largest_fitting, parameter_count, peak
from tfdoctor.memory.sizes import format_bytes, parse_size
from tfdoctor.report import render

GIB = 2**30
SEED = Config(batch=8, seq=5000, d_model=512, heads=8, layers=6, vocab=10000)
# SEED's peak, measured by summing the storages alive after each op (a TorchDispatchMode on fake tensors) over
# one AdamW training step of a GPT-2-style model (torch 2.13 CPU): in the backward of the attention softmax
# with naive attention (56.1 GiB), 13.8 GiB with SDPA.
SEED_TRACED_NAIVE = 60_284_841_916
SEED_TRACED_SDPA = 14_821_264_252


def test_seed_score_tensor_and_logits_exact():
    est = estimate(SEED)
    assert est.attention_scores_bytes == 6_400_000_000  # [8, 8, 5000, 5000] float32
    assert est.logits_bytes == 1_600_000_000  # [8, 5000, 10000] float32


def test_shorter_sequence_shrinks_scores_about_381_times():
    short = estimate(dataclasses.replace(SEED, seq=256))
    ratio = estimate(SEED).attention_scores_bytes / short.attention_scores_bytes
    assert round(ratio) == 381
    assert ratio == pytest.approx((5000 / 256) ** 2)


@pytest.mark.parametrize("attention, traced", [("naive", SEED_TRACED_NAIVE), ("sdpa", SEED_TRACED_SDPA)])
def test_seed_peak_matches_the_traced_reference(attention, traced):
    est = estimate(dataclasses.replace(SEED, attention=attention))
    assert abs(est.peak_bytes - traced) / traced < 0.001
    assert est.peak_phase == "backward"


def test_seed_peak_is_in_the_attention_softmax_backward_and_attention_dominates():
    est = estimate(SEED)
    assert "softmax backward" in est.peak_op
    assert est.at_peak["attention scores and probabilities"] > 10 * est.at_peak["logits and their float32 softmax"]


def test_seed_parameter_count():
    # 10000*512 tokens + 5000*512 positions + 6 blocks + ln_f + untied head
    assert parameter_count(SEED) == 31_715_328
    assert parameter_count(dataclasses.replace(SEED, tied=True)) == 31_715_328 - 10000 * 512


def test_defaults_heads_from_d_model():
    assert Config(batch=1, seq=8).n_head == 8
    assert Config(batch=1, seq=8, d_model=768).n_head == 12


def test_remedies_show_fused_attention_matters_here():
    verdict = judge(SEED, 24 * GIB, "test")
    assert not verdict.fits
    by_name = {r.name: r for r in verdict.remedies}
    assert by_name["fused attention"].fits
    assert not by_name["mixed precision"].fits
    assert by_name["best combination"].fits
    assert by_name["shorter sequences"].changes_training
    assert by_name["fused attention"].peak_bytes < by_name["mixed precision"].peak_bytes


def test_largest_fitting_is_the_boundary():
    budget = 24 * GIB
    seq = largest_fitting(SEED, "seq", budget)
    assert peak(dataclasses.replace(SEED, seq=seq)) <= budget < peak(dataclasses.replace(SEED, seq=seq + 1))
    batch = largest_fitting(SEED, "batch", budget)
    assert batch == 3


def test_each_remedy_lowers_the_peak():
    base = peak(SEED)
    for change in (dict(attention="sdpa"), dict(dtype="bf16"), dict(checkpointing="full"), dict(batch=2)):
        assert peak(dataclasses.replace(SEED, **change)) < base, change
    assert peak(dataclasses.replace(SEED, optimizer="none")) < base


def test_zero_sharding_divides_states_per_device():
    big = Config(batch=1, seq=512, d_model=4096, heads=32, layers=32, vocab=50257, attention="sdpa")
    alone = estimate(big)
    zero1 = estimate(dataclasses.replace(big, gpus=8, shard="zero1"))
    zero3 = estimate(dataclasses.replace(big, gpus=8, shard="zero3"))
    assert zero1.optimizer_bytes == alone.optimizer_bytes // 8
    assert alone.peak_bytes > zero1.peak_bytes > zero3.peak_bytes


@pytest.mark.parametrize("config", [
    Config(batch=8, seq=5000, heads=7),
    Config(batch=0, seq=5000),
    Config(batch=1, seq=-1),
    Config(batch=1, seq=8, d_model=200),  # default heads 3 do not divide 200
])
def test_invalid_configs_are_usage_errors(config):
    with pytest.raises(UsageError):
        estimate(config)


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1.5G", int(1.5 * 2**30)),
    ("1000", 1000), ("2 TB", 2 * 10**12), ("16gib", 16 * 2**30),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12XB", "0GB", "-3GiB", "GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(SEED_TRACED_NAIVE) == "56.1 GiB"
    assert format_bytes(SEED_TRACED_SDPA) == "13.8 GiB"
    assert format_bytes(512) == "512 B"


def test_json_carries_the_required_keys():
    out = io.StringIO()
    render(judge(SEED, 24 * GIB, "test"), "json", out)
    data = json.loads(out.getvalue())
    assert data["attention_scores_bytes"] == 6_400_000_000
    assert data["logits_bytes"] == 1_600_000_000
    assert data["budget_bytes"] == 24 * GIB
    assert data["fits"] is False
    assert data["peak_bytes"] == estimate(SEED).peak_bytes
    assert {r["name"] for r in data["remedies"]} >= {"fused attention", "best combination"}
    assert "breakdown" in data and "kept_per_layer" in data


def test_rich_report_says_out_of_memory_and_exit_137():
    out = io.StringIO()
    render(judge(SEED, 24 * GIB, "test"), "rich", out, width=100)
    text = out.getvalue()
    assert "OUT OF MEMORY" in text and "137" in text
    assert "6,400,000,000" in text and "1,600,000,000" in text
    assert "steady-state" in text


def test_rich_report_fits():
    out = io.StringIO()
    render(judge(dataclasses.replace(SEED, seq=256, batch=1), 24 * GIB, "test"), "rich", out, width=100)
    assert "FITS" in out.getvalue()


@pytest.mark.e2e
def test_analytic_mode_does_not_import_torch():
    code = ("import sys\n"
            "sys.argv = ['tfdoctor', 'memory', '--batch', '8', '--seq', '5000', '--budget', '24GiB']\n"
            "from tfdoctor.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            "assert code == 1, code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# Per device under FSDP2 (zero2/zero3): tfdoctor/memory/fsdp_shards.py (Fsdp2Schedule). Worked by hand for
# V 4096, C 64, T 64, one block, d_ff 256, 4 devices; every dim 0 divides by 4 except none, so no padding:
#   root shards: wte and lm_head 1024 x 64 each, wpe 16 x 64, ln_f 2 x 16 -> 132,128 floats
#   block shards: ln_1 32, c_attn 48 x 64 + 48, c_proj 16 x 64 + 16, ln_2 32, up 64 x 64 + 64,
#                 down 16 x 256 + 16 -> 12,496 floats
#   shards 144,624 floats = 578,496 bytes; the root unsharded 4 x 132,128 floats = 2,114,048 bytes
FSDP_SMALL = Config(batch=4, seq=64, d_model=64, heads=1, layers=1, vocab=4096, attention="sdpa", gpus=4)


def test_fsdp2_shards_and_states_per_device():
    est = estimate(dataclasses.replace(FSDP_SMALL, shard="zero3"))
    assert est.parameter_bytes == 578_496
    assert est.gradient_bytes == 578_496  # reduce-scattered into shards of the same size
    assert est.optimizer_bytes == 2 * 578_496  # AdamW: exp_avg and exp_avg_sq of each shard


def test_fsdp2_zero3_keeps_the_root_unsharded_at_the_logits_peak():
    # FSDP2 does not reshard the root after forward: at log_softmax backward the embeddings and LM head
    # are whole on every device beside the shards; no gradient exists yet.
    est = estimate(dataclasses.replace(FSDP_SMALL, shard="zero3"))
    assert est.peak_op == "log_softmax backward"
    assert est.at_peak["parameters"] == 578_496 + 2_114_048
    assert est.at_peak["gradients"] == 0
    assert est.at_peak["optimizer states"] == 2 * 578_496


def test_fsdp2_zero2_also_keeps_every_block_unsharded_until_its_backward():
    est = estimate(dataclasses.replace(FSDP_SMALL, shard="zero2"))
    assert est.peak_op == "log_softmax backward"
    assert est.at_peak["parameters"] == 578_496 + 2_114_048 + 4 * 12_496 * 4


def test_fsdp2_pads_dim_0_to_the_world_size():
    # vocab 4095 on 4 devices: 1024 rows per shard all the same (torch.chunk, padded), so the same bytes
    padded = estimate(dataclasses.replace(FSDP_SMALL, vocab=4095, shard="zero3"))
    assert padded.parameter_bytes == 578_496


def test_zero1_divides_only_the_optimizer_states():
    alone = estimate(FSDP_SMALL)
    zero1 = estimate(dataclasses.replace(FSDP_SMALL, shard="zero1"))
    assert zero1.parameter_bytes == alone.parameter_bytes
    assert zero1.optimizer_bytes == alone.optimizer_bytes // 4
