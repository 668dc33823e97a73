"""P3's step, simulated worker by worker: each worker's own priority sender, and a slice
applied once its last copy is in.

Every worker sends its slices most urgent first (:class:`gradsync.comm.priority.
PrioritySender`): when its window has room it takes the most urgent of the slices whose
gradients are ready, and which are ready depends on the worker's own timing. A server
applies a slice once every worker's copy is in and answers the workers in turn, worker 0
first (:class:`gradsync.comm.priority.P3Server`). So worker 0 has its parameters back a
copy's transfer before the last worker, starts backward that much earlier, and from then
on the workers pick different slices at the same instant: a slice one worker sent early
another sends late, and the server waits for the later copy (a measured trace shows
orders more than a second apart within a step, ``docs/predict.md`` §5). Nothing here is
fitted: the drift follows from the answers' order, the windows and the links.

Links are first-come-first-served pipes per host and direction
(:class:`~gradsync.predict.parts.Pipe`); a copy between two processes of one host moves at
the intra-host rate, and a colocated server's own worker hands its copy over in memory.
More than :data:`MAX_GROUPS` workers are simulated as that many groups of consecutive
workers, each moving as its last member (who gets its answers last): the cost of the
simulation stays that of :data:`MAX_GROUPS` workers.

Example:
    >>> # step_s, spans, moved = simulate_p3(profile, cluster, P3Options())
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradsync.predict.network import Cluster
from gradsync.predict.parts import (
    COMPUTE_TRACK,
    SERVER_TRACK,
    Pipe,
    Span,
    densified,
    layer_durations,
    wire_span,
    with_server_layout,
)
from gradsync.predict.profile import Profile
from gradsync.strategies.p3 import P3Options

STEPS = 3  # steps simulated: the drift starts with the first answers; the last is timed
LAST_STEP = STEPS - 1  # the step whose spans are kept
MEASURED_STEPS = 1  # steps timed at the end, each group's, averaged
MAX_GROUPS = 4  # workers simulated one by one; beyond, groups of consecutive workers


@dataclass(frozen=True)
class Slice:
    """One slice of a step's gradient: sent with ``priority`` (lower first), ``seq`` its
    place among the slices, ready ``ready_s`` after backward starts."""

    seq: int
    priority: int
    layer: int
    server: int
    num_bytes: float
    ready_s: float


Item = tuple[int, Slice]  # (step, slice)


def message_bytes(items: list[Item]) -> float:
    """The bytes of the slices one message carries."""
    if len(items) == 1:  # the common case, on the simulation's hot path
        return items[0][1].num_bytes
    return sum(piece.num_bytes for _, piece in items)


class Events:
    """A discrete-event loop: ``action(time, *args)`` runs in time order (ties: the order
    they were set)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()

    def at(self, time: float, action: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (time, next(self._order), action, args))

    def run(self) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap:
            time, _, action, args = pop(heap)
            action(time, *args)


class Sender:
    """A priority sender as :class:`gradsync.comm.priority.PrioritySender` runs: the most
    urgent item waiting, then the items right behind it (at most ``limit`` for one peer,
    one message per peer), while fewer than ``window`` items are in flight; when the window
    is full, the oldest message is waited for. ``send(now, peer, items)`` returns when the
    message is delivered.

    Example:
        >>> events, sent = Events(), []
        >>> sender = Sender(events, lambda now, peer, items: sent.append(items) or now + 1.0,
        ...                 window=1, limit=1)
        >>> def put(at, priority):
        ...     events.at(at, lambda now: sender.put(now, f"p{priority}", peer=0,
        ...                                          priority=priority, seq=priority))
        >>> put(0.0, 5); put(0.5, 3); put(0.5, 1)
        >>> events.run(); sent  # p5 alone; then the most urgent as the window frees
        [['p5'], ['p1'], ['p3']]
    """

    def __init__(
        self,
        events: Events,
        send: Callable[[float, int, list[Any]], float],
        *,
        window: int,
        limit: int,
    ) -> None:
        self.events, self.send = events, send
        self.window, self.limit = window, limit
        self.waiting: list[tuple[int, int, int, Any]] = []  # (priority, seq, peer, item)
        self.in_flight: deque[tuple[float, int]] = deque()  # (delivered, items), oldest first
        self.num_in_flight = 0
        self.wake_pending = False

    def put(self, now: float, item: Any, *, peer: int, priority: int, seq: int) -> None:
        """Queue ``item``; what is queued at one instant is taken together (the sender
        thread wakes once the burst of puts is over)."""
        heapq.heappush(self.waiting, (priority, seq, peer, item))
        if not self.wake_pending:
            self.wake_pending = True
            self.events.at(now, self._wake)

    def _wake(self, now: float) -> None:
        """Send what the window has room for; come back when the oldest is delivered."""
        self.wake_pending = False
        waiting, in_flight = self.waiting, self.in_flight
        while waiting:
            while in_flight and in_flight[0][0] <= now:
                self.num_in_flight -= in_flight.popleft()[1]
            room = self.window - self.num_in_flight
            if room <= 0:
                self.wake_pending = True
                self.events.at(in_flight[0][0], self._wake)
                return
            if self.limit == 1:  # one slice a message: the most urgent
                _, _, peer, item = heapq.heappop(waiting)
                in_flight.append((self.send(now, peer, [item]), 1))
                self.num_in_flight += 1
                continue
            for peer, items in self._take(room).items():
                in_flight.append((self.send(now, peer, items), len(items)))
                self.num_in_flight += len(items)

    def _take(self, room: int) -> dict[int, list[Any]]:
        """The most urgent item and those right behind it, by peer (``limit`` > 1: with one
        slice a message, :meth:`_wake` takes the most urgent itself)."""
        _, _, peer, item = heapq.heappop(self.waiting)
        taken: dict[int, list[Any]] = {peer: [item]}
        count = 1
        while self.waiting and count < room:
            peer = self.waiting[0][2]
            if len(taken.get(peer, ())) >= self.limit:
                break
            taken.setdefault(peer, []).append(heapq.heappop(self.waiting)[3])
            count += 1
        return taken


@dataclass(frozen=True)
class Route:
    """How a group's copies travel to or from one server: ``in_memory`` members hand them
    over in the server's own process, ``same_host`` members cross no link, ``remote`` ones
    cross the server host's link, ``on_link`` of them share the group's host link."""

    in_memory: int
    same_host: int
    remote: int
    on_link: int


class Job:
    """The groups of workers, the servers and the host links of one simulated p3 job, and
    the spans of its last step (group 0's compute, every copy, every server's work), in
    seconds from group 0's start of that step."""

    def __init__(
        self, profile: Profile, cluster: Cluster, slices: list[Slice], slices_per_message: int
    ) -> None:
        from gradsync.comm.priority import send_window

        self.profile, self.cluster = profile, cluster
        self.net = net = cluster.network
        self.rate, self.intra_rate, self.wire_hop_s = net.rate, net.intra_rate, net.wire_hop_s
        self.events = Events()
        hosts = {cluster.worker_host(w) for w in range(cluster.workers)}
        hosts |= {cluster.server_host(s) for s in range(cluster.servers)}
        self.out = {host: Pipe() for host in hosts}
        self.into = {host: Pipe() for host in hosts}
        self.slowdowns: dict[float, float] = {}  # transfer seconds → duplex slowdown
        self.window, self.limit = send_window(slices_per_message), slices_per_message
        self.layer_seconds = layer_durations(profile)
        self.slices_per_layer = [0] * len(self.layer_seconds)
        for piece in slices:
            self.slices_per_layer[piece.layer] += 1
        # Consecutive slices ready at one instant, queued by one event: as events of their
        # own they would run back to back (set one after another for the same time).
        self.ready_together = [
            (ready_s, list(pieces))
            for ready_s, pieces in itertools.groupby(slices, key=lambda p: p.ready_s)
        ]
        self.spans: list[Span] = []  # the last step's, from group 0's forward start
        self.origin = 0.0  # that start: set before any span of the step is recorded
        count = min(cluster.workers, MAX_GROUPS)
        bounds = [round(g * cluster.workers / count) for g in range(count + 1)]
        self.groups = [
            Group(self, g, range(a, b)) for g, (a, b) in enumerate(itertools.pairwise(bounds))
        ]
        self.servers = [Server(self, index) for index in range(cluster.servers)]

    def link_pipes(self, group_host: int, server: int) -> dict[bool, tuple[Pipe, Pipe, Pipe, Pipe]]:
        """The link directions a copy crosses toward ``server`` (True) and back (False),
        each with its opposite: the group host's, then the server host's."""
        host = self.cluster.server_host(server)
        out, into = self.out[group_host], self.into[group_host]
        server_in, server_out = self.into[host], self.out[host]
        return {True: (out, into, server_in, server_out), False: (into, out, server_out, server_in)}

    def route(self, members: range, on_hosts: Counter[int], server: int) -> Route:
        """How ``members`` (``on_hosts``: how many on each host) move their copies between
        them and ``server``."""
        cluster = self.cluster
        in_memory = int(cluster.colocate and server % cluster.workers in members)
        host = cluster.server_host(server)
        same_host = on_hosts[host] - in_memory
        remote = len(members) - in_memory - same_host
        last = cluster.worker_host(members[-1])
        on_link = 0 if last == host else on_hosts[last]
        return Route(in_memory, same_host, remote, on_link)

    def cross(
        self, now: float, group: Group, server: int, num_bytes: float, *, push: bool
    ) -> float:
        """Every member's copy of ``num_bytes`` between ``group`` and ``server`` leaves at
        ``now`` (``push``: toward the server); return when the last is in."""
        route = group.routes[server]
        arrived = now
        if route.same_host:
            arrived = now + route.same_host * num_bytes / self.intra_rate
        if route.remote:
            seconds = num_bytes / self.rate
            worker_pipe, worker_back, server_pipe, server_back = group.pipes[server][push]
            at_worker = self._transfer(now, route.on_link * seconds, worker_pipe, worker_back)
            at_server = self._transfer(now, route.remote * seconds, server_pipe, server_back)
            arrived = max(arrived, max(at_worker, at_server) + self.wire_hop_s)
        return arrived

    def _transfer(self, now: float, seconds: float, pipe: Pipe, opposite: Pipe) -> float:
        if not seconds:
            return now
        slowdown = self.slowdowns.get(seconds)
        if slowdown is None:  # slices share a few sizes: each curve lookup once
            slowdown = self.slowdowns[seconds] = self.net.duplex_slowdown(seconds)
        return pipe.transfer(now, seconds, opposite, slowdown)

    def send(
        self,
        now: float,
        group: Group,
        server: int,
        items: list[Item],
        *,
        push: bool,
        deliver: Callable[..., None],
        args: tuple[Any, ...],
    ) -> float:
        """Every member's copy of ``items`` between ``group`` and ``server`` leaves at
        ``now`` (``push``: toward the server), its span kept; ``deliver(time, *args)`` runs
        when the last is in. Return that time."""
        num_bytes = message_bytes(items)
        arrived = self.cross(now, group, server, num_bytes, push=push)
        copies = group.routes[server].remote
        if copies and items[0][0] == LAST_STEP:
            name = f"{'PUSH' if push else 'PULL'} layer{items[0][1].layer}"
            messages = 2 if len(items) == 1 else 3  # a bundle adds its manifest
            start = now - self.origin
            self.spans.append(wire_span(name, start, arrived - now, num_bytes, messages, copies))
        self.events.at(arrived, deliver, *args)
        return arrived

    def run(self) -> float:
        """Simulate :data:`STEPS` steps; return the mean length of the last ones."""
        for group in self.groups:
            self.events.at(0.0, group.forward)
        self.events.run()
        ends = [group.backward_ends for group in self.groups]
        lengths = [(e[-1] - e[-1 - MEASURED_STEPS]) / MEASURED_STEPS for e in ends]
        return sum(lengths) / len(lengths)


class Group:
    """Consecutive workers that move as one (each worker alone where there are at most
    :data:`MAX_GROUPS`): forward layer by layer, each once its slices of the step before
    are back; backward, with the slices queued as their gradients become ready."""

    def __init__(self, job: Job, index: int, members: range) -> None:
        self.job, self.index, self.members = job, index, members
        self.host = job.cluster.worker_host(members[-1])
        on_hosts = Counter(job.cluster.worker_host(w) for w in members)
        self.routes = [job.route(members, on_hosts, s) for s in range(job.cluster.servers)]
        self.pipes = [job.link_pipes(self.host, s) for s in range(job.cluster.servers)]
        self.sender = Sender(job.events, self._push, window=job.window, limit=job.limit)
        self.queued = itertools.count()
        self.layer_seconds = job.layer_seconds
        self.step, self.layer = 0, 0
        self.blocked_since: float | None = None
        self.backward_ends: list[float] = []
        self.missing: dict[int, list[int]] = {}  # step → each layer's slices not yet back

    def forward(self, now: float) -> None:
        """Run the step's layers from the current one while their parameters are back.

        The layers run ahead of the event clock: a layer found missing blocks the group
        from the time it reaches it, and an answer that comes before then resumes it
        from there, not from the answer's time."""
        while self.layer < len(self.layer_seconds):
            if self.step and self.missing[self.step - 1][self.layer]:
                if self.blocked_since is None:
                    self.blocked_since = now
                return
            if self.blocked_since is not None:
                start, now = self.blocked_since, max(now, self.blocked_since)
                if now > start:
                    self._span(f"WAIT layer{self.layer}", start, now - start)
                self.blocked_since = None
            seconds = self.layer_seconds[self.layer]
            self._span(f"FORWARD layer{self.layer}", now, seconds)
            now += seconds
            self.layer += 1
        self._backward(now)

    def _backward(self, start: float) -> None:
        profile, step = self.job.profile, self.step
        self._span("BACKWARD", start, profile.backward_s)
        self.missing[step] = list(self.job.slices_per_layer)
        for ready_s, pieces in self.job.ready_together:
            self.job.events.at(start + ready_s, self._ready, step, pieces)
        end = start + profile.backward_s
        if self.index == 0 and step == LAST_STEP - 1:
            # Every slice of the last step waits for this group's copies of this one, and
            # those are queued from here: no span of the last step can be recorded sooner.
            self.job.origin = end
        self.backward_ends.append(end)
        self.step, self.layer = step + 1, 0
        if self.step < STEPS:
            self.job.events.at(end, self.forward)

    def _ready(self, now: float, step: int, pieces: list[Slice]) -> None:
        # Ties (and every slice, without priority) go in the order they were queued.
        for piece in pieces:
            order = next(self.queued)
            self.sender.put(
                now, (step, piece), peer=piece.server, priority=piece.priority, seq=order
            )

    def _push(self, now: float, server: int, items: list[Item]) -> float:
        receive = self.job.servers[server].receive
        return self.job.send(
            now, self, server, items, push=True, deliver=receive, args=(self, items)
        )

    def answered(self, now: float, items: list[Item]) -> None:
        """Slices back from a server: a layer whose slices are all back may run."""
        for step, piece in items:
            self.missing[step][piece.layer] -= 1
        if self.blocked_since is not None:
            self.forward(now)

    def _span(self, name: str, start: float, seconds: float) -> None:
        if self.index == 0 and self.step == LAST_STEP:  # the trace: the first worker's
            self.job.spans.append(Span(COMPUTE_TRACK, name, start - self.job.origin, seconds))


class Server:
    """One server: takes each message in, applies a slice once every worker's copy is in,
    and answers every worker, worker 0 first, through its own priority sender."""

    def __init__(self, job: Job, index: int) -> None:
        self.job, self.index = job, index
        cluster, profile = job.cluster, job.profile
        self.cpu = Pipe()
        self.copies: dict[tuple[int, int], int] = {}  # (step, slice) → copies in
        window = job.window * len(job.groups)
        self.sender = Sender(job.events, self._answer, window=window, limit=job.limit)
        self.order = itertools.count()
        self.per_byte = profile.aggregate_s_per_byte * cluster.workers + profile.apply_s_per_byte
        self.processes = cluster.workers - sum(g.routes[index].in_memory for g in job.groups)

    def receive(self, now: float, group: Group, items: list[Item]) -> None:
        """``group``'s copies of ``items`` are in: take them in; apply the complete ones."""
        job, cluster = self.job, self.job.cluster
        net, slowdown = cluster.network, cluster.server_slowdown
        messages = len(group.members) - group.routes[self.index].in_memory
        if messages:  # the Python half of each receive
            taking = messages * net.serial_s(message_bytes(items)) / 2
            now = self.cpu.hold(now, taking * slowdown)
        for step, piece in items:
            key = (step, piece.seq)
            self.copies[key] = self.copies.get(key, 0) + len(group.members)
            if self.copies[key] < cluster.workers:
                continue
            del self.copies[key]
            work = piece.num_bytes * self.per_byte + job.profile.server_round_s
            work += self.processes * net.serial_s(piece.num_bytes) / 2  # the answers' sends
            wall = work * slowdown
            applied = self.cpu.hold(now, wall)
            if step == LAST_STEP:
                name = f"AGGREGATE_APPLY layer{piece.layer}"
                start = applied - wall - job.origin
                job.spans.append(Span(SERVER_TRACK, name, start, wall, cpu_s=work))
            job.events.at(applied, self._queue, (step, piece))

    def _queue(self, now: float, item: Item) -> None:
        for group in self.job.groups:
            self.sender.put(
                now, item, peer=group.index, priority=item[1].priority, seq=next(self.order)
            )

    def _answer(self, now: float, peer: int, items: list[Item]) -> float:
        group = self.job.groups[peer]
        return self.job.send(
            now, group, self.index, items, push=False, deliver=group.answered, args=(items,)
        )


def slices_of(profile: Profile, options: P3Options, servers: int) -> list[Slice]:
    """The slices p3 cuts ``profile``'s gradient into, placed on ``servers`` servers."""
    from gradsync.comm.slicing import slice_variables

    variables = {v.name: v for v in profile.variables}
    pieces = slice_variables(
        [(v.name, v.numel) for v in profile.variables],
        slice_size=options.slice_size if options.slicing else None,
        num_servers=servers,
    )
    return [
        Slice(
            seq=p.index,
            priority=variables[p.name].layer if options.priority else 0,
            layer=variables[p.name].layer,
            server=p.server,
            num_bytes=p.numel * variables[p.name].element_size,
            ready_s=variables[p.name].grad_ready_s,
        )
        for p in pieces
    ]


def simulate_p3(
    profile: Profile, cluster: Cluster, options: P3Options | None
) -> tuple[float, list[Span], float]:
    """p3's steady-state step: (its seconds, the spans of the last step simulated from its
    forward's start, bytes each worker moves)."""
    options = options or P3Options()
    profile = densified(profile)  # each slice is cut from the dense gradient
    servers = options.num_servers(cluster.workers)
    cluster = with_server_layout(cluster, servers, colocate=options.colocate)
    job = Job(profile, cluster, slices_of(profile, options, servers), options.slices_per_message)
    return job.run(), job.spans, 2.0 * profile.num_bytes


__all__ = ["MAX_GROUPS", "simulate_p3"]
