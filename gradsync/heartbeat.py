"""Heartbeats: every rank tells gradsync's launcher what it is doing, so a hang is named.

The launcher gives each rank the write end of a pipe (``GRADSYNC_HEARTBEAT_FD``); a rank
calls :func:`beat` at each phase of each step, and server loops call it as they serve.
A beat is one short line, ``<step> <phase>``, written without blocking: training never
waits for the launcher, and a full pipe drops a beat rather than stall a step. Under
torchrun, srun or mpirun there is no pipe and :func:`beat` does nothing.

The launcher (:mod:`gradsync.launch`) reads the lines; a rank silent for longer than
``--hang-timeout`` is named with its last phase and step, and the job is torn down.

Server code calls ``beat("serve", step)`` from its receive loop (cheap: at most one write
per ``MIN_INTERVAL_S`` for the same step and phase).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ENV_FD = "GRADSYNC_HEARTBEAT_FD"
TICK_S = 5.0  # how often :func:`beating` beats while a server rank serves
MIN_INTERVAL_S = 0.5  # repeated beats of the same step and phase are thinned to this
# Phases in which a rank waits for its peers: a silent rank here is likelier a victim.
WAITING_PHASES = frozenset({"sync", "serve", "barrier", "finish", "rendezvous"})


@dataclass
class _Pipe:
    fd: int | None
    last: tuple[int, str] | None = None
    last_at: float = 0.0


_pipe: _Pipe | None = None


def _open() -> _Pipe:
    global _pipe
    if _pipe is None:
        text = os.environ.get(ENV_FD)
        fd = int(text) if text and text.isdigit() else None
        if fd is not None:
            try:
                os.set_blocking(fd, False)
            except OSError:
                fd = None
        _pipe = _Pipe(fd)
    return _pipe


def beat(phase: str, step: int = -1) -> None:
    """Tell the launcher this rank is alive, in ``phase`` of ``step`` (-1: outside steps).

    Example:
        >>> beat("forward", 3)  # a no-op outside gradsync's launcher
    """
    pipe = _open()
    if pipe.fd is None:
        return
    now = time.monotonic()
    if pipe.last == (step, phase) and now - pipe.last_at < MIN_INTERVAL_S:
        return
    pipe.last, pipe.last_at = (step, phase), now
    try:
        os.write(pipe.fd, f"{step} {phase}\n".encode())
    except BlockingIOError:
        pass  # the launcher is behind; the next beat will do
    except OSError:
        pipe.fd = None  # the launcher is gone; stop trying


@contextmanager
def beating(phase: str) -> Iterator[None]:
    """Beat ``phase`` every ``TICK_S`` seconds from a thread while the block runs.

    For a dedicated server rank, which waits on its inbox rather than running steps: a
    stopped or killed server goes silent, a serving one does not. (Server loops that call
    ``beat("serve", step)`` themselves also tell the launcher which step they serve.)

    Example:
        >>> with beating("serve"):
        ...     pass
    """
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            beat(phase)
            stop.wait(TICK_S)

    thread = threading.Thread(target=tick, daemon=True, name="gradsync-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=1)


@dataclass
class LastBeat:
    """What the launcher last heard from one rank (``at`` is ``time.monotonic()``)."""

    at: float
    step: int = -1
    phase: str = "startup"
    slowest_step_s: float = 0.0
    _step_started: float | None = None

    def update(self, line: str, at: float) -> None:
        """Record one heartbeat line ``<step> <phase>`` received at ``at``.

        Example:
            >>> last = LastBeat(at=0.0)
            >>> last.update("0 forward", 1.0); last.update("1 forward", 3.5)
            >>> last.step, last.phase, last.slowest_step_s
            (1, 'forward', 2.5)
        """
        text, _, phase = line.strip().partition(" ")
        try:
            step = int(text)
        except ValueError:
            return
        if phase == "forward":  # a step begins: the previous one's length is known
            if self._step_started is not None and step > self.step:
                self.slowest_step_s = max(self.slowest_step_s, at - self._step_started)
            self._step_started = at
        self.at, self.step, self.phase = at, step, phase or "?"

    def describe(self) -> str:
        """``backward of step 12``, or the phase alone outside steps."""
        return f"{self.phase} of step {self.step}" if self.step >= 0 else self.phase

    @property
    def waiting(self) -> bool:
        return self.phase in WAITING_PHASES


__all__ = ["ENV_FD", "WAITING_PHASES", "LastBeat", "beat", "beating"]
