"""Placeholder: filled by the judges of issue 21."""
