"""Depth checks: how the signal travels through the stack of blocks at initialisation."""
