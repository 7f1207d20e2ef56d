"""Keep freed heap memory for reuse, so the engine's temporaries do not fault pages in again.

Every configuration allocates a few dozen (heads x tokens) temporaries of a few hundred
kB. With glibc's default settings, freeing them shrinks the heap (the top chunk is
trimmed back to the system), so the next allocation faults the same pages in again; in
a virtual machine a page fault costs microseconds, and this alone measured 15x on
`np.abs(a - b)` for an (8, 4128) array. A 64 MB top pad keeps that much freed memory
mapped for reuse. Linux / glibc only; a no-op anywhere else.
"""

from __future__ import annotations

import ctypes
import sys

M_TOP_PAD = -2          # glibc <malloc.h>
TOP_PAD_BYTES = 64 << 20


def keep_heap(top_pad: int = TOP_PAD_BYTES) -> bool:
    """Ask glibc malloc to keep `top_pad` bytes of freed heap; True if it agreed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_TOP_PAD, ctypes.c_int(top_pad)))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to tune
        return False
