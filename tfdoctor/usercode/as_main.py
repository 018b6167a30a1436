"""Running the user's script as `python train.py ARGS` or `python -m pkg.mod ARGS` would, for the
drivers that run one (recording/script.py for `run`, watching/driver.py for `watch`): which script it
is, and the process's argv and path set for it and restored after."""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from typing import Iterator, Optional

from tfdoctor.errors import missing_file_hint
from tfdoctor.usercode.patches import Patches


def script_name(path: Optional[str], module: Optional[str], error: type) -> str:
    """The script as the user named it; raises `error(message, hint)` (a LoadError) when the file or
    the module is not there."""
    if (path is None) == (module is None):
        raise ValueError("give a path or a module")
    if path is not None and not os.path.isfile(path):
        raise error(f"script not found: {path}",
                    missing_file_hint(path, "give the path of a Python file, or -m package.module"))
    if module is not None:
        import importlib.util

        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise error(f"module not found: {module}", "run from the folder that holds it, or give a path")
    return path if path is not None else f"-m {module}"


@contextlib.contextmanager
def as_main(path: Optional[str], module: Optional[str], args: tuple) -> Iterator[None]:
    """The script's own sys.argv, and its folder first on sys.path (as `python train.py` puts it), for
    the block; the process's own are back after it, however it ends."""
    saved_path = sys.path[:]
    with Patches() as patches:
        patches.setattr(sys, "argv", [path if path is not None else module, *args])
        if path is not None:
            sys.path[0:1] = [os.path.dirname(os.path.abspath(path))]
        try:
            yield
        finally:
            sys.path[:] = saved_path


def run_main(path: Optional[str], module: Optional[str]) -> None:
    if path is not None:
        runpy.run_path(path, run_name="__main__")
    else:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
