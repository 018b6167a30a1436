"""The fallback sandbox, where the machine forbids user namespaces: Python's file APIs are patched so
that a write, truncation, rename or deletion under a protected folder lands in a mirror in the scratch
folder, and reads see the mirror first, then the user's files less what the code deleted.

Covered: open/io.open, os.open, os.remove/unlink/rmdir/mkdir (and so makedirs/removedirs),
os.rename/replace, os.truncate, os.chmod/chown/utime/setxattr/removexattr, os.link/symlink,
os.stat/lstat/access/listdir/scandir/listxattr/getxattr (and so os.path, pathlib, glob, os.walk,
tempfile, shutil's copies and moves), shutil.rmtree, torch.save/torch.load and safetensors'
save_file/load_file (patched when they are imported). Child Python processes (DataLoader spawn
workers, subprocesses) install it again
from TFDOCTOR_SANDBOX_VIEW through boot/sitecustomize.py. Not covered: non-Python subprocesses, C
and Rust code that opens paths itself, calls given a dir_fd.

No tfdoctor import: boot/sitecustomize.py loads this file by its path in the Python processes the user's
code starts, where tfdoctor may not be importable (another environment's python); the two leaf modules
it shares with tfdoctor (usercode/import_hooks.py, usercode/environment.py) are loaded by path too.
"""

from __future__ import annotations

import builtins
import errno
import importlib.util
import io
import json
import os
import shutil
import stat
import sys

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tfdoctor/


def _leaf(relative: str):
    """tfdoctor/RELATIVE, a module with no tfdoctor import, loaded by its path (once per process)."""
    name = "_tfdoctor_sandbox_" + relative[:-3].replace("/", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(_PACKAGE, relative))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


AfterImport = _leaf("usercode/import_hooks.py").AfterImport
Patches = _leaf("usercode/patches.py").Patches
VIEW_ENV = _leaf("usercode/environment.py").SANDBOX_VIEW.name
BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
_R = {name: getattr(os, name) for name in (
    "open", "remove", "unlink", "rmdir", "mkdir", "rename", "replace", "truncate", "chmod", "chown", "utime",
    "setxattr", "removexattr", "link", "symlink", "stat", "lstat", "access", "listdir", "scandir", "makedirs",
    "listxattr", "getxattr") if hasattr(os, name)}
_OPEN, _RMTREE, _COPY2, _COPYTREE = builtins.open, shutil.rmtree, shutil.copy2, shutil.copytree
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_active: "View | None" = None


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _missing(path) -> OSError:
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)


class View:
    """The script's view of the protected folders: the mirror over the user's files, less deletions."""

    def __init__(self, roots: list[str], scratch: str, exempt=()) -> None:
        self.roots, self.scratch, self.exempt = list(roots), scratch, list(exempt)
        self.mirror = os.path.join(scratch, "mirror")
        self.log = os.path.join(scratch, "gone.log")
        self._gone: set[str] = set()
        self._seen = -1

    def covers(self, path) -> str | None:
        """The absolute path when `path` is under a protected folder (not the scratch), else None."""
        if isinstance(path, int) or path is None:
            return None
        full = os.path.abspath(os.fsdecode(os.fspath(path)))
        if (_inside(full, self.scratch) or not any(_inside(full, root) for root in self.roots)
                or any(_inside(full, folder) for folder in self.exempt)):
            return None
        return full

    def copy_of(self, full: str) -> str:
        return self.mirror + full

    def gone(self, full: str) -> bool:
        try:
            size = _R["stat"](self.log).st_size
        except OSError:
            size = 0
        if size != self._seen:  # another process (a DataLoader worker, a subprocess) deleted something
            self._seen = size
            with _OPEN(self.log, encoding="utf-8") if size else io.StringIO() as log:
                self._gone = {line.rstrip("\n") for line in log}
        return any(_inside(full, dead) for dead in self._gone)

    def forget(self, full: str) -> None:
        """Record a deletion (every process shares the log)."""
        fd = _R["open"](self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (full + "\n").encode())
        finally:
            os.close(fd)
        copy = self.copy_of(full)
        if os.path.isdir(copy) and not os.path.islink(copy):
            _RMTREE(copy)
        elif _lexists(copy):
            _R["unlink"](copy)

    def read(self, full: str) -> str:
        """Where to read `full` from; FileNotFoundError when the code deleted it."""
        copy = self.copy_of(full)
        if _lexists(copy):
            return copy
        if self.gone(full):
            raise _missing(full)
        return full

    def exists(self, full: str) -> bool:
        try:
            return _lexists(self.read(full))
        except OSError:
            return False

    def isdir(self, full: str) -> bool:
        try:
            return _isdir(self.read(full))
        except OSError:
            return False

    def write(self, full: str, keep_content: bool) -> str:
        """The mirror path to write `full` at, its folders made; the user's file copied first when the
        write keeps content (append, r+, chmod)."""
        if not self.isdir(os.path.dirname(full)):
            raise _missing(full)
        copy = self.copy_of(full)
        _R["makedirs"](os.path.dirname(copy), exist_ok=True)
        if keep_content and not _lexists(copy) and not self.gone(full) and _lexists(full):
            if _isdir(full):
                _R["makedirs"](copy, exist_ok=True)
                shutil.copystat(full, copy)
            else:
                _COPY2(full, copy)
        return copy

    def names(self, full: str) -> list[str] | None:
        """The merged listing of a folder, or None when nothing of it was written or deleted."""
        copy = self.copy_of(full)
        here = os.path.isdir(copy)
        self.gone(full)
        touched = here or any(_inside(dead, full) for dead in self._gone)
        if not touched:
            return None
        names = set(_R["listdir"](copy)) if here else set()
        if not self.gone(full) and _isdir(full):
            names.update(n for n in _R["listdir"](full) if not self.gone(os.path.join(full, n)))
        elif not here:
            raise _missing(full)
        return sorted(names)


def _isdir(path: str) -> bool:
    """The real file system's answer (os.path.isdir asks the view, once patched)."""
    try:
        return stat.S_ISDIR(_R["stat"](path).st_mode)
    except OSError:
        return False


def _lexists(path: str) -> bool:
    try:
        _R["lstat"](path)
        return True
    except OSError:
        return False


# --- the patches --------------------------------------------------------------------------------------

def _open(file, mode="r", *args, **kwargs):
    full = _active.covers(file) if _active and not isinstance(file, int) else None
    if full is None:
        return _OPEN(file, mode, *args, **kwargs)
    if any(c in mode for c in "wax+"):
        if "x" in mode and _active.exists(full):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), full)
        if _active.isdir(full):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), full)
        return _OPEN(_active.write(full, keep_content="w" not in mode), mode, *args, **kwargs)
    return _OPEN(_active.read(full), mode, *args, **kwargs)


def _os_open(path, flags, mode=0o777, *, dir_fd=None):
    full = _active.covers(path) if _active and dir_fd is None else None
    if full is None:
        return _R["open"](path, flags, mode, dir_fd=dir_fd)
    if flags & WRITE_FLAGS:
        if flags & os.O_EXCL and flags & os.O_CREAT and _active.exists(full):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), full)
        return _R["open"](_active.write(full, keep_content=not flags & os.O_TRUNC), flags, mode)
    return _R["open"](_active.read(full), flags, mode)


def _reader(name: str):
    def read(path, *args, dir_fd=None, **kwargs):
        full = _active.covers(path) if _active and dir_fd is None else None
        target = path if full is None else _active.read(full)
        return _R[name](target, *args, **({"dir_fd": dir_fd} if dir_fd is not None else {}), **kwargs)
    return read


def _changer(name: str):
    """chmod, chown, utime, setxattr, removexattr, truncate: on the mirror's copy of the file."""
    def change(path, *args, **kwargs):
        full = _active.covers(path) if _active and not kwargs.get("dir_fd") else None
        if full is None:
            return _R[name](path, *args, **kwargs)
        _active.read(full)  # FileNotFoundError when it is gone
        if not _active.exists(full):
            raise _missing(full)
        return _R[name](_active.write(full, keep_content=True), *args, **kwargs)
    return change


def _unlink(path, *, dir_fd=None):
    full = _active.covers(path) if _active and dir_fd is None else None
    if full is None:
        return _R["unlink"](path, dir_fd=dir_fd)
    if not _active.exists(full):
        raise _missing(full)
    if _active.isdir(full) and not os.path.islink(_active.read(full)):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), full)
    _active.forget(full)


def _rmdir(path, *, dir_fd=None):
    full = _active.covers(path) if _active and dir_fd is None else None
    if full is None:
        return _R["rmdir"](path, dir_fd=dir_fd)
    if not _active.isdir(full):
        raise _missing(full) if not _active.exists(full) else NotADirectoryError(errno.ENOTDIR, "Not a directory", full)
    if _listdir(full):
        raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), full)
    _active.forget(full)


def _mkdir(path, mode=0o777, *, dir_fd=None):
    full = _active.covers(path) if _active and dir_fd is None else None
    if full is None:
        return _R["mkdir"](path, mode, dir_fd=dir_fd)
    if _active.exists(full):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), full)
    # A folder deleted and made again lists only what is written into it now (its path stays in the log).
    _R["mkdir"](_active.write(full, keep_content=False), mode)


def _mover(name: str):
    def move(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        fsrc = _active.covers(src) if _active and src_dir_fd is None else None
        fdst = _active.covers(dst) if _active and dst_dir_fd is None else None
        if fsrc is None and fdst is None:
            return _R[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        origin = src if fsrc is None else _active.read(fsrc)
        if not _lexists(origin):
            raise _missing(src)
        target = dst if fdst is None else _active.write(fdst, keep_content=False)
        if fdst is not None and os.path.isdir(target) and not os.path.islink(target):
            _RMTREE(target)  # replacing an (empty) folder of the mirror
        if fsrc is None or origin == _active.copy_of(fsrc):  # nothing of the user's moves: a real rename
            try:
                _R["replace"](origin, target)
            except OSError:  # another file system: copy, then drop the origin
                _copy_any(origin, target)
                (_RMTREE if os.path.isdir(origin) else _R["unlink"])(origin)
        else:
            _copy_any(origin, target)
        if fsrc is not None:
            _active.forget(fsrc)
    return move


def _copy_any(origin: str, target: str) -> None:
    if os.path.isdir(origin) and not os.path.islink(origin):
        _COPYTREE(origin, target, symlinks=True)
    else:
        _COPY2(origin, target, follow_symlinks=False)


def _link(src, dst, *args, **kwargs):
    fdst = _active.covers(dst) if _active else None
    if fdst is None:
        return _R["link"](src, dst, *args, **kwargs)
    fsrc = _active.covers(src)
    _COPY2(_active.read(fsrc) if fsrc else src, _active.write(fdst, keep_content=False))


def _symlink(src, dst, *args, **kwargs):
    fdst = _active.covers(dst) if _active else None
    if fdst is None:
        return _R["symlink"](src, dst, *args, **kwargs)
    return _R["symlink"](src, _active.write(fdst, keep_content=False), *args)


def _listdir(path="."):
    full = _active.covers(path) if _active else None
    names = _active.names(full) if full is not None else None
    if names is None:
        return _R["listdir"](path if full is None else _active.read(full))
    return [os.fsencode(n) for n in names] if isinstance(path, bytes) else names


class _Entry:
    """A DirEntry seen at the path the code asked for, whichever layer holds it."""

    def __init__(self, folder, name, where) -> None:
        self.name, self.path, self._where = name, os.path.join(folder, name), where

    def is_dir(self, *, follow_symlinks=True):
        return os.path.isdir(self._where) if follow_symlinks else os.path.isdir(self._where) and not self.is_symlink()

    def is_file(self, *, follow_symlinks=True):
        return os.path.isfile(self._where) if follow_symlinks else os.path.isfile(self._where) and not self.is_symlink()

    def is_symlink(self):
        return os.path.islink(self._where)

    def stat(self, *, follow_symlinks=True):
        return _R["stat"](self._where) if follow_symlinks else _R["lstat"](self._where)

    def inode(self):
        return _R["lstat"](self._where).st_ino

    def __fspath__(self):
        return self.path


class _Listing:
    """What os.scandir returns: an iterator and a context manager."""

    def __init__(self, entries: list) -> None:
        self._entries = iter(entries)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._entries)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def close(self):
        pass


def _scandir(path="."):
    full = _active.covers(path) if _active and not isinstance(path, int) else None
    names = _active.names(full) if full is not None else None
    if names is None:
        return _R["scandir"](path if full is None else _active.read(full))
    folder = path if isinstance(path, (str, bytes)) else os.fspath(path)
    entries = [_Entry(folder, os.fsencode(name) if isinstance(folder, bytes) else name,
                      _active.read(os.path.join(full, name))) for name in names]
    return _Listing(entries)


def _rmtree(path, ignore_errors=False, onerror=None, **kwargs):
    full = _active.covers(path) if _active else None
    if full is None:
        return _RMTREE(path, ignore_errors, onerror, **kwargs)
    if not _active.isdir(full):
        if ignore_errors:
            return None
        raise _missing(full) if not _active.exists(full) else NotADirectoryError(errno.ENOTDIR, "Not a directory", full)
    _active.forget(full)
    return None


PATCHES = {
    (builtins, "open"): _open, (io, "open"): _open, (os, "open"): _os_open, (os, "remove"): _unlink,
    (os, "unlink"): _unlink, (os, "rmdir"): _rmdir, (os, "mkdir"): _mkdir, (os, "rename"): _mover("rename"),
    (os, "replace"): _mover("replace"), (os, "link"): _link, (os, "symlink"): _symlink,
    (os, "listdir"): _listdir, (os, "scandir"): _scandir, (shutil, "rmtree"): _rmtree,
    **{(os, name): _changer(name) for name in ("truncate", "chmod", "chown", "utime", "setxattr", "removexattr")},
    **{(os, name): _reader(name) for name in ("stat", "lstat", "access", "listxattr", "getxattr")},
}


# --- libraries that open paths in C or Rust: patched when imported -------------------------------------

def _patch_torch(torch, patches) -> None:
    save, load = torch.save, torch.load

    def guarded_save(obj, f, *args, **kwargs):
        full = _active.covers(f) if _active and isinstance(f, (str, bytes, os.PathLike)) else None
        if full is None:
            return save(obj, f, *args, **kwargs)
        with _open(full, "wb") as out:  # torch's own writer opens a path in C++, past open()
            return save(obj, out, *args, **kwargs)

    def guarded_load(f, *args, **kwargs):
        full = _active.covers(f) if _active and isinstance(f, (str, bytes, os.PathLike)) else None
        return load(f if full is None else _active.read(full), *args, **kwargs)

    for module in (torch, torch.serialization):
        patches.setattr(module, "save", guarded_save)
        patches.setattr(module, "load", guarded_load)


def _patch_safetensors(module, patches) -> None:
    save_file, load_file = module.save_file, module.load_file

    def guarded_save_file(tensors, filename, metadata=None):
        full = _active.covers(filename) if _active else None
        if full is None:
            return save_file(tensors, filename, metadata=metadata)
        with _open(full, "wb") as out:
            out.write(module.save(tensors, metadata=metadata))

    def guarded_load_file(filename, *args, **kwargs):
        full = _active.covers(filename) if _active else None
        return load_file(filename if full is None else _active.read(full), *args, **kwargs)

    patches.setattr(module, "save_file", guarded_save_file)
    patches.setattr(module, "load_file", guarded_load_file)


AFTER_IMPORT = {"torch": _patch_torch, "safetensors.torch": _patch_safetensors}


def _after_import(patches) -> AfterImport:
    """Patches a library the moment it is imported (the user's code imports it after we start)."""
    return AfterImport({name: (lambda module, patch=patch: patch(module, patches))
                        for name, patch in AFTER_IMPORT.items()})


# --- install / uninstall --------------------------------------------------------------------------------

class Installed:
    """Every patch made, so that `uninstall` leaves the process as it was found."""

    def __init__(self, view: View) -> None:
        self.view, self.patches = view, Patches()

    def uninstall(self) -> None:
        global _active
        self.patches.undo()
        _active = None


def install(roots: list[str], scratch: str, exempt=(), children: bool = True) -> Installed:
    """Patch this process (and, with `children`, tell child Python processes to patch themselves); paths
    under `exempt` (the interpreter's own folders) are left alone."""
    global _active
    view = View(roots, scratch, exempt)
    os.makedirs(view.mirror, exist_ok=True)
    installed = Installed(view)
    patches = installed.patches
    for (module, name), patch in PATCHES.items():
        if hasattr(module, name):
            patches.setattr(module, name, patch)
    for name, patch in AFTER_IMPORT.items():
        if name in sys.modules:
            patch(sys.modules[name], patches)
    patches.prepend(sys.meta_path, _after_import(patches))
    _active = view
    if children:
        patches.setitem(os.environ, VIEW_ENV, json.dumps({"roots": view.roots, "scratch": scratch,
                                                          "exempt": view.exempt}))
        patches.setitem(os.environ, "PYTHONPATH",
                        os.pathsep.join([BOOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    # Python's own bytecode writer goes past every patch: it writes no caches into the user's folders.
    patches.setattr(sys, "dont_write_bytecode", True)
    patches.setitem(os.environ, "PYTHONDONTWRITEBYTECODE", "1")
    return installed


def install_from_env() -> Installed | None:
    """In a child Python process: the sandbox its parent ran, from TFDOCTOR_SANDBOX_VIEW."""
    spec = os.environ.get(VIEW_ENV)
    if not spec or _active is not None:
        return None
    view = json.loads(spec)
    return install(view["roots"], view["scratch"], view.get("exempt", ()), children=False)
