"""The hybrid server's lazy momentum rule against torch's SGD on sparse gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsync.comm.lazy import LazyMomentumRows, window_steps
from gradsync.comm.sparse import RowPartition, SparseShard, coalesce_rows, split_rows

STEPS = 1200  # longer than the 0.9 window (443 steps), so rows fall out of it


def _irregular_lookups(generator: torch.Generator, rows: int) -> list[int]:
    """A few rows per step, hot ones often, others after long gaps, some steps none."""
    if torch.rand(1, generator=generator).item() < 0.05:
        return []
    hot = torch.randint(0, 3, (2,), generator=generator).tolist()
    if torch.rand(1, generator=generator).item() < 0.02:
        hot.append(int(torch.randint(3, rows, (1,), generator=generator)))
    return hot


@pytest.mark.parametrize("momentum", [0.5, 0.9, 0.99])
def test_lazy_rows_match_torch_sgd_over_many_irregular_steps(momentum: float) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    rows, width = 40, 3
    table = nn.Embedding(rows, width, sparse=True, dtype=torch.float64)
    optimizer = torch.optim.SGD(table.parameters(), lr=0.1, momentum=momentum)
    lazy = LazyMomentumRows(table.weight.detach().clone(), momentum=momentum)
    seen: set[int] = set()
    for step in range(STEPS):
        lr = 0.1 * min(1.0, (step + 1) / 50)  # a warm-up: the rate changes per step
        for group in optimizer.param_groups:
            group["lr"] = lr
        lookup = _irregular_lookups(generator, rows)
        if lookup:
            table(torch.tensor(lookup)).sin().sum().backward()
            indices, values = coalesce_rows(table.weight.grad, rows)
        else:  # a step whose batch touched no row: torch still decays the buffer
            indices = torch.zeros(0, dtype=torch.long)
            values = torch.zeros(0, width, dtype=torch.float64)
            table.weight.grad = torch.sparse_coo_tensor(
                torch.zeros(1, 0, dtype=torch.long), values, (rows, width), check_invariants=True
            )
        optimizer.step()
        optimizer.zero_grad()
        lazy.apply(indices, values, lr=lr)
        seen.update(lookup)
        if step % 97 == 0:  # a pull of a few rows now and then reads them mid-run
            probe = torch.tensor(sorted(seen)[:5] or [0])
            assert torch.allclose(lazy.read(probe), table.weight[probe], atol=1e-12, rtol=0)
    lazy.sync_all()
    assert torch.allclose(lazy.values, table.weight.detach(), atol=1e-12, rtol=0)
    buffer = optimizer.state[table.weight]["momentum_buffer"].to_dense()
    assert torch.allclose(lazy.buffer, buffer, atol=1e-12, rtol=0)
    never = [r for r in range(rows) if r not in seen]
    assert never and torch.equal(lazy.values[never], table.weight.detach()[never])


def test_a_step_costs_the_window_not_the_run() -> None:
    """The per-step work is bounded: the sums advance over ``window_steps`` entries only."""
    rows = LazyMomentumRows(torch.zeros(10, 1, dtype=torch.float64), momentum=0.9)
    for _ in range(2 * window_steps(0.9)):
        rows.apply(torch.tensor([0]), torch.ones(1, 1, dtype=torch.float64), lr=0.1)
    assert int(rows.synced[1]) == 0  # never touched, never read: no work was done on it
    assert window_steps(0.9) < 500 and window_steps(0.0) == 1


def test_shard_state_round_trips_for_resume() -> None:
    part = RowPartition("e", 0, 6, 2, 0)
    initial = {"e": torch.arange(12.0, dtype=torch.float64).view(6, 2)}
    original = SparseShard([part], initial, momentum=0.9)
    restored = SparseShard([part], {"e": torch.zeros(6, 2, dtype=torch.float64)}, momentum=0.9)
    grad = torch.ones(2, 2, dtype=torch.float64)
    original.apply([(torch.tensor([1, 4]), grad)], lr=0.1)
    original.apply([(torch.tensor([4]), grad[:1])], lr=0.1)
    restored.load_state_tensors(original.state_tensors())
    for shard in (original, restored):
        shard.apply([(torch.tensor([2]), grad[:1])], lr=0.1)
    everything = [torch.arange(6)]
    assert torch.equal(original.rows(everything), restored.rows(everything))
    indices, _ = split_rows(torch.tensor([1, 4]), None, [part])[0]
    assert indices.tolist() == [1, 4]
