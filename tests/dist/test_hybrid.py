"""The hybrid strategy's sparse path on real Gloo ranks: untouched rows, bytes on the wire."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradsync.config import OptimConfig, TrainConfig
from gradsync.optim import Updater
from gradsync.strategies.base import Context
from gradsync.strategies.hybrid import Hybrid, HybridOptions

# Rows each worker's batch looks up, per step (duplicates on purpose: coalesced before sending).
LOOKUPS = [
    [[1, 2, 2, 5], [5, 7]],
    [[3, 3], [3]],
    [[1, 9], [2, 9, 9]],
]


class _Toy(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids)).sum()


def _hybrid(
    model: nn.Module, rank: int, world_size: int, out: str, *, lr: float, momentum: float
) -> tuple[Hybrid, nn.Module]:
    """``model`` set up under colocated hybrid (2 partitions) on this rank."""
    config = TrainConfig(
        strategy="hybrid",
        workers=world_size,
        out=out,
        optim=OptimConfig(lr=lr, momentum=momentum),
        strategy_options=HybridOptions(colocate=True, partitions=2),
    )
    context = Context(
        config=config,
        rank=rank,
        world_size=world_size,
        worker_index=rank,
        num_workers=world_size,
        device=torch.device("cpu"),
        worker_group=None,
        make_updater=lambda ps: Updater(ps, config.optim, lr=lr),
    )
    strategy = Hybrid()
    return strategy, strategy.setup(model, context)


def _train(rank: int, world_size: int, vocab: int, momentum: float, out: str) -> dict:
    torch.manual_seed(0)
    model = _Toy(vocab)
    strategy, module = _hybrid(model, rank, world_size, out, lr=0.5, momentum=momentum)
    initial = model.embedding.weight.detach().clone()
    tables, sparse_bytes = [], []
    for _step, lookups in enumerate(LOOKUPS):
        before = strategy.sparse_counters.copy()
        module(torch.tensor(lookups[rank])).backward()
        strategy.step()
        after = strategy.sparse_counters
        sparse_bytes.append(
            (after.bytes_sent - before.bytes_sent, after.bytes_recv - before.bytes_recv)
        )
        state = strategy.checkpoint_tensors()  # worker 0: the servers' rows after this step
        if state is not None:
            tables.append(state["param/embedding.weight"])
    strategy.finish()
    return {"initial": initial, "tables": tables, "bytes": sparse_bytes}


def test_rows_no_worker_touched_stay_bit_identical(run_ranks, tmp_path) -> None:
    worker0, _ = run_ranks(2, _train, 50, 0.0, str(tmp_path))
    before = [worker0["initial"], *worker0["tables"]]
    for step, lookups in enumerate(LOOKUPS):
        touched = {row for rows in lookups for row in rows}
        for row in range(50):
            same = torch.equal(before[step + 1][row], before[step][row])
            assert same == (row not in touched), (step, row)


def test_momentum_moves_rows_touched_before_like_torch_sgd(run_ranks, tmp_path) -> None:
    worker0, _ = run_ranks(2, _train, 50, 0.9, str(tmp_path))
    final, initial = worker0["tables"][-1], worker0["initial"]
    ever = {row for lookups in LOOKUPS for rows in lookups for row in rows}
    for row in range(50):  # never touched: bit-identical; touched once: moved on by momentum
        assert torch.equal(final[row], initial[row]) == (row not in ever), row
    assert not torch.equal(worker0["tables"][1][7], worker0["tables"][0][7])  # row 7: step 0 only


def test_sparse_bytes_follow_touched_rows_not_vocabulary(run_ranks, tmp_path) -> None:
    small = run_ranks(2, _train, 1_000, 0.0, str(tmp_path / "small"))
    large = run_ranks(2, _train, 100_000, 0.0, str(tmp_path / "large"))
    for rank in range(2):
        # Step 0 is the same too (no pulls: initial values are everywhere); later steps pull.
        assert small[rank]["bytes"] == large[rank]["bytes"], rank
    # And they scale with the rows: step 1 touches 1 row, step 2 three (per worker: 1 and 2).
    sent = [b[0] for b in small[0]["bytes"]]
    assert sent[1] < sent[2]
    assert max(sent) < 1_000 * 4 * 4 / 4  # far below a quarter of even the small table


# -- pulls: one round trip per step, predicted from the forward's inputs -------------------

# Per step, per worker: token ids and extra ids (a keyword input).
INPUTS = [
    ([[1, 2], [2, 5]], [[7], [3]]),
    ([[3, 3], [8, 1]], [[2], [9]]),
    ([[4, 9], [6, 6]], [[1], [5]]),
    ([[0, 2], [7, 3]], [[4], [8]]),
]


class _Lookups(nn.Module):
    """Tables read by input ids, by input ids and a keyword input concatenated (as a
    sampled softmax does), and, with ``hashed``, by ids computed inside the forward."""

    def __init__(self, vocab: int, hashed: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, 3, sparse=True)
        self.output = nn.Embedding(vocab, 3, sparse=True)
        self.hashed = nn.Embedding(vocab, 2, sparse=True) if hashed else None
        self.vocab = vocab

    def forward(self, ids: torch.Tensor, *, extra: torch.Tensor) -> torch.Tensor:
        both = torch.cat([ids, extra])
        loss = (self.embedding(ids).sum(0) * self.output(both).sum(0)).sum()
        if self.hashed is not None:  # not an input: only known once the forward runs
            loss = loss + self.hashed(ids + self.vocab // 2).pow(2).sum()
        return loss


def _inputs(step: int, worker: int, dtype: str = "int64") -> tuple[torch.Tensor, torch.Tensor]:
    ids, extra = INPUTS[step]
    kind = getattr(torch, dtype)
    return torch.tensor(ids[worker], dtype=kind), torch.tensor(extra[worker], dtype=kind)


def _train_lookups(rank: int, world_size: int, hashed: bool, ids: str, out: str) -> dict:
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # exact comparison with the reference below
    try:
        return _run_lookups(rank, world_size, hashed, ids, out)
    finally:
        torch.set_default_dtype(dtype)


def _run_lookups(rank: int, world_size: int, hashed: bool, ids_dtype: str, out: str) -> dict:
    torch.manual_seed(0)
    model = _Lookups(20, hashed)  # ids < 10: no input names a hashed row
    reference = copy.deepcopy(model)
    strategy, module = _hybrid(model, rank, world_size, out, lr=0.1, momentum=0.9)
    pulls = []
    for step in range(len(INPUTS)):
        before = strategy.client.num_pulls if strategy._connected else 0
        ids, extra = _inputs(step, rank, ids_dtype)
        module(ids, extra=extra).backward()
        pulls.append((strategy.client.num_pulls if strategy._connected else 0) - before)
        strategy.step()
    state = strategy.checkpoint_tensors()
    strategy.finish()
    with torch.no_grad():  # the validation pass after training: no pull, no wait
        module(*_inputs(0, rank, ids_dtype)[:1], extra=_inputs(0, rank, ids_dtype)[1])
    tables = {n: p.detach().clone() for n, p in model.named_parameters()}
    # single: the mean of the workers' losses, torch's SGD on the sparse gradients.
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(len(INPUTS)):
        optimizer.zero_grad()
        losses = [reference(*_inputs(step, w)[:1], extra=_inputs(step, w)[1]) for w in range(2)]
        (sum(losses) / world_size).backward()
        optimizer.step()
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    return {"pulls": pulls, "state": state, "expected": expected, "tables": tables}


@pytest.mark.parametrize(("hashed", "ids"), [(False, "int64"), (True, "int64"), (False, "int32")])
def test_one_pull_round_trip_per_step_and_single_s_parameters(
    run_ranks, tmp_path, hashed: bool, ids: str
) -> None:
    """int32 ids (nn.Embedding takes them) pull and install rows like int64 ones."""
    results = run_ranks(2, _train_lookups, hashed, ids, str(tmp_path))
    for worker in results:
        # Step 0 reads the initial tables (no pull). Later steps: one pull before the
        # forward for every table fed by an input; rows made inside the forward need a
        # second one (a pull per lookup would take 2, or 3 with the hashed table).
        assert worker["pulls"] == [0, *[2 if hashed else 1] * (len(INPUTS) - 1)]
    state, expected = results[0]["state"], results[0]["expected"]
    for name, value in expected.items():
        assert torch.allclose(state[f"param/{name}"], value, atol=1e-12, rtol=0), name
        # Worker 0's own tables hold the servers' rows for evaluation after training.
        assert torch.allclose(results[0]["tables"][name], value, atol=1e-12, rtol=0), name
