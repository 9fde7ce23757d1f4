"""A rank's CPU heap keeps the memory it frees, so that a timed step reuses pages instead of faulting in new ones.

glibc serves an allocation above its mmap threshold (128 KiB at first, raised as large blocks are freed, to at
most 32 MiB) with fresh pages from the kernel, and returns them when the block is freed; it also trims the top of
the heap. The next step's tensors then fault every page in again, and the kernel zeroes each one on the thread's
CPU time. The load-proof clock (`par.clock`) counts that work, since the thread does it, though it is the
allocator's and no mechanism's (what it cost lecture 08: docs/instructor.md, "page faults").

    keep_freed_memory()       mallopt(M_MMAP_THRESHOLD, 1 GiB), mallopt(M_TRIM_THRESHOLD, 1 GiB): blocks under
                              1 GiB come from the heap, and up to 1 GiB freed at its top stays mapped

A kernel may still reclaim pages the heap keeps (this course's VM runs DAMON with a pageout scheme, which takes
idle memory back now and then); what it saves is then fewer faults, not none. Elsewhere than glibc (macOS, musl)
it does nothing and says so (False).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # glibc's malloc.h
KEEP = 1 << 30                                   # bytes: blocks under this come from the heap and stay there


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Have glibc keep freed memory mapped (module docstring); True when it did, False without glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP))
