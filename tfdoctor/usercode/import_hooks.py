"""Run a hook on a module the moment it is imported: tfdoctor installs its patches before the user's
code runs, and the user's code imports the libraries to patch (torch, safetensors, transformers)
afterwards. Used by the file sandbox (sandbox/interpose.py) and the run recorder
(recording/pretrained.py)."""

from __future__ import annotations

import importlib.abc
import importlib.util
from typing import Callable


class AfterImport(importlib.abc.MetaPathFinder):
    """A meta-path finder (put it first on sys.meta_path) that lets each module named in `hooks` load
    as usual, then calls `hooks[name](module)`; every other import passes by untouched."""

    def __init__(self, hooks: dict[str, Callable]) -> None:
        self.hooks, self.busy = hooks, set()

    def find_spec(self, name, path=None, target=None):
        if name not in self.hooks or name in self.busy:
            return None
        self.busy.add(name)  # the real finders, asked below, must not come back here
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        run, hook = spec.loader.exec_module, self.hooks[name]

        def exec_module(module):
            run(module)
            hook(module)

        spec.loader.exec_module = exec_module
        return spec
