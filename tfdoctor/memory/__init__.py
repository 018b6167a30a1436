"""Memory estimation for one training step: `analytic` (pure Python, from the shape) and `traced`
(fake tensors, from the user's model). Importing this package does not import torch.

Both modes:
- `sizes.py`: byte sizes in and out ("24GiB" -> int, int -> "56.1 GiB");
- `budget.py`: where the budget comes from (--budget, the machine's memory, the GPU's free memory);
- `fsdp_shards.py`: what FSDP2 shards, keeps and allocates on one rank (Fsdp2Schedule), pure Python;
- `seq_limit.py`: whether a model can take the sequence length a flag asks for.

The analytic mode (no torch):
- `analytic.py`: the step of a GPT-2-style decoder as a ledger of allocations, its Verdict and remedies.

The traced mode (imports torch):
- `fake_step.py`: one real training step of the user's model on fake tensors, its storages counted;
- `counter.py`: the live-bytes counter of that step, each storage tagged by how remedies would change it;
- `blocks.py`: the model's top-level blocks, the module each op runs in, its tensors made fake;
- `kernels.py`: the attention kernel SDPA would pick on the device the model trains on;
- `derive.py`: the arithmetic from one traced step to the peak at another batch size or length (no torch);
- `fsdp_overlay.py`: one rank of a sharded job, laid over the traced single-device step;
- `traced_judge.py`: the traced steps judged against the budget, with the remedies (judge_traced).

What the benches and tests hold both modes to (imports torch):
- `gpt.py`: the model the analytic mode describes, written out so that it can be traced and measured;
- `fsdp_measured.py`: one real FSDP2 training step measured on a rank, by component.
"""
