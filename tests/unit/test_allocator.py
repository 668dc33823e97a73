"""The allocator setting every rank applies: what it chooses, and that memory freed by one
step serves the next without page faults."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gradsync import allocator

# One step: a block above the largest mmap threshold glibc picks by itself (32 MiB) is
# allocated, written and freed; then the page faults of five more such steps are counted.
STEPS = textwrap.dedent(
    """
    import ctypes, resource, sys
    from gradsync import allocator
    if sys.argv[1] == "keep":
        print(allocator.keep_step_memory(), file=sys.stderr)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    SIZE = 40 << 20
    def step():
        block = libc.malloc(SIZE)
        ctypes.memset(block, 1, SIZE)
        libc.free(block)
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
    """
)


def _clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if allocator.environment_choice({k: v}) is None}


def _is_glibc() -> bool:
    return (
        os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc") if sys.platform == "linux" else False
    )


def _faults_per_step(mode: str) -> tuple[float, str]:
    done = subprocess.run(
        [sys.executable, "-c", STEPS, mode],
        capture_output=True,
        text=True,
        env=_clean_environment(),
        timeout=60,
        check=True,
    )
    return float(done.stdout), done.stderr


@pytest.mark.skipif(not _is_glibc(), reason="the setting is glibc's")
def test_a_block_freed_by_one_step_serves_the_next_without_page_faults() -> None:
    kept, applied = _faults_per_step("keep")
    default, _ = _faults_per_step("default")
    pages = (40 << 20) / os.sysconf("SC_PAGE_SIZE")
    assert applied.startswith("glibc") and "mmap threshold 64 MiB" in applied
    assert kept <= 0.01 * pages, f"{kept:.0f} page faults a step of {pages:.0f} pages"
    assert kept < default  # glibc's own thresholds map and unmap the block every step


def test_the_environment_keeps_its_own_allocator_choice(monkeypatch) -> None:
    monkeypatch.setattr(allocator, "_applied", allocator.applied())  # restored afterwards
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert allocator.keep_step_memory() == "left to the environment (MALLOC_ARENA_MAX)"
    assert allocator.applied() == "left to the environment (MALLOC_ARENA_MAX)"


@pytest.mark.parametrize(
    ("environ", "choice"),
    [
        ({}, None),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
        ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so"}, "LD_PRELOAD=/usr/lib/libtcmalloc.so"),
        ({"LD_PRELOAD": "libfaketime.so"}, None),
        (
            {"MALLOC_TOP_PAD_": "1", "MALLOC_MMAP_THRESHOLD_": "1"},
            "MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_",
        ),
    ],
)
def test_environment_choice(environ: dict[str, str], choice: str | None) -> None:
    assert allocator.environment_choice(environ) == choice
