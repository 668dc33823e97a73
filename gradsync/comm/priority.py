"""P3's communication: a priority send queue (preemption at slice granularity) and the
server policy that answers slices in priority order (:class:`P3Server`).

Items are queued with a priority (lower goes first: P3 gives layer i priority i, input side
first) as they become ready; one thread sends them one at a time, always taking the most
urgent item waiting at that moment. An urgent item that arrives while a long run of
less urgent ones is queued therefore overtakes all of them, and waits for at most the one
slice already on the wire. ``fifo=True`` ignores the priorities (the ``--no-priority``
ablation): arrival order.

Items may share a message (``bundle``): with the most urgent item the thread also takes
the items right behind it in the queue, in order, up to ``bundle_limit`` per peer and the
room left in the window of items in flight, and sends them as one message per peer.
Priority order is kept, and so is the bound on what an urgent item waits behind (the
window, in items); per message, the cost of a send (a header, a wake-up of each thread on
the way) is paid once.

Every item sent is recorded in :attr:`PrioritySender.log` (bounded) with what was still
waiting, so the order can be checked afterwards.

Example:
    >>> sent = []
    >>> sender = PrioritySender(lambda items, records: sent.extend(items), name="demo")
    >>> sender.put("layer 1", priority=1); sender.close(timeout_s=5); sent
    ['layer 1']
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
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


def send_window(slices_per_message: int) -> int:
    """Slices a P3 sender keeps in flight: ``SEND_WINDOW``, or one full bundle if larger.

    Example:
        >>> send_window(1), send_window(4), send_window(16)
        (4, 4, 16)
    """
    return max(SEND_WINDOW, slices_per_message)


@dataclass(frozen=True)
class SendRecord:
    """One send: its priority and arrival number, and the most urgent item left waiting."""

    priority: int
    seq: int
    started: float
    num_waiting: int
    next_priority: int | None  # lowest priority among the items still queued, if any
    next_seq: int | None  # lowest arrival number among them


class _LeastOf:
    """The least value among changing ``(value, seq)`` entries (``seq`` unique): a heap
    whose removed entries are dropped once they reach the top, so each entry costs
    O(log n) in all.

    Example:
        >>> least = _LeastOf()
        >>> least.add(3, seq=0); least.add(1, seq=1); least.remove(1); least.value()
        3
        >>> least.remove(0); least.value() is None
        True
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []
        self._removed: set[int] = set()  # seqs removed but still in the heap

    def add(self, value: int, seq: int) -> None:
        """Add the entry ``seq``, of ``value``."""
        heapq.heappush(self._heap, (value, seq))

    def remove(self, seq: int) -> None:
        """Remove the entry ``seq`` (added and not removed yet)."""
        self._removed.add(seq)

    def value(self) -> int | None:
        """The least value left, None if no entry is left."""
        while self._heap and self._heap[0][1] in self._removed:
            self._removed.remove(heapq.heappop(self._heap)[1])
        return self._heap[0][0] if self._heap else None


class _Waiting:
    """What a :class:`SendRecord` notes of the items still queued, kept as they come and
    go: their number, lowest priority and lowest arrival number (amortized O(log n) an
    item, where listing them on every send costs O(n))."""

    def __init__(self) -> None:
        self.count = 0
        self._priorities = _LeastOf()
        self._seqs = _LeastOf()

    def add(self, priority: int, seq: int) -> None:
        """Item ``seq`` is queued."""
        self.count += 1
        self._priorities.add(priority, seq)
        self._seqs.add(seq, seq)

    def remove(self, seq: int) -> None:
        """Item ``seq`` has left the queue."""
        self.count -= 1
        self._priorities.remove(seq)
        self._seqs.remove(seq)

    def record(self, priority: int, seq: int) -> SendRecord:
        """The record of sending item ``seq`` (already removed), started now."""
        return SendRecord(
            priority=priority,
            seq=seq,
            started=time.perf_counter(),
            num_waiting=self.count,
            next_priority=self._priorities.value(),
            next_seq=self._seqs.value(),
        )


Send = Callable[[list[Any], list[SendRecord]], Callable[[], None] | None]
Bundle = Callable[[Any], Hashable | None]  # the peer of an item that may share a message


class PrioritySender:
    """Queue of ready items; a thread sends them with ``send(items, records)``, most urgent
    first.

    ``send`` runs on the sender thread with one peer's items (one item, or a bundle in
    queue order). It either blocks until they have left and returns None, or starts an
    asynchronous send and returns a function that waits for it. At most ``window`` items
    are in flight (the oldest send is waited for before more start), so an urgent item
    waits behind at most ``window`` items already on the wire, bundled or not: a bundle
    takes only the room the window has left, so items share messages when the link keeps
    up and go one by one when it is the bottleneck. ``bundle(item)`` names the peer of an
    item that may share a message, None for one that travels alone. An exception in
    ``send`` stops the thread; :attr:`error` holds it and :meth:`put` and :meth:`close`
    re-raise it.
    """

    def __init__(
        self,
        send: Send,
        *,
        name: str,
        fifo: bool = False,
        window: int = 1,
        bundle: Bundle | None = None,
        bundle_limit: int = 1,
        log_limit: int = LOG_LIMIT,
    ) -> None:
        self.fifo = fifo
        self.window = window
        self._bundle = bundle
        self.bundle_limit = bundle_limit
        self._in_flight: deque[tuple[Callable[[], None], int]] = deque()  # (wait, items)
        self._num_in_flight = 0
        self.error: BaseException | None = None
        self.log: deque[SendRecord] = deque(maxlen=log_limit)
        self._send = send
        self._heap: list[tuple[tuple[float, int], int, Any]] = []
        self._waiting = _Waiting()  # the items in the heap, but the stop marker
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
            self._waiting.add(priority, seq)
            self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._heap and not self._in_flight:
                        self._cond.wait()
                    room = self.window - self._num_in_flight
                    taken = self._take(room) if self._heap and room > 0 else []
                if not taken:  # nothing queued, or the window is full: finish the oldest
                    self._finish_oldest()
                    continue
                if taken[0][0] is _STOP:
                    while self._in_flight:
                        self._finish_oldest()
                    return
                for items, records in _per_peer(taken, self._bundle):
                    finish = self._send(items, records)
                    if finish is not None:
                        self._in_flight.append((finish, len(items)))
                        self._num_in_flight += len(items)
        except BaseException as error:  # the owner re-raises it on its next put/wait
            self.error = error

    def _finish_oldest(self) -> None:
        finish, count = self._in_flight.popleft()
        finish()
        self._num_in_flight -= count

    def _take(self, room: int) -> list[tuple[Any, SendRecord]]:
        """Under the lock: the most urgent item, then the items right behind it, at most
        ``room`` in all and ``bundle_limit`` for one peer."""
        taken = [self._pop()]
        peer = self._peer(taken[0][0])
        if peer is None:
            return taken
        counts = {peer: 1}
        while self._heap and len(taken) < room:
            peer = self._peer(self._heap[0][2])
            if peer is None or counts.get(peer, 0) >= self.bundle_limit:
                break
            counts[peer] = counts.get(peer, 0) + 1
            taken.append(self._pop())
        return taken

    def _peer(self, item: Any) -> Hashable | None:
        if self._bundle is None or self.bundle_limit < 2 or item is _STOP:
            return None
        return self._bundle(item)

    def _pop(self) -> tuple[Any, SendRecord]:
        """Under the lock: the most urgent item and its record (logged unless the item is
        the stop marker); O(log n) amortized."""
        (_, seq), priority, item = heapq.heappop(self._heap)
        if item is not _STOP:
            self._waiting.remove(seq)
        record = self._waiting.record(priority, seq)
        if item is not _STOP:
            self.log.append(record)
        return item, record

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


def _per_peer(
    taken: list[tuple[Any, SendRecord]], bundle: Bundle | None
) -> list[tuple[list[Any], list[SendRecord]]]:
    """Items taken together, one message per peer, each in queue order.

    Example:
        >>> r = SendRecord(0, 0, 0.0, 0, None, None)
        >>> taken = [("a1", r), ("b1", r), ("a2", r)]
        >>> [items for items, _ in _per_peer(taken, lambda item: item[0])]
        [['a1', 'a2'], ['b1']]
    """
    if len(taken) == 1 or bundle is None:
        return [([item], [record]) for item, record in taken]
    messages: dict[Hashable, tuple[list[Any], list[SendRecord]]] = {}
    for item, record in taken:
        items, records = messages.setdefault(bundle(item), ([], []))
        items.append(item)
        records.append(record)
    return list(messages.values())


def slice_reader(header: Header, recv: Recv) -> list[Tensor]:
    """A server's read of a push: ``length`` gradient values (none for NO_GRADIENT); a
    bundle's indices come first."""
    if header.kind != Kind.PUSH:
        return []
    return [*read_manifest(header, recv), recv(torch.empty(header.length))]


def read_manifest(header: Header, recv: Recv) -> list[Tensor]:
    """A bundle's manifest (int64: the pieces' indices, then their priorities), or
    nothing for a single piece."""
    if header.count == 1:
        return []
    return [recv(torch.empty(2 * header.count, dtype=torch.int64))]


def unbundle(header: Header, tensors: list[Tensor]) -> list[tuple[int, int]]:
    """``(index, priority)`` of each piece of a message: its bundle's manifest, or its
    header's fields.

    Example:
        >>> unbundle(Header(Kind.PUSH, index=3, priority=1), [torch.ones(2)])
        [(3, 1)]
        >>> unbundle(Header(Kind.PUSH, count=2), [torch.tensor([5, 1, 0, 2]), torch.ones(4)])
        [(5, 0), (1, 2)]
    """
    if header.count == 1:
        return [(header.index, header.priority)]
    manifest = tensors[0].tolist()
    return list(zip(manifest[: header.count], manifest[header.count :], strict=True))


def split_bundle(values: Tensor, lengths: Sequence[int]) -> list[Tensor]:
    """A bundle's pieces: views of ``values`` (its pieces' values end to end), one per
    length, in order (no copy); a ValueError if the lengths do not add up to its length.

    Example:
        >>> [t.tolist() for t in split_bundle(torch.arange(5.0), [2, 3])]
        [[0.0, 1.0], [2.0, 3.0, 4.0]]
        >>> split_bundle(torch.arange(5.0), [2, 2])
        Traceback (most recent call last):
        ...
        ValueError: a bundle of 5 values cannot hold pieces of 2 + 2 = 4 values
    """
    lengths = list(lengths)
    if sum(lengths) != values.numel():
        shown = " + ".join(map(str, lengths)) or "0"
        raise ValueError(
            f"a bundle of {values.numel()} values cannot hold pieces of "
            f"{shown} = {sum(lengths)} values"
        )
    return list(values.split(lengths))


def bundle_message(
    kind: Kind, headers: list[Header], values: list[Tensor], *, worker: int = -1
) -> tuple[Header, list[Tensor]]:
    """One message for several pieces: the first header's fields, ``count`` of them, the
    manifest (their indices, then their priorities), then their values end to end (one
    piece: as it is, no manifest).

    Example:
        >>> pieces = [Header(Kind.REPLY, step=2, index=i, priority=i) for i in (4, 0)]
        >>> header, tensors = bundle_message(Kind.REPLY, pieces, [torch.ones(2), torch.zeros(1)])
        >>> header.count, header.length, tensors[0].tolist(), tensors[1].tolist()
        (2, 3, [4, 0, 4, 0], [1.0, 1.0, 0.0])
    """
    first = headers[0]
    if len(headers) == 1:
        return first, values
    total = sum(v.numel() for v in values)
    header = Header(
        kind,
        worker=worker,
        step=first.step,
        index=first.index,
        priority=first.priority,
        length=total,
        lr=first.lr,
        count=len(headers),
    )
    numbers = [h.index for h in headers] + [h.priority for h in headers]
    manifest = torch.tensor(numbers, dtype=torch.int64)
    return header, [manifest, torch.cat(values)]


class P3Server(ServerPolicy):
    """One P3 server: a :class:`ShardState` per slice it owns; a slice is applied once every
    worker's contribution is in, and answered, in priority order, to every worker (up to
    ``slices_per_message`` answers queued back to back for one worker share a message).

    The answers share one window, a worker's (:func:`send_window`) times the workers
    answered, finished oldest first. A Gloo send stays in flight until its receiver has
    posted the receive, so with a single worker's window for all of them, a worker whose
    receiver thread was slow to wake soon filled it and held back every other worker's
    answers (transformer, 2 workers behind one 300 Mbit/s link: the median answer left
    233 ms after its slice was applied; 54 ms with the window sized for both)."""

    def __init__(
        self,
        states: dict[int, ShardState],
        outbox: Outbox,
        metrics: ServerMetrics,
        *,
        num_workers: int,
        fifo: bool,
        timeout_s: float,
        slices_per_message: int = 1,
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
        # A step's record is written once every slice is applied and every answer sent (the
        # sender thread sends them later): the step's bytes, and no tally made anew after.
        self._unsent: dict[int, int] = {}  # step → answers queued, not yet sent
        self._records = threading.Lock()  # guards applied and _unsent
        self.replies = PrioritySender(
            self._send_reply,
            name="p3-reply",
            fifo=fifo,
            window=send_window(slices_per_message) * num_workers,
            bundle=self._bundle_peer,
            bundle_limit=slices_per_message,
        )

    def on_push(self, message: Message) -> None:
        """A worker's slices (one, or a bundle): each is applied once every worker's is in."""
        if self.replies.error is not None:
            raise TransportError(f"sending replies failed: {self.replies.error}")
        header = message.header
        if message.kind != Kind.PUSH:  # NO_GRADIENT: always a single slice
            self._on_slice(message.worker, header.step, header.index, header.priority, None)
            return
        pieces = unbundle(header, message.tensors)
        lengths = [self.states[index].values.numel() for index, _ in pieces]
        grads = split_bundle(message.tensors[-1], lengths)
        for (index, priority), grad in zip(pieces, grads, strict=True):
            self._on_slice(message.worker, header.step, index, priority, grad)

    def _on_slice(
        self, worker: int, step: int, index: int, priority: int, grad: Tensor | None
    ) -> None:
        """One worker's gradient of slice ``index`` (None: it had none); the last one in
        applies the slice and queues the answers."""
        contributions = self.rounds.add(index, worker, grad)
        if contributions is None:
            return
        state = self.states[index]
        span = dict(step=step, slice=index, priority=priority)
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
                index=index,
                priority=priority,
                length=values.numel(),
                lr=state.lr,
            )
            with self._records:  # before they are queued: the sender may send at once
                self._unsent[step] = self._unsent.get(step, 0) + self.num_workers
            for worker in range(self.num_workers):
                self._reply(worker, reply, values, priority)
        with self._records:
            self.applied[step] = self.applied.get(step, 0) + 1
            self._record_if_done(step)

    def _replied(self, step: int, answers: int, sent: int) -> None:
        """``answers`` of ``step`` have left, ``sent`` bytes on the wire (sender thread)."""
        with self._records:
            self.metrics.tally(step).bytes_sent += sent
            self._unsent[step] -= answers
            self._record_if_done(step)

    def _record_if_done(self, step: int) -> None:
        """Write ``step``'s record once every slice is applied and answered (the lock
        held)."""
        if self.applied.get(step) == len(self.states) and not self._unsent.get(step):
            del self.applied[step]
            self._unsent.pop(step, None)
            self.metrics.finish(step)

    def _reply(self, worker: int, header: Header, values: Tensor, priority: int) -> None:
        """Queue an updated slice for ``worker`` (tests override it to slow a layer down)."""
        self.replies.put((worker, header, values), priority)

    def _bundle_peer(self, item: tuple[int, Header, Tensor | None]) -> Hashable | None:
        """Answers to one worker for one step may share a message; the rest go alone."""
        worker, header, _ = item
        return (worker, header.step, header.lr) if header.kind == Kind.REPLY else None

    def _send_reply(self, items: list[tuple[int, Header, Tensor | None]], records: object):
        """One worker's answers: one message to a remote worker, handed over one by one to
        the worker in this process."""
        worker, first, payload = items[0]
        if worker == self.outbox.local_peer:
            for _, header, values in items:
                self.outbox.post(worker, header, [] if values is None else [values])
            if first.kind == Kind.REPLY:
                self._replied(first.step, len(items), 0)
            return None
        if len(items) == 1:
            header, tensors = first, [] if payload is None else [payload]
        else:
            headers = [h for _, h, _ in items]
            header, tensors = bundle_message(Kind.REPLY, headers, [v for _, _, v in items])
        sent, wait = self.outbox.post(worker, header, tensors)
        if first.kind == Kind.REPLY:  # a bundle's answers share one step (_bundle_peer)
            self._replied(first.step, len(items), sent)
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


__all__ = [
    "LAST",
    "SEND_WINDOW",
    "P3Server",
    "PrioritySender",
    "SendRecord",
    "bundle_message",
    "read_manifest",
    "send_window",
    "slice_reader",
    "split_bundle",
    "unbundle",
]
