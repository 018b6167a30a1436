"""Where in the user's code a recorded call was made: the innermost frame that is not tfdoctor's,
torch's, the standard library's or an installed package's (transformers, accelerate), as
"path:line". A Hugging Face Trainer's backward is thus located at the user's `trainer.train()`.

No torch here: the frames are walked with sys._getframe, and each file's verdict is cached, so a
call site costs a few microseconds;
the displayed path is cached per file and current directory too.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import Optional

_PACKAGE = str(Path(__file__).resolve().parent.parent)  # tfdoctor/ (this file is in tfdoctor/usercode/)
_LIBRARY_ROOTS = tuple({p for p in (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib",
                                                                          "platlib")) if p})
_verdicts: dict[str, bool] = {}


def is_library(filename: str) -> bool:
    """Whether `filename` is not the user's: tfdoctor's own, the standard library's, an installed
    package's (site-packages, dist-packages: torch, transformers, Lightning) or no file at all. The
    one test of "is this frame the user's", for the recorder's call sites and the supervisor's stack
    dumps alike."""
    verdict = _verdicts.get(filename)
    if verdict is None:
        path = os.path.abspath(filename)
        # "<string>", "<stdin>", "<frozen ...>" are no files; a real one may be named "<&]]>.py"
        synthetic = filename.startswith("<") and not os.path.isfile(filename)
        verdict = (synthetic or path.startswith(_PACKAGE + os.sep)
                   or path.startswith(_LIBRARY_ROOTS) or f"{os.sep}site-packages{os.sep}" in path
                   or f"{os.sep}dist-packages{os.sep}" in path)
        _verdicts[filename] = verdict
    return verdict


_displayed: dict[tuple[str, str], str] = {}


def display_path(filename: str) -> str:
    """Relative to the current directory when inside it (what the user typed), else absolute."""
    key = (filename, os.getcwd())  # relpath costs ~30 us and a step records a dozen call sites
    shown = _displayed.get(key)
    if shown is None:
        path = os.path.abspath(filename)
        relative = os.path.relpath(path)
        shown = _displayed[key] = path if relative.startswith("..") else relative
    return shown


def call_site(skip: int = 1) -> Optional[str]:
    """"path:line" of the innermost user frame above the caller, or None when there is none (a call
    made from tfdoctor's own code, or from a library with no user code above it)."""
    try:
        frame = sys._getframe(skip + 1)
    except ValueError:
        return None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library(filename):
            return f"{display_path(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def user_frames(skip: int = 1):
    """The user's frames on the stack above the caller, innermost first (what call_site looks at)."""
    try:
        frame = sys._getframe(skip + 1)
    except ValueError:
        return
    while frame is not None:
        if not is_library(frame.f_code.co_filename):
            yield frame
        frame = frame.f_back


def raised_at(error: BaseException) -> str:
    """"path:line in function" of the innermost user frame the exception passed through ("" if none):
    where a script raised, or called sys.exit."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if not is_library(f.filename)]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{display_path(frame.filename)}:{frame.lineno} in {frame.name}"


def raised_outside_tfdoctor(error: BaseException) -> str:
    """"path:line in function" of the innermost frame outside the tfdoctor package ("" if none): where
    the model's (or its library's) code made the call that raised, when the call passed through one of
    tfdoctor's hooks (a TorchFunctionMode re-runs the op from its own frame)."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not os.path.abspath(f.filename).startswith(_PACKAGE + os.sep)]
    if not frames:
        return ""
    return f"{display_path(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}"


def raised_in_tfdoctor(error: BaseException) -> Optional[str]:
    """"path:line in function" when the exception was raised by tfdoctor's own code (the innermost
    frame of its traceback is in the tfdoctor package: a hook or patch the recorder installed), else
    None (the user's code, or a library it called, raised)."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    if not frames or not os.path.abspath(frames[-1].filename).startswith(_PACKAGE + os.sep):
        return None
    frame = frames[-1]
    return f"{os.path.relpath(frame.filename, os.path.dirname(_PACKAGE))}:{frame.lineno} in {frame.name}"
