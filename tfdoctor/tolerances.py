"""Thresholds shared by probes and checks (no torch here, so check modules can import it)."""

# A measured output counts as changed when it moves by more than this fraction of the largest
# |logit| of the unperturbed output. Float32 reordering noise is ~1e-7 relative; the quietest real
# leak we know of (probabilities zeroed after the softmax, so the future still moves the
# denominator) is ~1e-4. 1e-5 sits a decade from each. Used by the dependency map, the padding
# probe and the cross-attention map.
RELATIVE_TOLERANCE = 1e-5
