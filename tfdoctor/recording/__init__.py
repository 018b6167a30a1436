"""Recording what training code really does, whoever drives it.

The recorder itself (hooks, patches, the Trace it yields) lives in tfdoctor/probes/trace.py and is
shared by every driver: `check --train` calls the user's `train(model, batches)` (record_loop),
`tfdoctor run` runs an unmodified script as __main__ (script.py) and reads what it showed (discovery.py). A judge in checks/trainloop.py never
knows which driver produced its Trace. `sites.py` names the user's line behind each recorded call.
"""
