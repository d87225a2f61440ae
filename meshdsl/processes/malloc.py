"""Keep the C allocator from handing a training step's memory back to the kernel.

A training step allocates and frees the same large buffers (activations, gradients)
every step.  glibc's ``malloc`` serves blocks above a moving threshold with fresh
``mmap``s and trims the free top of its heap back to the kernel, so a later step can
page-fault the same memory in again, zeroed, a page at a time
(``resource.getrusage().ru_minflt``).  How often depends on what else the process
allocates between steps: in ``bench/dense_vs_torch.py``, where meshdsl's steps
alternate with torch's, meshdsl's faulted in thousands of pages each.

:func:`tune_malloc` raises both thresholds once per process (``mallopt``): blocks up
to 32 MiB come from the heap, and up to 1 GiB of free heap is kept for reuse.  The
peak is unchanged; what the process holds between steps stays held.  meshdsl calls it
in the processes it owns (every rank it starts, and the ``meshdsl`` command);
in your own process call it yourself.  ``MESHDSL_MALLOC=default`` leaves the
allocator as it is.  Off glibc (macOS, musl) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

from ..errors import DistributedError, env_choice

ENV = "MESHDSL_MALLOC"
MODES = ("tuned", "default")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's malloc.h
TRIM_BYTES = 1 << 30
MMAP_BYTES = 32 << 20   # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit hosts

_done: bool | None = None


def mode() -> str:
    """``$MESHDSL_MALLOC``, checked: ``tuned`` (the default) or ``default``."""
    return env_choice(ENV, MODES, "a malloc setting", "set it to default to leave malloc as it is", DistributedError)


def tune_malloc() -> bool:
    """Raise glibc's trim and mmap thresholds in this process; True if they were set.

    Idempotent.  False off glibc, or with ``MESHDSL_MALLOC=default`` in the environment.

    Raises:
      DistributedError: ``MESHDSL_MALLOC`` holds another value (see :func:`mode`).
    """
    global _done
    if _done is not None:
        return _done
    chosen = mode()
    _done = False
    if chosen == "default" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
    return _done
