"""Hybrid's pure pieces: classification, coalescing, row partitioning, the P chooser, the rule."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from gradsync.comm.prefetch import RowPredictor, forward_indices, missing_rows
from gradsync.comm.sparse import (
    RowPartition,
    SparseShard,
    SparseVariable,
    choose_num_partitions,
    coalesce_rows,
    partition_rows,
    split_rows,
    sum_rows,
)
from gradsync.config import TrainConfig
from gradsync.errors import UserError
from gradsync.models.lstm_lm import PRESETS, LSTMLanguageModel
from gradsync.strategies.hybrid import HybridOptions, classify


def test_classification_follows_sparse_gradients_and_patterns() -> None:
    model = LSTMLanguageModel(PRESETS["tiny"], sparse_embedding=True, num_sampled=4)
    kinds = classify(model, HybridOptions())
    assert [n for n, k in kinds.items() if k == "sparse"] == [
        "embedding.weight",
        "softmax_weight.weight",
        "softmax_bias.weight",
    ]
    # Every variable classified sparse really gets a sparse gradient.
    tokens = torch.zeros(2, 8, dtype=torch.long)
    logits = model(
        tokens, tokens, sampled=torch.tensor([1, 2, 3, 4]), sampled_tries=torch.tensor(4)
    )
    logits.sum().backward()
    grads = {n: p.grad.is_sparse for n, p in model.named_parameters()}
    assert {n for n, s in grads.items() if s} == {n for n, k in kinds.items() if k == "sparse"}
    dense = classify(model, HybridOptions(dense_patterns=("softmax_*",)))
    assert [n for n, k in dense.items() if k == "sparse"] == ["embedding.weight"]
    plain = LSTMLanguageModel(PRESETS["tiny"])  # dense embedding, full softmax
    assert set(classify(plain, HybridOptions()).values()) == {"dense"}
    # Its lookup has sparse=False: a dense gradient, which the servers' rows cannot take
    # (it crashed at step 0 before session 29).
    with pytest.raises(UserError, match="built with sparse=False"):
        classify(plain, HybridOptions(sparse_patterns=("re:^embedding\\.",)))
    with pytest.raises(UserError, match="not the weight of an"):
        classify(plain, HybridOptions(sparse_patterns=("decoder.*",)))


def test_coalescing_sums_duplicates_and_sorts() -> None:
    grad = torch.sparse_coo_tensor(
        [[4, 1, 4, 4]], torch.arange(8.0).view(4, 2), (6, 2), check_invariants=False
    )
    indices, values = coalesce_rows(grad, 6)
    assert indices.tolist() == [1, 4]
    assert values.tolist() == [[2.0, 3.0], [0.0 + 4 + 6, 1.0 + 5 + 7]]
    dense = torch.zeros(6, 2)
    dense[3] = 1.0
    assert coalesce_rows(dense, 6)[0].tolist() == [3]
    merged = sum_rows(
        [(torch.tensor([1, 3]), torch.ones(2, 2)), (torch.tensor([3]), torch.ones(1, 2))], 6
    )
    assert merged[0].tolist() == [1, 3] and merged[1][:, 0].tolist() == [1.0, 2.0]


def test_row_partitions_cover_every_row_once_and_spread_round_robin() -> None:
    variables = [SparseVariable("a", 10, 3), SparseVariable("b", 5, 1)]
    parts = partition_rows(variables, 4, num_servers=2)
    for v in variables:
        mine = [p for p in parts if p.name == v.name]
        assert mine[0].start == 0 and mine[-1].stop == v.num_rows
        assert all(x.stop == y.start for x, y in itertools.pairwise(mine))
    assert [p.server for p in parts] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert len(partition_rows([SparseVariable("c", 2, 1)], 8, num_servers=1)) == 2  # ≤ rows
    pieces = split_rows(torch.tensor([0, 2, 3, 9]), None, [p for p in parts if p.name == "a"])
    assert [i.tolist() for i, _ in pieces] == [[0, 2], [3], [], [9]]


def test_partition_chooser_spreads_hot_rows_and_stays_small_otherwise() -> None:
    table = SparseVariable("emb", 50_000, 200)
    zipf_head = {"emb": torch.arange(2000)}  # frequent words: all in the first 4% of ids
    choice = choose_num_partitions([table], zipf_head, num_servers=2)
    assert choice.num_partitions > 2 and set(choice.costs) == {2, 4, 8, 16, 32, 64, 128}
    assert "P=" in choice.describe()
    uniform = {"emb": torch.arange(0, 50_000, 25)}
    assert choose_num_partitions([table], uniform, num_servers=2).num_partitions == 2
    assert choose_num_partitions([table], zipf_head, num_servers=1).num_partitions >= 1


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_shard_rule_is_torch_sgd_on_sparse_gradients(momentum: float) -> None:
    torch.manual_seed(0)
    table = nn.Embedding(12, 3, sparse=True, dtype=torch.float64)
    optimizer = torch.optim.SGD(table.parameters(), lr=0.1, momentum=momentum)
    parts = [RowPartition("w", 0, 5, 3, 0), RowPartition("w", 5, 12, 3, 0)]
    shard = SparseShard(parts, {"w": table.weight.detach().clone()}, momentum=momentum)
    for lookup in ([1, 6, 6], [2], [11, 1]):
        table(torch.tensor(lookup)).pow(2).sum().backward()
        indices, values = coalesce_rows(table.weight.grad, 12)
        pieces = split_rows(indices, values, parts)
        shard.apply([(i - p.start, v) for (i, v), p in zip(pieces, parts, strict=True)], lr=0.1)
        optimizer.step()
        optimizer.zero_grad()
        mine = shard.rows([torch.arange(0, 5), torch.arange(5, 12)]).view(12, 3)
        assert torch.allclose(mine, table.weight.detach(), atol=1e-12, rtol=0)


def test_hybrid_config_round_trips_and_rejects_bad_topologies() -> None:
    config = TrainConfig(
        strategy="hybrid",
        workers=2,
        strategy_options=HybridOptions(partitions=4, sparse_patterns=("emb*",)),
    )
    assert TrainConfig.from_json(config.to_json()) == config
    with pytest.raises(UserError, match="--servers with --colocate"):
        TrainConfig(strategy="hybrid", workers=2, strategy_options={"servers": 2, "colocate": True})
    with pytest.raises(UserError, match="--partitions must be >= 1"):
        TrainConfig(strategy="hybrid", strategy_options={"partitions": 0})
    with pytest.raises(UserError, match="bad regular expression"):
        TrainConfig(strategy="hybrid", strategy_options=HybridOptions(dense_patterns=("re:(",)))


def test_rows_are_predicted_from_the_inputs_that_fed_each_table() -> None:
    # As lstm-lm with sampled softmax: tokens feed the embedding, targets and the sampled
    # ids (a keyword input) the softmax; a scalar (the tries) and float inputs feed nothing.
    def inputs(tokens, targets, sampled):
        args = (torch.tensor(tokens), torch.tensor(targets), torch.ones(2))
        return forward_indices(args, {"sampled": torch.tensor(sampled), "tries": torch.tensor(9)})

    predictor = RowPredictor({"emb": 100, "softmax": 100})
    step_0 = inputs([[5, 1], [1, 2]], [[1, 3], [2, 4]], [7, 0])
    assert set(step_0) == {"args.0", "args.1", "kwargs.sampled", "kwargs.tries"}
    read = {"emb": torch.tensor([1, 2, 5]), "softmax": torch.tensor([0, 1, 2, 3, 4, 7])}
    predictor.learn(read, step_0)
    assert predictor.sources == {"emb": ("args.0",), "softmax": ("args.1", "kwargs.sampled")}
    step_1 = inputs([[8, 8]], [[8, 9]], [0, 120])  # 120 is no row of the table: dropped
    predicted = predictor.predict(step_1)
    assert predicted["emb"].tolist() == [8]
    assert predicted["softmax"].tolist() == [0, 8, 9]
    # Rows a lookup reads that were not predicted are the ones left to pull.
    assert missing_rows(torch.tensor([0, 8, 11]), predicted["softmax"]).tolist() == [11]
    assert missing_rows(torch.tensor([3]), None).tolist() == [3]
    # A table read from no input (indices made in the forward) is not predicted.
    predictor.learn({"emb": torch.tensor([50])}, step_1)
    assert predictor.sources == {"emb": ()} and predictor.predict(step_1) == {}


def test_a_pattern_must_match_and_may_force_only_a_sparse_untied_lookup() -> None:
    """A pattern matching nothing left the classification silently unchanged (probe 29c)."""
    model = LSTMLanguageModel(PRESETS["tiny"], sparse_embedding=True, num_sampled=4)
    with pytest.raises(UserError, match="--dense-pattern 'embedding' matches no trainable"):
        classify(model, HybridOptions(dense_patterns=("embedding",)))  # no '.weight'
    with pytest.raises(UserError, match=r"--sparse-pattern 'nothing\.\*' matches no trainable"):
        classify(model, HybridOptions(sparse_patterns=("nothing.*",)))
    emb, out = nn.Embedding(5, 3, sparse=True), nn.Linear(3, 5, bias=False)
    out.weight = emb.weight
    tied = nn.ModuleDict({"emb": emb, "out": out})
    assert classify(tied, HybridOptions()) == {"emb.weight": "dense"}
    with pytest.raises(UserError, match="tied to another layer that reads it whole"):
        classify(tied, HybridOptions(sparse_patterns=("emb.weight",)))
