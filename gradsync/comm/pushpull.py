"""``ps``'s policy on the server toolkit: dense push/pull, synchronous or stale-synchronous.

One message per (worker, server) per step in each direction (framing of
:mod:`gradsync.comm.wire`): the worker *pushes* the gradients of every piece the server
owns as one flat payload followed by one had-a-gradient flag per piece; the server answers
with a REPLY carrying the fresh values and the learning rate it applied. Two update rules
(:class:`DenseServer`):

- synchronous: wait for every worker's push of step t, add them in worker order, divide by
  the number of workers (the global-batch gradient, as ``single`` computes it), apply once,
  answer everyone with the same values;
- stale-synchronous (Ho et al. 2013): apply each push on arrival (scaled by 1/workers, so
  one round of pushes moves as far as one synchronous step), answer at once unless that
  lets the pusher run more than ``staleness`` steps ahead of the slowest worker;
  ``staleness=None`` is plain asynchronous training (TF 1.x between-graph replication),
  which never holds an answer back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
)
from gradsync.trace import NullTimeline, Phase, Timeline


def dense_reader(size: int) -> Callable[[Header, Recv], list[Tensor]]:
    """A server's :data:`~gradsync.comm.wire.ReadBody`: a push carries ``size`` values."""

    def read(header: Header, recv: Recv) -> list[Tensor]:
        return [recv(torch.empty(size))] if header.kind == Kind.PUSH else []

    return read


class DenseServer(ServerPolicy):
    """One ps server: its :class:`ShardState`, the update rule, its answers.

    ``staleness`` is ignored when ``synchronous``; None with asynchronous updates never
    holds an answer back.
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
        timeline: Timeline | None = None,
        track: str = "server",
    ) -> None:
        self.state, self.outbox, self.metrics = state, outbox, metrics
        self.num_workers = num_workers
        self.synchronous = synchronous
        self.staleness = staleness
        self.timeline = timeline or NullTimeline()
        self.track = track
        self.rounds = Gather(range(num_workers))
        self.clocks = [0] * num_workers  # steps each worker has completed here (SSP)
        self.waiting: list[tuple[int, int]] = []  # (worker, step) whose answer is held

    def on_push(self, message: Message) -> None:
        if self.synchronous:
            self._on_sync_push(message)
        else:
            self._on_async_push(message)
        self._report_complete()

    def _on_sync_push(self, message: Message) -> None:
        step, payload = message.step, message.tensors[0]
        pushes = self.rounds.add(step, message.worker, payload)
        if pushes is None:
            return
        span = dict(step=step, tensor=self.track, bytes=payload.numel() * payload.element_size())
        with self.metrics.busy(step):
            with self.timeline.span(self.track, Phase.SERVER_AGGREGATE, **span):
                total = sum_in_order(pushes, scale=1.0 / self.num_workers)
            with self.timeline.span(self.track, Phase.SERVER_APPLY, **span):
                self._apply(total, step)
            values = self.state.values.clone()  # one copy, sent to every worker
            for worker in range(self.num_workers):
                self._answer(worker, step, values)

    def _on_async_push(self, message: Message) -> None:
        step = message.step
        with self.metrics.busy(step):
            with self.timeline.span(
                self.track, Phase.SERVER_APPLY, step=step, tensor=self.track, worker=message.worker
            ):
                self._apply(message.tensors[0] / self.num_workers, step)
            self.clocks[message.worker] = step + 1
            self.waiting.append((message.worker, step))
            slowest, held = min(self.clocks), []
            for worker, waiting_step in self.waiting:
                # SSP: the pusher's next step (step + 1) may lead the slowest by ≤ staleness.
                if self.staleness is not None and waiting_step + 1 - slowest > self.staleness:
                    held.append((worker, waiting_step))
                else:
                    self._answer(worker, waiting_step)
            self.waiting = held

    def _apply(self, payload: Tensor, step: int) -> None:
        """Payload = gradients then one had-a-gradient flag per slot."""
        size = self.state.values.numel()
        present = payload[size:].gt(0).tolist()
        self.state.apply(payload[:size], step, present=present)

    def _answer(self, worker: int, step: int, values: Tensor | None = None) -> None:
        """Send ``worker`` the values after ``step`` (a copy of them unless given)."""
        values = self.state.values.clone() if values is None else values
        header = Header(Kind.REPLY, step=step, lr=self.state.lr)
        tally = self.metrics.tally(step)
        tally.bytes_sent += self.outbox.send(worker, header, [values])
        tally.replies += 1

    def _report_complete(self) -> None:
        """A step is recorded once every worker pushed it and got its answer."""
        for step in sorted(self.metrics.tallies):
            tally = self.metrics.tallies[step]
            if tally.pushes < self.num_workers or tally.replies < self.num_workers:
                return
            self.metrics.finish(step)

    def state_tensors(self) -> dict[str, Tensor]:
        return self.state.state_tensors()

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> None:
        self.state.load_state_tensors(tensors)

    def resume_at(self, steps_done: int) -> None:
        self.clocks = [steps_done] * self.num_workers  # SSP: every worker is there


class Client(ServerLinks):
    """A worker's end: push gradients to every server, pull their values back.

    ``sizes`` are the values per server (pulls), ``push_sizes`` the push payloads (values
    and flags); the rest as :class:`~gradsync.comm.wire.ServerLinks`.
    """

    def __init__(
        self,
        *,
        sizes: Sequence[int],
        push_sizes: Sequence[int],
        timeline: Timeline | None = None,
        **links: Any,
    ) -> None:
        super().__init__(**links)
        self.timeline = timeline or NullTimeline()
        self.push_buffers = [torch.zeros(n) for n in push_sizes]
        self.pull_buffers = [torch.zeros(n) for n in sizes]
        self.lr = 0.0

    def push_pull(self, step: int) -> tuple[int, int]:
        """Send ``push_buffers`` (filled by the caller); fill ``pull_buffers``.

        Returns the (sent, received) wire bytes.
        """
        pulls, pushes, sent, received = [], [], 0, 0
        timeline = self.timeline
        headers = [torch.empty(HEADER, dtype=torch.float64) for _ in self.servers]
        for index, (rank, pull) in enumerate(zip(self.servers, self.pull_buffers, strict=True)):
            if rank is not None:  # receives posted before the send: nothing waits unmatched
                nbytes = headers[index].numel() * 8 + pull.numel() * pull.element_size()
                timeline.begin(
                    f"pull from server {index}", Phase.PULL, tensor=f"server {index}", bytes=nbytes
                )
                works = [
                    dist.irecv(t, src=rank, group=self.group, tag=TAG_REPLY)
                    for t in (headers[index], pull)
                ]
                pulls.append((index, works))
                received += nbytes
        header = Header(Kind.PUSH, worker=self.worker, step=step)
        encoded = header.encode()
        for index, (rank, push) in enumerate(zip(self.servers, self.push_buffers, strict=True)):
            if rank is None:
                self.send(index, header, [push.clone()])
                continue
            nbytes = encoded.numel() * 8 + push.numel() * push.element_size()
            timeline.begin(
                f"push to server {index}", Phase.PUSH, tensor=f"server {index}", bytes=nbytes
            )
            works = [
                dist.isend(t, dst=rank, group=self.group, tag=TAG_PUSH) for t in (encoded, push)
            ]
            pushes.append((index, works))
            sent += nbytes
        for index, rank in enumerate(self.servers):
            if rank is None:
                reply = self.local_reply()
                self.pull_buffers[index].copy_(reply.tensors[0])
                self.lr = reply.header.lr
        for index, works in pushes:
            for work in works:
                work.wait()
            timeline.end(f"push to server {index}", Phase.PUSH)
        for index, works in pulls:
            for work in works:
                work.wait()
            timeline.end(f"pull from server {index}", Phase.PULL)
            self.lr = Header.decode(headers[index]).lr
        return sent, received


__all__ = ["Client", "DenseServer", "dense_reader"]
