"""A run's private temporary folder: the supervisor's stack dump, torchelastic's folders, and the
TMPDIR of every process the run starts, whose files a kill would otherwise leave behind
(multiprocessing's pymp-* folders, a script's own temporary files). Removed when the run ends.

Torch's compile cache is not a temporary file: it stays where torch keeps it by default (under the
temporary folder tfdoctor itself was given), so a torch.compile script is not recompiled every run.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import tempfile
from typing import Iterator

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


@contextlib.contextmanager
def private_folder() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="tfdoctor-")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def temp_environment(folder: str) -> dict:
    """The variables that make `folder` the temporary folder of a child process (and its own)."""
    return {"TMPDIR": folder, INDUCTOR_CACHE_ENV: os.environ.get(INDUCTOR_CACHE_ENV) or _inductor_default()}


def _inductor_default() -> str:
    """Where TorchInductor puts its cache when not told (its runtime/cache_dir_utils.py), without torch."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
