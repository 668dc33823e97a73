"""``ps``'s policy on the server toolkit: dense push/pull, synchronous or stale-synchronous.

A server's flat state is cut into :class:`Chunk` s (runs of consecutive slots, in the order
their gradients become ready). Per step, a worker *pushes* each chunk as one message
(framing of :mod:`gradsync.comm.wire`; ``index`` is the chunk): its gradients followed by
one had-a-gradient flag per slot, as soon as they are complete (so pushes overlap
backward); the server answers each chunk with a REPLY carrying its fresh values and the
learning rate it applied. One chunk per server is the push-after-backward variant.
Two update rules (:class:`DenseServer`):

- synchronous: wait for every worker's push of chunk c of step t, add them in worker
  order, divide by the number of workers (the global-batch gradient, as ``single``
  computes it), apply once, answer everyone with the same values;
- stale-synchronous (Ho et al. 2013): apply each push on arrival (scaled by 1/workers, so
  one round of pushes moves as far as one synchronous step), answer at once unless that
  lets the pusher run more than ``staleness`` steps ahead of the slowest worker;
  ``staleness=None`` is plain asynchronous training (TF 1.x between-graph replication),
  which never holds an answer back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradsync.comm.server import Gather, ServerMetrics, ServerPolicy, ShardState, sum_in_order
from gradsync.comm.wire import (
    HEADER,
    TAG_PUSH,
    TAG_REPLY,
    Header,
    Kind,
    Message,
    Outbox,
    Recv,
    ServerLinks,
    TransportError,
    nbytes,
)
from gradsync.trace import NullTimeline, Phase, Timeline


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive slots of a server's flat state pushed (and answered) as one
    message: values ``start:stop`` and slots ``first_slot:stop_slot``.

    A push carries the run's gradients, then one had-a-gradient flag per slot; the reply
    carries the run's fresh values.
    """

    start: int
    stop: int
    first_slot: int
    stop_slot: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def push_size(self) -> int:
        return self.numel + self.stop_slot - self.first_slot


def plan_chunks(sizes: Sequence[int], chunk_values: int | None) -> list[Chunk]:
    """Consecutive slots of ``sizes`` grouped into chunks of at most ``chunk_values`` values
    (a larger slot is a chunk of its own); None: one chunk of every slot, 0: one per slot.

    Example:
        >>> [(c.start, c.stop) for c in plan_chunks([3, 3, 5, 2], 6)]
        [(0, 6), (6, 11), (11, 13)]
        >>> len(plan_chunks([3, 3, 5, 1], None)), len(plan_chunks([3, 3, 5, 1], 0))
        (1, 4)
    """
    cap = sum(sizes) if chunk_values is None else chunk_values
    chunks: list[Chunk] = []
    start = first = 0
    offset = 0
    for slot, size in enumerate(sizes):
        if slot > first and offset + size - start > cap:
            chunks.append(Chunk(start, offset, first, slot))
            start, first = offset, slot
        offset += size
    if sizes:
        chunks.append(Chunk(start, offset, first, len(sizes)))
    return chunks


def chunk_reader(chunks: Sequence[Chunk]) -> Callable[[Header, Recv], list[Tensor]]:
    """A server's :data:`~gradsync.comm.wire.ReadBody`: a push of chunk ``header.index``."""

    def read(header: Header, recv: Recv) -> list[Tensor]:
        if header.kind != Kind.PUSH:
            return []
        return [recv(torch.empty(chunks[header.index].push_size))]

    return read


class DenseServer(ServerPolicy):
    """One ps server: its :class:`ShardState`, the update rule, its answers.

    A worker pushes each of the server's ``chunks`` (default: one of the whole state) as
    one message, in chunk order, and gets each back answered. ``staleness`` is ignored when
    ``synchronous``; None with asynchronous updates never holds an answer back.
    """

    def __init__(
        self,
        state: ShardState,
        outbox: Outbox,
        metrics: ServerMetrics,
        *,
        num_workers: int,
        synchronous: bool,
        staleness: int | None = None,
        chunks: Sequence[Chunk] | None = None,
        timeline: Timeline | None = None,
        track: str = "server",
    ) -> None:
        self.state, self.outbox, self.metrics = state, outbox, metrics
        self.chunks = list(chunks) if chunks else plan_chunks(state.sizes, None)
        self.num_workers = num_workers
        self.synchronous = synchronous
        self.staleness = staleness
        self.timeline = timeline or NullTimeline()
        self.track = track
        self.rounds = Gather(range(num_workers))
        self.clocks = [0] * num_workers  # steps each worker has completed here (SSP)
        self.waiting: list[tuple[int, int, int]] = []  # (worker, step, chunk) held back

    def on_push(self, message: Message) -> None:
        if self.synchronous:
            self._on_sync_push(message)
        else:
            self._on_async_push(message)
        self._report_complete()

    def _on_sync_push(self, message: Message) -> None:
        step, index, payload = message.step, message.header.index, message.tensors[0]
        pushes = self.rounds.add((step, index), message.worker, payload)
        if pushes is None:
            return
        span = dict(step=step, tensor=self.track, chunk=index, bytes=nbytes(payload))
        with self.metrics.busy(step):
            with self.timeline.span(self.track, Phase.SERVER_AGGREGATE, **span):
                total = sum_in_order(pushes, scale=1.0 / self.num_workers)
            with self.timeline.span(self.track, Phase.SERVER_APPLY, **span):
                self._apply(index, total, step)
            values = self._values(index)  # one copy, sent to every worker
            for worker in range(self.num_workers):
                self._answer(worker, step, index, values)

    def _on_async_push(self, message: Message) -> None:
        step, index, worker = message.step, message.header.index, message.worker
        with self.metrics.busy(step):
            span = dict(step=step, tensor=self.track, chunk=index, worker=worker)
            with self.timeline.span(self.track, Phase.SERVER_APPLY, **span):
                self._apply(index, message.tensors[0] / self.num_workers, step)
            if index == len(self.chunks) - 1:  # the worker's last push of the step
                self.clocks[worker] = step + 1
            self.waiting.append((worker, step, index))
            slowest, held = min(self.clocks), []
            for waiting in self.waiting:
                # SSP: the pusher's next step (step + 1) may lead the slowest by ≤ staleness.
                if self.staleness is not None and waiting[1] + 1 - slowest > self.staleness:
                    held.append(waiting)
                else:
                    self._answer(*waiting)
            self.waiting = held

    def _apply(self, index: int, payload: Tensor, step: int) -> None:
        """Payload = the chunk's gradients, then one had-a-gradient flag per slot."""
        chunk = self.chunks[index]
        present = payload[chunk.numel :].gt(0).tolist()
        self.state.apply_run(chunk.first_slot, payload[: chunk.numel], step, present)

    def _values(self, index: int) -> Tensor:
        chunk = self.chunks[index]
        return self.state.values[chunk.start : chunk.stop].detach().clone()

    def _answer(self, worker: int, step: int, index: int, values: Tensor | None = None) -> None:
        """Send ``worker`` chunk ``index``'s values after ``step`` (a copy unless given)."""
        values = self._values(index) if values is None else values
        header = Header(Kind.REPLY, step=step, index=index, length=values.numel(), lr=self.state.lr)
        tally = self.metrics.tally(step)
        tally.bytes_sent += self.outbox.send(worker, header, [values])
        tally.replies += 1

    def _report_complete(self) -> None:
        """A step is recorded once every worker pushed every chunk and got its answers."""
        expected = self.num_workers * len(self.chunks)
        for step in sorted(self.metrics.tallies):
            tally = self.metrics.tallies[step]
            if tally.pushes < expected or tally.replies < expected:
                return
            self.metrics.finish(step)

    def state_tensors(self) -> dict[str, Tensor]:
        return self.state.state_tensors()

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        self.state.load_state_tensors(tensors)

    def resume_at(self, steps_done: int) -> None:
        self.clocks = [steps_done] * self.num_workers  # SSP: every worker is there


class Client(ServerLinks):
    """A worker's end: push each server's chunks of gradients, receive their values back.

    ``chunks[s]`` is server s's chunk plan. A step is :meth:`begin` (every reply's receive
    is posted, so no answer waits unmatched), one :meth:`push` per chunk in chunk order per
    server (the caller fills ``push_buffers[s][c]`` first; pushes may start during
    backward), then :meth:`finish`, which returns once ``pull_buffers`` hold every value.
    The rest as :class:`~gradsync.comm.wire.ServerLinks`.

    Example:
        >>> # client.begin(step)
        >>> # for s, c in ready_chunks: fill(client.push_buffers[s][c]); client.push(s, c)
        >>> # sent, received = client.finish()
    """

    def __init__(
        self,
        *,
        chunks: Sequence[Sequence[Chunk]],
        timeline: Timeline | None = None,
        **links: Any,
    ) -> None:
        super().__init__(**links)
        self.timeline = timeline or NullTimeline()
        self.chunks = [list(server_chunks) for server_chunks in chunks]
        self.push_buffers = [[torch.zeros(c.push_size) for c in cs] for cs in self.chunks]
        self.pull_buffers = [torch.zeros(cs[-1].stop if cs else 0) for cs in self.chunks]
        self.lr = 0.0
        self._step = -1
        self._pulls: list[tuple[int, int, Tensor, list[Any]]] = []
        self._pushes: list[tuple[int, int, list[Any]]] = []
        self._sent = self._received = 0

    def begin(self, step: int) -> None:
        """Post the receives of every remote server's answers for ``step``."""
        self._step, self._pushes, self._pulls = step, [], []
        self._sent = self._received = 0
        for server, rank in enumerate(self.servers):
            if rank is None:
                continue
            for index, chunk in enumerate(self.chunks[server]):
                header = torch.empty(HEADER, dtype=torch.float64)
                values = self.pull_buffers[server][chunk.start : chunk.stop]
                works = [
                    dist.irecv(t, src=rank, group=self.lanes.from_rank(rank), tag=TAG_REPLY)
                    for t in (header, values)
                ]
                self._pulls.append((server, index, header, works))
                self._received += nbytes(header) + nbytes(values)

    def push(self, server: int, index: int) -> None:
        """Start sending ``push_buffers[server][index]`` (left alone until :meth:`finish`)."""
        header = Header(Kind.PUSH, worker=self.worker, step=self._step, index=index)
        payload = self.push_buffers[server][index]
        rank = self.servers[server]
        if rank is None:
            self.send(server, header, [payload.clone()])
            return
        encoded = header.encode()
        name = _chunk_name(server, index)
        size = nbytes(encoded) + nbytes(payload)
        self.timeline.begin(f"push to {name}", Phase.PUSH, tensor=name, bytes=size)
        self.timeline.begin(f"pull from {name}", Phase.PULL, tensor=name)
        works = [
            dist.isend(t, dst=rank, group=self.lanes.to(rank), tag=TAG_PUSH)
            for t in (encoded, payload)
        ]
        self._pushes.append((server, index, works))
        self._sent += size

    def finish(self) -> tuple[int, int]:
        """Wait until every push has left and every answer is in ``pull_buffers``.

        Returns the (sent, received) wire bytes of the step.
        """
        for server, rank in enumerate(self.servers):
            if rank is None:
                self._take_local_replies(server)
        for server, index, works in self._pushes:
            for work in works:
                work.wait()
            self.timeline.end(f"push to {_chunk_name(server, index)}", Phase.PUSH)
        for server, index, header, works in self._pulls:
            for work in works:
                work.wait()
            self.timeline.end(f"pull from {_chunk_name(server, index)}", Phase.PULL)
            self.lr = Header.decode(header).lr
        return self._sent, self._received

    def _take_local_replies(self, server: int) -> None:
        """The answers of this process's server, one per chunk, in chunk order."""
        for index, chunk in enumerate(self.chunks[server]):
            reply = self.local_reply()
            if reply.header.index != index:
                raise TransportError(
                    f"the colocated server answered chunk {reply.header.index}, not {index}"
                )
            self.pull_buffers[server][chunk.start : chunk.stop].copy_(reply.tensors[0])
            self.lr = reply.header.lr

    def push_pull(self, step: int) -> tuple[int, int]:
        """One step with every chunk pushed at once (buffers filled by the caller)."""
        self.begin(step)
        for server, server_chunks in enumerate(self.chunks):
            for index in range(len(server_chunks)):
                self.push(server, index)
        return self.finish()


def _chunk_name(server: int, index: int) -> str:
    """A chunk's name on its timeline tracks (push and pull)."""
    return f"server {server} chunk {index}"


__all__ = ["Chunk", "Client", "DenseServer", "chunk_reader", "plan_chunks"]
