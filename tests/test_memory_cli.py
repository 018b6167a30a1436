"""`tfdoctor memory` through the installed command: exit codes 0, 1, 2, JSON (its one-line usage errors,
refused before anything runs, are in test_usage.py)."""

import json
import subprocess
import sys

from helpers import E2E, tfdoctor as run

pytestmark = E2E
SEED = ["--batch", "8", "--seq", "5000", "--d-model", "512", "--heads", "8", "--vocab", "10000"]


def tfdoctor(*args: str):
    return run(*args, timeout=120)


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


def test_output_writes_the_report_to_the_file_as_every_command_does(tmp_path):
    path = tmp_path / "memory.json"
    done = tfdoctor("memory", *SEED, "--budget", "24GiB", "--format", "json", "--output", str(path))
    assert done.returncode == 1, done.stderr  # the exit code is still the verdict's
    assert done.stdout == "" and f"report written to {path}" in done.stderr
    assert json.loads(path.read_text(encoding="utf-8"))["fits"] is False


def test_default_budget_is_this_machine():
    done = tfdoctor("memory", "--batch", "1", "--seq", "64", "--d-model", "128", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["budget_source"] == "available memory of this machine"


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
    from tfdoctor.memory.fake_step import fake_step
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


def test_traced_cli_exit_codes():
    out_of_memory = run("memory", FIXTURE, "--batch", "8", "--seq", "64", "--budget", "2MiB")
    assert out_of_memory.returncode == 1, out_of_memory.stderr
    assert "OUT OF MEMORY" in out_of_memory.stdout and "traced" in out_of_memory.stdout
    too_long = run("memory", FIXTURE, "--batch", "1", "--seq", "100000", "--budget", "80GB")
    assert too_long.returncode == 2 and "positions" in too_long.stderr
