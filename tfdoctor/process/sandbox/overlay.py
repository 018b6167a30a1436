"""The OS-level sandbox: a private user and mount namespace in which every protected folder is covered
by an overlay whose writable layer lies in the scratch folder.

Everything the worker and its children do (Python or not, DataLoader workers, subprocesses) then
reads the user's files as they were and writes, truncates, renames and deletes only in the overlay.
Needs Linux >= 5.11 with unprivileged user namespaces (many CI hosts forbid them: Ubuntu 24.04's
AppArmor, Docker's default seccomp profile); `enter` raises OSError where they are not allowed and the
caller falls back to interposition. unshare(CLONE_NEWUSER) refuses a process with threads, so this
runs first thing in the worker, before torch is imported.
"""

from __future__ import annotations

import ctypes
import os

from tfdoctor.process.sandbox.roots import inside

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
# Mount-option separators that a scratch path must not hold (the lower layers are passed as fds).
UNSAFE = (",", ":", "\\")


def enter(roots: list[str], scratch: str, exempt: tuple = ()) -> list[dict]:
    """Cover each root (and each file system mounted under one) with an overlay, then put each `exempt`
    folder (inside a root) back as it is; returns the layers. OSError when this machine does not allow
    it; then nothing is left mounted."""
    if any(ch in scratch for ch in UNSAFE):
        raise OSError(f"the scratch path {scratch!r} holds a mount-option separator")
    if any(inside(scratch, root) for root in roots):
        raise OSError(f"the scratch folder {scratch} lies inside a protected folder")
    if len(os.listdir("/proc/self/task")) != 1:
        raise OSError("the worker already runs threads (a user namespace needs a single thread)")
    targets = _targets(roots, scratch)
    uid, gid = os.getuid(), os.getgid()  # read before: inside, unmapped, they read as the overflow id
    libc = ctypes.CDLL(None, use_errno=True)
    _call(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")  # the same uid inside: getuid() does not change
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    # Private: nothing mounted here reaches the rest of the machine.
    _call(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    # Opened in the new namespace (an overlay refuses layers of another) before anything is mounted:
    # a sub-mount's own files stay reachable once its parent is covered.
    fds = [os.open(target, os.O_PATH | os.O_DIRECTORY) for target in [*targets, *exempt]]
    try:
        layers = _mount_all(libc, targets, fds, scratch)
        for folder, fd in zip(exempt, fds[len(targets):]):
            _call(libc.mount(f"/proc/self/fd/{fd}".encode(), folder.encode(), None, MS_BIND | MS_REC, None),
                  f"bind {folder}")
        return layers
    finally:
        for fd in fds:
            os.close(fd)


def _mount_all(libc, targets: list[str], fds: list[int], scratch: str) -> list[dict]:
    cwd = os.getcwd()
    layers, mounted = [], []
    try:
        for i, (target, fd) in enumerate(zip(targets, fds)):
            upper, work = (os.path.join(scratch, "layers", str(i), part) for part in ("upper", "work"))
            os.makedirs(upper)
            os.makedirs(work)
            options = f"userxattr,lowerdir=/proc/self/fd/{fd},upperdir={upper},workdir={work}"
            _call(libc.mount(b"overlay", target.encode(), b"overlay", 0, options.encode()), f"overlay on {target}")
            mounted.append(target)
            layers.append({"root": target, "upper": upper})
    except OSError:
        for target in reversed(mounted):
            libc.umount2(target.encode(), MNT_DETACH)
        raise
    os.chdir(cwd)  # the old working directory is the folder under the overlay: step onto the overlay
    return layers


def _targets(roots: list[str], scratch: str) -> list[str]:
    """The roots, then every mount point under one (parents first): an overlay does not show what is
    mounted under its lower folder, so each sub-mount gets its own."""
    subs = []
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        for line in info:
            point = _unescape(line.split()[4])
            if any(inside(point, root) and point != root for root in roots) and not inside(point, scratch):
                subs.append(point)
    return list(roots) + sorted(set(subs), key=lambda p: (p.count(os.sep), p))


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as out:
        out.write(text)


def _call(rc: int, what: str) -> None:
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
