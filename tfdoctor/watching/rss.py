"""The process's memory, read by the watch monitor: its resident memory every optimizer step (on Linux
from /proc/self/statm through a descriptor kept open, a few microseconds; elsewhere through psutil,
tens of microseconds), and the bytes malloc holds in use every few steps (glibc's mallinfo2)."""

from __future__ import annotations

import os
from typing import Callable, Optional


def rss_reader() -> Callable[[], int]:
    """A function returning the resident set size in bytes."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        page = os.sysconf("SC_PAGE_SIZE")
        os.pread(fd, 64, 0)
    except (OSError, ValueError, AttributeError):
        import psutil

        process = psutil.Process(os.getpid())
        return lambda: process.memory_info().rss

    def read() -> int:  # statm: size resident shared ... in pages
        return int(os.pread(fd, 64, 0).split()[1]) * page

    read.fd = fd  # type: ignore[attr-defined]
    return read


def close_reader(read: Callable[[], int]) -> None:
    fd = getattr(read, "fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def heap_reader() -> Optional[Callable[[], int]]:
    """A function returning the bytes malloc holds in use (glibc's mallinfo2: small blocks plus mmapped
    ones), or None where there is no glibc 2.33+. Unlike RSS it does not hide a leak in memory the
    allocator had freed and hands out again: `total_loss += loss` keeps each step's autograd nodes, a few
    KiB on a tiny model, which a process's RSS absorbs for a while and then shows in stairs. About 40 us
    a call (it walks the allocator's bins): the monitor reads it every few steps."""
    import ctypes
    import ctypes.util

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    mallinfo2.restype = MallInfo2

    def read() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return read
