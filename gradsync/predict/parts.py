"""What the strategies' simulations share: the spans of a predicted step, first-come-
first-served pipes (a link direction, a server's CPU), a profile as strategies that push
dense gradients see it, the servers' layout and the layers' forward times.

Example:
    >>> Span("compute", "BACKWARD", 0.0, 1.5).duration
    1.5
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from gradsync.predict.network import Cluster
from gradsync.predict.profile import Profile

COMPUTE_TRACK, COMM_TRACK, SERVER_TRACK = "compute", "communication", "server 0"
# Compute-track spans of the worker's own work besides forward and backward (buffer copies,
# its optimizer step): compute, not time waiting for communication.
WORKER_WORK = ("MEMCPY_", "OPTIMIZER_STEP")


@dataclass(frozen=True)
class Span:
    """One predicted activity on a track, seconds from the step's start. A communication
    span also says what it moves over the whole job (``num_bytes`` sent between ranks,
    ``messages``; ``wire``: through the server transport, not a collective): the CPU work
    it costs where hosts share cores. A server span's ``cpu_s`` is its CPU time where that
    is less than its duration (a server on shared cores; None: the duration)."""

    track: str
    name: str
    start: float
    duration: float
    num_bytes: float = 0.0
    messages: int = 0
    wire: bool = False
    cpu_s: float | None = None


def wire_span(
    name: str, start: float, duration: float, num_bytes: float, messages: int, copies: int
) -> Span:
    """The span of a push or pull through the server transport, with what it moves between
    processes over the whole job: ``copies`` copies (one per worker in another process on
    another host) of ``num_bytes``, each ``messages`` messages (a header and a payload; a
    bundle of slices adds its manifest).

    Example:
        >>> wire_span("PUSH", 0.0, 1.0, num_bytes=100.0, messages=2, copies=3).num_bytes
        300.0
    """
    return Span(COMM_TRACK, name, start, duration, copies * num_bytes, copies * messages, True)


def densified(profile: Profile) -> Profile:
    """``profile`` as a strategy that makes sparse gradients dense in the backward hook runs
    it: each sparse variable's measured ``densify_s`` delays its own gradient and every one
    ready after it, and lengthens backward.

    Example:
        >>> # densified(lstm_profile).backward_s  # + 2 × ~20 ms for two 40 MB tables
    """
    costs = [(v.grad_ready_s, v.densify_s) for v in profile.sparse_variables if v.densify_s]
    if not costs:
        return profile

    def delay(ready_s: float) -> float:
        return sum(seconds for at, seconds in costs if at <= ready_s)

    variables = tuple(
        replace(v, grad_ready_s=v.grad_ready_s + delay(v.grad_ready_s)) for v in profile.variables
    )
    total = sum(seconds for _, seconds in costs)
    return replace(profile, backward_s=profile.backward_s + total, variables=variables)


def with_server_layout(cluster: Cluster, servers: int, *, colocate: bool) -> Cluster:
    """``cluster`` with the strategy's server layout; an explicit one (validation) is kept
    when it already matches."""
    if cluster.servers == servers and cluster.colocate == colocate:
        return cluster
    return cluster.with_servers(servers, colocate=colocate)


class Pipe:
    """A first-come-first-served resource: a server's CPU, a link direction."""

    def __init__(self) -> None:
        self.free = 0.0

    def hold(self, ready: float, duration: float) -> float:
        """Take the pipe for ``duration`` once it is free and ``ready`` has come; return
        when it is released.

        Example:
            >>> pipe = Pipe(); pipe.hold(1.0, 2.0), pipe.hold(0.0, 1.0)
            (3.0, 4.0)
        """
        self.free = max(ready, self.free) + duration
        return self.free

    def transfer(self, ready: float, seconds: float, opposite: Pipe, slowdown: float) -> float:
        """Send a point-to-point transfer of ``seconds`` over this link direction; return
        when it has crossed.

        Where the network is not fully duplex (``slowdown``: the measured
        ``Network.duplex_slowdown`` d > 1 of a transfer this long), the time both
        directions are busy together slows the ``opposite`` one by d − 1: two equal
        transfers the opposite ways then take d·t together, one alone t.

        Example:
            >>> out, back = Pipe(), Pipe()
            >>> back.hold(0.0, 1.0), out.transfer(0.0, 1.0, back, slowdown=1.5), back.free
            (1.0, 1.0, 1.5)
        """
        start = ready if ready > self.free else self.free  # the later; no call on the hot path
        crossed = self.free = start + seconds
        both_ways = min(crossed, opposite.free) - start
        if slowdown > 1.0 and both_ways > 0:
            opposite.free += (slowdown - 1.0) * both_ways
        return crossed


def layer_durations(profile: Profile) -> list[float]:
    """Each layer's forward seconds (work before the first layer counts with it).

    Example:
        >>> # layer_durations(profile)  # [0.004, 0.011, ...], summing to forward_s
    """
    starts = [layer.forward_start_s for layer in profile.layers] + [profile.forward_s]
    head = starts[0]
    durations = [max(0.0, b - a) for a, b in itertools.pairwise(starts)]
    if durations:
        durations[0] += head
    return durations or [profile.forward_s]


__all__ = [
    "COMM_TRACK",
    "COMPUTE_TRACK",
    "SERVER_TRACK",
    "WORKER_WORK",
    "Pipe",
    "Span",
    "densified",
    "layer_durations",
    "wire_span",
    "with_server_layout",
]
