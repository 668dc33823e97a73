"""A message and its answer through the server transport, for ``gradsync commbench --ops wire``.

The strategies with server ranks (``ps``, ``hybrid``, ``p3``) move their values through
:mod:`gradsync.comm.wire`, not through Gloo's collectives: a header and a payload per message,
a receiver thread per peer blocking in ``dist.recv``, a queue to the thread that uses it, and
an outbox of ``isend`` on a process group per direction. What that costs per message and per
byte, in time and in CPU (the receiver threads included), is what ``predict`` charges their
pushes and pulls; collectives do not show it. :class:`WireEcho` measures it: rank 0 plays a
worker that sends a message of ``size`` bytes and waits for the answer; rank 1 a server that
answers each message with one of the same size. Other ranks take no part.

Example:
    >>> # echo = WireEcho.start(lanes, rank=0); echo.round_trip(payload); echo.stop()
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradsync.comm.wire import (
    TAG_PUSH,
    TAG_REPLY,
    Header,
    Kind,
    Lanes,
    Message,
    Outbox,
    Recv,
    nbytes,
    start_receiver,
)

WORKER, SERVER = 0, 1  # the global ranks that take part
TIMEOUT_S = 60.0


def _peer_of(rank: int) -> int:
    return SERVER if rank == WORKER else WORKER


def _read_payload(header: Header, recv: Recv) -> list[Tensor]:
    """A PUSH or a REPLY carries ``header.length`` bytes."""
    if header.kind in (Kind.PUSH, Kind.REPLY):
        return [recv(torch.empty(header.length, dtype=torch.uint8))]
    return []


@dataclass
class WireEcho:
    """One end of the echo: its outbox to the peer and the messages its receiver delivers."""

    rank: int
    outbox: Outbox
    inbox: queue.Queue[Message | BaseException]
    receiver: Any

    @property
    def peer(self) -> int:
        return _peer_of(self.rank)

    @classmethod
    def start(cls, lanes: Lanes, rank: int) -> WireEcho:
        """Start this rank's receiver thread (rank 0 or 1 only)."""
        peer = _peer_of(rank)
        tag_in, tag_out = (TAG_REPLY, TAG_PUSH) if rank == WORKER else (TAG_PUSH, TAG_REPLY)
        inbox: queue.Queue[Message | BaseException] = queue.Queue()
        receiver = start_receiver(
            rank=peer,
            lanes=lanes,
            tag=tag_in,
            read_body=_read_payload,
            deliver=inbox.put,
            name=f"echo-recv-{peer}",
        )
        outbox = Outbox(ranks={peer: peer}, lanes=lanes, tag=tag_out)
        return cls(rank, outbox, inbox, receiver)

    def _send(self, kind: Kind, payload: Tensor | None = None) -> None:
        tensors = [] if payload is None else [payload]
        length = sum(nbytes(t) for t in tensors)
        _, wait = self.outbox.post(self.peer, Header(kind, length=length), tensors)
        wait()

    def _next(self) -> Message:
        item = self.inbox.get(timeout=TIMEOUT_S)
        if isinstance(item, BaseException):
            raise item
        return item

    def round_trip(self, payload: Tensor) -> None:
        """Worker: send ``payload`` and wait for its answer. Server: wait for a message and
        answer it with ``payload`` (the same size)."""
        if self.rank == WORKER:
            self._send(Kind.PUSH, payload)
            self._next()
        else:
            self._next()
            self._send(Kind.REPLY, payload)

    def stop(self) -> None:
        """End both receiver threads: the worker's DONE ends the server's, the server's FIN
        (sent once it has seen DONE) ends the worker's."""
        if self.rank == WORKER:
            self._send(Kind.DONE)
        else:
            while self._next().kind != Kind.DONE:
                pass
            self._send(Kind.FIN)
        self.receiver.join(timeout=TIMEOUT_S)
