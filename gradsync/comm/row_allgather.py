"""Sparse gradients as Horovod sends them: an allgather of each worker's (indices, rows).

Horovod's DistributedOptimizer does not allreduce a sparse gradient (an embedding's): every
worker allgathers the coalesced row indices and row values it touched, and each worker sums
what it gathered. The bytes grow with the rows touched, not with the table.

Gloo's allgather needs equal sizes, so one step takes two collectives over the workers:

1. a small allgather of every rank's row count and had-a-gradient flag per variable;
2. one allgather of a byte buffer per rank — for each variable its int64 indices then its
   values — padded to the largest rank's size.

Both are launched after the fusion buffers' last allreduce (the same order on every rank)
and the rows are summed in rank order, so reruns are bit-identical. A variable with no
gradient on any rank keeps ``grad = None`` (the optimizer skips it, as ``single``'s does).

Example:
    >>> # rows = RowAllgather(named_sparse, group=None, world_size=2, stats=CommStats())
    >>> # loss.backward(); rows.launch(); ...; rows.finish(); optimizer.step()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradsync.comm.counters import CommStats
from gradsync.comm.sparse import coalesce_rows, sum_rows
from gradsync.trace import NullTimeline, Phase, Timeline

TRACK = "sparse-allgather"


def pack_rows(parts: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """One byte buffer: each variable's int64 indices, then its values.

    Example:
        >>> buffer = pack_rows([(torch.tensor([2]), torch.ones(1, 3))])
        >>> buffer.numel()  # 8 + 3 * 4
        20
    """
    pieces = [t.contiguous().reshape(-1).view(torch.uint8) for part in parts for t in part]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8)


def unpack_rows(
    buffer: Tensor, counts: Sequence[int], widths: Sequence[int], dtype: torch.dtype
) -> list[tuple[Tensor, Tensor]]:
    """Inverse of :func:`pack_rows` for ``counts[v]`` rows of ``widths[v]`` values each.

    Example:
        >>> rows = [(torch.tensor([2, 5]), torch.arange(6.0).view(2, 3))]
        >>> unpack_rows(pack_rows(rows), [2], [3], torch.float32)[0][1].tolist()
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """
    parts, offset = [], 0
    value_size = torch.empty(0, dtype=dtype).element_size()
    for count, width in zip(counts, widths, strict=True):
        index_bytes, value_bytes = count * 8, count * width * value_size
        indices = buffer[offset : offset + index_bytes].view(torch.long)
        offset += index_bytes
        values = buffer[offset : offset + value_bytes].view(dtype).view(count, width)
        offset += value_bytes
        parts.append((indices, values))
    return parts


class RowAllgather:
    """Average the sparse gradients of ``params`` over ``group`` by allgathering rows.

    ``params`` are (name, parameter) pairs whose gradients are sparse (``nn.Embedding`` with
    ``sparse=True``); call :meth:`launch` after backward, once every rank has launched its
    other collectives, and :meth:`finish` before the optimizer step.
    """

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Parameter]],
        *,
        group: Any,
        world_size: int,
        stats: CommStats,
        timeline: Timeline | None = None,
    ) -> None:
        self.names = [name for name, _ in params]
        self.params = [param for _, param in params]
        self.widths = [p[0].numel() for p in self.params]
        self.group = group
        self.world_size = world_size
        self.stats = stats
        self.timeline = timeline or NullTimeline()
        self._pending: tuple[Any, list[Tensor], Tensor] | None = None

    def launch(self) -> None:
        """Exchange row counts, then start the allgather of every rank's rows."""
        local = [coalesce_rows(p.grad, p.shape[0]) for p in self.params]
        local = [(i, v.to(p.dtype)) for (i, v), p in zip(local, self.params, strict=True)]
        present = [int(p.grad is not None) for p in self.params]
        counts = torch.tensor([len(i) for i, _ in local] + present, dtype=torch.long)
        everyone = [torch.empty_like(counts) for _ in range(self.world_size)]
        own = pack_rows(local)
        with self.timeline.span(TRACK, Phase.ALLGATHER, tensor="row counts"):
            dist.all_gather(everyone, counts, group=self.group)
        counts_table = torch.stack(everyone)
        sizes = [self._packed_size(row) for row in counts_table]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: own.numel()] = own
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        self.timeline.begin(TRACK, Phase.ALLGATHER, tensor="rows", bytes=padded.numel())
        work = dist.all_gather(gathered, padded, group=self.group, async_op=True)
        self._pending = (work, gathered, counts_table)
        size = counts.numel() * counts.element_size()
        self.stats.add_allgather(size, size * self.world_size, self.world_size)
        self.stats.add_allgather(padded.numel(), padded.numel() * self.world_size, self.world_size)

    def _packed_size(self, counts_row: Tensor) -> int:
        dtype_size = self.params[0].element_size()
        counts = counts_row[: len(self.params)].tolist()
        return sum(c * (8 + w * dtype_size) for c, w in zip(counts, self.widths, strict=True))

    def finish(self) -> None:
        """Wait for the rows, sum them in rank order, write averaged sparse gradients."""
        assert self._pending is not None, "finish() without launch()"
        work, gathered, counts_table = self._pending
        work.wait()
        self.timeline.end(TRACK, Phase.ALLGATHER)
        self._pending = None
        num = len(self.params)
        per_rank = [
            unpack_rows(buffer, row[:num].tolist(), self.widths, self.params[0].dtype)
            for buffer, row in zip(gathered, counts_table, strict=True)
        ]
        anywhere = counts_table[:, num:].any(dim=0).tolist()
        for v, param in enumerate(self.params):
            if not anywhere[v]:
                param.grad = None
                continue
            indices, values = sum_rows([rows[v] for rows in per_rank], param.shape[0])
            param.grad = torch.sparse_coo_tensor(
                indices[None],
                (values / self.world_size).view(len(indices), *param.shape[1:]),
                param.shape,
                is_coalesced=True,
            )
