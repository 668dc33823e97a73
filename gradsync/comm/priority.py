"""A priority send queue drained by one thread: P3's preemption at slice granularity.

Items are queued with a priority (lower goes first: P3 gives layer i priority i, input side
first) as they become ready; one thread sends them one at a time, always taking the most
urgent item waiting at that moment. An urgent item that arrives while a long run of
less urgent ones is queued therefore overtakes all of them, and waits for at most the one
slice already on the wire. ``fifo=True`` ignores the priorities (the ``--no-priority``
ablation): arrival order.

Every send is recorded in :attr:`PrioritySender.log` (bounded) with what was still
waiting, so the order can be checked afterwards.

Example:
    >>> sent = []
    >>> sender = PrioritySender(lambda item, record: sent.append(item), name="demo")
    >>> sender.put("layer 1", priority=1); sender.close(timeout_s=5); sent
    ['layer 1']
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_STOP = object()
LOG_LIMIT = 100_000


@dataclass(frozen=True)
class SendRecord:
    """One send: its priority and arrival number, and the most urgent item left waiting."""

    priority: int
    seq: int
    started: float
    num_waiting: int
    next_priority: int | None  # lowest priority among the items still queued, if any
    next_seq: int | None  # lowest arrival number among them


class PrioritySender:
    """Queue of ready items; a thread sends each with ``send(item, record)``, most urgent first.

    ``send`` runs on the sender thread. It either blocks until the item has left and returns
    None, or starts an asynchronous send and returns a function that waits for it; at most
    ``window`` such sends are in flight (the oldest is waited for before the next starts),
    so an urgent item waits behind at most ``window`` items already on the wire. An
    exception in ``send`` stops the thread; :attr:`error` holds it and :meth:`put` and
    :meth:`close` re-raise it.
    """

    def __init__(
        self,
        send: Callable[[Any, SendRecord], Callable[[], None] | None],
        *,
        name: str,
        fifo: bool = False,
        window: int = 1,
        log_limit: int = LOG_LIMIT,
    ) -> None:
        self.fifo = fifo
        self.window = window
        self._in_flight: deque[Callable[[], None]] = deque()
        self.error: BaseException | None = None
        self.log: deque[SendRecord] = deque(maxlen=log_limit)
        self._send = send
        self._heap: list[tuple[tuple[float, int], int, Any]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any, priority: int) -> None:
        """Queue ``item``; lower ``priority`` is sent first (ties and ``fifo``: arrival order)."""
        self._raise_if_failed()
        with self._cond:
            seq = next(self._seq)
            key = (0 if self.fifo else priority, seq)
            heapq.heappush(self._heap, (key, priority, item))
            self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._heap and not self._in_flight:
                        self._cond.wait()
                    entry = None
                    if self._heap and len(self._in_flight) < self.window:
                        entry = heapq.heappop(self._heap)
                        waiting = [(p, k[1]) for k, p, i in self._heap if i is not _STOP]
                if entry is None:  # nothing queued, or the window is full: finish the oldest
                    self._in_flight.popleft()()
                    continue
                (_, seq), priority, item = entry
                if item is _STOP:
                    while self._in_flight:
                        self._in_flight.popleft()()
                    return
                record = SendRecord(
                    priority=priority,
                    seq=seq,
                    started=time.perf_counter(),
                    num_waiting=len(waiting),
                    next_priority=min((p for p, _ in waiting), default=None),
                    next_seq=min((s for _, s in waiting), default=None),
                )
                self.log.append(record)
                finish = self._send(item, record)
                if finish is not None:
                    self._in_flight.append(finish)
        except BaseException as error:  # the owner re-raises it on its next put/wait
            self.error = error

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"the {self._thread.name} thread failed: {self.error}"
            ) from self.error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, *, timeout_s: float) -> None:
        """Send everything queued, then stop the thread (waits at most ``timeout_s``)."""
        with self._cond:
            heapq.heappush(self._heap, ((float("inf"), next(self._seq)), 0, _STOP))
            self._cond.notify()
        self._thread.join(timeout=timeout_s)
        self._raise_if_failed()
        if self._thread.is_alive():
            raise TimeoutError(f"the {self._thread.name} thread did not finish in {timeout_s:g} s")


__all__ = ["PrioritySender", "SendRecord"]
