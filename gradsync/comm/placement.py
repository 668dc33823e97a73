"""Which server owns which variable: partitioning and placement, as pure functions.

A *variable* is one parameter tensor. A variable above the partition threshold is split
into contiguous ranges of its flattened elements, one *partition* per server it spans
(TensorFlow's ``min_max_variable_partitioner`` splits along dimension 0; a flat split is
the same for element-wise optimizers and balances better). Every other variable is one
partition. Partitions are then placed on servers:

- ``greedy``: biggest partition first, each to the least-loaded server so far
  (TensorFlow's ``GreedyLoadBalancingStrategy`` with the byte-size load function);
- ``round-robin``: in model order, partition i to server i mod S (TensorFlow's default
  ``replica_device_setter``).

Example:
    >>> variables = [Variable("a", 600, 4), Variable("b", 300, 4), Variable("c", 300, 4)]
    >>> plan = plan_placement(variables, num_servers=2, policy="greedy")
    >>> plan.bytes_per_server()
    [2400, 2400]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from gradsync.comm.pieces import Piece
from gradsync.errors import UserError


@dataclass(frozen=True)
class Variable:
    """A parameter to place: its name, element count and element size in bytes."""

    name: str
    numel: int
    element_size: int = 4

    @property
    def num_bytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class Placement:
    """Every partition with its server; ``partitions`` keeps model order."""

    num_servers: int
    partitions: tuple[Piece, ...]

    def on_server(self, server: int) -> list[Piece]:
        """The partitions ``server`` owns, in model order (the layout of its flat buffer)."""
        return [p for p in self.partitions if p.server == server]

    def bytes_per_server(self) -> list[int]:
        loads = [0] * self.num_servers
        for partition in self.partitions:
            loads[partition.server] += partition.num_bytes
        return loads

    def imbalance(self) -> float:
        """max / min bytes per server (1.0 is perfect balance)."""
        loads = self.bytes_per_server()
        return max(loads) / max(1, min(loads))

    def describe(self) -> str:
        """Variable → server lines and the bytes per server, for the start of a run."""
        lines = []
        for p in self.partitions:
            span = "" if p.start == 0 and _whole(p, self) else f"[{p.start}:{p.stop}]"
            lines.append(f"  {p.name}{span} → server {p.server} ({_mb(p.num_bytes)})")
        loads = ", ".join(f"server {s}: {_mb(b)}" for s, b in enumerate(self.bytes_per_server()))
        lines.append(f"  bytes per server: {loads} (max/min {self.imbalance():.2f})")
        return "\n".join(lines)


def partition_variables(
    variables: Sequence[Variable], num_servers: int, threshold_bytes: int
) -> list[Piece]:
    """Split each variable above ``threshold_bytes`` into near-equal contiguous partitions.

    A variable of B bytes becomes ``min(num_servers, ceil(B / threshold))`` partitions.

    Example:
        >>> [(p.start, p.stop) for p in partition_variables([Variable("e", 10)], 3, 16)]
        [(0, 4), (4, 7), (7, 10)]
    """
    partitions = []
    for variable in variables:
        count = 1
        if variable.num_bytes > threshold_bytes:
            count = min(num_servers, math.ceil(variable.num_bytes / threshold_bytes))
        count = max(1, min(count, variable.numel))
        bounds = [variable.numel * i // count for i in range(count + 1)]
        # Larger pieces first, so the split matches torch.tensor_split's sizes.
        sizes = sorted((b - a for a, b in itertools.pairwise(bounds)), reverse=True)
        start = 0
        for size in sizes:
            partitions.append(
                Piece(variable.name, start, start + size, element_size=variable.element_size)
            )
            start += size
    return partitions


def place_greedy(partitions: Sequence[Piece], num_servers: int) -> list[Piece]:
    """Biggest first, each to the least-loaded server (ties: lowest server index) that holds
    no other partition of its variable: a variable is split to spread it over servers.

    Example:
        >>> w, x = Variable("w", 60), Variable("x", 70)
        >>> pieces = partition_variables([w, x], num_servers=2, threshold_bytes=256)
        >>> [(p.name, p.server) for p in place_greedy(pieces, 2)]
        [('w', 0), ('x', 1), ('x', 0)]
    """
    loads = [0] * num_servers
    holders: dict[str, set[int]] = {}
    placed: dict[int, Piece] = {}
    order = sorted(range(len(partitions)), key=lambda i: (-partitions[i].num_bytes, i))
    for index in order:
        piece = partitions[index]
        held = holders.setdefault(piece.name, set())
        server = min(range(num_servers), key=lambda s: (s in held, loads[s], s))
        held.add(server)
        loads[server] += piece.num_bytes
        placed[index] = _on(piece, server)
    return [placed[i] for i in range(len(partitions))]


def place_round_robin(partitions: Sequence[Piece], num_servers: int) -> list[Piece]:
    """Piece i to server i mod ``num_servers``, in model order."""
    return [_on(p, i % num_servers) for i, p in enumerate(partitions)]


POLICIES = {"greedy": place_greedy, "round-robin": place_round_robin}


def plan_placement(
    variables: Sequence[Variable],
    *,
    num_servers: int,
    policy: str = "greedy",
    threshold_bytes: int = 4 << 20,
) -> Placement:
    """Piece and place ``variables`` on ``num_servers`` servers.

    Every server must own something: more servers than partitions is a UserError.
    """
    if policy not in POLICIES:
        raise UserError(f"unknown --placement '{policy}'; choose one of: {', '.join(POLICIES)}")
    partitions = partition_variables(variables, num_servers, threshold_bytes)
    if num_servers > len(partitions):
        raise UserError(
            f"{num_servers} parameter servers but only {len(partitions)} variables (and "
            f"partitions) to place; use at most {len(partitions)} servers"
        )
    return Placement(num_servers, tuple(POLICIES[policy](partitions, num_servers)))


def _on(partition: Piece, server: int) -> Piece:
    return dataclasses.replace(partition, server=server)


def _whole(partition: Piece, placement: Placement) -> bool:
    return sum(p.name == partition.name for p in placement.partitions) == 1


def _mb(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KB"


__all__ = [
    "Piece",
    "Placement",
    "Variable",
    "partition_variables",
    "place_greedy",
    "place_round_robin",
    "plan_placement",
]
