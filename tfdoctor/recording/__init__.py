"""Recording what training code really does, whoever drives it.

One recorder (recorder.py, with the patched calls of patched_calls.py) installs the hooks and patches and
yields a plain-data Trace (trace.py); what it reads off the gradients lives beside it (scores.py,
schedule.py, grads.py). It is shared by every driver: `check --train` calls the user's
`train(model, batches)` on random batches (loop.py, batches.py), `tfdoctor run` runs an unmodified
script as __main__ (script.py), a torchrun job adds each rank's digest (ranks.py, distributed.py),
and discovery.py reads what the script showed. wrappers.py knows the wrappers (DDP, FSDP, compile) in
front of the user's model; tfdoctor/usercode/call_sites.py names the user's line behind each recorded call.
"""
