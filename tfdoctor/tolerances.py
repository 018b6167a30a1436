"""Thresholds shared by probes and checks (no torch here, so check modules can import it)."""

# A measured output counts as changed when it moves by more than this fraction of the largest
# |logit| of the unperturbed output. Float32 reordering noise is ~1e-7 relative; the quietest real
# leak we know of (probabilities zeroed after the softmax, so the future still moves the
# denominator) is ~1e-4. 1e-5 sits a decade from each. Used by the dependency map, the padding
# probe and the cross-attention map.
RELATIVE_TOLERANCE = 1e-5

# Two arrangements of the same sequence (alone / padded in a batch / packed / decoded with a cache)
# agree when their logits differ by at most this fraction of the largest |logit|. Different batch
# shapes and masks reorder float32 sums (measured on tiny GPT-2, Llama and Qwen2 under eager and
# sdpa: below 1e-6 relative); the bugs it catches (positions shifted by the pad count, a document
# reading its neighbour, a cache without its causal mask) move logits by 1e-3 relative or more.
EQUIVALENCE_TOLERANCE = RELATIVE_TOLERANCE
