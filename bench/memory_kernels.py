"""The attention kernel a traced model runs (issue 17, item 18): a model built on the meta device is
traced with the kernel it will run where it trains, not with SDPA's math path (meta's choice).

For each model, configured for SDPA: the real CPU step's peak of live tensor bytes (the same op-by-op
counter as the traced mode, on real tensors: the ground truth of bench/memory_accuracy.py), the model
built on the CPU and traced, the same model built on meta and traced, and the kernel each trace ran.
Then TinyLlama-1.1B's shape at 8,192 tokens, traced from meta only (it is never allocated), for the CPU
and for a GPU (--device cuda: CUDA's choice emulated), fp32 and bf16 autocast, against 80 GiB.

    python bench/memory_kernels.py          # about two minutes on 2 cores
    python bench/memory_kernels.py --quick  # without the 1.1B traces
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "fixtures")]

import torch  # noqa: E402

from tfdoctor.memory.fake_step import fake_step as trace_step  # noqa: E402
from tfdoctor.subject import Subject  # noqa: E402

GIB = 2**30
# Small enough for a real step on a laptop's CPU; TinyLlama's head size (64) and 8:1 grouped KV heads.
LLAMA_SMALL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                   num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=2048)


def _kernel(trace) -> str:
    return ", ".join(f"{k['op'].replace('_scaled_dot_product_', '') if k['fused'] else 'math'} x{k['calls']}"
                     for k in trace.attention["kernels"]) or "no SDPA call"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def models():
    """(name, build on a device, vocabulary, batch, seq)."""
    import transformers

    import llama_meta
    import sdpa_meta

    def llama(device: str):
        config = transformers.LlamaConfig(**LLAMA_SMALL, attn_implementation="sdpa")
        torch.manual_seed(0)
        with torch.device(device):
            return transformers.LlamaForCausalLM(config)

    def gpt(device: str):
        return sdpa_meta.build() if device == "meta" else sdpa_meta.build_cpu()

    def tiny(device: str):
        return llama_meta.build() if device == "meta" else llama_meta.build_cpu()

    return [("HF Llama 2 layers, d 1024, GQA 16:2", llama, 32000, 1, 1024),
            ("HF Llama tiny (the test's)", tiny, 256, 2, 128),
            ("own GPT, SDPA is_causal", gpt, 256, 4, 512)]


def small(rows: list) -> None:
    print(f"{'model':36} {'B x T':>10} | {'real CPU step':>14} {'traced (CPU)':>14} {'traced (meta)':>14} "
          f"{'meta/real':>9} | kernel (meta)")
    for name, build, vocab, batch, seq in models():
        cpu_model = build("cpu")
        traced_cpu = trace_step(Subject(cpu_model, vocab_size=vocab), batch, seq)
        traced_meta = trace_step(Subject(build("meta"), vocab_size=vocab), batch, seq)
        real = trace_step(Subject(cpu_model, vocab_size=vocab), batch, seq, fake=False)
        ratio = traced_meta.peak_bytes / real.peak_bytes
        rows.append(ratio)
        print(f"{name:36} {f'{batch} x {seq}':>10} | {_mib(real.peak_bytes):>14} {_mib(traced_cpu.peak_bytes):>14} "
              f"{_mib(traced_meta.peak_bytes):>14} {ratio:>9.4f} | {_kernel(traced_meta)}")
        del cpu_model


def one_billion() -> None:
    import llama_meta

    model = llama_meta.build_1b()
    count = sum(p.numel() for p in model.parameters())
    print(f"\nTinyLlama-1.1B shape ({count:,} parameters), batch 1 x 8,192, built on meta, against 80 GiB:")
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    for target, dtype, math in (("cpu", None, True), ("cpu", None, False), ("cuda", None, False),
                                ("cuda", torch.bfloat16, False)):
        with sdpa_kernel([SDPBackend.MATH]) if math else nullcontext():  # what meta's choice used to trace
            trace = trace_step(Subject(model, vocab_size=32000), 1, 8192, target=target, autocast_dtype=dtype)
        fits = "fits" if trace.peak_bytes <= 80 * GIB else "OUT OF MEMORY"
        scores = _mib(trace.attention_scores_bytes) if trace.attention_scores_bytes else "none"
        print(f"  --device {target:4} {'bf16' if dtype else 'fp32'}{' math only' if math else ''}: "
              f"peak {trace.peak_bytes / GIB:6.1f} GiB ({fits}), "
              f"kernel {_kernel(trace)}, [.., T, T] scores stored: {scores}, "
              f"traced in {trace.seconds:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip the 1.1B traces")
    args = parser.parse_args()
    torch.set_num_threads(2)
    ratios: list = []
    small(ratios)
    print(f"worst meta/real: {max(abs(r - 1) for r in ratios):.4%}")
    if not args.quick:
        one_billion()


if __name__ == "__main__":
    main()
