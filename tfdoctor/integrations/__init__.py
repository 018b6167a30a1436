"""Callbacks that watch a run inside the training loop people already use: the Hugging Face Trainer
(`tfdoctor.integrations.huggingface.TfdoctorCallback`) and Lightning
(`tfdoctor.integrations.lightning.TfdoctorCallback`). Each records the same series as `tfdoctor watch`,
judges it as the run goes on and writes the same report at its end (integrations/common.py).

Nothing is imported here: `import tfdoctor` must not pull in transformers, Lightning or torch; only the
integration module the user imports does.
"""
