"""P3's communication: a priority send queue (preemption at slice granularity) and the
server policy that answers slices in priority order (:class:`P3Server`).

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

import torch
from torch import Tensor

from gradsync.comm.server import Gather, ServerMetrics, ServerPolicy, ShardState, sum_in_order
from gradsync.comm.wire import (
    Header,
    Kind,
    Message,
    Outbox,
    Recv,
    TransportError,
    decode_state,
    encode_state,
    nbytes,
)
from gradsync.trace import NullTimeline, Phase, Timeline

_STOP = object()
LOG_LIMIT = 100_000
LAST = 2**40  # priority of control messages: after every slice
SEND_WINDOW = 4  # slices in flight per sender: keeps the link busy; preemption waits ≤ this


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


def slice_reader(header: Header, recv: Recv) -> list[Tensor]:
    """A server's read of a push: ``length`` gradient values (none for NO_GRADIENT)."""
    return [recv(torch.empty(header.length))] if header.kind == Kind.PUSH else []


class P3Server(ServerPolicy):
    """One P3 server: a :class:`ShardState` per slice it owns; a slice is applied once every
    worker's contribution is in, and answered, in priority order, to every worker."""

    def __init__(
        self,
        states: dict[int, ShardState],
        outbox: Outbox,
        metrics: ServerMetrics,
        *,
        num_workers: int,
        fifo: bool,
        timeout_s: float,
        timeline: Timeline | None = None,
        track: str = "server",
    ) -> None:
        self.states, self.outbox, self.metrics = states, outbox, metrics
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.timeline = timeline or NullTimeline()
        self.track = track
        self.rounds = Gather(range(num_workers))
        self.applied: dict[int, int] = {}  # step → slices applied
        self.replies = PrioritySender(
            self._send_reply, name="p3-reply", fifo=fifo, window=SEND_WINDOW
        )

    def on_push(self, message: Message) -> None:
        if self.replies.error is not None:
            raise TransportError(f"sending replies failed: {self.replies.error}")
        header = message.header
        grad = message.tensors[0] if message.kind == Kind.PUSH else None
        contributions = self.rounds.add(header.index, message.worker, grad)
        if contributions is None:
            return
        step, state = header.step, self.states[header.index]
        span = dict(step=step, slice=header.index, priority=header.priority)
        span["bytes"] = nbytes(state.values)
        with self.metrics.busy(step):
            with self.timeline.span(self.track, Phase.SERVER_AGGREGATE, **span):
                total = sum_in_order(contributions, scale=1.0 / self.num_workers)
            with self.timeline.span(self.track, Phase.SERVER_APPLY, **span):
                # No gradient on any worker: skipped, as single's optimizer skips it.
                state.apply(
                    state.values if total is None else total, step, present=[total is not None]
                )
            values = state.values.detach().clone()
            reply = Header(
                Kind.REPLY,
                step=step,
                index=header.index,
                priority=header.priority,
                length=values.numel(),
                lr=state.lr,
            )
            for worker in range(self.num_workers):
                self._reply(worker, reply, values, header.priority)
        self.applied[step] = self.applied.get(step, 0) + 1
        if self.applied[step] == len(self.states):  # this server has finished the step
            del self.applied[step]
            self.metrics.finish(step)

    def _reply(self, worker: int, header: Header, values: Tensor, priority: int) -> None:
        """Queue an updated slice for ``worker`` (tests override it to slow a layer down)."""
        self.replies.put((worker, header, values), priority)

    def _send_reply(self, item: tuple[int, Header, Tensor | None], record: SendRecord):
        worker, header, payload = item
        sent, wait = self.outbox.post(worker, header, [] if payload is None else [payload])
        if header.kind == Kind.REPLY:
            self.metrics.tally(header.step).bytes_sent += sent
        return wait

    def on_state(self, message: Message) -> None:
        data = encode_state(self.state_tensors())
        header = Header(Kind.STATE_REPLY, length=data.numel())
        self.replies.put((message.worker, header, data), LAST)

    def on_load(self, message: Message) -> None:
        """Install the state; the acknowledgement goes with the replies (one sender)."""
        self.load_state_tensors(decode_state(message.tensors[0]))
        self.replies.put((message.worker, Header(Kind.LOADED, step=message.step), None), LAST)

    def on_done(self, worker: int) -> None:
        self.replies.put((worker, Header(Kind.FIN), None), LAST)

    def state_tensors(self) -> dict[str, Tensor]:
        return {
            f"{index}/{key}": value
            for index, state in self.states.items()
            for key, value in state.state_tensors().items()
        }

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        per_slice: dict[int, dict[str, Tensor]] = {}
        for key, value in tensors.items():
            index, _, rest = key.partition("/")
            per_slice.setdefault(int(index), {})[rest] = value
        for index, state in per_slice.items():
            self.states[index].load_state_tensors(state)

    def close(self) -> None:
        self.replies.close(timeout_s=self.timeout_s)


__all__ = ["LAST", "SEND_WINDOW", "P3Server", "PrioritySender", "SendRecord", "slice_reader"]
