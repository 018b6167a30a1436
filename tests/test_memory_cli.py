"""`tfdoctor memory` through the installed command: exit codes 0, 1, 2, one-line usage errors, JSON."""

import json
import shutil
import subprocess
import sys

import pytest

TFDOCTOR = shutil.which("tfdoctor")
pytestmark = pytest.mark.skipif(TFDOCTOR is None, reason="the tfdoctor command is not installed (pip install -e .)")
SEED = ["--batch", "8", "--seq", "5000", "--d-model", "512", "--heads", "8", "--vocab", "10000"]


def tfdoctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TFDOCTOR, *args], capture_output=True, text=True, timeout=120)


def test_seed_is_out_of_memory_exit_1():
    done = tfdoctor("memory", *SEED, "--budget", "24GiB", "--format", "json")
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert data["attention_scores_bytes"] == 6_400_000_000
    assert data["logits_bytes"] == 1_600_000_000
    assert data["fits"] is False and data["budget_bytes"] == 24 * 2**30


def test_fused_attention_fits_exit_0():
    done = tfdoctor("memory", *SEED, "--attention", "sdpa", "--budget", "80GB")
    assert done.returncode == 0, done.stderr
    assert "FITS" in done.stdout


def test_rich_output_names_the_symptom():
    done = tfdoctor("memory", *SEED, "--budget", "24GiB")
    assert done.returncode == 1
    assert "OUT OF MEMORY" in done.stdout and "137" in done.stdout


def test_default_budget_is_this_machine():
    done = tfdoctor("memory", "--batch", "1", "--seq", "64", "--d-model", "128", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["budget_source"] == "available memory of this machine"


@pytest.mark.parametrize("args", [
    ["--heads", "7"],
    ["--budget", "lots"],
    ["--budget", "0GB"],
    ["--gpus", "0"],
    ["--dtype", "fp8"],
])
def test_usage_errors_exit_2_with_one_line(args):
    done = tfdoctor("memory", *SEED, *args)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdoctor: error:"), done.stderr
    assert "Traceback" not in done.stderr


def test_non_positive_batch_exit_2():
    done = tfdoctor("memory", "--batch", "0", "--seq", "10")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_model_shape_flags_rejected_with_a_target():
    done = tfdoctor("memory", "fixtures/gpt_correct.py:build", "--batch", "2", "--seq", "16", "--d-model", "64")
    assert done.returncode == 2 and "analytic" in done.stderr


def test_help_does_not_import_torch():
    code = ("import sys\nsys.argv = ['tfdoctor', 'memory', '--help']\nfrom tfdoctor.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--budget" in done.stdout


FIXTURE = "fixtures/gpt_correct.py:build"


def test_traced_batch_one_reports_a_computed_largest_batch():
    """Issue 8 item 2: batch 1 printed the placeholder 1,048,576 as the largest batch that fits."""
    rich = tfdoctor("memory", FIXTURE, "--batch", "1", "--seq", "64", "--budget", "64MiB")
    assert rich.returncode == 0, rich.stderr
    text = " ".join(rich.stdout.split())  # Rich wraps at the terminal width
    assert "1,048,576" not in text and "largest batch that fits" in text
    done = tfdoctor("memory", FIXTURE, "--batch", "1", "--seq", "64", "--budget", "64MiB", "--format", "json")
    data = json.loads(done.stdout)
    assert 1 < data["largest_batch_that_fits"] < 1 << 20
    assert data["largest_seq_that_fits"] == 64  # the fixture's positions
    assert data["remedies"] and all(r["change"].endswith("(derived)") for r in data["remedies"])


def test_traced_shard_gives_the_per_device_figure_of_the_trace():
    import dataclasses

    from tfdoctor.loader import load_subject
    from tfdoctor.memory.traced import fake_step
    from tfdoctor.runner import as_subject
    from tfdoctor.subject import vocab_size_of

    done = tfdoctor("memory", FIXTURE, "--batch", "2", "--seq", "64", "--gpus", "4", "--shard", "zero3",
                    "--budget", "64MiB", "--format", "json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    subject = as_subject(load_subject(FIXTURE))
    subject = dataclasses.replace(subject, vocab_size=subject.vocab_size or vocab_size_of(subject.model))
    expected = fake_step(subject, 2, 64, gpus=4, shard="zero3").peak_bytes
    assert data["peak_bytes"] == data["trace"]["per_device_peak_bytes"] == expected
    assert expected < fake_step(subject, 2, 64).peak_bytes
    assert any("FSDP2 zero3 on 4 devices" in note for note in data["trace"]["notes"])


def test_device_cuda_traces_a_meta_model_with_cudas_kernels():
    """--device reaches the trace (the worker): a meta-built SDPA model runs CUDA's flash kernel under bf16."""
    done = tfdoctor("memory", "fixtures/sdpa_meta.py:build", "--batch", "2", "--seq", "128", "--dtype", "bf16",
                    "--device", "cuda", "--budget", "1GiB", "--format", "json")
    assert done.returncode == 0, done.stderr
    attention = json.loads(done.stdout)["attention"]
    assert attention["device"] == "cuda" and attention["why"] == "set by --device cuda"
    assert [k["op"] for k in attention["kernels"]] == ["_scaled_dot_product_flash_attention"]
