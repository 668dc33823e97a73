"""Byte and time accounting for communication: what each rank puts on the wire.

Two kinds of figures, both from the real tensors handed to torch.distributed:

* **counted** — point-to-point calls (send/isend/recv/irecv): the bytes of the tensors
  passed, exactly what the transport carries (plus TCP/IP headers);
* **modelled from the collective's algorithm** — a collective's per-rank traffic depends on
  how the backend runs it, so the tensor size is multiplied by the algorithm's factor:
  ring allreduce ``2(p-1)/p · S`` per rank (the nccl-tests "bus bandwidth" factor; Gloo's
  ring), allgather ``(p-1) · own`` sent and the others' chunks received, and a sparse
  allreduce (Gloo allgathers every rank's coalesced indices and values) as an allgather.

``benchmarks/wire_bytes.py`` checks both kinds against the loopback interface's counters.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


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

    def add_allgather(self, own_bytes: int, gathered_bytes: int, world_size: int) -> None:
        """Count one allgather: this rank's ``own_bytes`` reach the ``world_size − 1`` others
        (a ring forwards every chunk ``p − 1`` times, so the sum over ranks is exact), and it
        receives everything gathered but its own chunk.

        Example:
            >>> stats = CommStats()
            >>> stats.add_allgather(own_bytes=100, gathered_bytes=250, world_size=3)
            >>> stats.bytes_sent, stats.bytes_recv
            (200, 150)
        """
        if world_size <= 1:
            return
        self.bytes_sent += (world_size - 1) * own_bytes
        self.bytes_recv += gathered_bytes - own_bytes

    def add_sparse_allreduce(self, gradient: Tensor, world_size: int) -> None:
        """Count Gloo's sparse allreduce of a coalesced ``gradient``: an allgather of its
        indices and values. The others' sizes are not known here, so the received bytes
        are set equal to the sent ones (the sum over ranks is exact).

        Example:
            >>> import torch
            >>> g = torch.sparse_coo_tensor([[0, 3]], torch.ones(2, 4), (10, 4)).coalesce()
            >>> stats = CommStats()
            >>> stats.add_sparse_allreduce(g, world_size=2)
            >>> stats.bytes_sent  # 2 int64 indices + 2 rows of 4 float32
            48
        """
        moved = (world_size - 1) * tensor_bytes(gradient) if world_size > 1 else 0
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


def tensor_bytes(tensor: Tensor) -> int:
    """Bytes a tensor occupies on the wire: dense data, or a sparse tensor's indices + values.

    Example:
        >>> import torch
        >>> tensor_bytes(torch.zeros(3, dtype=torch.float64))
        24
    """
    if tensor.is_sparse:
        indices, values = tensor._indices(), tensor._values()
        return indices.numel() * indices.element_size() + values.numel() * values.element_size()
    return tensor.numel() * tensor.element_size()
