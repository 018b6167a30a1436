"""The versions a report was made with: tfdoctor's, Python's, and those of the libraries whose
behaviour the checks measure (torch, transformers). Read from the installed distributions, so that
asking does not import torch (a reporter never does)."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from functools import lru_cache

__version__ = "0.1.0"  # tfdoctor's own (tfdoctor/__init__.py re-exports it); keep pyproject.toml's in step
LIBRARIES = ("torch", "transformers")


@lru_cache(maxsize=None)
def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def tool_versions() -> dict[str, str | None]:
    """{"tfdoctor", "python", "torch", "transformers"}: None for a library that is not installed. A
    library already imported answers itself (a source build's version can differ from its metadata)."""
    found: dict[str, str | None] = {"tfdoctor": __version__, "python": platform.python_version()}
    for name in LIBRARIES:
        module = sys.modules.get(name)
        found[name] = str(getattr(module, "__version__", "")) or _installed(name)
    return found


def describe(versions: dict) -> str:
    """One line for people: "tfdoctor 0.1.0, python 3.11.9, torch 2.4.0, transformers not installed"."""
    return ", ".join(f"{name} {version or 'not installed'}" for name, version in versions.items())
