"""Byte and time accounting for communication.

Collective traffic is counted with the usual per-rank model: a ring allreduce of ``n`` bytes
over ``p`` ranks sends and receives ``2(p-1)/p · n`` bytes per rank (the nccl-tests "bus
bandwidth" factor). Gloo may pick another algorithm; the model keeps strategies comparable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CommStats:
    """Cumulative counters of one rank.

    ``exposed_comm_s`` is the time the training thread spent blocked on communication
    (not overlapped with computation).
    """

    bytes_sent: int = 0
    bytes_recv: int = 0
    exposed_comm_s: float = 0.0

    def add_allreduce(self, num_bytes: int, world_size: int) -> None:
        """Count one allreduce of ``num_bytes`` per rank.

        Example:
            >>> stats = CommStats()
            >>> stats.add_allreduce(1000, 4)
            >>> stats.bytes_sent, stats.bytes_recv
            (1500, 1500)
        """
        moved = ring_allreduce_bytes(num_bytes, world_size)
        self.bytes_sent += moved
        self.bytes_recv += moved

    def copy(self) -> CommStats:
        return CommStats(self.bytes_sent, self.bytes_recv, self.exposed_comm_s)


def ring_allreduce_bytes(num_bytes: int, world_size: int) -> int:
    """Bytes each rank sends (and receives) in a ring allreduce of ``num_bytes``.

    Example:
        >>> ring_allreduce_bytes(1000, 2)
        1000
    """
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * num_bytes // world_size
