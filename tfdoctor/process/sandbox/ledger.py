"""The scratch folder a sandboxed worker writes into, read back from outside: what the user's code
tried to write and delete, and (TFDOCTOR_KEEP_WRITES) a copy of it kept for inspection.

Layout (both mechanisms): `state.json` says which mechanism ran and lists its layers, each a
protected folder (`root`) and the folder its writes went to (`upper`, the same relative paths).
An overlay layer marks a deletion with a whiteout (a 0/0 character device) and a replaced folder
with an opaque mark; the interposer appends the paths it deleted to `gone.log`.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from typing import Optional

STATE = "state.json"
GONE = "gone.log"
# Shown in the report; the JSON carries the counts too.
MAX_LISTED = 20
# Python's own bytecode caches are not the user's code writing: never listed.
NOISE = (os.sep + "__pycache__" + os.sep,)


def write_state(scratch: str, state: dict) -> None:
    with open(os.path.join(scratch, STATE), "w", encoding="utf-8") as out:
        json.dump(state, out)


def read_state(scratch: str) -> dict:
    try:
        with open(os.path.join(scratch, STATE), encoding="utf-8") as state:
            return json.load(state)
    except (OSError, ValueError):
        return {}


def changes(scratch: str) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(written, deleted, files): absolute paths the code wrote and deleted, and (path, its copy)."""
    state = read_state(scratch)
    written: list[str] = []
    deleted: list[str] = []
    files: list[tuple[str, str]] = []
    for layer in state.get("layers", []):
        root, upper = layer["root"], layer["upper"]
        for folder, dirs, names in os.walk(upper):
            rel = os.path.relpath(folder, upper)
            real = os.path.normpath(os.path.join(root, rel))
            if rel != "." and _opaque(folder) and os.path.lexists(real):
                deleted.append(real)
            for name in names:
                copy, path = os.path.join(folder, name), os.path.join(real, name)
                info = os.lstat(copy)
                if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
                    deleted.append(path)
                elif stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode):
                    written.append(path)
                    files.append((path, copy))
    try:
        with open(os.path.join(scratch, GONE), encoding="utf-8") as log:
            deleted.extend(line.rstrip("\n") for line in log if os.path.lexists(line.rstrip("\n")))
    except OSError:
        pass
    keep = lambda path: not any(noise in path for noise in NOISE)  # noqa: E731
    return sorted(filter(keep, set(written))), _outermost(filter(keep, set(deleted))), files


def _opaque(folder: str) -> bool:
    try:
        return "user.overlay.opaque" in os.listxattr(folder)
    except OSError:
        return False


def _outermost(paths) -> list[str]:
    kept: list[str] = []
    for path in sorted(paths):
        if not any(path.startswith(root + os.sep) for root in kept):
            kept.append(path)
    return kept


def summary(scratch: str, keep_in: Optional[str] = None) -> dict:
    """The report's `sandbox` record: mechanism, what was written and deleted, where a copy was kept."""
    state = read_state(scratch)
    if not state:
        return {}
    written, deleted, files = changes(scratch)
    record = {"mechanism": state.get("mechanism", ""), "protected": state.get("protected", []),
              "written": written[:MAX_LISTED], "written_count": len(written),
              "deleted": deleted[:MAX_LISTED], "deleted_count": len(deleted)}
    for key in ("fallback", "limits"):
        if state.get(key):
            record[key] = state[key]
    if keep_in and (written or deleted):
        record["kept_in"] = _keep(files, deleted, keep_in)
    return record


def _keep(files: list[tuple[str, str]], deleted: list[str], keep_in: str) -> str:
    """Copy the written files to a new folder in `keep_in`, at their own absolute paths under it."""
    os.makedirs(keep_in, exist_ok=True)
    rank = os.environ.get("RANK")
    folder = tempfile.mkdtemp(prefix=time.strftime("run-%Y%m%d-%H%M%S-") + (f"rank{rank}-" if rank else ""),
                              dir=keep_in)
    for path, copy in files:
        target = os.path.join(folder, path.lstrip(os.sep))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(copy, target, follow_symlinks=False)
    if deleted:
        with open(os.path.join(folder, "DELETED.txt"), "w", encoding="utf-8") as out:
            out.writelines(path + "\n" for path in deleted)
    return folder
