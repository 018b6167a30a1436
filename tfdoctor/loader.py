"""Turn "package.module:attr" or "path/to/file.py:attr" into the object it names.

Every way this can go wrong becomes a LoadError with one line that names the problem.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from tfdoctor.errors import LoadError, missing_file_hint, missing_name_hint


def _split_target(target: str) -> tuple[str, str]:
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise LoadError(f"target {target!r} is not MODULE:ATTR",
                        "write it as package.module:build or path/to/file.py:build")
    return module_part, attr


def _import_file(path: Path):
    if not path.is_file():
        raise LoadError(f"file not found: {path}", missing_file_hint(str(path), "give path/to/file.py:factory"))
    name = f"_tfdoctor_target_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    # The file's own folder goes on sys.path so that it can import its neighbours, as `python file.py`.
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise LoadError(f"importing {path} raised {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str):
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise LoadError(f"module not found: {name}",
                            "run from the folder that holds it, or give a path/to/file.py") from exc
        raise LoadError(f"importing {name} raised ModuleNotFoundError: {exc}") from exc
    except Exception as exc:
        raise LoadError(f"importing {name} raised {type(exc).__name__}: {exc}") from exc


def load_attr(target: str) -> Any:
    """The object `attr` in the module the target names (not called)."""
    module_part, attr = _split_target(target)
    looks_like_file = module_part.endswith(".py") or os.sep in module_part or "/" in module_part
    module = _import_file(Path(module_part)) if looks_like_file else _import_module(module_part)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise LoadError(f"{module_part} has no attribute {attr!r}", missing_name_hint(part, dir(obj)))
        obj = getattr(obj, part)
    return obj


def load_subject(target: str):
    """A Subject or nn.Module from TARGET: a factory is called with no arguments."""
    import torch.nn as nn

    from tfdoctor.subject import Subject

    obj = load_attr(target)
    if not isinstance(obj, (nn.Module, Subject)):
        if not callable(obj):
            raise LoadError(f"{target} is a {type(obj).__name__}, not a model, Subject or factory")
        try:
            obj = obj()
        except Exception as exc:
            raise LoadError(f"factory {target} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, (nn.Module, Subject)):
        raise LoadError(f"factory {target} returned {type(obj).__name__}, not an nn.Module or tfdoctor.Subject")
    return obj


def load_function(target: str):
    fn = load_attr(target)
    if not callable(fn):
        raise LoadError(f"{target} is a {type(fn).__name__}, not a function")
    return fn
