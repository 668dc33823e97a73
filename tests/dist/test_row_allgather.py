"""allreduce's sparse path: rows allgathered and averaged, as an explicit dense allreduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm.counters import CommStats
from gradsync.comm.row_allgather import RowAllgather


def _rows(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    tables = nn.ModuleList(nn.Embedding(50, 3, sparse=True, dtype=torch.float64) for _ in range(3))
    stats = CommStats()
    rows = RowAllgather(
        [(f"t{i}", t.weight) for i, t in enumerate(tables)],
        group=None,
        world_size=world_size,
        stats=stats,
    )
    # Table 0: a few rows per rank, some repeated and shared; table 1: rank 0 only;
    # table 2: never used.
    ids = torch.tensor([rank, rank, 7, 10 + 3 * rank])
    loss = tables[0](ids).pow(2).sum()
    if rank == 0:
        loss = loss + tables[1](torch.tensor([4, 5])).sum()
    loss.backward()
    expected = []
    for table in tables:
        dense = torch.zeros_like(table.weight) if table.weight.grad is None else None
        dense = table.weight.grad.to_dense() if dense is None else dense
        dist.all_reduce(dense)
        expected.append(dense / world_size)
    rows.launch()
    rows.finish()
    grads = [t.weight.grad for t in tables]
    return {
        "sparse": [g is not None and g.is_sparse for g in grads],
        "none": [g is None for g in grads],
        "grads": [None if g is None else g.to_dense() for g in grads],
        "expected": expected,
        "bytes_sent": stats.bytes_sent,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_rows_are_averaged_and_unused_tables_keep_no_gradient(run_ranks, world_size):
    results = run_ranks(world_size, _rows)
    for result in results:
        assert result["sparse"] == [True, True, False]
        assert result["none"] == [False, False, True]  # unused everywhere: skipped, as single
        for got, want in zip(result["grads"][:2], result["expected"][:2], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    # Bytes follow the rows touched (3 distinct rows of table 0 on each rank, 2 rows of
    # table 1 on rank 0: the largest rank pads to 5 rows), not the 50-row tables.
    counts = 6 * 8  # row count and had-a-gradient flag per table
    padded = 5 * (8 + 3 * 8)
    assert results[1]["bytes_sent"] == (world_size - 1) * (counts + padded)
