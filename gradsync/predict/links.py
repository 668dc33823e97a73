"""Host links shared fairly by the connections that cross them (``ps``'s pushes and pulls).

Every process pair talks over its own connection (a TCP socket): messages on one
connection cross in order, and the connections that have bytes waiting on a link direction
share its rate equally, as TCP flows through one queue do. A worker that pushes to two
servers at once therefore sees both pushes progress together and finish late together,
not one after the other: the servers' answers start later than a first-come-first-served
link would say. With one connection per link direction this is first come, first served.

The rates are fluid: between two events every waiting connection's first message moves at
rate ÷ waiting connections. :class:`SharedLinks` is advanced event by event by its caller
(:meth:`SharedLinks.next_event`, :meth:`SharedLinks.advance`).

Example:
    >>> from gradsync.predict.network import Cluster, Network
    >>> cluster = Cluster(workers=1, network=Network(bandwidth=1.0), servers=2)
    >>> links = SharedLinks(cluster)
    >>> links.push(0.0, server=0, num_bytes=1.0, tag="a")
    >>> links.push(0.0, server=1, num_bytes=1.0, tag="b")
    >>> links.next_event()  # each server's inbound link has carried its copy
    1.0
    >>> links.advance(1.0), links.next_event()  # host 0's outbound link is shared: 2 s
    ([], 2.0)
    >>> sorted(links.advance(2.0))
    ['a', 'b']
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from gradsync.predict.network import Cluster

DUPLEX = "duplex"  # the connection key of the share a transfer takes of the opposite way


@dataclass
class _Transfer:
    """One message on every link direction it crosses; done when the last copy is in."""

    tag: Any
    legs: int  # link directions still carrying it


@dataclass
class _Leg:
    transfer: _Transfer | None  # None: the opposite direction's share of a duplex transfer
    remaining: float  # bytes


class _Direction:
    """One direction of one host's link: a queue per connection, the heads sharing it."""

    def __init__(self) -> None:
        self.queues: dict[Any, deque[_Leg]] = {}
        self.waiting: list[deque[_Leg]] = []  # the queues with a leg, in no order

    def add(self, connection: Any, leg: _Leg) -> None:
        queue = self.queues.setdefault(connection, deque())
        if not queue:
            self.waiting.append(queue)
        queue.append(leg)

    def next_end(self, rate: float) -> float:
        """Seconds until the first head finishes at the current shares."""
        return min(queue[0].remaining for queue in self.waiting) * len(self.waiting) / rate

    def move(self, num_bytes: float, *, finish_soonest: bool) -> list[_Leg]:
        """Each head moves ``num_bytes`` on; return the legs that are through: those with
        nothing left, and with ``finish_soonest`` the heads that had the least left (so
        rounding cannot leave a crumb that never finishes)."""
        least = min(queue[0].remaining for queue in self.waiting)
        through = []
        for queue in self.waiting:
            head = queue[0]
            soonest = finish_soonest and head.remaining == least
            head.remaining -= num_bytes
            if soonest or head.remaining <= 1e-9 * num_bytes:
                through.append(queue.popleft())
        self.waiting = [queue for queue in self.waiting if queue]
        return through


class SharedLinks:
    """Every host's link, each way, shared by the connections crossing it.

    A push from the workers to server s crosses the outbound link of each other host with
    workers (one copy per worker there) and the inbound link of s's host (one copy per
    remote worker), on s's connections; a pull the reverse. Where the network is not fully
    duplex (``Network.duplex_slowdown`` d > 1 for a transfer of t seconds alone), the
    transfer also puts (d − 1)·t of the opposite direction's rate to use: two equal
    transfers the opposite ways then take d·t together, one alone t.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.network = cluster.network
        self.rate = cluster.network.rate
        self.now = 0.0
        server_hosts = {cluster.server_host(s) for s in range(cluster.servers)}
        self.worker_hosts = _alike_worker_hosts(cluster, server_hosts)
        hosts = server_hosts | {h for h, _ in self.worker_hosts}
        self.outbound = {h: _Direction() for h in hosts}
        self.inbound = {h: _Direction() for h in hosts}
        self.active: list[_Direction] = []  # the directions with a leg
        self.hop_s = cluster.network.wire_hop_s
        # (when it is in, tag): crossed transfers one hop after their last byte, transfers
        # with nothing to cross at once
        self._arrivals: list[tuple[float, Any]] = []

    def push(self, ready: float, *, server: int, num_bytes: float, tag: Any) -> None:
        """Start every worker's ``num_bytes`` to ``server`` at ``ready`` (not before
        :attr:`now`); :meth:`advance` returns ``tag`` once the last copy is in."""
        self._start(ready, server, num_bytes, tag, self.outbound, self.inbound)

    def pull(self, ready: float, *, server: int, num_bytes: float, tag: Any) -> None:
        """Start ``server``'s answer of ``num_bytes`` to every worker, as :meth:`push`."""
        self._start(ready, server, num_bytes, tag, self.inbound, self.outbound)

    def next_event(self) -> float:
        """When, if nothing else starts, a transfer is next in or a link direction next
        finishes one of its copies (inf when nothing is left)."""
        return min(self._next_leg_end(), *(when for when, _ in self._arrivals), math.inf)

    def advance(self, until: float) -> list[Any]:
        """Move every waiting connection's bytes on to ``until``; return the tags of the
        transfers in by then (in no particular order)."""
        while (leg_end := self._next_leg_end()) <= until:
            self._move(leg_end, finishing=True)
        self._move(until, finishing=False)
        due = [tag for when, tag in self._arrivals if when <= until]
        self._arrivals = [(when, tag) for when, tag in self._arrivals if when > until]
        return due

    @property
    def busy(self) -> bool:
        return bool(self._arrivals or self.active)

    def _next_leg_end(self) -> float:
        ends = (direction.next_end(self.rate) for direction in self.active)
        return self.now + min(ends, default=math.inf)

    def _move(self, until: float, *, finishing: bool) -> None:
        """Every waiting head moves on to ``until`` at its share of the rate; with
        ``finishing``, ``until`` is the next leg end and the directions whose end it is
        finish their soonest heads."""
        seconds = until - self.now
        for direction in self.active:
            due = finishing and self.now + direction.next_end(self.rate) <= until
            share = seconds * self.rate / len(direction.waiting)
            for leg in direction.move(share, finish_soonest=due):
                self._leg_done(leg, until)
        self.active = [direction for direction in self.active if direction.waiting]
        self.now = max(self.now, until)

    def _leg_done(self, leg: _Leg, now: float) -> None:
        if leg.transfer is None:
            return
        leg.transfer.legs -= 1
        if leg.transfer.legs == 0:
            self._arrivals.append((now + self.hop_s, leg.transfer.tag))

    def _start(
        self,
        ready: float,
        server: int,
        num_bytes: float,
        tag: Any,
        worker_side: dict[int, _Direction],
        server_side: dict[int, _Direction],
    ) -> None:
        if ready > self.now:
            raise ValueError(f"advance to {ready} before starting a transfer then")
        cluster = self.cluster
        host = cluster.server_host(server)
        legs = [(server_side, worker_side, host, cluster.remote_workers(server) * num_bytes)]
        legs += [
            (worker_side, server_side, h, count * num_bytes)
            for h, count in self.worker_hosts
            if h != host
        ]
        transfer = _Transfer(tag, legs=0)
        for direction, opposite, h, size in legs:
            if size <= 0:
                continue
            transfer.legs += 1
            self._add(direction[h], server, _Leg(transfer, size))
            slowdown = self.network.duplex_slowdown(size / self.rate)
            if slowdown > 1.0:
                self._add(opposite[h], DUPLEX, _Leg(None, (slowdown - 1.0) * size))
        if not transfer.legs:
            self._arrivals.append((ready, tag))

    def _add(self, direction: _Direction, connection: Any, leg: _Leg) -> None:
        if not direction.waiting:
            self.active.append(direction)
        direction.add(connection, leg)


def _alike_worker_hosts(cluster: Cluster, server_hosts: set[int]) -> list[tuple[int, int]]:
    """(host, workers on it) for one host of each kind: hosts without a
    server and with the same number of workers carry the same copies at the same times,
    so one of them stands for all (a 512-host cluster with dedicated servers is one)."""
    kinds: dict[Any, tuple[int, int]] = {}  # kind → its first host and that host's workers
    for host, count in cluster.workers_per_host().items():
        kinds.setdefault(host if host in server_hosts else ("alike", count), (host, count))
    return list(kinds.values())
