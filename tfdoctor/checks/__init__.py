"""Check families, one module each. Registered in tfdoctor.registry.CHECK_MODULES.

These modules must not import torch at module level (see registry.py); the check functions import
their probes when they run.
"""
