"""Push/pull transport between workers and parameter servers over c10d point-to-point.

One message per (worker, server) per step in each direction: the worker *pushes* the
gradients of every partition the server owns as one flat buffer, the server answers with a
*pull* of the same size holding the fresh values. Every message starts with a
``HEADER``-float header, so a server reads pushes, checkpoint requests and "done" notices
from one stream:

    push:  [kind, worker index, step | payload ...]     worker → server, tag TAG_PUSH
    pull:  [step applied, learning rate, 0 | values ...] server → worker, tag TAG_PULL
    state: [length] then safetensors bytes               server → worker, tag TAG_STATE

Why point-to-point and not collectives on subgroups: asynchronous and stale-synchronous
servers must take each worker's push the moment it arrives, which a collective cannot
express. A server reads its pushes through an :class:`Inbox`: one receiver thread per
remote worker blocking in ``dist.recv`` (bounded by the process group timeout) feeds one
queue, so the server loop waits on a single queue, with a timeout, in arrival order. Gloo
cannot send to its own rank, so a colocated worker hands its push to the server thread in
its own process through the same queue (and gets the pull back through a local queue).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

from gradsync.trace import NullTimeline, Phase

HEADER = 3
PUSH, STATE, DONE = 0, 1, 2
TAG_PUSH, TAG_PULL, TAG_STATE = 101, 102, 103


class TransportError(RuntimeError):
    """A peer did not answer in time or the connection to it broke."""


@dataclass
class Message:
    """One push (or request) as the server sees it. ``wire_bytes`` is 0 for a local push."""

    kind: int
    worker: int
    step: int
    payload: Tensor
    wire_bytes: int


def encode_push(buffer: Tensor, kind: int, worker: int, step: int) -> Tensor:
    """Write the header of ``buffer`` in place and return it."""
    buffer[:HEADER] = torch.tensor([kind, worker, step], dtype=buffer.dtype)
    return buffer


def decode_push(buffer: Tensor, wire_bytes: int) -> Message:
    kind, worker, step = (int(v) for v in buffer[:HEADER].tolist())
    return Message(kind, worker, step, buffer[HEADER:], wire_bytes)


def wire_size(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Inbox:
    """Every push addressed to one server, in arrival order.

    ``remote`` maps worker index → global rank of each worker reached over ``group``;
    ``local_worker`` is the worker index that shares this process (colocated), if any.
    """

    def __init__(
        self,
        *,
        size: int,
        remote: dict[int, int],
        local_worker: int | None,
        group: Any,
        timeout_s: float,
    ) -> None:
        self.size = size
        self.local_worker = local_worker
        self.timeout_s = timeout_s
        self._queue: queue.Queue[Message | BaseException] = queue.Queue()
        self._threads = [
            threading.Thread(
                target=self._receive, args=(rank, group), name=f"ps-recv-{rank}", daemon=True
            )
            for rank in remote.values()
        ]
        for thread in self._threads:
            thread.start()

    def _receive(self, rank: int, group: Any) -> None:
        try:
            while True:
                buffer = torch.empty(HEADER + self.size)
                dist.recv(buffer, src=rank, group=group, tag=TAG_PUSH)
                message = decode_push(buffer, wire_size(buffer))
                self._queue.put(message)
                if message.kind == DONE:
                    return
        except BaseException as error:  # the server loop re-raises it, naming the rank
            self._queue.put(TransportError(f"receiving from rank {rank} failed: {error}"))

    def put_local(self, buffer: Tensor) -> None:
        """A push from the worker in this process (already a private copy)."""
        self._queue.put(decode_push(buffer, 0))

    def get(self) -> Message:
        try:
            item = self._queue.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TransportError(f"no push reached this server in {self.timeout_s:g} s") from None
        if isinstance(item, BaseException):
            raise item
        return item


class Outbox:
    """Replies from one server to workers: isend to remote ranks, a queue for a local one."""

    def __init__(self, *, remote: dict[int, int], local_worker: int | None, group: Any) -> None:
        self.remote = remote
        self.local_worker = local_worker
        self.group = group
        self.local: dict[int, queue.Queue[Tensor]] = {
            TAG_PULL: queue.Queue(),
            TAG_STATE: queue.Queue(),
        }
        self._pending: list[tuple[Any, Tensor]] = []

    def send(self, worker: int, tensor: Tensor, tag: int = TAG_PULL) -> int:
        """Send ``tensor`` (not modified afterwards by the caller); returns the wire bytes."""
        if worker == self.local_worker:
            self.local[tag].put(tensor)
            return 0
        work = dist.isend(tensor, dst=self.remote[worker], group=self.group, tag=tag)
        self._pending.append((work, tensor))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        return wire_size(tensor)

    def send_state(self, worker: int, tensors: dict[str, Tensor]) -> int:
        """A checkpoint snapshot as safetensors bytes: its length, then the bytes."""
        data = torch.frombuffer(bytearray(save_tensors(tensors)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        return self.send(worker, length, TAG_STATE) + self.send(worker, data, TAG_STATE)

    def flush(self) -> None:
        """Wait until every reply has left (bounded by the process group timeout)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []


class Client:
    """A worker's end: push gradients to every server, pull their values back.

    ``sizes`` are the values per server (pulls); ``push_sizes`` the push payloads when they
    carry more (the had-a-gradient flags), default the same.

    ``servers`` lists each server's global rank (None for the server in this process, whose
    :class:`Inbox` and :class:`Outbox` are passed as ``local``).
    """

    def __init__(
        self,
        *,
        worker: int,
        sizes: Sequence[int],
        servers: Sequence[int | None],
        group: Any,
        timeout_s: float,
        local: tuple[Inbox, Outbox] | None = None,
        alive: Any = None,
        timeline: NullTimeline | None = None,
        push_sizes: Sequence[int] | None = None,
    ) -> None:
        self.worker = worker
        self.timeline = timeline or NullTimeline()
        self.servers = list(servers)
        self.group = group
        self.timeout_s = timeout_s
        self.local = local
        self.alive = alive or (lambda: True)
        self.push_buffers = [torch.zeros(HEADER + n) for n in (push_sizes or sizes)]
        self.pull_buffers = [torch.zeros(HEADER + n) for n in sizes]

    def push_pull(self, step: int) -> tuple[int, int]:
        """Send ``push_buffers`` (payloads filled by the caller); fill ``pull_buffers``.

        Returns the (sent, received) wire bytes.
        """
        pulls, pushes, sent, received = [], [], 0, 0
        timeline = self.timeline
        for index, (rank, pull) in enumerate(zip(self.servers, self.pull_buffers, strict=True)):
            if rank is not None:  # receive posted before the send: nothing waits unmatched
                timeline.begin(
                    f"pull from server {index}",
                    Phase.PULL,
                    tensor=f"server {index}",
                    bytes=wire_size(pull),
                )
                pulls.append((index, dist.irecv(pull, src=rank, group=self.group, tag=TAG_PULL)))
                received += wire_size(pull)
        for index, (rank, push) in enumerate(zip(self.servers, self.push_buffers, strict=True)):
            encode_push(push, PUSH, self.worker, step)
            if rank is None:
                self._local_inbox().put_local(push.clone())
            else:
                timeline.begin(
                    f"push to server {index}",
                    Phase.PUSH,
                    tensor=f"server {index}",
                    bytes=wire_size(push),
                )
                pushes.append((index, dist.isend(push, dst=rank, group=self.group, tag=TAG_PUSH)))
                sent += wire_size(push)
        for index, rank in enumerate(self.servers):
            if rank is None:
                self.pull_buffers[index].copy_(self._local_reply(TAG_PULL))
        for index, work in pushes:
            work.wait()
            timeline.end(f"push to server {index}", Phase.PUSH)
        for index, work in pulls:
            work.wait()
            timeline.end(f"pull from server {index}", Phase.PULL)
        return sent, received

    def request_state(self) -> list[dict[str, Tensor]]:
        """Every server's authoritative state (values and optimizer state), in server order."""
        for rank, push in zip(self.servers, self.push_buffers, strict=True):
            encode_push(push, STATE, self.worker, -1)
            self._send(rank, push)
        states = []
        for rank in self.servers:
            if rank is None:
                self._local_reply(TAG_STATE)  # the length; the bytes follow
                data = self._local_reply(TAG_STATE)
            else:
                length = torch.zeros(1, dtype=torch.int64)
                dist.recv(length, src=rank, group=self.group, tag=TAG_STATE)
                data = torch.empty(int(length.item()), dtype=torch.uint8)
                dist.recv(data, src=rank, group=self.group, tag=TAG_STATE)
            states.append(load_tensors(data.numpy().tobytes()))
        return states

    def done(self) -> None:
        """Tell every server this worker has finished (its last push was answered)."""
        for rank, push in zip(self.servers, self.push_buffers, strict=True):
            encode_push(push, DONE, self.worker, -1)
            self._send(rank, push)

    def _send(self, rank: int | None, push: Tensor) -> None:
        if rank is None:
            self._local_inbox().put_local(push.clone())
        else:
            dist.send(push, dst=rank, group=self.group, tag=TAG_PUSH)

    def _local_inbox(self) -> Inbox:
        assert self.local is not None
        return self.local[0]

    def _local_reply(self, tag: int) -> Tensor:
        assert self.local is not None
        return wait_local_reply(self.local[1].local[tag], self.alive, self.timeout_s)


def wait_local_reply(replies: queue.Queue[Any], alive: Any, timeout_s: float) -> Any:
    """The next reply of this rank's colocated server thread, noticing at once if it died."""
    waited = 0.0
    while True:  # short waits, so a dead server thread is noticed at once
        with contextlib.suppress(queue.Empty):
            return replies.get(timeout=0.5)
        waited += 0.5
        if not alive():
            raise TransportError("the colocated server thread of this rank has stopped")
        if waited >= timeout_s:
            raise TransportError(f"the colocated server did not answer in {timeout_s:g} s")


__all__ = [
    "DONE",
    "HEADER",
    "PUSH",
    "STATE",
    "Client",
    "Inbox",
    "Message",
    "Outbox",
    "TransportError",
    "wait_local_reply",
]
