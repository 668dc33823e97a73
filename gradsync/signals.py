"""SIGTERM and SIGHUP stop gradsync the way Ctrl-C does: cleanly, with exit 128 + signal.

A batch system ends a job with SIGTERM, a closed terminal sends SIGHUP. Both raise
:class:`Stopped` in the main thread, so ``finally`` blocks run: the launcher stops its
ranks, temp files of half-written checkpoints are removed, emulated hosts are deleted.
"""

from __future__ import annotations

import signal
import threading
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


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


def stop_on_signals() -> None:
    """Make SIGTERM and SIGHUP raise :class:`Stopped` (main thread only; else a no-op).

    Example:
        >>> # stop_on_signals()  # first thing in main(); then `except Stopped as stop:`
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in HANDLED:
        signal.signal(signum, _raise_stopped)


__all__ = ["HANDLED", "Stopped", "stop_on_signals"]
