"""SIGTERM and SIGHUP stop gradsync the way Ctrl-C does: cleanly, with exit 128 + signal.

A batch system ends a job with SIGTERM, a closed terminal sends SIGHUP. Both raise
:class:`Stopped` in the main thread, so ``finally`` blocks run: the launcher stops its
ranks, temp files of half-written checkpoints are removed, emulated hosts are deleted.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED = (signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """Raised by the handler of SIGTERM or SIGHUP; ``exit_code`` is 128 + the signal.

    Example:
        >>> Stopped(signal.SIGTERM).exit_code, Stopped(signal.SIGHUP).name
        (143, 'SIGHUP')
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum
        self.name = signal.Signals(signum).name


_deferring = 0
_pending: list[int] = []


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    if _deferring:
        _pending.append(signum)
        return
    raise Stopped(signum)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGTERM/SIGHUP until the block ends, then raise :class:`Stopped` for the first.

    A block that raises keeps its own exception; the held signal is dropped with it.

    For writes that must finish together (a checkpoint and its sidecar): a signal that
    arrives in between stops the job after both are written, never between them.

    Example:
        >>> with signals_deferred():
        ...     pass  # write the checkpoint, then its sidecar
    """
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        # At the outermost exit the held signals are taken, even when the block raised:
        # its own exception then goes on (the job stops either way), and none stays pending.
        held = _pending[:] if not _deferring else []
        if held:
            _pending.clear()
    if held:
        raise Stopped(held[0])


def stop_on_signals() -> None:
    """Make SIGTERM and SIGHUP raise :class:`Stopped` (main thread only; else a no-op).

    Example:
        >>> # stop_on_signals()  # first thing in main(); then `except Stopped as stop:`
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in HANDLED:
        signal.signal(signum, _raise_stopped)


__all__ = ["HANDLED", "Stopped", "signals_deferred", "stop_on_signals"]
