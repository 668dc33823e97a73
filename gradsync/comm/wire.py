"""Messages between workers and servers: one header format, one receiver thread, one outbox.

Every strategy with server ranks (``ps``, ``hybrid``, ``p3``) speaks the same framing over
c10d point-to-point. A message is a float64 :class:`Header` followed by zero or more payload
tensors sent with the same tag to the same peer (Gloo delivers them in order):

    [kind, worker, step, index, priority, length, lr, count] then the payload tensors

``index`` names a piece of the server's state (a p3 slice), ``priority`` its layer,
``length`` the payload size where the receiver cannot know it, ``lr`` the learning rate
the server applied, ``count`` how many pieces share the message (a p3 bundle: an int64
manifest of their indices and priorities comes first, then their values end to end).
Which payloads follow a header is the strategy's policy, given to the receiver as a
:data:`ReadBody`; the kinds every strategy shares (DONE, STATE, LOAD and
their replies) are read here.

Why point-to-point and not collectives on subgroups: asynchronous servers must take each
worker's push the moment it arrives, which a collective cannot express. A server reads its
messages through an :class:`Inbox`: one receiver thread per remote peer blocking in
``dist.recv`` (bounded by the process group's timeout) feeds one queue. Gloo cannot send to
its own rank, so a colocated worker hands its messages to the server thread in its own
process through the same queue, and replies come back through a local callback.

Messages travel on two process groups, one per direction of every rank pair
(:class:`Lanes`), so that two peers sending to each other at once both get the link's
full rate.

Example:
    >>> header = Header(Kind.PUSH, worker=1, step=7, length=3)
    >>> Header.decode(header.encode())
    Header(kind=<Kind.PUSH: 0>, worker=1, step=7, index=-1, priority=0, length=3, lr=0.0, count=1)
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

from gradsync.checkpoint import with_own_storage

HEADER = 8
MAX_PENDING = 64  # sends an Outbox keeps in flight before it waits for the oldest
TAG_PUSH, TAG_REPLY = 101, 102  # worker → server, server → worker


class Kind(IntEnum):
    """What a message is. Worker → server: PUSH … DONE; server → worker: REPLY … LOADED."""

    PUSH = 0  # gradients
    PULL = 1  # a request for values (hybrid's rows)
    NO_GRADIENT = 2  # a piece that had no gradient on this worker (p3)
    STATE = 3  # a request for the server's authoritative state (checkpoint)
    LOAD = 4  # a state to install (resume) and the steps done; safetensors bytes follow
    DONE = 5  # this worker has finished
    REPLY = 10  # fresh values
    STATE_REPLY = 11  # safetensors bytes follow
    FIN = 12  # the server's last message to a worker
    LOADED = 13  # a LOAD is installed


class TransportError(RuntimeError):
    """A peer did not answer in time or the connection to it broke."""


@dataclass(frozen=True)
class Lanes:
    """The transport's process groups: a message from a lower to a higher global rank
    travels on ``up``, one the other way on ``down``.

    Why two: Gloo sends a point-to-point payload only once the receiver has announced its
    receive, and that announcement is queued on the pair's socket behind whatever the
    receiver's process is already sending the other way. On one group, two peers that send
    to each other at once therefore take turns: one payload crosses before the other can
    start (an isend-then-irecv exchange of 4 MB over a 100 Mbit/s emulated link took 2.0×
    one way). With a lane per direction, a socket carries payloads one way and
    announcements the other, and both directions move at once (1.0×).

    ``Lanes()`` is the default group both ways (tests, one-direction traffic).

    Example:
        >>> lanes = Lanes(up="up", down="down")
        >>> lanes.between(0, 2), lanes.between(2, 0)
        ('up', 'down')
    """

    up: Any = None
    down: Any = None

    @classmethod
    def create(cls, world_size: int, timeout: timedelta | None = None) -> Lanes:
        """Collective on every rank (two ``new_group`` calls, in the same order everywhere)."""
        everyone = list(range(world_size))
        options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        return cls(dist.new_group(everyone, **options), dist.new_group(everyone, **options))

    def between(self, src: int, dst: int) -> Any:
        """The group a message from global rank ``src`` to ``dst`` travels on."""
        return self.up if src < dst else self.down

    def to(self, dst: int) -> Any:
        """The group of a message from this rank to ``dst``."""
        return self.between(dist.get_rank(), dst)

    def from_rank(self, src: int) -> Any:
        """The group of a message from ``src`` to this rank."""
        return self.between(src, dist.get_rank())


@dataclass(frozen=True)
class Header:
    """The fixed part of every message (see the module docstring)."""

    kind: Kind
    worker: int = -1
    step: int = -1
    index: int = -1
    priority: int = 0
    length: int = 0
    lr: float = 0.0
    count: int = 1

    def encode(self) -> Tensor:
        values = [self.kind, self.worker, self.step, self.index, self.priority, self.length]
        return torch.tensor([*values, self.lr, self.count], dtype=torch.float64)

    @classmethod
    def decode(cls, tensor: Tensor) -> Header:
        kind, worker, step, index, priority, length, lr, count = tensor.tolist()  # as encoded
        return cls(
            kind=Kind(int(kind)),
            worker=int(worker),
            step=int(step),
            index=int(index),
            priority=int(priority),
            length=int(length),
            lr=lr,
            count=int(count),
        )


@dataclass
class Message:
    """A header and its payloads as the receiver sees them; ``wire_bytes`` is 0 when local."""

    header: Header
    tensors: list[Tensor] = field(default_factory=list)
    wire_bytes: int = 0

    @property
    def kind(self) -> Kind:
        return self.header.kind

    @property
    def worker(self) -> int:
        return self.header.worker

    @property
    def step(self) -> int:
        return self.header.step


Recv = Callable[[Tensor], Tensor]  # receive the next payload of this message into a tensor
ReadBody = Callable[[Header, Recv], list[Tensor]]  # a strategy's payloads for its kinds


def nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def encode_state(tensors: dict[str, Tensor]) -> Tensor:
    """A state dictionary as safetensors bytes in a uint8 tensor (no pickle on the wire).

    Example:
        >>> decode_state(encode_state({"values": torch.ones(2)}))["values"].tolist()
        [1.0, 1.0]
    """
    contiguous = with_own_storage({k: v.detach().contiguous() for k, v in tensors.items()})
    return torch.frombuffer(bytearray(save_tensors(contiguous)), dtype=torch.uint8)


def decode_state(data: Tensor) -> dict[str, Tensor]:
    return load_tensors(data.numpy().tobytes())


def read_common(header: Header, recv: Recv) -> list[Tensor]:
    """The payloads of the kinds every strategy shares: state bytes for LOAD/STATE_REPLY."""
    if header.kind in (Kind.LOAD, Kind.STATE_REPLY):
        return [recv(torch.empty(header.length, dtype=torch.uint8))]
    return []


def receive(rank: int, lanes: Lanes, tag: int, read_body: ReadBody) -> Message:
    """One message from ``rank``: the header, then the payloads ``read_body`` asks for."""
    group = lanes.from_rank(rank)
    header_tensor = torch.empty(HEADER, dtype=torch.float64)
    dist.recv(header_tensor, src=rank, group=group, tag=tag)
    header = Header.decode(header_tensor)
    received = [nbytes(header_tensor)]

    def recv(into: Tensor) -> Tensor:
        dist.recv(into, src=rank, group=group, tag=tag)
        received.append(nbytes(into))
        return into

    read = read_common if header.kind in (Kind.LOAD, Kind.STATE_REPLY) else read_body
    tensors = read(header, recv)
    return Message(header, tensors, sum(received))


def start_receiver(
    *,
    rank: int,
    lanes: Lanes,
    tag: int,
    read_body: ReadBody,
    deliver: Callable[[Message | BaseException], None],
    name: str,
) -> threading.Thread:
    """A daemon thread that receives every message from ``rank`` and hands it to ``deliver``.

    It stops after a DONE or FIN (the peer's last message); an error (a dead peer, the
    group's timeout) is delivered as a :class:`TransportError` naming the rank, and ends it.
    """

    def run() -> None:
        try:
            while True:
                message = receive(rank, lanes, tag, read_body)
                deliver(message)
                if message.kind in (Kind.DONE, Kind.FIN):
                    return
        except BaseException as error:  # the owner re-raises it, naming the rank
            deliver(TransportError(f"receiving from rank {rank} failed: {error}"))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class Inbox:
    """Every message addressed to one server, in arrival order.

    ``remote`` are the global ranks reached over ``lanes`` (one receiver thread each); a
    colocated worker's messages arrive through :meth:`put_local`.
    """

    def __init__(
        self,
        *,
        remote: Iterable[int],
        lanes: Lanes,
        timeout_s: float,
        read_body: ReadBody,
        tag: int = TAG_PUSH,
    ) -> None:
        self.timeout_s = timeout_s
        self._queue: queue.Queue[Message | BaseException] = queue.Queue()
        self.threads = [
            start_receiver(
                rank=rank,
                lanes=lanes,
                tag=tag,
                read_body=read_body,
                deliver=self._queue.put,
                name=f"server-recv-{rank}",
            )
            for rank in remote
        ]

    def put_local(self, message: Message) -> None:
        """A message from the worker in this process (private tensors, ``wire_bytes`` 0)."""
        self._queue.put(message)

    def get(self) -> Message:
        try:
            item = self._queue.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TransportError(
                f"no message reached this server in {self.timeout_s:g} s"
            ) from None
        if isinstance(item, BaseException):
            raise item
        return item


def send(header: Header, tensors: Iterable[Tensor], *, dst: int, lanes: Lanes, tag: int) -> int:
    """Blocking send of one message; returns its wire bytes."""
    group = lanes.to(dst)
    encoded = header.encode()
    dist.send(encoded, dst=dst, group=group, tag=tag)
    sent = nbytes(encoded)
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=dst, group=group, tag=tag)
        sent += nbytes(tensor)
    return sent


class Outbox:
    """Messages from one end to its peers: isend to remote ranks, ``local`` for this process.

    ``ranks`` maps a peer index (worker or server) → global rank; ``local_peer`` is the
    index living in this process, whose messages go to ``deliver_local`` as they are.
    """

    def __init__(
        self,
        *,
        ranks: dict[int, int],
        lanes: Lanes,
        tag: int,
        local_peer: int | None = None,
        deliver_local: Callable[[Message], None] | None = None,
    ) -> None:
        self.ranks = ranks
        self.lanes = lanes
        self.tag = tag
        self.local_peer = local_peer
        self.deliver_local = deliver_local
        self._pending: deque[tuple[Any, Tensor]] = deque()

    def post(
        self, peer: int, header: Header, tensors: Iterable[Tensor] = ()
    ) -> tuple[int, Callable[[], None]]:
        """Start sending; returns the wire bytes and a function that waits until it has left.
        The caller must not modify ``tensors`` before that."""
        sent, works = self._start(peer, header, list(tensors))

        def wait() -> None:
            for work, _ in works:
                work.wait()

        return sent, wait

    def send(self, peer: int, header: Header, tensors: Iterable[Tensor] = ()) -> int:
        """Like :meth:`post`, for callers that wait for everything at once with
        :meth:`flush`. Returns the wire bytes."""
        sent, works = self._start(peer, header, list(tensors))
        self._pending.extend(works)
        # Gloo's isend reports completion only to wait(): bound what is kept by waiting for
        # the oldest (every reply's receive is posted before its request, so it has left).
        while len(self._pending) > MAX_PENDING:
            work, _ = self._pending.popleft()
            work.wait()
        return sent

    def _start(
        self, peer: int, header: Header, tensors: list[Tensor]
    ) -> tuple[int, list[tuple[Any, Tensor]]]:
        if peer == self.local_peer:
            assert self.deliver_local is not None
            self.deliver_local(Message(header, tensors, 0))
            return 0, []
        dst = self.ranks[peer]
        pieces = [header.encode(), *(t.contiguous() for t in tensors)]
        # Each tensor is kept with its work: it must live until it has been sent.
        group = self.lanes.to(dst)
        works = [(dist.isend(t, dst=dst, group=group, tag=self.tag), t) for t in pieces]
        return sum(nbytes(t) for t in pieces), works

    def send_state(self, peer: int, tensors: dict[str, Tensor], step: int = -1) -> int:
        """A state dictionary as one STATE_REPLY (safetensors bytes)."""
        data = encode_state(tensors)
        return self.send(peer, Header(Kind.STATE_REPLY, step=step, length=data.numel()), [data])

    def flush(self) -> None:
        """Wait until every message has left (bounded by the process group timeout)."""
        while self._pending:
            work, _ = self._pending.popleft()
            work.wait()


class ServerLinks:
    """A worker's end of its links to every server.

    ``servers`` lists each server's global rank, None for the server in this process (its
    inbox is :attr:`local_inbox`, set once it exists; its replies arrive in
    :attr:`local_replies`). Strategies add their pushes and pulls; the requests every
    strategy shares are here.
    """

    def __init__(
        self,
        *,
        worker: int,
        servers: Sequence[int | None],
        lanes: Lanes,
        timeout_s: float,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self.worker = worker
        self.servers = list(servers)
        self.lanes = lanes
        self.timeout_s = timeout_s
        self.alive = alive
        self.local_inbox: Inbox | None = None
        self.local_replies: queue.Queue[Message] = queue.Queue()

    def send(self, server: int, header: Header, tensors: Sequence[Tensor] = ()) -> int:
        """Blocking send to server ``server`` (or a hand-over); returns the wire bytes."""
        rank = self.servers[server]
        if rank is None:
            assert self.local_inbox is not None
            self.local_inbox.put_local(Message(header, list(tensors)))
            return 0
        return send(header, tensors, dst=rank, lanes=self.lanes, tag=TAG_PUSH)

    def request_state(self, step: int = -1) -> list[dict[str, Tensor]]:
        """Every server's state (checkpoint), in server order, once it has applied
        ``step`` steps (servers that answer at once ignore it)."""
        for server in range(len(self.servers)):
            self.send(server, Header(Kind.STATE, worker=self.worker, step=step))
        states = []
        for rank in self.servers:
            if rank is None:
                message = self.local_reply()
            else:
                message = receive(rank, self.lanes, TAG_REPLY, lambda header, recv: [])
            states.append(decode_state(message.tensors[0]))
        return states

    def load_state(self, states: Sequence[dict[str, Tensor]], step: int) -> None:
        """Install ``states[s]`` on server s, which goes on after ``step`` steps (resume);
        before the first push or pull. Returns once every server has acknowledged it."""
        self.send_load(states, step)
        for rank in self.servers:
            if rank is None:
                message = self.local_reply()
            else:
                message = receive(rank, self.lanes, TAG_REPLY, lambda header, recv: [])
            if message.kind != Kind.LOADED:
                raise TransportError(f"a server answered a LOAD with {message.kind.name}")

    def send_load(self, states: Sequence[dict[str, Tensor]], step: int) -> None:
        """Send ``states[s]`` to server s (:meth:`load_state` without waiting for the
        acknowledgements, for a strategy whose receiver threads collect them)."""
        for server, state in enumerate(states):
            data = encode_state(state)
            header = Header(Kind.LOAD, worker=self.worker, step=step, length=data.numel())
            self.send(server, header, [data])

    def done(self) -> None:
        """Tell every server this worker has finished."""
        for server in range(len(self.servers)):
            self.send(server, Header(Kind.DONE, worker=self.worker))

    def local_reply(self) -> Message:
        """The next reply of this process's server."""
        return wait_local(self.local_replies, self.alive, self.timeout_s)


def wait_local(replies: queue.Queue[Any], alive: Callable[[], bool], timeout_s: float) -> Any:
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
    "HEADER",
    "TAG_PUSH",
    "TAG_REPLY",
    "Header",
    "Inbox",
    "Kind",
    "Lanes",
    "Message",
    "Outbox",
    "ReadBody",
    "ServerLinks",
    "TransportError",
    "decode_state",
    "encode_state",
    "read_common",
    "receive",
    "send",
    "start_receiver",
    "wait_local",
]
