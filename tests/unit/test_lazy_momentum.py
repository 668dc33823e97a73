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


def test_a_checkpoint_changes_nothing_and_a_loaded_shard_goes_on_bit_for_bit() -> None:
    """Saving leaves rows behind as they are (the run is not perturbed), and a shard loaded
    from the save catches them up when the unsaved one does: the same bits (resume)."""
    generator = torch.Generator().manual_seed(3)
    part = RowPartition("e", 0, 40, 3, 0)
    initial = {"e": torch.randn(40, 3, generator=generator, dtype=torch.float64)}
    saved, unsaved = (SparseShard([part], initial, momentum=0.9) for _ in range(2))
    restored = SparseShard([part], {"e": torch.zeros(40, 3, dtype=torch.float64)}, momentum=0.9)

    def steps(shards: list[SparseShard], count: int) -> None:
        for _ in range(count):
            rows = torch.tensor(sorted(set(_irregular_lookups(generator, 40))), dtype=torch.long)
            grad = torch.randn(len(rows), 3, generator=generator, dtype=torch.float64)
            lr = torch.rand(1, generator=generator).item()
            for shard in shards:
                shard.apply([(rows, grad)], lr=lr)

    steps([saved, unsaved], 30)
    restored.load_state_tensors(saved.state_tensors())
    steps([saved, unsaved, restored], 30)
    everything = [torch.arange(40)]
    for shard in (saved, restored):
        assert torch.equal(shard.rows(everything), unsaved.rows(everything))
        assert torch.equal(shard.parts[0].buffer, unsaved.parts[0].buffer)


def test_rows_of_one_partition_starting_at_zero_keep_their_numbers() -> None:
    part = RowPartition("e", 0, 6, 2, 0)
    indices, _ = split_rows(torch.tensor([1, 4]), None, [part])[0]
    assert indices.tolist() == [1, 4]
