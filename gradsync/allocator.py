"""glibc's allocator, set so that a step's memory stays in the process for the next step.

A training step allocates its gradients, activations and messages and frees them again,
every step the same sizes. glibc's ``malloc`` by default serves a large request with a
fresh ``mmap`` (above a threshold that starts at 128 KiB and rises with the blocks freed)
and hands free memory at the top of its heap back to the kernel once it exceeds a trim
threshold. Each block that went back costs the next step a page fault per 4 KiB page, and
the kernel zeroes every such page: system CPU in the training thread, on the cores the
ranks share. Measured (Intel Xeon, 2 cores, transformer, ``allreduce``, 4 ranks, 1
thread each): 220 ms of rank 0's 2.7 s of training-thread CPU were spent in the kernel,
and none with the thresholds below. ``ddp`` spent none either way: its reducer's buffers
stay allocated.

Every rank of every strategy, and a profile's processes, call :func:`keep_step_memory`
at start: a 64 MiB ``mmap`` threshold and a 256 MiB trim threshold (the allocator keeps up
to that much free memory for reuse). Where the environment already chooses the allocator
(``MALLOC_*`` variables, ``GLIBC_TUNABLES`` with ``glibc.malloc``, or an ``LD_PRELOAD``
of another malloc) or the C library is not glibc, nothing is changed. ``summary.json``
records which applied (``environment.allocator``).
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
_ALLOCATOR_PRELOADS = ("malloc", "jemalloc", "tcmalloc", "mimalloc")

_applied = "system default (keep_step_memory not called)"


def environment_choice(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The variables by which ``environ`` already chooses the allocator, or None.

    Example:
        >>> environment_choice({"MALLOC_TRIM_THRESHOLD_": "0", "PATH": "/bin"})
        'MALLOC_TRIM_THRESHOLD_'
        >>> environment_choice({"LD_PRELOAD": "libjemalloc.so.2"})
        'LD_PRELOAD=libjemalloc.so.2'
        >>> environment_choice({"GLIBC_TUNABLES": "glibc.rtld.nns=4"}) is None
        True
    """
    chosen = sorted(k for k in environ if k.startswith("MALLOC_"))
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    preload = environ.get("LD_PRELOAD", "")
    if any(name in preload for name in _ALLOCATOR_PRELOADS):
        chosen.append(f"LD_PRELOAD={preload}")
    return ", ".join(chosen) or None


def keep_step_memory() -> str:
    """Set glibc's thresholds (module docstring) unless the environment chose; say what holds.

    Example:
        >>> keep_step_memory().startswith(("glibc", "left to", "system default"))
        True
    """
    global _applied
    chosen = environment_choice()
    if chosen is not None:
        _applied = f"left to the environment ({chosen})"
        return _applied
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        mallopt = libc.mallopt
    except (AttributeError, OSError):
        _applied = "system default (not glibc)"
        return _applied
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(
        M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES
    ):
        _applied = (
            f"glibc {version}: mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, "
            f"trim threshold {TRIM_THRESHOLD_BYTES >> 20} MiB"
        )
    else:
        _applied = f"system default (glibc {version} refused the thresholds)"
    return _applied


def applied() -> str:
    """What :func:`keep_step_memory` did in this process (for ``summary.json``)."""
    return _applied


__all__ = ["applied", "environment_choice", "keep_step_memory"]
