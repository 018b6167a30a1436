"""Which folders hold the user's files while their code runs (the ones the sandbox protects).

Protected: the current folder, the home folder, the folder of the script or target file, and every
path the script's arguments name that exists (the folder itself, or a file's folder; a path that does
not exist yet protects its nearest existing folder). System folders are never protected: the user's
code does not own them, and an overlay there would hide what the interpreter itself needs.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable

# Never protected (nor anything they hold unless named more precisely): not the user's files.
SYSTEM = ("/", "/proc", "/sys", "/dev", "/run", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
          "/boot", "/var", "/opt", "/snap", "/mnt", "/media", "/srv")


def protected_roots(request: dict) -> list[str]:
    """The outermost folders to protect for this worker request (run, check or memory)."""
    found = [os.getcwd(), os.path.expanduser("~")]
    if request.get("script"):
        found.append(os.path.dirname(os.path.abspath(request["script"])))
    for key in ("target", "train"):
        spec = request.get(key) or ""
        file_part = spec.rsplit(":", 1)[0] if ":" in spec else spec
        if file_part.endswith(".py"):
            found.append(os.path.dirname(os.path.abspath(file_part)))
    for arg in request.get("args") or ():
        found.extend(_named_folder(str(arg)))
    return outermost(os.path.realpath(path) for path in found)


def exempt_folders(roots: list[str], own: Iterable[str] = ()) -> list[str]:
    """The interpreter's own folders (its prefix, a virtual environment in the project) and tfdoctor's
    own (`own`) that lie inside a protected folder: not the user's files, and read by every import, so
    they stay uncovered."""
    import site
    import sysconfig

    found = [sys.prefix, sys.base_prefix, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
             *site.getsitepackages(), *own]
    real = {os.path.realpath(path) for path in found if os.path.isdir(path)}
    return sorted(path for path in outermost_any(real) if any(inside(path, root) and path != root for root in roots))


def outermost_any(paths: Iterable[str]) -> list[str]:
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if not any(inside(path, root) for root in kept):
            kept.append(path)
    return kept


def _named_folder(arg: str) -> list[str]:
    """The folder an argument names (`--out-dir=runs/a`, `ckpt.pt`, `/data/x`), if it names a path."""
    value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
    if not value or value.startswith("-") or (os.sep not in value and not os.path.exists(value)):
        return []
    path = os.path.abspath(value)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return [path if os.path.isdir(path) else os.path.dirname(path)]


def outermost(paths: Iterable[str]) -> list[str]:
    """The paths none of the others holds, system folders left out, sorted."""
    return sorted(outermost_any(path for path in paths if not _is_system(path)))


def _is_system(path: str) -> bool:
    if path in SYSTEM or path == sys.prefix or path == sys.base_prefix:
        return True
    return any(inside(path, top) for top in ("/proc", "/sys", "/dev"))


def inside(path: str, folder: str) -> bool:
    """`path` is `folder` or lies under it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
